"""The fleet artefacts against the real programs: Debian's Prometheus scraping two real
`stepserve serve` processes (and one dead port) with deploy/prometheus/'s config and rules, and
Debian's nginx with deploy/nginx/stepserve.conf in front of the same two.

Only what cannot run here is swapped: Prometheus gets 1 s scrape/evaluation intervals, the
targets are loopback ports and the Alertmanager is dropped; nginx gets loopback upstreams and
listen port. Dashboard queries are evaluated as Grafana would send them with instance=All
(`$instance` -> the variable's allValue) and `$__rate_interval` -> 1m (Grafana's value for a
15 s scrape interval, 4 scrapes; the load below falls inside that window).

The Prometheus test runs first: the nginx test stops the second server.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from service.bench.servers import free_port
from tests.support import DASHBOARD, DEPLOY, PROMETHEUS, ServerProcess, tool

pytestmark = pytest.mark.slow
RATE_INTERVAL = "1m"
# Panels that may read 0 right after this load: nothing failed with 5xx, the queue is empty
# again, batch-1 steps pad nothing, and counters such as the 429s' are born at their first
# increment, so rate() cannot see the increments of a series' first scrape.
# Panels that may rightly show zeros after this load: no errors, no queue, and prompts shorter than
# a prefix-cache block (nothing cached, nothing hit).
ZERO_OK = {
    "Error ratio",
    "Queue depth",
    "Padding waste",
    "Rejections / s",
    "Prefix-cache hit ratio",
    "Prefix-cache bytes and evictions",
}
PROMPT = "The sky is"
# Answered by copying, so prompt lookup's proposals are accepted (greedy: the same every run).
COPY = "Repeat the following text exactly: the river near the old mill was quiet in winter, and the keeper wrote."
SESSION = "X-Session-Id"  # the header deploy/nginx/stepserve.conf routes by
# A system prompt longer than a prefix-cache block (32 tokens) and used by no other test; each
# chat's starts with its session id, so no instance has a chat's prefix cached before it starts.
SYSTEM = (
    "This is conversation {session}. You are the assistant of the fleet routing test. Answer every "
    "question in one short, plain sentence, without lists, greetings or apologies. When a question "
    "has no answer, say so and stop."
)
QUESTIONS = ["What is the capital of France?", "And of Italy?", "And of Spain?", "And of Peru?"]


@pytest.fixture(scope="module")
def second():
    """A second instance with one slot and one queue place, so a burst gets 429s, speculating
    with prompt lookup (the speculative panels' data); a small warm-up (short prompts only, two
    capacity buckets, no rehearsal: its dummy requests count in no metric) keeps its start short."""
    speculate = ["--speculative", "lookup", "--speculative-max-batch", "1", "--capacity-buckets", "256,512"]
    proc = ServerProcess.start(
        ["--warmup-prompt-tokens", "32", "--warmup-rehearsal", "false", "--max-waiting", "1", *speculate],
        env={"STEPSERVE_MAX_SEQUENCES": "1"},
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def wait_for(check, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise TimeoutError(f"timed out waiting for {what}")


def infer(url: str, max_tokens: int = 4, stream: bool = False, prompt: str = PROMPT, session: str | None = None) -> int:
    headers = {SESSION: session} if session else {}
    with httpx.Client(base_url=url, timeout=120) as client:
        body = {"messages": [{"role": "user", "content": prompt}]} if prompt == COPY else {"prompt": prompt}
        reply = client.post("/infer", json={**body, "max_tokens": max_tokens, "stream": stream}, headers=headers)
        return reply.status_code


# --- Prometheus --------------------------------------------------------------------------------


def prometheus_config(tmp: Path, live: list[str], dead: str, listen: str) -> Path:
    """deploy/prometheus/prometheus.yml with test intervals, loopback targets and absolute rule paths."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS / f) for f in config["rule_files"]]
    del config["alerting"]
    (tmp / "targets.yml").write_text(yaml.safe_dump([{"targets": live + [dead], "labels": {"site": "test"}}]))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["stepserve"]["file_sd_configs"] = [{"files": [str(tmp / "targets.yml")], "refresh_interval": "1s"}]
    jobs["prometheus"]["static_configs"] = [{"targets": [listen]}]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def prometheus(tmp_path, server, second):
    """A real Prometheus on loopback scraping `server`, `second` and a port nobody listens on."""
    binary = tool("prometheus")
    listen = f"127.0.0.1:{free_port()}"
    live = [f"127.0.0.1:{server.port}", f"127.0.0.1:{second.port}"]
    dead = f"127.0.0.1:{free_port()}"
    config = prometheus_config(tmp_path, live, dead, listen)
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address={listen}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = httpx.Client(base_url=f"http://{listen}", timeout=10)
    try:
        wait_for(lambda: proc.poll() is not None or ready(api), "Prometheus to be ready")
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
        yield api, live, dead
    finally:
        api.close()
        proc.terminate()
        proc.wait(30)
        log.close()


def ready(api: httpx.Client) -> bool:
    try:
        return api.get("/-/ready").status_code == 200
    except httpx.TransportError:
        return False


def query(api: httpx.Client, expr: str) -> list[dict]:
    """An instant query's result; fails on an invalid expression with Prometheus' message."""
    reply = api.get("/api/v1/query", params={"query": expr})
    body = reply.json()
    assert reply.status_code == 200 and body["status"] == "success", f"{expr}\n{body.get('error')}"
    return body["data"]["result"]


def scraped(api: httpx.Client, instance: str, proc: ServerProcess) -> bool:
    """Prometheus holds `proc`'s current request count (its last scrape came after the load)."""
    result = query(api, f'sum(stepserve_requests_total{{instance="{instance}"}})')
    return bool(result) and float(result[0]["value"][1]) == proc.metric("stepserve_requests_total")


def load(server: ServerProcess, second: ServerProcess) -> list[int]:
    """Requests to both instances, streamed and not, and a burst the second one must refuse in
    part (one slot, one queue place): histograms, counters and 429s for every panel."""
    for proc in (server, second):
        for stream in (False, True):
            assert infer(proc.url, max_tokens=8, stream=stream) == 200
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: infer(second.url, max_tokens=24), range(4)))
    # Last, so that its verify steps are well inside the panels' 1-minute rate window even on a
    # loaded machine (the burst above can take a minute there).
    assert infer(second.url, max_tokens=24, prompt=COPY) == 200  # speculates
    return codes


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, with the variables as Grafana fills them."""
    dashboard = json.loads(DASHBOARD.read_text())
    all_value = next(v for v in dashboard["templating"]["list"] if v["name"] == "instance")["allValue"]
    return [
        (panel["title"], target["expr"].replace("$instance", all_value).replace("$__rate_interval", RATE_INTERVAL))
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]


def test_prometheus_scrapes_the_fleet_and_every_rule_and_panel_query_works(prometheus, server, second):
    api, live, dead = prometheus
    wait_for(lambda: len(query(api, 'up{job="stepserve"} == 1')) == 2, "both servers scraped")
    codes = load(server, second)
    assert 429 in codes and 200 in codes, codes
    for instance, proc in zip(live, (server, second), strict=False):
        wait_for(lambda i=instance, p=proc: scraped(api, i, p), f"a scrape of {instance} after the load")

    # Rules: all loaded and evaluated without error; recording rules produce series.
    groups = yaml.safe_load((PROMETHEUS / "rules/stepserve.yml").read_text())["groups"]
    recorded = [r["record"] for g in groups for r in g["rules"] if "record" in r]
    wait_for(lambda: all(query(api, name) for name in recorded), "every recording rule to have data")
    rules = [r for g in api.get("/api/v1/rules").json()["data"]["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r.get("record") or r.get("alert") for g in groups for r in g["rules"]}
    for rule in rules:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
        query(api, rule["query"])  # valid on its own too
    down = next(r for r in rules if r["name"] == "StepserveInstanceDown")
    assert [a["labels"]["instance"] for a in down["alerts"]] == [dead]  # pending: `for: 2m` not over yet

    # Dashboard: the instance variable lists the live servers; every panel query has data.
    values = api.get("/api/v1/label/instance/values", params={"match[]": "stepserve_build_info"}).json()["data"]
    assert sorted(values) == sorted(live)
    for title, expr in dashboard_queries():
        values = [float(sample["value"][1]) for sample in query(api, expr)]
        assert any(math.isfinite(v) for v in values), f"panel {title!r}: no data from {expr}"
        assert title in ZERO_OK or any(v > 0 for v in values), f"panel {title!r}: only zeros from {expr}"


# --- nginx -------------------------------------------------------------------------------------


def nginx_config(tmp: Path, upstreams: list[str], listen: str) -> Path:
    """A main nginx.conf around deploy/nginx/stepserve.conf, the server lines of each of its
    upstream blocks and its listen address replaced (their parameters kept)."""
    front = (DEPLOY / "nginx/stepserve.conf").read_text()
    blocks = re.findall(r"^upstream \S+ \{.*?\n\}", front, re.DOTALL | re.MULTILINE)
    assert len(blocks) == 2, "expected the least-connections and the session-hash upstream blocks"
    for block in blocks:
        lines = re.findall(r"^\s*server \S+ ([^;]*);\n", block, re.MULTILINE)
        assert lines, f"no server lines in {block.splitlines()[0]}"
        servers = "".join(re.findall(r"^\s*server .*\n", block, re.MULTILINE))
        local = "".join(f"    server {addr} {lines[0]};\n" for addr in upstreams)
        front = front.replace(block, block.replace(servers, local))
    front, listens = re.subn(r"listen 80;", f"listen {listen};", front)
    assert listens == 1
    (tmp / "stepserve.conf").write_text(front)
    temp = "\n".join(
        f"    {kind}_temp_path {tmp / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    main = tmp / "nginx.conf"
    main.write_text(f"""
{"user root;" if os.geteuid() == 0 else ""}
worker_processes 1;
daemon off;
pid {tmp / "nginx.pid"};
error_log {tmp / "error.log"} info;
events {{ worker_connections 256; }}
http {{
    log_format upstreams '$request_uri $status session=[$http_x_session_id] upstream=[$upstream_addr] '
                         'upstream_status=[$upstream_status]';
    access_log {tmp / "access.log"} upstreams;
{temp}
    include {tmp / "stepserve.conf"};
}}
""")
    return main


@pytest.fixture
def nginx(tmp_path, server, second):
    binary = tool("nginx")
    port = free_port()
    config = nginx_config(tmp_path, [f"127.0.0.1:{server.port}", f"127.0.0.1:{second.port}"], f"127.0.0.1:{port}")
    args = [binary, "-p", str(tmp_path), "-c", str(config)]
    check = subprocess.run([*args, "-t"], check=False, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or port_open(url), "nginx to listen")
        assert proc.poll() is None, (tmp_path / "error.log").read_text()
        yield url, tmp_path / "access.log"
    finally:
        proc.terminate()
        proc.wait(30)


def port_open(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def served(procs) -> list[float]:
    return [p.metric("stepserve_requests_total", status="200") for p in procs]


def chat(url: str, session: str, turn: int) -> dict:
    """Turn ``turn`` (0-based) of the session's chat through ``url``: the system prompt, the
    earlier questions (each answered "I see."), then the next one. Returns its usage; asserts 200."""
    messages = [{"role": "system", "content": SYSTEM.format(session=session)}]
    for question in QUESTIONS[:turn]:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": "I see."}]
    messages.append({"role": "user", "content": QUESTIONS[turn]})
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 2, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers={SESSION: session}, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def session_hashed_to(url: str, procs: tuple[ServerProcess, ServerProcess], target: ServerProcess) -> str:
    """A session id that nginx sends to ``target``, found by asking: which instance an id hashes
    to depends on the instances' addresses, here free ports."""
    for i in range(32):
        session, before = f"chat-{i}", served(procs)
        assert infer(url, max_tokens=1, session=session) == 200
        if served(procs)[procs.index(target)] > before[procs.index(target)]:
            return session
    raise AssertionError(f"no session id of 32 hashed to {target.url}")


def test_nginx_keeps_a_session_on_one_instance_where_its_prefix_is_cached(nginx, server, second):
    url, access_log = nginx
    procs = (server, second)
    for target in procs:  # sessions go to either instance, each always to the same one
        session = session_hashed_to(url, procs, target)
        before, hits = served(procs), target.metric("stepserve_prefix_cache_hit_tokens_total")
        usages = [chat(url, session, turn) for turn in range(3)]
        after = served(procs)
        other = procs.index(target) ^ 1
        assert after[procs.index(target)] - before[procs.index(target)] == 3 and after[other] == before[other]
        assert cached(usages[0]) == 0 and all(cached(u) >= 32 for u in usages[1:]), usages  # whole blocks
        assert target.metric("stepserve_prefix_cache_hit_tokens_total") - hits == sum(map(cached, usages))
    # Without the header, requests still spread (least connections).
    before = served(procs)
    assert [infer(url) for _ in range(4)] == [200] * 4
    assert all(a > b for a, b in zip(served(procs), before, strict=True))


def test_nginx_spreads_streams_and_survives_a_stopped_instance(nginx, server, second):
    url, access_log = nginx
    before = served((server, second))
    assert [infer(url) for _ in range(6)] == [200] * 6
    after = served((server, second))
    assert all(a > b for a, b in zip(after, before, strict=False)) and sum(after) - sum(before) == 6, (before, after)

    # Events pass through as they come: the first reaches the client while its request is still
    # generating. (nginx 1.22 here also passes them on with proxy_buffering on, and stepserve
    # sends X-Accel-Buffering: no, so this cannot pin that directive; test_deploy_files checks it.)
    with httpx.Client(base_url=url, timeout=120) as client:
        events, running_at_first = 0, None
        with client.stream("POST", "/infer", json={"prompt": PROMPT, "max_tokens": 32, "stream": True}) as reply:
            for line in reply.iter_lines():
                if line.startswith("data:"):
                    events += 1
                    if running_at_first is None:
                        running_at_first = sum(p.metric("stepserve_requests_running") for p in (server, second))
    assert events > 5 and running_at_first == 1, (events, running_at_first)

    # SIGTERM to the second while it streams a long answer: it drains (503 to new requests),
    # then exits. nginx moves every request to the first, sessions hashed to the second too;
    # none fails.
    session = session_hashed_to(url, (server, second), second)
    long_status = []
    long = threading.Thread(target=lambda: long_status.append(infer(second.url, 64, stream=True)))
    long.start()
    wait_for(lambda: second.metric("stepserve_requests_running") == 1, "the long request to run")
    second.process.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{second.url}/readyz", timeout=5).status_code == 503, "the second server to drain")
    moved = [chat(url, session, turn) for turn in range(2)]  # the first instance never saw this chat
    assert cached(moved[0]) == 0 and cached(moved[1]) >= 32, moved
    assert [infer(url) for _ in range(4)] == [200] * 4
    second_addr = f"127.0.0.1:{second.port}"
    retried = [
        line
        for line in access_log.read_text().splitlines()
        if f"[{second_addr}, 127.0.0.1:{server.port}]" in line and re.search(r"\[50[23], 200\]", line)
    ]
    assert retried, access_log.read_text()  # nginx tried the stopping server (503 draining, 502 gone) and moved on
    assert any(f"session=[{session}]" in line for line in retried), access_log.read_text()  # the session too
    long.join()
    assert long_status == [200] and second.process.wait(60) == 0  # the drain let it finish
    assert [infer(url) for _ in range(4)] == [200] * 4
    assert cached(chat(url, session, 2)) >= 32  # the session stays where it moved
