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


def _serving(args: list[str]):
    proc = ServerProcess.start(args)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def server() -> ServerProcess:
    """The default model served by a real `stepserve serve` (compile on, default settings, but a
    warm-up budget that keeps the whole CPU extent however slow or loaded the host is)."""
    yield from _serving(["--compile", "on", "--warmup-budget-s", "3600"])


@pytest.fixture(scope="session")
def eager_server() -> ServerProcess:
    """The same model with `--compile off` (the eager baseline; it runs every step eagerly, so
    it warms nothing up)."""
    yield from _serving(["--compile", "off", "--warmup-prompt-tokens", "0"])


def pytest_collection_modifyitems(items):
    """Everything under tests/e2e and tests/deploy starts processes: mark it ``slow``
    (``pytest -m "not slow"`` or ``pytest tests/unit`` is the fast loop)."""
    for item in items:
        if {"e2e", "deploy"} & set(item.path.parts):
            item.add_marker(pytest.mark.slow)
