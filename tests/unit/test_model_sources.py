"""What names a model (a local path or a Hugging Face repo id, models/hub.py) and the settings of
models loaded on demand (load, ttl_s, on_demand_wait): read as users write them, refused with a
message naming the model and the fix. A repo of GGUF files serves the one its ``:TAG`` names (a
quantization, as llama.cpp's ``-hf`` and Ollama's ``hf.co/`` name it, or a file name), offline
from a Hugging Face cache laid out as huggingface_hub lays it out, holding the real default
model's GGUF; an ambiguous repo is refused listing its files and the fix."""

from __future__ import annotations

import mlx.core as mx
import pytest
from huggingface_hub import constants

from models.default import default_model_path
from models.errors import ModelLoadError
from models.hub import RepoRef, choose_gguf, repo_id_of, resolve_model_path
from models.loader import load_model
from service.config import ConfigError, load_settings
from tests.support import hub_cache_repo

BARTOWSKI = [  # a bartowski/...-GGUF repo's files, abridged
    ".gitattributes",
    "README.md",
    "Llama-3.2-3B-Instruct-IQ4_XS.gguf",
    "Llama-3.2-3B-Instruct-Q4_K_L.gguf",
    "Llama-3.2-3B-Instruct-Q4_K_M.gguf",
    "Llama-3.2-3B-Instruct-Q8_0.gguf",
    "Llama-3.2-3B-Instruct-f16.gguf",
    "Llama-3.2-3B-Instruct.imatrix",
    "mmproj-Llama-3.2-3B-Instruct-f16.gguf",
    "Q8_0/Llama-3.2-3B-Instruct-Q8_0-00001-of-00002.gguf",
    "Q8_0/Llama-3.2-3B-Instruct-Q8_0-00002-of-00002.gguf",
]
REPO = "bartowski/Llama-3.2-3B-Instruct-GGUF"
GGUF_REPO = "stepserve-test/SmolLM2-135M-Instruct-GGUF"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", ("HuggingFaceTB/SmolLM2-135M-Instruct", None, None)),
        ("mlx-community/Qwen3-0.6B-4bit@main", ("mlx-community/Qwen3-0.6B-4bit", "main", None)),
        (f"{REPO}:Q4_K_M", (REPO, None, "Q4_K_M")),  # llama.cpp's -hf and Ollama's hf.co/ form
        (f"{REPO}@v1:q8_0", (REPO, "v1", "q8_0")),
        (f"hf.co/{REPO}:Q4_K_M", (REPO, None, "Q4_K_M")),  # as Ollama writes it
        (f"{REPO}:Q8_0/Llama-3.2-3B-Instruct-Q8_0.gguf", (REPO, None, "Q8_0/Llama-3.2-3B-Instruct-Q8_0.gguf")),
        ("/models/llama", None),  # absolute: a path
        ("./llama", None),
        ("a/b/c.gguf", None),  # deeper than ORG/NAME
        (f"{REPO}:", None),  # an empty tag
        (f"{REPO}:Q4/K", None),  # a tag with a folder names a .gguf file
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


@pytest.mark.parametrize(
    ("tag", "want"),
    [
        ("Q4_K_M", "Llama-3.2-3B-Instruct-Q4_K_M.gguf"),
        ("q4_k_m", "Llama-3.2-3B-Instruct-Q4_K_M.gguf"),  # case aside, as Ollama
        ("IQ4_XS", "Llama-3.2-3B-Instruct-IQ4_XS.gguf"),
        ("F16", "Llama-3.2-3B-Instruct-f16.gguf"),  # never the vision projector mmproj-...-f16
        ("Llama-3.2-3B-Instruct-Q8_0.gguf", "Llama-3.2-3B-Instruct-Q8_0.gguf"),  # a file name
    ],
)
def test_a_tag_picks_one_gguf_file(tag, want):
    assert choose_gguf(RepoRef(REPO, None, tag), BARTOWSKI) == want


def test_a_gguf_repo_without_a_tag_is_refused_listing_its_files_and_the_fix():
    with pytest.raises(ModelLoadError) as refused:
        choose_gguf(RepoRef(REPO), BARTOWSKI)
    message = str(refused.value)
    assert f"model '{REPO}' holds 6 GGUF files" in message  # the split Q8_0 once, no mmproj
    assert f"Llama-3.2-3B-Instruct-Q4_K_M.gguf ({REPO}:Q4_K_M)" in message
    assert f"--model {REPO}:IQ4_XS" in message and f'path = "{REPO}:IQ4_XS"' in message
    assert "mmproj" not in message


def test_a_tag_matching_several_files_or_none_is_refused():
    with pytest.raises(ModelLoadError, match="2 GGUF files match 'Q8_0'; name one by its file name") as several:
        choose_gguf(RepoRef(REPO, None, "Q8_0"), BARTOWSKI)  # the single file and the split one
    assert f"{REPO}:Llama-3.2-3B-Instruct-Q8_0.gguf" in str(several.value)
    with pytest.raises(ModelLoadError, match="no GGUF file matches 'Q4_K'; the repo's GGUF files") as none:
        choose_gguf(RepoRef(REPO, None, "Q4_K"), BARTOWSKI)  # a prefix of Q4_K_M is no match
    assert f"({REPO}:Q4_K_L)" in str(none.value)


def test_a_split_gguf_is_refused_naming_the_merge():
    files = ["M-Q8_0-00001-of-00002.gguf", "M-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(ModelLoadError, match="split in 2 parts.*llama-gguf-split --merge"):
        choose_gguf(RepoRef("o/m"), files)


def test_a_safetensors_repo_is_served_as_a_directory():
    assert choose_gguf(RepoRef("o/m"), ["config.json", "model.safetensors", "model-Q4_K_M.gguf"]) is None
    assert choose_gguf(RepoRef("o/m"), ["config.json", "tokenizer.json"]) is None  # the loader names what is missing
    with pytest.raises(ModelLoadError, match="the repo holds no GGUF file.*remove ':Q4_K_M'"):
        choose_gguf(RepoRef("o/m", None, "Q4_K_M"), ["config.json", "model.safetensors"])


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 and a Hugging Face cache holding :data:`GGUF_REPO` with the real default
    model's GGUF as two quantizations (the same bytes; only the names differ) and a README."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    gguf = default_model_path()
    files = {"SmolLM2-135M-Instruct.Q4_1.gguf": gguf, "SmolLM2-135M-Instruct.Q8_0.gguf": gguf, "README.md": "# x"}
    return hub_cache_repo(tmp_path, GGUF_REPO, files)


def test_a_gguf_named_by_quantization_loads_offline_from_the_cache(offline_cache):
    path = resolve_model_path(f"{GGUF_REPO}:Q4_1")
    assert path == offline_cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_path(f"{GGUF_REPO}@main:SmolLM2-135M-Instruct.Q4_1.gguf") == path
    model = load_model(path, "smol", mx.float32, "quantized")
    reference = load_model(default_model_path(), "smol", mx.float32, "quantized")
    assert model.args == reference.args
    assert model.tokenizer.encode("The capital of France") == reference.tokenizer.encode("The capital of France")


def test_an_ambiguous_or_uncached_gguf_is_refused_offline(offline_cache):
    with pytest.raises(ModelLoadError) as ambiguous:
        resolve_model_path(GGUF_REPO)
    message = str(ambiguous.value)
    assert "holds 2 GGUF files" in message and f"--model {GGUF_REPO}:Q4_1" in message
    with pytest.raises(
        ModelLoadError,
        match="no GGUF file in the Hugging Face cache .HF_HUB_OFFLINE=1. matches 'Q6_K'",
    ):
        resolve_model_path(f"{GGUF_REPO}:Q6_K")
    with pytest.raises(ModelLoadError, match="model 'stepserve-test/other:Q4_1' is neither a local path nor in the"):
        resolve_model_path("stepserve-test/other:Q4_1")


def test_a_failed_listing_online_without_the_repo_cached_names_the_error(tmp_path, monkeypatch):
    def unreachable(self, repo_id, revision=None):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("models.hub.HfApi.list_repo_files", unreachable)
    with pytest.raises(ModelLoadError, match=f"model '{GGUF_REPO}:Q4_1'.*could not list its files.*no route to host"):
        resolve_model_path(f"{GGUF_REPO}:Q4_1")
