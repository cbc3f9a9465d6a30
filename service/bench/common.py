"""What every bench tool shares, written once: prompt sets, a streamed request and the
figures of many, percentiles, ``/metrics`` scraping, tables, plots, the JSON report, machine
info, and the in-process timing helpers (server subprocesses: :mod:`service.bench.servers`).

Importing this module does not import MLX: the in-process helpers import it when called,
so the HTTP tools (``stepserve bench``, ``stepserve soak``) stay MLX-free until they need it.
"""

from __future__ import annotations

import json
import platform
import random
import shlex
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from models.loader import WeightsMode
    from service.engine.compile_cache import CompileCache

MISSES = "stepserve_compile_cache_misses_total"

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


@dataclass
class Stream:
    """One streamed request as the client saw it. Times are ``time.perf_counter()`` seconds,
    so records of one process compare; ``arrivals`` holds one time per event that carried text
    (a token, or a few when a server batches them)."""

    start: float = 0.0
    end: float = 0.0  # when the stream ended (or was closed early)
    arrivals: list[float] = field(default_factory=list)
    usage: dict | None = None  # the OpenAI-style usage the events gave, later counts over earlier ones
    error: str | None = None  # a non-200 status or an error event; None when it ended well

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] - self.start if self.arrivals else None

    @property
    def gaps(self) -> list[tuple[float, float]]:
        """(earlier, later) arrival times of each pair of consecutive text events."""
        return list(zip(self.arrivals, self.arrivals[1:], strict=False))

    @property
    def counted(self) -> bool:
        """Whether the server reported the completion tokens (``usage.completion_tokens``)."""
        return (self.usage or {}).get("completion_tokens") is not None

    @property
    def tokens(self) -> int:
        """Completion tokens: the server's ``usage`` count, else the text events seen."""
        return self.usage["completion_tokens"] if self.usage and self.counted else len(self.arrivals)

    @property
    def prompt_tokens(self) -> int | None:
        return self.usage.get("prompt_tokens") if self.usage else None

    @property
    def cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens``; None when the server does not say."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return details.get("cached_tokens")


def _event_text(event: dict) -> str:
    """The text of one event of ``/infer`` (``text``), ``/v1/completions`` (``choices[0].text``)
    or ``/v1/chat/completions`` (``choices[0].delta.content``, or its ``reasoning_content``
    while a model thinks)."""
    choice = (event.get("choices") or [{}])[0]
    delta = choice.get("delta") or {}
    return event.get("text") or choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""


#: What one parsed server-sent event carries: (text, usage, error). ``text``: the generated text
#: it brings ("" for none: it is then no arrival); ``usage``: token counts in the OpenAI shape
#: (``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``), merged
#: into :attr:`Stream.usage`, or None; ``error``: what went wrong (at most 200 characters), or None.
EventParts = tuple[str, dict | None, str | None]


def openai_event(event: dict) -> EventParts:
    """:data:`EventParts` of one event of ``/infer``, ``/v1/completions`` or
    ``/v1/chat/completions``: its text, its ``usage`` and its ``error`` object."""
    error = json.dumps(event["error"])[:200] if event.get("error") else None
    return _event_text(event), event.get("usage") or None, error


async def stream_request(
    client: httpx.AsyncClient,
    path: str,
    body: dict,
    record: Stream | None = None,
    until: Callable[[], bool] | None = None,
    parse: Callable[[dict], EventParts] = openai_event,
) -> Stream:
    """POST ``body`` (a streaming request) to ``path`` and read its server-sent events into
    ``record`` (a new :class:`Stream` when None) as they come, so another task can watch it.
    ``until`` is asked after each text event; when it answers True the stream is closed early
    (the server sees a client that left). ``parse`` reads each event's ``data:`` JSON (default:
    the OpenAI routes' events; other APIs' in :mod:`service.bench.routes`); an ``event:`` line
    naming the event is skipped. Raises httpx.HTTPError (transport, timeouts)."""
    rec = record or Stream()
    rec.start = time.perf_counter()
    async with client.stream("POST", path, json=body) as reply:
        if reply.status_code != 200:
            rec.error = f"http_{reply.status_code}: {(await reply.aread())[:200].decode(errors='replace')}"
        else:
            await _read_events(reply, rec, until, parse)
    rec.end = time.perf_counter()
    return rec


async def _read_events(
    reply: httpx.Response, rec: Stream, until: Callable[[], bool] | None, parse: Callable[[dict], EventParts]
) -> None:
    async for line in reply.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        text, usage, error = parse(json.loads(line[6:]))
        if usage:  # merged: a route may send the prompt's count and the answer's in different events
            rec.usage = {**(rec.usage or {}), **usage}
        rec.error = rec.error or error  # the first error event says most
        if text:
            rec.arrivals.append(time.perf_counter())
            if until is not None and until():
                return


def level_figures(records: Sequence[Stream], errors: int, elapsed_s: float) -> dict:
    """What one load level reports: requests and errors, completion tokens, aggregate tokens/s
    (all completion tokens over ``elapsed_s``), per-stream tokens/s (the median over requests
    of completion tokens over the request's wall time, TTFT included), TTFT and inter-token
    latency p50/p99 in seconds, and the prompt tokens (min, p50, max) and prefix-cache hits
    (p50, total) the servers' ``usage`` reported (None where none did). ``records`` are the
    requests that ended well; failed ones count only in ``errors``."""
    ttft = [r.ttft_s for r in records if r.ttft_s is not None]
    prompt = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in records if r.cached_tokens is not None]
    itl = [b - a for r in records for a, b in r.gaps]
    tokens = sum(r.tokens for r in records)
    walls = [r.tokens / (r.end - r.start) for r in records]
    return {
        "requests": len(records),
        "errors": errors,
        "completion_tokens": tokens,
        "elapsed_s": elapsed_s,
        "aggregate_tok_s": tokens / elapsed_s,
        "per_stream_tok_s_p50": statistics.median(walls) if walls else None,
        "ttft_s_p50": percentile(ttft, 0.5),
        "ttft_s_p99": percentile(ttft, 0.99),
        "itl_s_p50": percentile(itl, 0.5),
        "itl_s_p99": percentile(itl, 0.99),
        "prompt_tokens_min": min(prompt, default=None),
        "prompt_tokens_p50": percentile(prompt, 0.5),
        "prompt_tokens_max": max(prompt, default=None),
        "cached_tokens_p50": percentile(cached, 0.5),
        "cached_tokens_total": sum(cached) if cached else None,
    }


def scrape(http: httpx.Client, names: Iterable[str]) -> dict[str, float]:
    """Sum over labels of each named metric's samples on ``GET /metrics`` (prometheus_client's
    text parser); 0.0 for a name the server does not expose. Raises httpx.HTTPError."""
    totals = dict.fromkeys(names, 0.0)
    for sample in _samples(http):
        if sample.name in totals:
            totals[sample.name] += sample.value
    return totals


def scrape_by(http: httpx.Client, name: str, label: str) -> dict[str, float]:
    """Sum of ``name``'s samples on ``GET /metrics`` per value of its label ``label``
    (e.g. ``stepserve_engine_seconds_total`` by ``kind``). Raises httpx.HTTPError."""
    totals: dict[str, float] = {}
    for sample in _samples(http):
        if sample.name == name:
            key = sample.labels.get(label, "")
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def _samples(http: httpx.Client) -> Iterator[Sample]:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        yield from family.samples


def stepserve_counters(http: httpx.Client, names: Sequence[str]) -> Callable[[], dict[str, float]] | None:
    """A reader of the ``names`` metrics (:func:`scrape`) when the server behind ``http`` has
    stepserve's ``/metrics``; None for one without (mlx_lm.server, vllm-mlx by default)."""
    if http.get("/metrics").status_code != 200:
        return None
    return lambda: scrape(http, names)


def metric_labels(http: httpx.Client, name: str) -> dict[str, str]:
    """Labels of the first sample of ``name`` on ``GET /metrics`` ({} when absent), e.g. the
    version, MLX version and device of ``stepserve_build_info``."""
    return next((dict(sample.labels) for sample in _samples(http) if sample.name == name), {})


def print_table(table: Table) -> None:
    """Print ``table`` to stderr whole: on a terminal at its width, and when stderr is piped
    or redirected (where rich falls back to 80 columns and would cut columns) as wide as the
    table needs."""
    console = Console(stderr=True)
    if not console.is_terminal:
        needed = console.measure(table, options=console.options.update_width(10_000)).maximum
        console = Console(stderr=True, width=max(console.width, needed))
    console.print(table)


def report(result: dict, argv: Sequence[str], tables: Sequence[Table], out: Path | None = None) -> int:
    """Finish a tool's run: add its exact command (``stepserve bench ARGV``), the time and
    :func:`machine_info` to ``result``, print ``tables`` to stderr, write ``result`` as JSON
    to ``out`` when given and to stdout. Returns 0 (the tool's exit code)."""
    result.update(
        command=shlex.join(["stepserve", "bench", *argv]),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **machine_info(),
    )
    for table in tables:
        print_table(table)
    text = json.dumps(result, indent=2)
    if out:
        out.write_text(text)
    print(text)
    return 0


def fmt(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    """``value * scale`` with ``digits`` decimals, or "-" for None."""
    return "-" if value is None else f"{value * scale:.{digits}f}"


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


def device_defaults(dtype: str | None = None, weights: str | None = None) -> tuple[str, WeightsMode]:
    """(``dtype``, ``weights``) where given (a benchmark's ``--dtype``/``--weights``), else
    stepserve's ``auto`` compute dtype name and weight format on MLX's default device
    (``service.process.startup``): ("float16", "quantized") on a GPU, ("float32",
    "dequantized") on the CPU."""
    from service.process.startup import compute_dtype, weights_mode

    auto_dtype = str(compute_dtype("auto")).removeprefix("mlx.core.")
    return dtype or auto_dtype, cast("WeightsMode", weights or weights_mode("auto"))


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
