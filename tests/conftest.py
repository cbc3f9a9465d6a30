"""Shared fixtures: a tiny random Llama for unit tests, real `stepserve serve` processes for
end-to-end tests."""

from __future__ import annotations

from models.blas import load_cpu_blas

load_cpu_blas()  # before MLX is imported, as `stepserve` does

import pytest  # noqa: E402

from tests.support import ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """The default model converted by `stepserve convert` into an mlx-community directory."""
    from models.default import default_model_path
    from models.gguf.convert import convert_gguf

    return convert_gguf(default_model_path(), tmp_path_factory.mktemp("smollm2-mlx"))


#: The session server's flags (compile on, default settings, but a warm-up budget that keeps the
#: whole CPU extent however slow or loaded the host is).
SERVER_ARGS = ["--compile", "on", "--warmup-budget-s", "3600"]

#: Session servers started when collection ends (:func:`pytest_collection_finish`), by fixture name.
_started: dict[str, ServerProcess] = {}


def _serving(args: list[str], name: str | None = None):
    proc = _started.pop(name, None) if name else None
    proc = proc or ServerProcess.start(args)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def server() -> ServerProcess:
    """The default model served by a real `stepserve serve` (compile on, default settings, but a
    warm-up budget that keeps the whole CPU extent however slow or loaded the host is), started
    as collection ends when a selected test uses it."""
    yield from _serving(SERVER_ARGS, "server")


@pytest.fixture(scope="session")
def eager_server() -> ServerProcess:
    """The same model with `--compile off` (the eager baseline; it runs every step eagerly, so
    it warms nothing up)."""
    yield from _serving(["--compile", "off", "--warmup-prompt-tokens", "0"])


def _starts_processes(item: pytest.Item) -> bool:
    return bool({"e2e", "deploy"} & set(item.path.parts))


def pytest_collection_modifyitems(items):
    """Everything under tests/e2e and tests/deploy starts processes: mark it ``slow``
    (``pytest -m "not slow"`` or ``pytest tests/unit`` is the fast loop), and run it after the
    rest (in its own order), so the session server's warm-up overlaps the in-process tests."""
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_starts_processes)  # stable: each part keeps its order


def pytest_collection_finish(session):
    """Start the session server now, when a selected test uses it: it warms up (about a minute
    on a 2-core host) while the in-process tests run, and its fixture then waits for it."""
    if not session.config.option.collectonly and any("server" in item.fixturenames for item in session.items):
        _started["server"] = ServerProcess.start(SERVER_ARGS)


def pytest_sessionfinish(session):
    """Stop a started server that no test asked for (a run stopped before its first user)."""
    while _started:
        _started.popitem()[1].stop()
