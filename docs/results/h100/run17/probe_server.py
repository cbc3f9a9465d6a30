"""Run 17's server probe: ``python3 probe_server.py OUT.jsonl serve ARGS...`` serves as
``stepserve serve ARGS...`` and appends one JSON line per ``/v1/chat/completions`` request with
its times (``time.perf_counter()``: CLOCK_MONOTONIC on Linux, so they compare with the client's):
``asgi`` (the request reached the app), ``arrival`` (its Sequence was made: the server's TTFT
starts here), ``started`` (the engine admitted it), ``first`` (its first token was appended on
the engine thread) and ``bodies`` (the first three response body writes: the role chunk, then
the first token's). A diagnostic wrapper, not part of the service."""

import contextvars
import json
import sys
import time

import service.api.app as app_module
import service.api.pipeline as pipeline
from service import cli

OUT = open(sys.argv[1], "a", buffering=1)  # noqa: SIM115
CURRENT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("probe", default=None)
_start, _create_app = pipeline.start, app_module.create_app


def start(*args, **kwargs):
    gen = _start(*args, **kwargs)
    if (rec := CURRENT.get()) is not None:
        rec["seq"] = gen.seq
    return gen


def create_app(*args, **kwargs):
    app = _create_app(*args, **kwargs)

    async def probe(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await app(scope, receive, send)
        rec: dict = {"asgi": time.perf_counter(), "bodies": []}
        token = CURRENT.set(rec)

        async def timed_send(message):
            if message["type"] == "http.response.body" and len(rec["bodies"]) < 3:
                rec["bodies"].append(time.perf_counter())
            await send(message)

        try:
            await app(scope, receive, timed_send)
        finally:
            CURRENT.reset(token)
            if (seq := rec.pop("seq", None)) is not None:
                rec |= {"arrival": seq.arrival, "started": seq.started, "first": seq.first_token_at}
                rec["cached"] = seq.cached_tokens
            OUT.write(json.dumps(rec) + "\n")

    probe.state = app.state  # type: ignore[attr-defined]  # the CLI reads the app's state
    return probe


pipeline.start = start
app_module.create_app = create_app
sys.exit(cli.main(sys.argv[2:]))
