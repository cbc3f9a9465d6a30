"""What names a model (a local path or a Hugging Face repo id, models/hub.py) and the settings of
models loaded on demand (load, ttl_s, on_demand_wait): read as users write them, refused with a
message naming the model and the fix."""

from __future__ import annotations

import pytest

from models.hub import repo_id_of
from service.config import ConfigError, load_settings


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct", None)),
        ("mlx-community/Qwen3-0.6B-4bit@main", ("mlx-community/Qwen3-0.6B-4bit", "main")),
        ("/models/llama", None),  # absolute: a path
        ("./llama", None),
        ("a/b/c.gguf", None),  # deeper than ORG/NAME
        ("bad name/x", None),  # no repo id has a space
    ],
)
def test_repo_ids_and_paths(text, want):
    assert repo_id_of(text) == want


def test_an_existing_path_is_never_a_repo_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert repo_id_of("org/model") is None


def test_on_demand_settings_resolve_per_model():
    settings = load_settings(
        on_demand_wait="503",
        models=[
            {"name": "a"},
            {"name": "b", "path": "org/b", "load": "on_demand", "ttl_s": 30},
            {"name": "c", "load": "on_demand", "on_demand_wait": "wait"},
        ],
    )
    a, b, c = settings.served_models()
    assert (a.load, a.ttl_s) == ("startup", None)
    assert (b.load, b.ttl_s, b.on_demand_wait, str(b.path)) == ("on_demand", 30, "503", "org/b")
    assert (c.load, c.ttl_s, c.on_demand_wait) == ("on_demand", None, "wait")


def test_ttl_without_on_demand_is_refused():
    with pytest.raises(ConfigError, match="model 'a': ttl_s unloads an on-demand model; set load = 'on_demand'"):
        load_settings(models=[{"name": "a", "ttl_s": 5}])


def test_on_demand_in_a_pipeline_group_is_refused():
    with pytest.raises(ConfigError, match="model 'a': distributed serves its model from start-up"):
        load_settings(distributed=True, models=[{"name": "a", "load": "on_demand"}])
