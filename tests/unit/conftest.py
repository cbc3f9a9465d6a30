"""Unit tests start no process: ``subprocess`` is closed to them, so a test that needs a real
server or tool belongs in tests/e2e or tests/deploy."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unit tests start no process; move this test to tests/e2e or tests/deploy")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
