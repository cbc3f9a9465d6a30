"""What every bench tool shares, written once: prompt sets, percentiles, ``/metrics``
scraping, a server subprocess on a free loopback port, tables, plots, machine info, and the
in-process timing helpers.

Importing this module does not import MLX: the in-process helpers import it when called,
so the HTTP tools (``stepserve bench``, ``stepserve soak``) stay MLX-free until they need it.
"""

from __future__ import annotations

import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from models.loader import WeightsMode
    from service.engine.compile_cache import CompileCache

STEPSERVE_SERVE = [sys.executable, "-m", "service.cli", "serve"]  # the CLI's main() loads OpenBLAS first
START_TIMEOUT_S = 900  # a cold CUDA host JIT-compiles its kernels for minutes (docs/BENCHMARKS.md)

ESSAY_TOPICS = (
    "the history of the printing press",
    "how a steam engine works",
    "the life cycle of a star",
    "the rules of chess",
    "why the sky is blue",
    "the migration of birds",
    "how bread is made",
    "the first voyage around the world",
)
WORDS = ("river", "stone", "market", "harbour", "lantern", "winter", "garden", "letter", "engine", "valley")


def essay_prompts(n: int = 16) -> list[str]:
    """``n`` essay prompts of mixed lengths (about 10 to 150 tokens), made here: no downloads.
    Prompt ``i`` repeats a context sentence ``2 * (i % 6)`` times, so lengths cycle."""
    prompts = []
    for i in range(n):
        topic = ESSAY_TOPICS[i % len(ESSAY_TOPICS)]
        context = f" Consider {topic} from every side, with examples and dates." * (i % 6) * 2
        prompts.append(f"Write a detailed essay about {topic}.{context}\n\nEssay:")
    return prompts


def word_prompt(rng: random.Random, words: int) -> str:
    """``words`` words drawn from :data:`WORDS` (about one token per word)."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (``q`` in hundredths, 0.01 to 0.99), interpolated
    between order statistics (``statistics.quantiles``, method "inclusive"); the value itself
    for one value, None for none."""
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def scrape(http: httpx.Client, names: Iterable[str]) -> dict[str, float]:
    """Sum over labels of each named metric's samples on ``GET /metrics`` (prometheus_client's
    text parser); 0.0 for a name the server does not expose. Raises httpx.HTTPError."""
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def metric_labels(http: httpx.Client, name: str) -> dict[str, str]:
    """Labels of the first sample of ``name`` on ``GET /metrics`` ({} when absent), e.g. the
    version, MLX version and device of ``stepserve_build_info``."""
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return dict(sample.labels)
    return {}


def free_port() -> int:
    """A TCP port free on loopback right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(
    name: str, command: list[str], ready_path: str, log: Path, timeout_s: float = START_TIMEOUT_S
) -> Iterator[tuple[str, int]]:
    """Run ``command --port PORT`` (a free loopback port), output to ``log``, until the block
    ends; yields (base URL, process id) once ``GET ready_path`` answers 200.

    Raises:
        SystemExit: the process exited before it was ready, or was not ready within
            ``timeout_s`` seconds (with the tail of its log).
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not _answers(f"{url}{ready_path}"):
            if proc.poll() is not None or time.monotonic() > deadline:
                state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {timeout_s} s"
                raise SystemExit(f"{name} {state}; log {log}:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(120)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def print_table(table: Table) -> None:
    """Print ``table`` to stderr whole: on a terminal at its width, and when stderr is piped
    or redirected (where rich falls back to 80 columns and would cut columns) as wide as the
    table needs."""
    console = Console(stderr=True)
    if not console.is_terminal:
        needed = console.measure(table, options=console.options.update_width(10_000)).maximum
        console = Console(stderr=True, width=max(console.width, needed))
    console.print(table)


def plot_levels(results: Mapping[str, dict], path: Path, title: str) -> Path | None:
    """Write a PNG of aggregate tokens/s and TTFT p50 (s) against concurrent streams (log2
    axis), one line per ``{name: service.bench.load.run() result}``. Returns ``path``, or
    None when matplotlib is not installed (``pip install -e '.[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, result in results.items():
        levels = [r["concurrency"] for r in result["levels"]]
        left.plot(levels, [r["aggregate_tok_s"] for r in result["levels"]], marker="o", label=name)
        right.plot(levels, [r["ttft_s_p50"] for r in result["levels"]], marker="o", label=name)
    left.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="Throughput")
    right.set(xlabel="concurrent streams", ylabel="TTFT p50 (s)", title="Time to first token")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def machine_info(in_process: bool = False) -> dict[str, str]:
    """Where a result was measured: ``machine`` (platform string) and ``processor``; with
    ``in_process`` (imports MLX) also ``device`` (cpu/gpu), ``mlx`` (version) and
    ``cpu_blas`` (the BLAS library MLX's CPU matmuls use)."""
    info = {"machine": platform.platform(), "processor": platform.machine()}
    if in_process:
        from models.blas import cpu_blas
        from models.loader import device_name

        info |= {"device": device_name(), "mlx": version("mlx"), "cpu_blas": cpu_blas()}
    return info


def device_defaults() -> tuple[str, WeightsMode]:
    """stepserve's ``auto`` compute dtype name and weight format on MLX's default device
    (``service.process.startup``): ("float16", "quantized") on a GPU, ("float32",
    "dequantized") on the CPU."""
    from service.process.startup import compute_dtype, weights_mode

    dtype = str(compute_dtype("auto")).removeprefix("mlx.core.")
    return dtype, cast("WeightsMode", weights_mode("auto"))


def quiet_compile_cache(policy: str | bool) -> CompileCache:
    """A :class:`CompileCache` with ``policy`` ("on", "off", "auto" or a bool) that records no
    metrics: the server's compile path, timed in-process."""
    from service.engine.compile_cache import CompileCache

    return CompileCache(policy, lambda *a: None, lambda s: None)


def warm_median_seconds(fn: Callable[..., Any], args: tuple = (), repeats: int = 10) -> float:
    """Median wall seconds of ``mx.eval(fn(*args))`` over ``repeats`` runs, after one untimed
    run (the compile, for a compiled ``fn``)."""
    import mlx.core as mx

    from service.engine.compile_cache import median_seconds

    mx.eval(fn(*args))
    return median_seconds(fn, args, repeats)
