"""The pure step functions on a tiny random model: padding, slots and stale cache entries
never change a real row, decode continues prefill exactly, and the GGUF RoPE layout."""

import mlx.core as mx
import pytest

from models.fuse import fuse_projections
from models.llama import decode, prefill
from models.loader import prepare_params
from tests.support import ATOL, TINY, new_cache, prefill_one, random_params


@pytest.fixture(scope="module")
def params():
    return random_params()


def test_prefill_rows_do_not_depend_on_padding_or_batchmates(params):
    prompts = [[5, 9, 2, 7, 1], [3] * 12, [8, 4, 6]]
    T, B = 16, 4
    rows = [p + [0] * (T - len(p)) for p in prompts] + [[1] * T]
    lengths = mx.array([len(p) for p in prompts] + [1])
    logits, _ = prefill(params, mx.array(rows, mx.int32), lengths, new_cache(B, T, fill=3.0), args=TINY)
    for i, p in enumerate(prompts):
        alone, _ = prefill_one(params, p)
        assert mx.allclose(logits[i], alone, atol=ATOL), f"row {i} changed by padding or batchmates"


def test_decode_continues_prefill_exactly(params):
    seq = [4, 17, 33, 2, 90, 11, 60, 7, 7, 21]
    _, kv = prefill_one(params, seq[:4])
    kv = kv.resized(32)
    for pos in range(4, len(seq)):
        logits, kv = decode(params, mx.array([seq[pos]], mx.int32), mx.array([pos]), kv, args=TINY)
        expected, _ = prefill_one(params, seq[: pos + 1])
        assert mx.allclose(logits[0], expected, atol=ATOL), f"decode at position {pos} differs from prefill"


def test_decode_rows_are_independent_of_slots_and_stale_entries(params):
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3], [50]]
    C, B = 16, 4
    kv = new_cache(B, C, fill=5.0)  # every slot starts as garbage; slot 3 stays empty
    for slot, p in enumerate(prompts):
        _, one = prefill_one(params, p)
        one = one.resized(C)
        for layer in range(TINY.num_hidden_layers):
            kv.keys[layer][slot, :, : len(p)] = one.keys[layer][0, :, : len(p)]
            kv.values[layer][slot, :, : len(p)] = one.values[layer][0, :, : len(p)]
    tokens = mx.array([11, 12, 13, 0], mx.int32)
    positions = mx.array([len(p) for p in prompts] + [0])
    logits, _ = decode(params, tokens, positions, kv, args=TINY)
    for i, p in enumerate(prompts):
        expected, _ = prefill_one(params, p + [int(tokens[i])])
        assert mx.allclose(logits[i], expected, atol=ATOL), f"slot {i} influenced by other slots or stale entries"


def _llama_cpp_permute(w: mx.array, n_heads: int) -> mx.array:
    """The Q/K row permutation of llama.cpp's convert_hf_to_gguf.py (HF half-split RoPE
    layout -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_qk_layout_needs_traditional_rope(params):
    hf_args = TINY  # rope_traditional=False: the Hugging Face layout
    gguf_args = TINY.__class__(**{**TINY.__dict__, "rope_traditional": True})
    permuted = {**params, "layers": []}
    for layer in params["layers"]:
        attn = dict(layer["self_attn"])
        attn["q_proj"] = {"weight": _llama_cpp_permute(attn["q_proj"]["weight"], TINY.num_attention_heads)}
        attn["k_proj"] = {"weight": _llama_cpp_permute(attn["k_proj"]["weight"], TINY.num_key_value_heads)}
        permuted["layers"].append({**layer, "self_attn": attn})
    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    reference, _ = prefill_one(params, ids, hf_args)
    right, _ = prefill_one(permuted, ids, gguf_args)
    wrong, _ = prefill_one(permuted, ids, hf_args)
    assert mx.allclose(right, reference, atol=ATOL)
    assert mx.abs(wrong - reference).max().item() > 10 * max(ATOL, 1e-2), "the wrong RoPE layout must change the logits"


def _quantize(node):
    if isinstance(node, dict):
        if "weight" in node and node["weight"].ndim == 2:
            w, s, b = mx.quantize(node["weight"], group_size=32, bits=4)
            return {"weight": w, "scales": s, "biases": b}
        return {k: _quantize(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_quantize(v) for v in node]
    return node


@pytest.mark.parametrize("fmt", ["dense", "quantized", "biased"])
def test_fused_projections_give_the_same_steps(params, fmt):
    if fmt == "quantized":
        params = _quantize(params)
    elif fmt == "biased":  # Qwen2-style Q/K/V biases travel with the fused weight
        params = {
            **params,
            "layers": [
                {
                    **layer,
                    "self_attn": {
                        **layer["self_attn"],
                        **{
                            n: {
                                **layer["self_attn"][n],
                                "bias": mx.random.normal((layer["self_attn"][n]["weight"].shape[0],)),
                            }
                            for n in ("q_proj", "k_proj", "v_proj")
                        },
                    },
                }
                for layer in params["layers"]
            ],
        }
    fused = fuse_projections(params)
    assert all("qkv_proj" in layer["self_attn"] and "q_proj" not in layer["self_attn"] for layer in fused["layers"])
    assert all("gate_up_proj" in layer["mlp"] for layer in fused["layers"])
    ids = [5, 9, 2, 7]
    (ref, ref_kv), (out, out_kv) = prefill_one(params, ids), prefill_one(fused, ids)
    assert mx.allclose(ref, out, atol=ATOL)
    tokens, positions = mx.array([3], mx.int32), mx.array([len(ids)], mx.int32)
    ref_step, _ = decode(params, tokens, positions, ref_kv.resized(8), args=TINY)
    out_step, _ = decode(fused, tokens, positions, out_kv.resized(8), args=TINY)
    assert mx.allclose(ref_step, out_step, atol=ATOL)


def test_projections_of_different_formats_stay_unfused(params):
    mixed = {
        **params,
        "layers": [
            {
                **params["layers"][0],
                "self_attn": {
                    **params["layers"][0]["self_attn"],
                    "k_proj": _quantize(params["layers"][0]["self_attn"]["k_proj"]),
                },
            },
            *params["layers"][1:],
        ],
    }
    fused = fuse_projections(mixed)
    assert "q_proj" in fused["layers"][0]["self_attn"] and "qkv_proj" not in fused["layers"][0]["self_attn"]
    assert "qkv_proj" in fused["layers"][1]["self_attn"]


def test_quantized_weights_match_their_dequantized_form(params):
    quantized = _quantize(params)
    dense = prepare_params(quantized, mx.float32, "dequantized", 32)
    ids = [1, 2, 3, 4, 5]
    q_logits, _ = prefill_one(quantized, ids)
    d_logits, _ = prefill_one(dense, ids)
    assert mx.allclose(q_logits, d_logits, atol=max(ATOL, 1e-3))


def test_dequantized_weights_are_expanded_in_float32_from_float16_scales():
    """A GGUF's scales and biases are float16: each weight is ``scale * q + bias`` in float32,
    as llama.cpp expands the block, not that value rounded to float16 first."""
    w = mx.random.normal((64, 128), key=mx.random.key(0))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    node = {"weight": packed, "scales": scales.astype(mx.float16), "biases": biases.astype(mx.float16)}
    dense = prepare_params({"proj": node}, mx.float32, "dequantized", 32)["proj"]["weight"]
    wide = [node["scales"].astype(mx.float32), node["biases"].astype(mx.float32)]
    assert dense.dtype == mx.float32
    assert mx.array_equal(dense, mx.dequantize(packed, *wide, group_size=32, bits=4))
    rounded = mx.dequantize(packed, node["scales"], node["biases"], group_size=32, bits=4).astype(mx.float32)
    assert not mx.array_equal(dense, rounded)  # the float16 expansion differs: the test can tell them apart


def test_cache_resize_keeps_prefix():
    kv = new_cache(2, 8, fill=1.0)
    grown = kv.resized(16)
    assert grown.capacity == 16 and mx.array_equal(grown.keys[0][:, :, :8], kv.keys[0])
    assert mx.array_equal(grown.resized(8).values[1], kv.values[1])
