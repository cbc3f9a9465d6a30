"""Every ``stepserve bench FORM`` the docs name reaches that form's own tool, not the load
generator (which would refuse the form's options)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import service.bench
from service.bench import FORMS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md"
NAMED = sorted(set(re.findall(r"`stepserve bench ([a-z][a-z-]*)", DOCS.read_text())))


def test_the_docs_name_forms():
    assert {"routes", "embeddings", "settings-ab"} <= set(NAMED)


@pytest.mark.parametrize("form", NAMED)
def test_a_documented_form_is_dispatched_to_its_module(form, monkeypatch):
    assert form in FORMS, f"docs/BENCHMARKS.md names `stepserve bench {form}`, which the dispatcher lacks"
    module = importlib.import_module(f"service.bench.{FORMS[form]}")
    got: list[list[str]] = []
    monkeypatch.setattr(module, "main", lambda argv: got.append(argv) or 0)
    assert service.bench.main([form, "--x"]) == 0 and got == [["--x"]]
