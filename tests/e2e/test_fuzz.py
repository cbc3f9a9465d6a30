"""Schemathesis against the live OpenAPI schema of a real `stepserve serve`: generated valid
and invalid requests on every route get no 5xx, no hang, no stack trace or file path, and
JSON errors; the server then answers a normal request.

CI runs a small, bounded run (``STEPSERVE_FUZZ_EXAMPLES`` per route and phase, default 10).
The full run uses the same command with more examples against a server started alike::

    python -m tests.e2e.test_fuzz --examples 1500 --out fuzz.json
    python -m tests.e2e.test_fuzz --examples 1000 --mode positive --out fuzz-positive.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import schemathesis

from models.default import default_model_path
from models.embedding_dir import packaged_minilm
from service.api.errors import is_anthropic
from service.config import DEFAULT_MODEL_NAME
from tests.support import ServerProcess

EXAMPLES = int(os.environ.get("STEPSERVE_FUZZ_EXAMPLES", "10"))
SCHEMATHESIS = str(Path(sys.executable).parent / "schemathesis")
REPO = Path(__file__).resolve().parents[2]  # the repository root (tests/e2e/ is two levels down)
# Small buckets keep every generation short: a prompt + max_tokens beyond 64 positions gets
# 400, and requests without max_tokens generate 8 tokens.
FUZZ_ENV = {
    "STEPSERVE_CAPACITY_BUCKETS": "[64]",
    "STEPSERVE_PROMPT_BUCKETS": "[16, 32, 64]",
    "STEPSERVE_BATCH_BUCKETS": "[1, 2, 4, 8]",
    "STEPSERVE_DEFAULT_MAX_TOKENS": "8",
}
# Warm-up compiles every step a fuzzed request can reach (prompts up to 64 tokens, batches up to 8)
# but skips the rehearsal (dummy requests run before ready, about half of the warm-up's time here):
# what is fuzzed is the answers, not how soon the first requests run.
FUZZ_ARGS = ["--warmup-prompt-tokens", "64", "--warmup-batch", "8", "--warmup-rehearsal", "false"]
LEAKS = ("Traceback", 'File "', "site-packages", '.py"', ".py,", "/work/", "/tmp/", str(default_model_path().parent))
ROUTES = {
    "GET /healthz",
    "GET /readyz",
    "GET /metrics",
    "GET /v1/models",
    "POST /infer",
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "POST /v1/embeddings",
}
EMBEDDER = "minilm"  # the fuzz server's embedding model, beside its chat model


def fuzz_env(tmp: Path) -> dict[str, str]:
    """FUZZ_ENV plus all-MiniLM-L6-v2 (extracted under ``tmp``) served beside the default model."""
    models = [{"name": DEFAULT_MODEL_NAME}, {"name": EMBEDDER, "path": str(packaged_minilm(tmp))}]
    return {**FUZZ_ENV, "STEPSERVE_MODELS": json.dumps(models)}


SERVED = DEFAULT_MODEL_NAME  # the fuzz server's one model


@schemathesis.hook
def map_body(context, body):
    """On the Messages routes ``model`` is required, and a generated name is almost never a
    served one: three bodies in four are sent with the served model, so the fuzz reaches the
    template, the grammar and generation there too, not only the 404 (likewise on
    ``/v1/responses``, where the OpenAI client always sends a model)."""
    path = context.operation.path if context.operation is not None else ""
    remapped = is_anthropic(path) or path in ("/v1/responses", "/v1/embeddings")
    if remapped and isinstance(body, dict) and isinstance(body.get("model"), str) and len(body["model"]) % 4:
        body["model"] = EMBEDDER if path == "/v1/embeddings" else SERVED
    return body


@schemathesis.check
def error_bodies_are_clean(ctx, response, case) -> None:
    """No response shows a stack trace or a file path, and every error is stepserve's JSON
    ``{"error": {message, type, param, code}}`` with ``code`` the status as a string, or on
    the Anthropic Messages routes Anthropic's ``{"type": "error", "error": {type, message}}``."""
    for leak in LEAKS:
        if leak in response.text:
            raise AssertionError(f"response shows {leak!r}: {response.text[:300]}")
    if response.status_code < 400:
        return
    body = response.json()
    if is_anthropic(case.path):
        if set(body) != {"type", "error"} or body["type"] != "error" or set(body["error"]) != {"type", "message"}:
            raise AssertionError(f"not an Anthropic error body: {response.text[:300]}")
        return
    error = body["error"]
    if set(error) != {"message", "type", "param", "code"} or error["code"] != str(response.status_code):
        raise AssertionError(f"not a stepserve error body: {response.text[:300]}")


def fuzz(
    url: str, examples: int, workers: int, report_dir: Path, seed: int = 1, mode: str = "all"
) -> tuple[int, str, dict]:
    """Run the schemathesis CLI (every phase; checks: no 5xx, :func:`error_bodies_are_clean`,
    60 s per request at most, so a hang fails) against ``url``. ``mode``: ``all``, or
    ``positive`` / ``negative`` for schema-valid / schema-violating requests only.

    Returns (exit code, the CLI's output, :func:`summarize` of its NDJSON report).
    """
    command = [
        SCHEMATHESIS,
        "run",
        f"{url}/openapi.json",
        "--max-examples",
        str(examples),
        "--workers",
        str(workers),
        "--checks",
        "not_a_server_error,error_bodies_are_clean",
        "--request-timeout",
        "60",
        "--seed",
        str(seed),
        "--mode",
        mode,
        "--report",
        "ndjson",
        "--report-ndjson-path",
        str(report_dir / "events.ndjson"),
        "--no-color",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.e2e.test_fuzz", "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=report_dir, timeout=3600)
    return result.returncode, result.stdout + result.stderr, summarize(report_dir / "events.ndjson")


def summarize(ndjson: Path) -> dict:
    """Requests per route and per status code, from a schemathesis NDJSON report."""
    routes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in ndjson.read_text().splitlines():
        event = json.loads(line).get("ScenarioFinished")
        if not event:
            continue
        recorder = event["recorder"]
        for interaction in recorder.get("interactions", {}).values():
            routes[recorder["label"]][
                str(interaction["response"]["status_code"]) if interaction.get("response") else "none"
            ] += 1
    return {
        label: {"requests": sum(codes.values()), "statuses": dict(sorted(codes.items()))}
        for label, codes in sorted(routes.items())
    }


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    proc = ServerProcess.start(FUZZ_ARGS, env=fuzz_env(tmp_path_factory.mktemp("minilm")))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_fuzzed_requests_get_no_server_error(fuzz_server, tmp_path):
    # One worker: schemathesis' workers are threads, and CPython 3.11's AST constructor keeps its
    # recursion depth per interpreter, not per thread, so hypothesis parsing lambdas in two
    # threads at once failed CI with "SystemError: AST constructor recursion depth mismatch"
    # (python/cpython#106905; seen with 3.11.2 in CI and 3.11.7 here).
    code, output, summary = fuzz(fuzz_server.url, EXAMPLES, 1, tmp_path)
    assert code == 0, output[-6000:]
    assert set(summary) == ROUTES, summary  # every route was fuzzed
    assert not any(s.startswith("5") or s == "none" for route in summary.values() for s in route["statuses"]), summary


# What the full runs found, kept as explicit cases: a top_k beyond int32 crashed the sampler's
# array construction (std::bad_cast, a 500); it is now refused by the schema.
FOUND = [
    ({"prompt": "Hi", "top_k": 2**40, "temperature": 0.5}, 422),
    ({"prompt": "Hi", "top_k": 2**31 - 1, "temperature": 0.5}, 200),
]


@pytest.mark.parametrize("body,status", FOUND)
def test_fuzz_findings_stay_fixed(fuzz_server, body, status):
    with fuzz_server.client() as client:
        reply = client.post("/infer", json={**body, "max_tokens": 2})
    assert reply.status_code == status, reply.text


def test_server_answers_normally_after_fuzzing(fuzz_server):
    with fuzz_server.client() as client:
        reply = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        )
        assert reply.status_code == 200, reply.text
        assert client.get("/readyz").status_code == 200
    assert fuzz_server.metric("stepserve_requests_total", status="500") == 0


def main(argv: list[str] | None = None) -> int:
    """The full run: start a fuzz server, fuzz it, print and write the counts as JSON."""
    parser = argparse.ArgumentParser(description="Fuzz a real stepserve with schemathesis (loopback only).")
    parser.add_argument("--examples", type=int, default=300, help="examples per route and phase")
    parser.add_argument("--workers", type=int, default=1, help="more than 1 may hit python/cpython#106905 on 3.11")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=["all", "positive", "negative"], default="all")
    parser.add_argument("--out", help="write the summary JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess.start(FUZZ_ARGS, env=fuzz_env(Path(tmp)))
        try:
            server.wait_ready()
            code, output, summary = fuzz(server.url, args.examples, args.workers, Path(tmp), args.seed, args.mode)
            normal = server.client().post("/infer", json={"prompt": "The sky is", "max_tokens": 4}).status_code
        finally:
            server.stop()
    report = {
        "exit_code": code,
        "requests": sum(r["requests"] for r in summary.values()),
        "routes": summary,
        "normal_request_after": normal,
        "output_tail": output[-4000:],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if code == 0 and normal == 200 else 1


if __name__ == "__main__":
    sys.exit(main())
