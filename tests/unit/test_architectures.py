"""Every supported model_type and every implemented config variant, as a tiny random model
built from mlx-lm's own classes, gives mlx-lm's greedy tokens and logits (within 1e-3,
float32 on the CPU) through the runner's compiled bucketed steps: a whole prefill, a chunked
prefill on a staging cache, decode across capacity-bucket moves, and rows batched with
others that join at different times (Gemma's and the sliding Llama's local layers on rings
of their window, which wrap within a few tokens)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import gemma3_text as lm_gemma3_text

from models import gemma3_text
from models.errors import ModelLoadError
from models.loader import LoadedModel, load_model
from service.engine.buckets import BucketTable
from service.engine.core import Engine
from service.engine.sequence import SamplingParams, Sequence
from tests.support import ON_GPU, engine_at, mlx_lm_greedy, tiny_config, write_lm_dir

TOL = 3e-2 if ON_GPU else 1e-3
STEPS = 14
#: (prompt, decode step at which it joins, prefilled whole or in chunks of 8)
PROMPTS = [
    ([3, 17, 5, 60, 8], 0, "whole"),
    ([9, 21, 33, 2, 90, 11, 40, 7, 1, 65, 12, 30, 4], 2, "whole"),  # 13 > the window of 8: its ring wraps
    ([int(t) for t in mx.random.randint(1, 96, (20,), key=mx.random.key(1)).tolist()], 4, "chunks"),  # type: ignore[union-attr]
]
BUCKETS = BucketTable(batch=(1, 2, 4), prompt=(8, 16), capacity=(16, 32, 48))

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
SLIDING = {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}

CASES = [
    ("llama", {}, None),
    ("llama", {"attention_bias": True, "mlp_bias": True}, None),
    ("llama", {"rope_scaling": LLAMA3}, None),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, None),
    ("llama", {"rope_scaling": YARN}, None),
    ("llama", SLIDING, None),
    ("llama", {}, (32, 4)),
    ("qwen2", {}, None),
    ("qwen3", {"rope_scaling": YARN}, None),
    ("qwen3", {}, (32, 4)),
    ("gemma3_text", {}, None),
    ("gemma3_text", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, None),
    ("gemma3_text", {}, (32, 4)),
    ("qwen3_moe", {}, None),
    ("qwen3_moe", {"norm_topk_prob": False}, (32, 4)),  # 4-bit experts (gather_qmm) and router
    ("qwen3_moe", {"rope_scaling": YARN}, None),
]


def admit(engine: Engine, live: list[Sequence], prompt: list[int], how: str) -> tuple[Sequence, mx.array]:
    """Prefill ``prompt`` (whole, or in chunks of 8 on a staging cache) and copy it into a free
    decode slot, as the engine does; returns the sequence and its first logits [V]."""
    seq = Sequence(prompt, SamplingParams(), detokenizer=None, emit=lambda e: None)  # type: ignore[arg-type]
    if how == "whole":
        logits, kv = engine.prefiller.prefill([prompt])
    else:
        kv = engine.executor.new_kv(1, 32)
        for offset in range(0, len(prompt), 8):
            part = prompt[offset : offset + 8]
            tokens = mx.array([part + [0] * (8 - len(part))], mx.int32)
            fn = engine.executor.step_fn("chunk", 1, 8, 32)
            logits, kv = fn(
                engine.model.params, tokens, mx.array([offset], mx.int32), mx.array([len(part)], mx.int32), kv
            )
    seq.position = len(prompt)
    engine.batch.fit(live, [seq])
    taken = {s.slot for s in live}
    engine.batch.insert(seq, next(i for i in range(engine.batch.kv.batch) if i not in taken), kv, 0)  # type: ignore[union-attr]
    return seq, logits[0]


def run_batched(model: LoadedModel) -> list[tuple[list[int], list[mx.array]]]:
    """Each prompt of :data:`PROMPTS`'s greedy tokens and logits through the engine's prefiller,
    decode batch and runner, joining
    the running batch at its step; the batch and capacity buckets move as rows join and grow."""
    engine = engine_at(model, BUCKETS)
    live: list[Sequence] = []
    out: dict[int, tuple[list[int], list[mx.array]]] = {}
    for step in range(STEPS + PROMPTS[-1][1] + 1):
        for prompt, joins, how in PROMPTS:
            if joins == step:
                seq, logits = admit(engine, live, prompt, how)
                seq.output_ids.append(int(mx.argmax(logits)))
                live.append(seq)
                out[id(seq)] = ([seq.output_ids[-1]], [logits])
        slots: list[Sequence | None] = [None] * engine.batch.kv.batch  # type: ignore[union-attr]
        for s in live:
            slots[s.slot] = s
        logits = engine.runner.decode(slots, mx.array([s.output_ids[-1] if s else 0 for s in slots], mx.int32))
        for seq in live:
            tokens, history = out[id(seq)]
            history.append(logits[seq.slot])
            seq.position += 1
            seq.output_ids.append(int(mx.argmax(logits[seq.slot])))
            tokens.append(seq.output_ids[-1])
        live = [s for s in live if len(s.output_ids) <= STEPS]
        engine.batch.fit(live)
        if not live:
            break
    return [out[k] for k in list(out)]


@pytest.mark.parametrize("model_type,keys,quantize", CASES)
def test_tiny_model_matches_mlx_lm_through_the_runner(tmp_path, model_type, keys, quantize):
    config = tiny_config(model_type, **keys)
    reference = write_lm_dir(tmp_path / "model", config, quantize)
    ours = load_model(tmp_path / "model", "tiny", mx.float32, "quantized")
    for (prompt, _, _), (tokens, history) in zip(PROMPTS, run_batched(ours), strict=True):
        expected_tokens, expected = mlx_lm_greedy(reference, prompt, STEPS)
        assert tokens[:STEPS] == expected_tokens, f"{len(prompt)}-token prompt"
        worst = max(mx.abs(a - b).max().item() for a, b in zip(history, expected, strict=False))
        assert worst < TOL, f"{len(prompt)}-token prompt: max |logit diff| {worst:.2e}"


def _unstacked(directory: Path, drop: str | None = None) -> None:
    """Rewrite a qwen3_moe directory's stacked experts as Hugging Face's one tensor per expert
    (``mlp.experts.E.{gate,up,down}_proj.weight``), leaving out ``drop`` if given."""
    weights = mx.load(str(directory / "model.safetensors"))
    assert isinstance(weights, dict)
    out = {}
    for key, value in weights.items():
        if ".switch_mlp." not in key:
            out[key] = value
            continue
        prefix, rest = key.split(".switch_mlp.")
        out |= {f"{prefix}.experts.{e}.{rest}": value[e] for e in range(value.shape[0])}
    out.pop(drop or "", None)
    mx.save_safetensors(str(directory / "model.safetensors"), out)


def test_per_expert_checkpoints_are_stacked_at_load(tmp_path):
    reference = write_lm_dir(tmp_path / "model", tiny_config("qwen3_moe"))
    _unstacked(tmp_path / "model")
    ours = load_model(tmp_path / "model", "tiny", mx.float32, "quantized")
    assert ours.params["layers"][0]["mlp"]["switch_mlp"]["up_proj"]["weight"].shape == (8, 32, 64)
    prompt = PROMPTS[1][0]
    tokens, history = run_batched(ours)[1]
    expected_tokens, expected = mlx_lm_greedy(reference, prompt, STEPS)
    assert tokens[:STEPS] == expected_tokens
    assert max(mx.abs(a - b).max().item() for a, b in zip(history, expected, strict=False)) < TOL


def test_a_missing_expert_is_refused(tmp_path):
    write_lm_dir(tmp_path / "model", tiny_config("qwen3_moe"))
    _unstacked(tmp_path / "model", drop="model.layers.2.mlp.experts.3.down_proj.weight")
    with pytest.raises(ModelLoadError, match=r"model.layers.2.mlp.experts has experts \[0, 1, 2, 4, 5\]"):
        load_model(tmp_path / "model", "tiny", mx.float32)


def test_gemma_residuals_in_float16_are_clipped_as_mlx_lms():
    # float16 is what a GPU computes in; Gemma's activations overflow it without the clip
    x = mx.array([60000.0, -60000.0, 1.5, 3.0], mx.float16)
    y = mx.array([30000.0, -30000.0, 0.25, -1.0], mx.float16)
    ours = gemma3_text._residual(x, y)
    assert ours.dtype == mx.float16 and mx.array_equal(ours, lm_gemma3_text.clip_residual(x, y))
    assert mx.isfinite(ours).all().item() and ours[0].item() == mx.finfo(mx.float16).max


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gemma3_text"])
def test_4bit_models_dequantized_as_on_the_cpu_match_mlx_lm(tmp_path, model_type):
    # the CPU default: quantized weights (experts included) expanded to dense at load
    reference = write_lm_dir(tmp_path / "model", tiny_config(model_type), (32, 4))
    ours = load_model(tmp_path / "model", "tiny", mx.float32, "dequantized")
    assert "scales" not in ours.params["layers"][0]["mlp"].get("switch_mlp", {}).get("up_proj", {})
    tokens, history = run_batched(ours)[1]
    expected_tokens, expected = mlx_lm_greedy(reference, PROMPTS[1][0], STEPS)
    assert tokens[:STEPS] == expected_tokens
    assert max(mx.abs(a - b).max().item() for a, b in zip(history, expected, strict=False)) < TOL
