"""Parity with mlx-lm (the reference implementation): the default model converted by
`stepserve convert`, and tiny random qwen2/qwen3 directories written here.

Tolerance: logits agree within 1e-3 in float32 (both sides run the same MLX kernels, ordered differently)."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen2 as lm_qwen2
from mlx_lm.models import qwen3 as lm_qwen3
from mlx_lm.models.cache import make_prompt_cache

from models.default import default_model_path
from models.errors import ModelLoadError
from models.gguf.convert import unpermute_rows
from models.kv_cache import KVCache
from models.llama import decode, prefill
from models.loader import load_model
from tests.support import ATOL, ON_GPU

TOL = 3e-2 if ON_GPU else 1e-3
STEPS = 3  # prefill and 3 decode steps, as the parity matrix
PROMPTS = ["What is the capital of France?", "def add(a, b):", "Once upon a time, in a land far away,"]


def stepserve_greedy(model, ids: list[int], steps: int = STEPS):
    """Greedy tokens and the logits of each step from stepserve's step functions."""
    a = model.args
    kv = KVCache.allocate(a.num_hidden_layers, 1, a.num_key_value_heads, len(ids), a.dim_per_head, mx.float32)
    logits, kv = prefill(model.params, mx.array([ids], mx.int32), mx.array([len(ids)]), kv, args=a)
    kv, history, tokens = kv.resized(256), [logits[0]], []
    for i in range(steps):
        tokens.append(int(mx.argmax(logits[0])))
        logits, kv = decode(model.params, mx.array([tokens[-1]], mx.int32), mx.array([len(ids) + i]), kv, args=a)
        history.append(logits[0])
    return tokens, history


def mlx_lm_greedy(model, ids: list[int], steps: int = STEPS):
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    history, tokens = [logits], []
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits)))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]
        history.append(logits)
    return tokens, history


def max_diff(xs, ys) -> float:
    return max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32)).max().item() for x, y in zip(xs, ys, strict=True))


def test_unpermute_inverts_llama_cpp_permutation():
    w = mx.arange(8 * 3).reshape(8, 3)
    permuted = w.reshape(2, 2, 2, 3).swapaxes(1, 2).reshape(8, 3)  # convert_hf_to_gguf.py, 2 heads
    assert mx.array_equal(unpermute_rows(permuted, 2), w)


def test_converted_default_model_matches_mlx_lm_and_the_gguf(converted, capsys):
    gguf = load_model(default_model_path(), "gguf", mx.float32, "quantized")
    ours = load_model(converted, "dir", mx.float32, "quantized")
    reference, hf_tokenizer = mlx_lm.load(str(converted))
    reference.set_dtype(mx.float32)  # float16 matmuls are unusably slow on the CPU
    worst_ref = worst_gguf = 0.0
    for prompt in PROMPTS:
        ids = gguf.tokenizer.encode(gguf.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
        assert ours.tokenizer.encode(gguf.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])) == ids
        assert (
            hf_tokenizer.encode(
                gguf.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False
            )
            == ids
        )
        tokens_gguf, logits_gguf = stepserve_greedy(gguf, ids)
        tokens_dir, logits_dir = stepserve_greedy(ours, ids)
        tokens_ref, logits_ref = mlx_lm_greedy(reference, ids)
        assert tokens_gguf == tokens_dir == tokens_ref, prompt
        worst_ref = max(worst_ref, max_diff(logits_dir, logits_ref))
        worst_gguf = max(worst_gguf, max_diff(logits_dir, logits_gguf))
    with capsys.disabled():
        print(f"\nmax |logit diff|: converted vs mlx-lm {worst_ref:.2e}, converted vs GGUF {worst_gguf:.2e}")
    assert worst_ref < TOL and worst_gguf < TOL


TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": 49152,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 512,
}


def write_tiny(directory: Path, converted: Path, model_type: str, quantize: bool):
    """A randomly initialised mlx-lm model of ``model_type`` saved as an mlx-community directory."""
    config = {**TINY, "model_type": model_type, "tie_word_embeddings": model_type == "qwen3"}
    if model_type == "qwen3":
        config["head_dim"] = 32  # Qwen3 decouples head_dim from hidden_size / heads
    module = {"qwen2": lm_qwen2, "qwen3": lm_qwen3}[model_type]
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(config))
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        config["quantization"] = {"group_size": 32, "bits": 4}
    directory.mkdir()
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(converted / name, directory / name)
    return model


@pytest.mark.parametrize("model_type,quantize", [("qwen2", False), ("qwen3", False), ("qwen3", True)])
def test_tiny_qwen_directories_match_mlx_lm(tmp_path, converted, model_type, quantize):
    reference = write_tiny(tmp_path / model_type, converted, model_type, quantize)
    ours = load_model(tmp_path / model_type, "tiny", mx.float32, "quantized")
    ids = [1, 520, 33, 2090, 41, 9, 77, 1000]
    tokens_ours, logits_ours = stepserve_greedy(ours, ids)
    tokens_ref, logits_ref = mlx_lm_greedy(reference, ids)
    assert tokens_ours == tokens_ref
    assert max_diff(logits_ours, logits_ref) < max(ATOL, 1e-4) * 10


def test_a_type_without_a_hand_written_module_is_refused_natively_naming_the_supported_ones(tmp_path, converted):
    """Under ``model_impl = native`` (``auto`` would build mlx-lm's gpt2 class)."""
    directory = tmp_path / "gpt2"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**TINY, "model_type": "gpt2"}))
    with pytest.raises(
        ModelLoadError,
        match=r"model_type 'gpt2' is not supported; supported: gemma3_text, llama, mistral, qwen2, qwen3, qwen3_moe",
    ):
        load_model(directory, "x", mx.float32, impl="native")
