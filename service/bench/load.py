"""``stepserve bench``: measure a running server from the outside, over HTTP.

For each concurrency level, that many client streams send greedy, streamed requests one
after another. Workloads (``--workload``):

* ``essays`` (default): ``POST /infer`` or OpenAI's ``POST /v1/completions`` (``--api``), a
  generated prompt set of mixed lengths (about 10 to 150 tokens);
* ``chat-shared-prefix``: ``POST /v1/chat/completions``, every request with the same long
  system prompt (about ``--system-tokens`` tokens, generated here) and its own short user
  turn, none repeated within a run;
* ``copy``: ``POST /v1/chat/completions``, copy-heavy tasks where the answer quotes the prompt
  (speculative decoding's prompt lookup pays here): edit a given passage (one word replaced
  throughout, the rest unchanged) or repeat a given text word for word, the passages
  (about ``--system-tokens`` tokens) generated here, a different one per request;
* ``chat``: ``POST /v1/chat/completions``, open-ended questions (nothing to copy);
* ``documents``: ``POST /v1/chat/completions``, each request a different document of about
  ``--system-tokens`` words drawn at random (new ones each run, so no prefix cache holds one)
  after a label unique to the run and the request, and a question about it: what many long,
  unrelated conversations at once cost in KV memory;
* ``long``: ``POST /v1/completions``, a short essay prompt (under 20 tokens, a different one
  per request) generating exactly ``--max-tokens`` tokens: the request sets ``ignore_eos``, so
  the model's end-of-sequence token does not stop it (a server without that field may stop early:
  the completion tokens say);
* ``long-arrival`` and ``first-burst`` are forms of their own (``--workload NAME --help``).

Reported per level: aggregate tokens/s (all completion tokens over the level's wall time),
per-stream tokens/s (the median over requests of completion tokens over the request's wall
time, TTFT included), TTFT and inter-token latency p50/p99 as the client sees them (first
text chunk; gaps between chunks), errors, the prompt tokens and prefix-cache hits the server
reported in ``usage``, and the compile-cache misses a stepserve counted during the level.
A table goes to stderr, JSON to stdout and optionally a file. Measurements: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import httpx
from rich.table import Table

from service.bench.common import (
    ESSAY_TOPICS,
    MISSES,
    Stream,
    essay_prompts,
    fmt,
    level_figures,
    metric_labels,
    plot_levels,
    report,
    scrape_by,
    stepserve_counters,
    stream_request,
    word_prompt,
)
from service.bench.constrained_schemas import SCHEMAS
from service.bench.prompts import copy_task, estimate_tokens, passage, system_prompt

LOAD_WORKLOADS = ("essays", "chat-shared-prefix", "copy", "chat", "long", "documents")
WORKLOADS = (*LOAD_WORKLOADS, "long-arrival", "first-burst")
PROMPTS = essay_prompts()


MASKS, MASK_SECONDS = "stepserve_grammar_masks_total", "stepserve_grammar_mask_seconds_total"
TTFT, QUEUE = "stepserve_time_to_first_token_seconds", "stepserve_queue_time_seconds"
SERVER_SIDE = [f"{TTFT}_sum", f"{TTFT}_count", f"{QUEUE}_sum", f"{QUEUE}_count"]
ENGINE = "stepserve_engine_seconds_total"


@dataclass
class Workload:
    """What the requests of a load run send: greedy and streamed, ``max_tokens`` each, with
    ``model`` as the model name (None: the server's default; some servers require one)."""

    name: str = "essays"  # one of LOAD_WORKLOADS
    api: str = "infer"  # essays only: "infer" (/infer) or "openai" (/v1/completions)
    max_tokens: int = 64
    model: str | None = None
    system_tokens: int = 400  # chat-shared-prefix: the system prompt's size, estimated
    constrained: int = 0  # essays on openai: this many streams of each level ask for JSON (response_format)
    schema: str = "notes"  # the constrained streams' JSON schema: a key of SCHEMAS
    streams: int = 1  # the level's streams (set by run)
    system: str = field(init=False, default="")
    _turns: Iterator[int] = field(init=False, default_factory=count, repr=False)
    _run: int = field(init=False, default_factory=lambda: random.getrandbits(32), repr=False)  # documents' seed

    def __post_init__(self) -> None:
        if self.name == "chat-shared-prefix":
            self.system = system_prompt(self.system_tokens)

    def request(self, slot: int) -> tuple[str, dict]:
        """Path and JSON body of one request: for essays, prompt ``slot`` of the set (cycling);
        for chat, copy and long, the next request of this run (``slot`` is not used)."""
        stream = {"max_tokens": self.max_tokens, "temperature": 0, "stream": True}
        if self.name == "long":
            turn = next(self._turns)
            prompt = f"Essay {turn}: write at length about {ESSAY_TOPICS[turn % len(ESSAY_TOPICS)]}.\n\nEssay:"
            body = {"model": self.model, "prompt": prompt, **stream, "ignore_eos": True}
            return "/v1/completions", body | {"stream_options": {"include_usage": True}}
        if self.name == "documents":
            turn = next(self._turns)
            words = word_prompt(random.Random(self._run * 1_000_003 + turn), self.system_tokens)
            # The label leads, so two documents differ from their first token (random words alone
            # can share a first few words: a birthday collision over WORDS).
            user = f"Document {self._run:08x}-{turn}: {words}\n\nWhat is the text above about?"
            body = {"model": self.model, "messages": [{"role": "user", "content": user}], **stream}
            return "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}
        if self.name in ("copy", "chat"):
            turn = next(self._turns)
            topic = ESSAY_TOPICS[turn % len(ESSAY_TOPICS)]
            user = copy_task(turn, self.system_tokens) if self.name == "copy" else f"Tell me about {topic}."
            body = {"model": self.model, "messages": [{"role": "user", "content": user}], **stream}
            return "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}
        if self.name == "chat-shared-prefix":
            turn = next(self._turns)
            user = f"Visitor {turn} asks: what do you know about {ESSAY_TOPICS[turn % len(ESSAY_TOPICS)]}?"
            messages = [{"role": "system", "content": self.system}, {"role": "user", "content": user}]
            body = {"model": self.model, "messages": messages, **stream, "stream_options": {"include_usage": True}}
            return "/v1/chat/completions", body
        prompt = PROMPTS[slot % len(PROMPTS)]
        if self.api == "openai":
            body = {"prompt": prompt, "model": self.model, **stream, "stream_options": {"include_usage": True}}
            if slot % self.streams < self.constrained:
                schema = {"name": self.schema, "schema": SCHEMAS[self.schema]}
                body["response_format"] = {"type": "json_schema", "json_schema": schema}
            return "/v1/completions", body
        return "/infer", {"prompt": prompt, **stream, **({"model": self.model} if self.model else {})}

    def describe(self) -> dict:
        """The workload's settings for the JSON result."""
        openai = self.system or self.name in ("copy", "chat", "long", "documents")
        info = {"workload": self.name, "api": "openai" if openai else self.api, "max_tokens": self.max_tokens}
        if self.name == "long":
            info["ignore_eos"] = True
        if self.name == "documents":
            info["document_words"] = self.system_tokens
        if self.name == "copy":
            info["passage_tokens_estimate"] = estimate_tokens(passage(0, self.system_tokens))
        if self.constrained:
            info |= {"constrained_streams": self.constrained, "constrained_schema": self.schema}
        if self.system:
            info |= {
                "system_tokens_requested": self.system_tokens,
                "system_tokens_estimate": estimate_tokens(self.system),
                "system_prompt_chars": len(self.system),
            }
        return info


async def run_level(
    url: str,
    concurrency: int,
    requests_per_stream: int,
    workload: Workload,
    transport: httpx.AsyncBaseTransport | None = None,
    sink: list[Stream] | None = None,
) -> dict:
    """Run one concurrency level: ``concurrency`` client streams, each sending
    ``requests_per_stream`` requests of ``workload`` back to back (stream i's j-th request is
    slot ``i + j * concurrency``). With ``workload.constrained`` = K, streams 0..K-1 ask for
    JSON and keep sending requests until the free streams are done (their answers are short,
    so a fixed count would leave the batch with fewer rows, and no constrained ones, for most
    of the level: the issue's measure is a batch that keeps K constrained rows). Their
    requests still streaming then are closed at their next token and count the tokens they
    got: left to finish, they would add a tail of up to a whole request in which only the K
    constrained rows run.

    Returns :func:`~service.bench.common.level_figures` with ``concurrency`` (and, when K > 0,
    ``constrained_requests`` and ``constrained_closed_early``); a request that failed (a
    non-200 answer, an error event or an httpx.HTTPError) counts in ``errors`` only.
    ``transport``: the httpx transport to use (tests); None: the network. ``sink``: when given,
    the records of the requests that ended well are appended to it (to pool levels' figures).
    """
    records: list[Stream] = []
    errors, constrained_requests = 0, 0
    free_left = concurrency - min(workload.constrained, concurrency)
    free_done = asyncio.Event()
    if free_left == 0:
        free_done.set()

    closed_early = 0

    async def send(client: httpx.AsyncClient, slot: int, until: Callable[[], bool] | None = None) -> Stream | None:
        nonlocal errors
        path, body = workload.request(slot)
        try:
            record = await stream_request(client, path, body, until=until)
        except httpx.HTTPError:
            record = None
        if record is None or record.error:
            errors += 1
            return None
        records.append(record)
        return record

    async def stream(client: httpx.AsyncClient, index: int) -> None:
        nonlocal free_left, constrained_requests, closed_early
        if index < workload.constrained and free_left > 0:
            j = 0
            while not free_done.is_set():
                record = await send(client, index + j * concurrency, until=free_done.is_set)
                j, constrained_requests = j + 1, constrained_requests + 1
                closed_early += record is not None and record.usage is None and free_done.is_set()
            return
        for j in range(requests_per_stream):
            await send(client, index + j * concurrency)
        if index >= workload.constrained:
            free_left -= 1
            if free_left == 0:
                free_done.set()

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits, transport=transport) as client:
        start = time.perf_counter()
        await asyncio.gather(*(stream(client, i) for i in range(concurrency)))
        elapsed = time.perf_counter() - start
    if sink is not None:
        sink.extend(records)
    extra = {"constrained_requests": constrained_requests, "constrained_closed_early": closed_early}
    extra = extra if workload.constrained else {}
    return {"concurrency": concurrency, **level_figures(records, errors, elapsed), **extra}


def run(
    url: str,
    levels: list[int],
    requests_per_stream: int,
    workload: Workload,
    warmup_requests: int = 0,
    records: dict[int, list[Stream]] | None = None,
) -> dict:
    """Every concurrency level in turn (:func:`run_level`), with the compile misses the server
    counted in each (None for a server without stepserve's /metrics, such as mlx_lm.server).

    ``warmup_requests`` > 0 first runs each level untimed with that many requests per
    stream, so that a server which builds its kernels on first use (on CUDA, NVRTC takes
    seconds per new kernel) is measured warm; misses during that pass are reported as
    ``warmup_compile_misses`` (stepserve should have none: it warms up before it is ready).
    ``records``: when given, each level's timed requests that ended well are appended to
    ``records[concurrency]`` (warm-up requests are not).
    Raises httpx.HTTPError when the server does not answer.
    """
    with httpx.Client(base_url=url, timeout=60) as client:
        read = stepserve_counters(client, [MISSES, MASKS, MASK_SECONDS, *SERVER_SIDE])
        stepserve = read is not None
        build = metric_labels(client, "stepserve_build_info") if stepserve else {}

        def misses() -> float:
            return read()[MISSES] if read else 0.0

        results = []
        for level in levels:
            before = misses()
            if warmup_requests:
                workload.streams = level
                asyncio.run(run_level(url, level, warmup_requests, workload))
            timed = misses()
            masks_before = read() if read else {}
            engine_before = scrape_by(client, ENGINE, "kind") if read else {}
            workload.streams = level
            sink = None if records is None else records.setdefault(level, [])
            result = asyncio.run(run_level(url, level, requests_per_stream, workload, sink=sink))
            result["compile_misses"] = misses() - timed if stepserve else None
            if read:
                result |= server_side(masks_before, read(), engine_before, scrape_by(client, ENGINE, "kind"))
            if read and workload.constrained:
                after = read()
                n = after[MASKS] - masks_before[MASKS]
                result["grammar_masks"] = n
                result["mask_host_s_per_token"] = (after[MASK_SECONDS] - masks_before[MASK_SECONDS]) / n if n else None
            result["warmup_compile_misses"] = timed - before if stepserve and warmup_requests else None
            results.append(result)
    return {
        "url": url,
        **workload.describe(),
        "build": build,
        "requests_per_stream": requests_per_stream,
        "warmup_requests_per_stream": warmup_requests,
        "levels": results,
    }


def server_side(before: dict, after: dict, engine_before: dict, engine_after: dict) -> dict:
    """What a stepserve counted during a level, from its /metrics before and after: its own
    mean TTFT and queue time (from the request's arrival at the engine, after tokenizing: the
    client's TTFT minus these is the HTTP side's share) and the engine thread's host share
    (seconds running Python and queueing work over those plus the seconds waiting for the
    device; near 1, the host, not the device, bounds the step rate)."""

    def mean(name: str) -> float | None:
        n = after[f"{name}_count"] - before[f"{name}_count"]
        return (after[f"{name}_sum"] - before[f"{name}_sum"]) / n if n else None

    host, wait = (engine_after.get(k, 0.0) - engine_before.get(k, 0.0) for k in ("host", "wait"))
    return {
        "server_ttft_s_mean": mean(TTFT),
        "server_queue_s_mean": mean(QUEUE),
        "engine_host_share": host / (host + wait) if host + wait > 0 else None,
    }


OTHER_FORMS = """other forms (each has --help):
  stepserve bench --workload long-arrival ...  running streams' largest gap while a long prompt prefills
  stepserve bench --workload first-burst ...   TTFT of a just-ready server's first burst against its second
  stepserve bench --side-by-side ...           stepserve and its peers on the same weights
  stepserve bench --micro ...                  plain vs compiled, in-process
  stepserve bench settings-ab ...              two serve configurations, servers started here in turn
  stepserve bench ab ...                       two running servers, the same requests alternating
  stepserve bench routes ...                   streams over chat, Messages (tools) and Responses against all chat
  stepserve bench steps ...                    one prefill and decode step per dtype, weight format, compile mode
  stepserve bench profile ...                  where a decode step's time goes
  stepserve bench pipeline ...                 one process against pipeline ranks per decode step, in-process
  stepserve bench group ...                    one process against a pipeline group, through the real server
  stepserve bench random-model ...             mlx-lm's class at a named shape, random weights"""


def table(result: dict, title: str | None = None) -> Table:
    """The per-level table of one :func:`run` result."""
    table = Table(title=title or f"stepserve bench: {result['url']} ({_title(result)})")
    columns = ("streams", "requests", "errors", "aggregate tok/s", "per-stream tok/s", "TTFT p50/p99 s")
    for col in (*columns, "ITL p50/p99 ms", "prompt tok p50", "cached tok p50", "compile misses"):
        table.add_column(col, justify="right")
    for r in result["levels"]:
        table.add_row(
            str(r["concurrency"]),
            str(r["requests"]),
            str(r["errors"]),
            f"{r['aggregate_tok_s']:.1f}",
            fmt(r["per_stream_tok_s_p50"], digits=1),
            f"{fmt(r['ttft_s_p50'])}/{fmt(r['ttft_s_p99'])}",
            f"{fmt(r['itl_s_p50'], 1e3, 1)}/{fmt(r['itl_s_p99'], 1e3, 1)}",
            fmt(r["prompt_tokens_p50"], digits=0),
            fmt(r["cached_tokens_p50"], digits=0),
            fmt(r["compile_misses"], digits=0),
        )
    return table


def _title(result: dict) -> str:
    system = f", system prompt ~{result['system_tokens_estimate']} tokens" if "system_tokens_estimate" in result else ""
    return f"{result['workload']}{system}, max_tokens {result['max_tokens']}"


def add_workload_flags(parser: argparse.ArgumentParser, choices: tuple[str, ...]) -> None:
    """``--workload``, ``--system-tokens`` and ``--max-tokens``, shared by this tool and the
    side-by-side."""
    parser.add_argument("--workload", choices=choices, default="essays", help="what the requests send (see above)")
    parser.add_argument(
        "--system-tokens",
        type=int,
        default=400,
        help="chat-shared-prefix: the shared system prompt's size in tokens, about (CPU ~400, GPU ~1500); "
        "copy: each passage's; documents: each document's, in words",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request at most")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench",
        description=__doc__,
        epilog=OTHER_FORMS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], help="client streams per level")
    parser.add_argument("--requests", type=int, default=3, help="requests per stream and level")
    add_workload_flags(parser, WORKLOADS)
    parser.add_argument(
        "--api", choices=["infer", "openai"], default="infer", help="essays: POST /infer or /v1/completions"
    )
    parser.add_argument("--warmup-requests", type=int, default=0, help="untimed requests per stream before each level")
    parser.add_argument(
        "--constrained",
        type=int,
        default=0,
        help="essays with --api openai: this many streams of each level send response_format (a JSON schema), "
        "request after request while the free streams run; their requests still streaming when the free streams "
        "finish are closed and counted to there",
    )
    parser.add_argument(
        "--constrained-schema",
        choices=sorted(SCHEMAS),
        default="notes",
        help="the constrained streams' schema: 'notes' (short answers, about 18 tokens on the default model) or "
        "'report' (sections of points, longer than 128 tokens: as many requests per token as free text)",
    )
    parser.add_argument("--model", help="model name to send (required by some OpenAI servers)")
    parser.add_argument("--out", type=Path, help="write the JSON result here, and the plot next to it (.png)")
    return parser


def main(argv: list[str]) -> int:
    """``stepserve bench [options]``: run the load, print the table to stderr and the JSON
    to stdout; with ``--out`` write the JSON and a PNG plot beside it. Returns 0."""
    args = _parser().parse_args(argv)
    workload = Workload(args.workload, args.api, args.max_tokens, args.model, args.system_tokens)
    workload.constrained, workload.schema = args.constrained, args.constrained_schema
    result = run(args.url, args.concurrency, args.requests, workload, args.warmup_requests)
    if args.out:
        plot = plot_levels({result["url"]: result}, args.out.with_suffix(".png"), f"stepserve bench: {result['url']}")
        result["plot"] = str(plot) if plot else None
    return report(result, argv, [table(result)], args.out)
