"""``stepserve bench routes``: tokens/s of a load spread over the three chat APIs against the
same load on chat completions alone.

    stepserve bench routes --streams 32 --messages 8 --responses 8 --rounds 3 --serve-args="--model DIR"
    stepserve bench routes --url http://127.0.0.1:8000 --streams 8 --messages 2 --responses 2

Two loads of ``--streams`` concurrent client streams, each stream sending ``--requests``
greedy, streamed requests back to back:

* **all-chat**: every stream on ``POST /v1/chat/completions`` (``stream_options.include_usage``);
* **mixed**: ``--messages`` streams on Anthropic's ``POST /v1/messages`` with a ``tools`` list
  (:data:`TOOLS`: two function tools with ``input_schema``) and ``tool_choice`` ``auto``,
  ``--responses`` streams on OpenAI's ``POST /v1/responses`` (``instructions`` + ``input``), the
  rest on chat completions; the routes are spread over the streams (:func:`route_plan`).

Every request is one of the load tool's chat conversations (its ``chat-shared-prefix``
workload, :class:`service.bench.load.Workload`): a shared system prompt of about
``--system-tokens`` tokens and a short user turn of its own, none repeated within a run (so
neither load meets the other's prompts in the prefix cache). Messages gets the system prompt as
``system`` and the turns as ``messages``; Responses as ``instructions`` and the user turn as
``input``; each the same ``--max-tokens`` (``max_tokens``, ``max_output_tokens``), temperature 0.

Generated tokens are each route's own usage count: chat's ``usage.completion_tokens`` (the
usage chunk), Messages' ``usage.output_tokens`` (``message_delta``), Responses'
``response.usage.output_tokens`` (``response.completed``, or ``response.incomplete`` when
``max_output_tokens`` ended it). TTFT and ITL come from the streamed deltas: text (chat's
``content``, Messages' ``text_delta``, Responses' ``output_text.delta``), reasoning and tool
call arguments alike. A request that failed (a non-200 answer, an error event, a transport
error) or whose stream ended without its usage count is an error of its route: it adds no
tokens, and its reason is reported (``error_reasons``); the command then exits with 1.

A server is started here (``stepserve serve SERVE_ARGS`` on a free loopback port, stopped at
the end), or ``--url`` names one already running. After ``--warmup-requests`` untimed requests
per stream of the mixed load, each of ``--rounds`` rounds runs both loads, one after the other,
alternating the order (round 0: all-chat then mixed; round 1: mixed then all-chat; ...).
Reported: each load's aggregate tokens/s per round (all its completion tokens over its wall
time), mixed / all-chat per round and their geometric mean (its min and max), whether that
meets ``--target`` (issue 29: 0.9); per load and route, pooled over rounds: requests, errors,
tokens, tokens/s (the route's tokens over the load's wall time: its share), TTFT and ITL p50,
prompt tokens p50; and the compile misses a stepserve counted during the timed loads. A table
goes to stderr, JSON (with the command line) to stdout and ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
from rich.table import Table

from service.bench.common import (
    MISSES,
    EventParts,
    Stream,
    fmt,
    level_figures,
    metric_labels,
    openai_event,
    report,
    stepserve_counters,
    stream_request,
)
from service.bench.load import Workload
from service.bench.prompts import estimate_tokens
from service.bench.servers import START_TIMEOUT_S, STEPSERVE_SERVE, process_blas, serving
from service.bench.settings_ab import paired_statistics, warmup_seconds

ROUTES = ("chat", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
LOADS = ("all-chat", "mixed")
TARGET = 0.9  # issue 29: mixed tokens/s at least 0.9 of all-chat's
MAX_REASONS = 10  # distinct error reasons kept per route and load

#: The Messages streams' tools (Anthropic's shape): two function tools with an ``input_schema``.
TOOLS = (
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
    {
        "name": "search_archive",
        "description": "Search the town archive for records about a subject.",
        "input_schema": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
            "required": ["query"],
        },
    },
)


def route_plan(streams: int, messages: int, responses: int) -> list[str]:
    """The route of each of ``streams`` streams: ``messages`` "messages", ``responses``
    "responses" and the rest "chat", each route's streams spread evenly over the indices (so
    no route starts all its streams first). Raises ValueError for a negative count or
    ``messages + responses > streams``."""
    if min(streams, messages, responses) < 0 or messages + responses > streams:
        raise ValueError(
            f"{messages} messages + {responses} responses streams of {streams}: need 0 <= each, sum <= all"
        )
    counts = {"messages": messages, "responses": responses, "chat": streams - messages - responses}
    slots = [((j + 0.5) / n, i, route) for i, (route, n) in enumerate(counts.items()) for j in range(n)]
    return [route for _, _, route in sorted(slots)]


def _system_and_turns(chat: dict) -> tuple[str | None, list[dict]]:
    """A chat body's system prompt (system turns joined by a blank line; None without one) and
    its other turns."""
    system = [m["content"] for m in chat["messages"] if m["role"] == "system"]
    return ("\n\n".join(system) if system else None), [m for m in chat["messages"] if m["role"] != "system"]


def messages_body(chat: dict, tools: Sequence[dict] = TOOLS) -> dict:
    """The ``/v1/messages`` body of a streamed ``/v1/chat/completions`` body (``model``,
    ``messages``, ``max_tokens``, ``temperature``): its system turns as ``system``, the other
    turns as ``messages``, the same ``max_tokens`` and temperature, streamed, with ``tools``
    (Anthropic's shape) and ``tool_choice`` ``auto``."""
    system, turns = _system_and_turns(chat)
    body = {
        "model": chat["model"],
        "messages": turns,
        "max_tokens": chat["max_tokens"],
        "temperature": chat["temperature"],
        "stream": True,
        "tools": [dict(t) for t in tools],
        "tool_choice": {"type": "auto"},
    }
    return body | ({"system": system} if system is not None else {})


def responses_body(chat: dict) -> dict:
    """The ``/v1/responses`` body of a streamed ``/v1/chat/completions`` body: its system turns
    as ``instructions``, a single user turn as the ``input`` text (more turns: message items),
    ``max_tokens`` as ``max_output_tokens``, the same temperature, streamed."""
    system, turns = _system_and_turns(chat)
    one = len(turns) == 1 and turns[0]["role"] == "user"
    body = {
        "model": chat["model"],
        "input": turns[0]["content"] if one else [{"type": "message", **t} for t in turns],
        "max_output_tokens": chat["max_tokens"],
        "temperature": chat["temperature"],
        "stream": True,
    }
    return body | ({"instructions": system} if system is not None else {})


def route_request(route: str, chat: dict) -> tuple[str, dict]:
    """(path, body) of the chat completions body ``chat`` sent through ``route`` (one of
    :data:`ROUTES`). Raises KeyError for another route."""
    convert: dict[str, Callable[[dict], dict]] = {"chat": dict, "messages": messages_body, "responses": responses_body}
    return PATHS[route], convert[route](chat)


def messages_event(event: dict) -> EventParts:
    """:data:`~service.bench.common.EventParts` of one Anthropic Messages event: the text of a
    ``content_block_delta`` (``text_delta``, ``thinking_delta`` or a tool call's
    ``input_json_delta``); ``message_start``'s ``usage`` as ``prompt_tokens`` (Anthropic's
    ``input_tokens`` + ``cache_read_input_tokens`` + ``cache_creation_input_tokens``, the whole
    prompt; ``cache_read_input_tokens`` as the cached ones) and ``message_delta``'s
    ``usage.output_tokens`` as ``completion_tokens`` (``message_start``'s own output count is
    not the answer's, and is not read); an ``error`` event's ``error``."""
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        return delta.get("text") or delta.get("thinking") or delta.get("partial_json") or "", None, None
    if kind == "message_start":
        usage = (event.get("message") or {}).get("usage") or {}
        if usage.get("input_tokens") is None:
            return "", None, None
        cached = usage.get("cache_read_input_tokens")
        details = {"prompt_tokens_details": {"cached_tokens": cached}} if cached is not None else {}
        prompt = usage["input_tokens"] + (cached or 0) + (usage.get("cache_creation_input_tokens") or 0)
        return "", {"prompt_tokens": prompt, **details}, None
    if kind == "message_delta":
        out = (event.get("usage") or {}).get("output_tokens")
        return "", ({"completion_tokens": out} if out is not None else None), None
    if kind == "error":
        return "", None, json.dumps(event.get("error"))[:200]
    return "", None, None


RESPONSES_DELTAS = frozenset(
    {"response.output_text.delta", "response.reasoning_text.delta", "response.function_call_arguments.delta"}
)


def responses_event(event: dict) -> EventParts:
    """:data:`~service.bench.common.EventParts` of one OpenAI Responses event: the ``delta`` of
    an output text, reasoning text or function call arguments delta; the ``usage`` of
    ``response.completed`` or ``response.incomplete`` (the output limit ended it) as
    ``prompt_tokens`` (``input_tokens``), ``completion_tokens`` (``output_tokens``) and the
    cached tokens; an ``error`` event's code and message, or ``response.failed``'s error."""
    kind = event.get("type")
    if kind in RESPONSES_DELTAS:
        return event.get("delta") or "", None, None
    if kind in ("response.completed", "response.incomplete"):
        usage = (event.get("response") or {}).get("usage") or {}
        if usage.get("output_tokens") is None:
            return "", None, None
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        counts = {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage["output_tokens"]}
        return "", counts | {"prompt_tokens_details": {"cached_tokens": cached}}, None
    if kind == "error":
        return "", None, json.dumps({k: event.get(k) for k in ("code", "message", "param")})[:200]
    if kind == "response.failed":
        return "", None, json.dumps((event.get("response") or {}).get("error"))[:200]
    return "", None, None


PARSERS: dict[str, Callable[[dict], EventParts]] = {
    "chat": openai_event,
    "messages": messages_event,
    "responses": responses_event,
}


def checked(record: Stream) -> Stream:
    """``record`` with ``error`` set to "missing usage: ..." when it ended without an error but
    its route did not report the completion tokens (its tokens would otherwise be guessed from
    the deltas)."""
    if record.error is None and not record.counted:
        record.error = f"missing usage: the stream ended after {len(record.arrivals)} deltas without its token count"
    return record


def load_figures(results: Sequence[tuple[str, Stream]], elapsed_s: float) -> dict:
    """One load's figures from its requests (``(route, record)`` pairs, failed ones included)
    and its wall seconds: :func:`~service.bench.common.level_figures` of every request that
    ended well, and ``routes``: the same per route present (its ``aggregate_tok_s`` is the
    route's tokens over the whole load's ``elapsed_s``: its share), each with
    ``error_reasons`` ({reason: count}, at most :data:`MAX_REASONS` reasons, the rest under
    "other"). A request with ``error`` set adds to ``errors`` only."""
    routes: dict[str, dict] = {}
    for route in ROUTES:
        mine = [r for name, r in results if name == route]
        if not mine:
            continue
        ok = [r for r in mine if r.error is None]
        routes[route] = {**level_figures(ok, len(mine) - len(ok), elapsed_s), "error_reasons": _reasons(mine)}
    ok = [r for _, r in results if r.error is None]
    return {**level_figures(ok, len(results) - len(ok), elapsed_s), "routes": routes}


def _reasons(records: Sequence[Stream]) -> dict[str, int]:
    counts = Counter(r.error for r in records if r.error is not None)
    kept = dict(counts.most_common(MAX_REASONS))
    rest = sum(counts.values()) - sum(kept.values())
    return kept | ({"other": rest} if rest else {})


async def run_load(
    url: str,
    routes: Sequence[str],
    requests_per_stream: int,
    workload: Workload,
    model: str | None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[tuple[str, Stream]], float]:
    """``len(routes)`` concurrent client streams, stream i sending ``requests_per_stream``
    requests back to back through ``routes[i]``: each the next conversation of ``workload``
    (a chat body) as :func:`route_request` turns it, with ``model`` as the model name.

    Returns ((route, record) of every request in the order they ended, failed ones included
    with ``error`` set: :func:`checked`, or the type and message of a transport error or of an
    event that is not JSON), the load's wall seconds). ``transport``: httpx's transport
    (tests); None: the network."""
    results: list[tuple[str, Stream]] = []

    async def stream(client: httpx.AsyncClient, route: str) -> None:
        for _ in range(requests_per_stream):
            _, chat = workload.request(0)
            path, body = route_request(route, {**chat, "model": model})
            record = Stream()
            try:
                await stream_request(client, path, body, record, parse=PARSERS[route])
            except (httpx.HTTPError, ValueError) as error:  # transport, timeout, an event that is not JSON
                record.error, record.end = f"{type(error).__name__}: {error}"[:200], time.perf_counter()
            results.append((route, checked(record)))

    limits = httpx.Limits(max_connections=len(routes) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits, transport=transport) as client:
        start = time.perf_counter()
        await asyncio.gather(*(stream(client, route) for route in routes))
        elapsed = time.perf_counter() - start
    return results, elapsed


def pooled(runs: Sequence[tuple[list[tuple[str, Stream]], float]]) -> dict:
    """:func:`load_figures` of several runs of one load together: their requests pooled, their
    wall seconds summed."""
    return load_figures([x for results, _ in runs for x in results], sum(elapsed for _, elapsed in runs))


def schedule(rounds: int) -> list[tuple[str, str]]:
    """The order of each round's loads: all-chat then mixed in even rounds, mixed then all-chat
    in odd ones."""
    return [("all-chat", "mixed") if r % 2 == 0 else ("mixed", "all-chat") for r in range(rounds)]


def run(url: str, args: argparse.Namespace) -> dict:
    """Both loads against the server at ``url``: the untimed warm-up, then ``args.rounds``
    rounds in :func:`schedule`'s order. Returns the result (see the module's docstring).
    Raises httpx.HTTPError when the server does not answer, ValueError for a bad route split."""
    plans = {"all-chat": ["chat"] * args.streams, "mixed": route_plan(args.streams, args.messages, args.responses)}
    workload = Workload("chat-shared-prefix", max_tokens=args.max_tokens, system_tokens=args.system_tokens)
    with httpx.Client(base_url=url, timeout=60) as http:
        model = args.model or _first_model(http)
        read = stepserve_counters(http, [MISSES])
        build = metric_labels(http, "stepserve_build_info") if read else {}
        warmup = None
        if args.warmup_requests:
            warmup = load_figures(*asyncio.run(run_load(url, plans["mixed"], args.warmup_requests, workload, model)))
        runs: dict[str, list[tuple[list[tuple[str, Stream]], float]]] = {name: [] for name in LOADS}
        by_round = []
        for r, order in enumerate(schedule(args.rounds)):
            row: dict = {"round": r, "order": list(order)}
            for name in order:
                before = read()[MISSES] if read else None
                done = asyncio.run(run_load(url, plans[name], args.requests, workload, model))
                runs[name].append(done)
                row[name] = load_figures(*done) | {
                    "compile_misses": read()[MISSES] - before if read and before is not None else None
                }
            by_round.append(row)
    ratio = paired_statistics(
        [row["all-chat"]["aggregate_tok_s"] for row in by_round], [row["mixed"]["aggregate_tok_s"] for row in by_round]
    )
    geomean = ratio["paired_ratio_geomean"]
    loads = {name: pooled(runs[name]) for name in LOADS}
    return {
        "url": url,
        "model": model,
        "streams": args.streams,
        "mixed_routes": dict(Counter(plans["mixed"])),
        "route_plan": plans["mixed"],
        "requests_per_stream": args.requests,
        "warmup_requests_per_stream": args.warmup_requests,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "system_tokens_requested": args.system_tokens,
        "system_tokens_estimate": estimate_tokens(workload.system),
        "tools": [t["name"] for t in TOOLS],
        "tool_choice": "auto",
        "build": build,
        "by_round": by_round,
        "pooled": loads,
        "mixed_over_all_chat": {
            "all_chat_tok_s_median": ratio["a_tok_s_median"],
            "mixed_tok_s_median": ratio["b_tok_s_median"],
            "ratio_geomean": geomean,
            "ratio_min": ratio["paired_ratio_min"],
            "ratio_max": ratio["paired_ratio_max"],
            "ratio_by_round": ratio["ratio_by_round"],
            "rounds": ratio["rounds"],
        },
        "target": args.target,
        "target_met": None if geomean is None else geomean >= args.target,
        "errors_total": sum(loads[name]["errors"] for name in LOADS),
        "warmup": warmup,
        "warmup_errors": warmup["errors"] if warmup else 0,
    }


def _first_model(http: httpx.Client) -> str:
    """The first model ``GET /v1/models`` lists (Messages requires a name). Raises
    httpx.HTTPStatusError when the server answers an error, SystemExit when it lists none."""
    reply = http.get("/v1/models")
    reply.raise_for_status()
    data = reply.json().get("data") or []
    if not data:
        raise SystemExit(f"{http.base_url}/v1/models lists no model; name one with --model")
    return data[0]["id"]


def _serve(args: argparse.Namespace) -> dict:
    """Start ``stepserve serve SERVE_ARGS``, run :func:`run` against it and stop it; the result
    with ``server`` (command, process id, seconds to ready, warm-up seconds, BLAS, log)."""
    with tempfile.TemporaryDirectory(prefix="stepserve-bench-routes-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / "server.log"
        command = [*STEPSERVE_SERVE, *args.serve_args]
        start = time.perf_counter()
        with serving("stepserve", command, "/readyz", log, args.ready_timeout_s) as (url, pid):
            ready_s = time.perf_counter() - start
            readyz = httpx.get(f"{url}/readyz", timeout=60).json()
            server = {
                "command": shlex.join([*command, "--port", url.rsplit(":", 1)[1]]),
                "pid": pid,
                "ready_s": ready_s,
                "warmup_s": warmup_seconds(readyz, log.read_text(errors="replace")),
                "blas": process_blas(pid),
                "log": str(log) if args.log_dir else None,
            }
            result = run(url, args)
    return {**result, "server": server}


def tables(result: dict) -> list[Table]:
    """The per-load, per-route table and the ratio table of a :func:`run` result."""
    title = (
        f"stepserve bench routes: {result['streams']} streams, mixed {result['mixed_routes']}, "
        f"max_tokens {result['max_tokens']}, system ~{result['system_tokens_estimate']} tokens "
        f"(pooled over {result['rounds']} rounds)"
    )
    table = Table(title=title)
    columns = ("load", "route", "requests", "errors", "tokens", "tok/s", "TTFT p50 ms", "ITL p50 ms", "prompt tok p50")
    for col in columns:
        table.add_column(col, justify="right")
    for name in LOADS:
        load = result["pooled"][name]
        for route, f in [("all", load), *load["routes"].items()]:
            table.add_row(
                name,
                route,
                str(f["requests"]),
                str(f["errors"]),
                str(f["completion_tokens"]),
                fmt(f["aggregate_tok_s"], digits=1),
                fmt(f["ttft_s_p50"], 1e3, 1),
                fmt(f["itl_s_p50"], 1e3, 2),
                fmt(f["prompt_tokens_p50"], digits=0),
            )
    ratio = result["mixed_over_all_chat"]
    title = f"mixed / all-chat aggregate tok/s (target {result['target']}; order: c all-chat, m mixed)"
    summary = Table(title=title)
    for col in ("rounds", "all-chat tok/s median", "mixed tok/s median", "geomean", "min-max", "by round", "met"):
        summary.add_column(col, justify="right")
    by_round = zip(ratio["ratio_by_round"], result["by_round"], strict=True)
    summary.add_row(
        str(ratio["rounds"]),
        fmt(ratio["all_chat_tok_s_median"], digits=1),
        fmt(ratio["mixed_tok_s_median"], digits=1),
        fmt(ratio["ratio_geomean"]),
        f"{fmt(ratio['ratio_min'])}-{fmt(ratio['ratio_max'])}",
        " ".join(f"{fmt(q)}({'cm' if row['order'][0] == 'all-chat' else 'mc'})" for q, row in by_round),
        {True: "yes", False: "no", None: "-"}[result["target_met"]],
    )
    return [table, summary]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepserve bench routes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--url", help="a server already running (default: start one with --serve-args)")
    parser.add_argument(
        "--serve-args",
        type=shlex.split,
        default=[],
        metavar="ARGS",
        help="stepserve serve flags, e.g. --serve-args='--model DIR'",
    )
    parser.add_argument("--streams", type=int, default=32, help="concurrent client streams of each load")
    parser.add_argument("--messages", type=int, default=8, help="mixed: streams on /v1/messages (with tools)")
    parser.add_argument("--responses", type=int, default=8, help="mixed: streams on /v1/responses")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both loads in alternating order")
    parser.add_argument("--requests", type=int, default=2, help="timed requests per stream, load and round")
    parser.add_argument("--warmup-requests", type=int, default=1, help="untimed requests per stream of the mixed load")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request at most")
    parser.add_argument("--system-tokens", type=int, default=400, help="the shared system prompt's tokens, about")
    parser.add_argument("--model", help="the model name to send (default: the first of /v1/models)")
    parser.add_argument("--target", type=float, default=TARGET, help="mixed / all-chat tok/s to meet (geomean)")
    parser.add_argument("--ready-timeout-s", type=float, default=START_TIMEOUT_S, help="the started server's")
    parser.add_argument("--log-dir", type=Path, help="keep the started server's log here")
    parser.add_argument("--out", type=Path, help="write the JSON result here too")
    return parser


def main(argv: list[str]) -> int:
    """``stepserve bench routes [options]``: print the tables to stderr and the JSON to stdout
    (and ``--out``). Returns 0, or 1 when any request (warm-up included) failed or lacked its
    usage count."""
    parser = _parser()
    args = parser.parse_args(argv)
    if min(args.streams, args.rounds, args.requests) < 1 or args.warmup_requests < 0:
        parser.error("--streams, --rounds and --requests must be at least 1, --warmup-requests at least 0")
    try:
        route_plan(args.streams, args.messages, args.responses)
    except ValueError as error:
        parser.error(str(error))
    result = _serve(args) if args.url is None else {**run(args.url, args), "server": None}
    report(result, ["routes", *argv], tables(result), args.out)
    return 1 if result["errors_total"] or result["warmup_errors"] else 0
