"""GGUF files served through mlx-lm's model classes (``model_impl = "mlx_lm"``,
:func:`models.lm_loader.load_lm_gguf`): the default model SmolLM2 (Q4_1, mlx-lm's ``llama`` with
llama.cpp's permuted Q/K rows and ``rope_traditional``) and Gemma 3 270M (Q4_K_M, read densely
by the ``gguf`` package, mlx-lm's ``gemma3_text``, built with its sliding windows). Through the
engine, several SmolLM2 prompts at once (batched rows at different lengths) with its quantized
layers as the file packed them: greedy tokens equal to the hand-written path's on the same file
and to mlx-lm's own ``generate_step`` on the directory ``stepserve convert`` writes."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama as mlx_lm_llama
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load_model as lm_load_model

from models.adapter import AdapterArgs
from models.default import default_model_path
from models.gguf.convert import convert_gguf
from models.gguf.reader import GGUF_GROUP_SIZE
from models.layers import quantized_bits
from models.loader import LoadedModel, WeightsMode, load_model
from models.model_args import ModelArgs
from service.engine.buckets import BucketTable
from service.engine.sequence import SamplingParams, Sequence
from tests.support import engine_at, gemma_gguf

BUCKETS = BucketTable(batch=(1, 2, 4), prompt=(16, 32), capacity=(64,))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
MAX_TOKENS = 8


def engine_tokens(model: LoadedModel) -> list[list[int]]:
    """Greedy tokens (``ignore_eos``) of every prompt of PROMPTS, submitted at once and stepped
    by hand through ``model``'s engine (compiled steps, rows batched)."""
    engine = engine_at(model, BUCKETS)
    engine.ready.set()
    seqs = []
    for prompt in PROMPTS:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        seqs.append(Sequence(model.tokenizer.encode(prompt), params, model.tokenizer.detokenizer(), lambda _: None))
        engine.submit(seqs[-1])
    while not all(s.finish_reason for s in seqs) or engine.runner.busy:
        engine.step()
    return [list(seq.output_ids) for seq in seqs]


def mlx_lm_tokens(directory: Path, model: LoadedModel, weights: WeightsMode) -> list[list[int]]:
    """mlx-lm's own greedy tokens (``generate_step``) of PROMPTS, tokenized by ``model``, on its
    load of ``directory`` in float32 (its quantized layers expanded when ``weights`` says)."""
    module, _ = lm_load_model(directory)
    module.set_dtype(mx.float32)  # before expanding: dequantized in float32, as stepserve does
    if weights == "dequantized":
        module = dequantize_model(module)
    tokens = []
    for prompt in PROMPTS:
        steps = generate_step(mx.array(model.tokenizer.encode(prompt), mx.int32), module, max_tokens=MAX_TOKENS)
        tokens.append([int(token) for token, _ in steps])
    return tokens


def packed_bits(model: LoadedModel) -> dict[str, int]:
    """Bits of each quantized layer of an mlx-lm module, by parameter path without ``model.``."""
    assert isinstance(model.args, AdapterArgs)
    layers = model.args.module.named_modules()
    return {
        path.removeprefix("model."): m.bits
        for path, m in layers
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.group_size == GGUF_GROUP_SIZE
    }


def native_bits(model: LoadedModel) -> dict[str, int]:
    """Bits of each quantized layer of the hand-written path's parameters, by parameter path."""
    nodes = tree_flatten(model.params, is_leaf=lambda node: isinstance(node, dict) and "scales" in node)
    return {path: quantized_bits(node, GGUF_GROUP_SIZE) for path, node in nodes if isinstance(node, dict)}


@pytest.fixture(scope="module")
def smollm_dir(tmp_path_factory) -> Path:
    return convert_gguf(default_model_path(), tmp_path_factory.mktemp("smollm2"), mx.float32)


@pytest.mark.parametrize("weights", ["quantized"])  # dequantized (the CPU's default): tests/e2e/test_mlx_lm_serving.py
def test_smollm2_gguf_through_mlx_lm_gives_the_native_and_mlx_lms_tokens(smollm_dir, weights):
    native = load_model(default_model_path(), "native", mx.float32, weights, impl="native")
    model = load_model(default_model_path(), "mlx_lm", mx.float32, weights, impl="mlx_lm")
    assert isinstance(native.args, ModelArgs) and isinstance(model.args, AdapterArgs)
    assert isinstance(model.args.module, mlx_lm_llama.Model) and model.args.module.args.rope_traditional
    if weights == "quantized":  # each layer quantized as the file packed it (Q4_1: 4 bits, Q8_0: 8)
        assert packed_bits(model) == native_bits(native) and packed_bits(model)
    else:
        assert not packed_bits(model)
    got = engine_tokens(model)
    assert got == engine_tokens(native)
    assert got == mlx_lm_tokens(smollm_dir, model, weights)
    assert "Paris" in model.tokenizer.decode(got[0])


def test_gemma3_gguf_through_mlx_lm_builds_gemma3_text_with_its_sliding_windows():
    """Its K-quants arrive dense (the ``gguf`` package's values), so ``dequantized`` is all there
    is; the sliding-window layers decode in rings of 512 as mlx-lm's ``make_cache`` says. Its
    greedy tokens against mlx-lm's: tests/e2e/test_mlx_lm_serving.py (through the server), and
    the native path's against mlx-lm's: tests/e2e/test_gemma.py."""
    model = load_model(gemma_gguf(), "mlx_lm", mx.float32, "dequantized", impl="mlx_lm")
    assert isinstance(model.args, AdapterArgs) and model.args.model_type == "gemma3_text"
    assert model.args.windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
