"""`stepserve serve`'s flags, generated from Settings: every field is a flag, precedence
flag > env > TOML > default, bad values exit 2 naming the option; and the subcommands'
dispatch. The parser runs in-process: nothing is served."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.cli import main, serve_settings
from service.config import Settings

# field -> (the flag's argument, or None for a flag without one, the value Settings should hold);
# one entry per Settings field.
SAMPLES = {
    "host": ("0.0.0.0", "0.0.0.0"),
    "port": ("0", 0),
    "model": ("/models/SmolLM2-mlx", Path("/models/SmolLM2-mlx")),
    "model_name": ("tiny", "tiny"),
    "model_impl": ("mlx_lm", "mlx_lm"),
    "reasoning_parser": ("think", "think"),
    "compile": ("auto", "auto"),
    "dtype": ("bfloat16", "bfloat16"),
    "weights": ("dequantized", "dequantized"),
    "batch_buckets": ("[1,2]", [1, 2]),
    "prompt_buckets": ("[32,64]", [32, 64]),
    "capacity_buckets": ("[128,256]", [128, 256]),
    "warmup_prompt_tokens": ("0", 0),
    "warmup_batch": ("2", 2),
    "warmup_budget_s": ("30", 30.0),
    "warmup_rehearsal": ("false", False),
    "speculative": ("draft", "draft"),
    "draft_model": ("/m/draft", Path("/m/draft")),
    "speculative_tokens": ("3", 3),
    "speculative_max_batch": ("2", 2),
    "default_max_tokens": ("16", 16),
    "max_waiting": ("3", 3),
    "prefill_chunk_tokens": ("32", 32),
    "max_batched_tokens": ("4096", 4096),
    "prefix_cache_bytes": ("0", 0),
    "prefix_block_tokens": ("16", 16),
    "kv_cache": ("paged", "paged"),
    "kv_block_tokens": ("32", 32),
    "paged_attention_kernel": ("false", False),
    "kv_bits": ("8", 8),
    "max_model_len": ("32768", 32768),
    "kv_pool_tokens": ("4096", 4096),
    "responses_store_bytes": ("1024", 1024),
    "on_demand_wait": ("503", "503"),
    "request_timeout_s": ("1.5", 1.5),
    "shutdown_grace_s": ("0", 0.0),
    "switch_interval_s": ("0.001", 0.001),
    "max_body_bytes": ("4096", 4096),
    "max_sequences": ("2", 2),
    "memory_budget_bytes": ("1000000", 1_000_000),
    "mlx_memory_limit_bytes": ("2000000", 2_000_000),
    "models": ('[{"name": "a", "path": "/m/a"}]', [{"name": "a", "path": Path("/m/a")}]),
    "log_level": ("debug", "debug"),
    "distributed": (None, True),
    "distributed_backend": ("ring", "ring"),
    "distributed_timeout_s": ("5", 5.0),
    "pid_file": ("/run/stepserve.pid", Path("/run/stepserve.pid")),
    "read_timeout_s": ("2.5", 2.5),
    "api_key": ("s3cret", "s3cret"),
    "auth_exempt_paths": ('["/healthz", "/metrics"]', ["/healthz", "/metrics"]),
    "cors_origins": ('["https://a.example"]', ["https://a.example"]),
}


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def value_of(settings: Settings, field: str):
    value = getattr(settings, field)
    if field == "api_key":
        return value.get_secret_value()
    if field == "models":
        return [m.model_dump(exclude_none=True) for m in value]
    return value


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No STEPSERVE_* from the shell running the tests."""
    for name in list(os.environ):
        if name.upper().startswith("STEPSERVE_"):
            monkeypatch.delenv(name)


def test_every_setting_is_a_flag_and_lands_in_settings():
    assert set(SAMPLES) == set(Settings.model_fields), "give every new Settings field a sample here"
    argv = [arg for field, (text, _) in SAMPLES.items() for arg in (flag(field), text) if arg is not None]
    settings = serve_settings(argv)
    assert {field: value_of(settings, field) for field in SAMPLES} == {f: want for f, (_, want) in SAMPLES.items()}


def test_no_flags_give_the_defaults():
    assert serve_settings([]).model_dump() == Settings().model_dump()


@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt-buckets", "[32,64]"],
        ["--prompt-buckets", "32,64"],
        ["--prompt-buckets", "32", "--prompt-buckets", "64"],
    ],
)
def test_list_flags_take_json_commas_or_repeats(argv):
    assert serve_settings(argv).prompt_buckets == [32, 64]


def test_precedence_flag_over_env_over_toml(tmp_path, monkeypatch):
    config = tmp_path / "stepserve.toml"
    config.write_text('port = 9001\ncompile = "off"\nbatch_buckets = [1, 8]\nhost = "127.0.0.2"\nmax_waiting = 7\n')
    monkeypatch.setenv("STEPSERVE_PORT", "9002")
    monkeypatch.setenv("STEPSERVE_PROMPT_BUCKETS", "[16, 32]")
    monkeypatch.setenv("STEPSERVE_HOST", "127.0.0.4")
    settings = serve_settings(["--config", str(config), "--host", "127.0.0.3", "--max-waiting", "9"])
    assert (settings.host, settings.max_waiting) == ("127.0.0.3", 9)  # flag > env, flag > TOML
    assert (settings.port, settings.prompt_buckets) == (9002, [16, 32])  # env > TOML
    assert (settings.compile, settings.batch_buckets) == ("off", [1, 8])  # TOML > default
    assert settings.default_max_tokens == Settings.model_fields["default_max_tokens"].default

    monkeypatch.setenv("STEPSERVE_CONFIG", str(config))  # the file without --config
    assert serve_settings([]).compile == "off"


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--port", "70000"], "--port: Input should be less than or equal to 65535"),
        (["--port", "eighty"], "--port: Input should be a valid integer"),
        (["--prompt-buckets", "64,32"], "--prompt-buckets: must be a non-empty ascending list"),
        (["--prompt-buckets", "[32,"], "--prompt-buckets: Missing end delimiter"),
        (["--compile", "maybe"], "--compile: Input should be 'on', 'off' or 'auto'"),
        (["--max-sequences", "0"], "--max-sequences: Input should be greater than or equal to 1"),
        (["--models", '[{"nme": "a"}]'], "--models[0].nme: Extra inputs are not permitted"),
        (["--auth-exempt-paths", "/infer"], "--auth-exempt-paths[0]: Input should be '/healthz'"),
        (["--capacity-buckets", "[256]"], "exceeds the largest capacity bucket (256); add a capacity bucket"),
        (["--api-key", " "], "--api-key: api_key is empty; set a non-empty key"),
        (["--no-such-option", "1"], "unrecognized arguments: --no-such-option"),
        (["--prompt", "32"], "unrecognized arguments: --prompt"),  # no abbreviations
        (["--config", "/nonexistent/stepserve.toml"], "pass --config PATH to a TOML file"),
    ],
)
def test_a_bad_flag_exits_2_naming_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_settings(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_a_bad_env_or_toml_value_names_where_it_came_from(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STEPSERVE_MAX_BATCHED_TOKENS", "0")
    with pytest.raises(SystemExit):
        serve_settings([])
    assert "STEPSERVE_MAX_BATCHED_TOKENS: Input should be greater than or equal to 1" in capsys.readouterr().err
    monkeypatch.delenv("STEPSERVE_MAX_BATCHED_TOKENS")
    config = tmp_path / "stepserve.toml"
    config.write_text("max_batched_tokens = 0\n")
    with pytest.raises(SystemExit):
        serve_settings(["--config", str(config)])
    assert f"max_batched_tokens in {config}: Input should be" in capsys.readouterr().err
    config.write_text('[[models]]\nname = "a"\nbatch_buckets = [2, 1]\n')
    with pytest.raises(SystemExit):
        serve_settings(["--config", str(config)])
    assert f"models[0].batch_buckets in {config}: must be a non-empty ascending" in capsys.readouterr().err
    monkeypatch.setenv("STEPSERVE_CORS_ORIGINS", "[https://a.example")  # not JSON
    with pytest.raises(SystemExit):
        serve_settings([])
    assert "STEPSERVE_CORS_ORIGINS: Expecting value" in capsys.readouterr().err


def test_the_api_key_is_never_echoed(capsys):
    with pytest.raises(SystemExit):
        serve_settings(["--api-key", "s3cret", "--port", "-1"])
    assert "s3cret" not in capsys.readouterr().err


def test_help_lists_every_setting(capsys):
    with pytest.raises(SystemExit) as exit_:
        serve_settings(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    missing = [flag(field) for field in Settings.model_fields if f"{flag(field)} " not in text]
    assert not missing, f"not in --help: {missing}"
    assert "--config FILE" in text
    assert "GGUF file or model directory (Hugging Face / mlx-" in text


@pytest.mark.parametrize(("command", "target"), [("bench", "service.bench.main"), ("soak", "service.bench.soak.main")])
def test_bench_and_soak_get_their_arguments(command, target, monkeypatch):
    calls = []
    monkeypatch.setattr(target, lambda argv: calls.append(argv) or 0)
    assert main([command, "--duration", "1"]) == 0
    assert calls == [["--duration", "1"]]
