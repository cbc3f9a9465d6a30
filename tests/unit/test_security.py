"""Security settings checked without a server: the exposed-bind warning and the API key setting."""

from __future__ import annotations

import logging

import pytest

from service.api.security import warn_if_exposed
from service.config import ConfigError, Settings, load_settings

KEY = "test-key-7f3a9c"


def test_exposed_bind_without_a_key_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="stepserve.security"):
        warn_if_exposed(Settings(host="127.0.0.1"))
        warn_if_exposed(Settings(host="::1"))
        warn_if_exposed(Settings(host="0.0.0.0", api_key="k"))
        assert not caplog.records
        warn_if_exposed(Settings(host="0.0.0.0"))
    assert "without an API key" in caplog.records[0].getMessage()


def test_api_key_setting_is_checked_and_never_printed():
    with pytest.raises(ConfigError, match="api_key"):
        load_settings(api_key="  ")
    settings = Settings(api_key=KEY)
    assert KEY not in repr(settings) and KEY not in str(settings.model_dump())
