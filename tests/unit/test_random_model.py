"""``stepserve bench random-model``'s shapes are configs mlx-lm's own classes build, at the
documented sizes, and stepserve serves the hand-written ones by the same names."""

from __future__ import annotations

import importlib

import pytest
from mlx.utils import tree_flatten

from models.architectures import architecture
from service.bench.random_model import SHAPES

VOCAB = 49_152  # the default model's, as --tokenizer-from gives it
#: Parameters at that vocabulary, in billions (the checkpoint's own figure differs by its vocabulary).
SIZE = {
    "llama-8b": 7.38,
    "llama-1b": 1.07,
    "qwen3-0.6b": 0.49,
    "qwen2.5-0.5b": 0.40,
    "qwen3-moe": 0.39,
    "qwen3-next": 0.26,
    "gpt-oss": 0.22,
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_shape_builds_in_mlx_lms_class_at_its_size(shape):
    config = {**SHAPES[shape], "vocab_size": VOCAB}
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))  # lazy: nothing is evaluated
    count = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert count / 1e9 == pytest.approx(SIZE[shape], abs=0.01)


@pytest.mark.parametrize("shape", ["llama-8b", "qwen3-0.6b", "qwen2.5-0.5b", "qwen3-moe"])
def test_the_shapes_of_hand_written_types_have_a_native_module(shape):
    """The A/B of mlx-lm's class against the hand-written module needs both for these shapes."""
    assert hasattr(architecture(SHAPES[shape]["model_type"]), "decode")
