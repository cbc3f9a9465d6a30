"""mlx-lm's model classes as pipeline stages (:mod:`models.lm_loader` with a group): the split's
bytes from the shapes alone, a rank keeping only its layers' weights (and the ends every rank
runs), its caches its own layers', the stage traits joined over the ranks, and a module
without ``PipelineMixin`` refused, named. No process is started: a stage's ``pipeline`` call
reads only its group's rank and size (the two-rank runs are tests/e2e/test_pipeline_mlx_lm.py)."""

from __future__ import annotations

import gc
import importlib
import itertools
from typing import cast

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.pipeline import PipelineMixin

from models.adapter import AdapterArgs, StageTraits
from models.adapter.support import PIPELINE_SPLITS, SUPPORTED
from models.errors import ModelLoadError
from models.lm_loader import _alone, lm_layout, load_lm_dir
from tests.parity.tiny_configs import TINY_CONFIGS
from tests.support import write_mlx_lm_dir


class _Rank:
    """What mlx-lm's ``PipelineMixin.pipeline`` asks of a group: its size and this rank."""

    def __init__(self, rank: int, size: int = 2):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def Rank(rank: int) -> mx.distributed.Group:  # noqa: N802 (reads as the class it stands for)
    """Rank ``rank`` of a group of two, as the loader's group argument."""
    return cast(mx.distributed.Group, _Rank(rank))


def nbytes(module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(module.parameters()) if isinstance(a, mx.array))


@pytest.mark.parametrize(
    ("name", "layers", "quantize", "weights"),
    [
        ("qwen2", 5, (32, 4), "quantized"),
        ("qwen2", 5, (32, 4), "dequantized"),
        ("deepseek_v3", 3, None, "dequantized"),  # (its latent widths take no 4-bit group of 32)
        ("qwen3_next", 4, None, "dequantized"),
    ],
)
def test_a_rank_reads_and_holds_its_layers_and_the_ends_only(tmp_path, name, layers, quantize, weights):
    directory = tmp_path / name
    write_mlx_lm_dir(directory, {**TINY_CONFIGS[name], "num_hidden_layers": layers}, quantize=quantize)
    layout = lm_layout(directory, mx.float32, weights)
    assert layout.model_type == name and len(layout.layer_bytes) == layers
    gc.collect()  # arrays earlier tests left for the collector must not be freed inside the window
    mx.clear_cache()
    before = mx.get_active_memory()
    whole_args, whole, _ = load_lm_dir(directory, mx.float32, weights)
    extra = mx.get_active_memory() - before - nbytes(whole)  # what the probes leave beside the weights
    assert nbytes(whole) == layout.shared_bytes + sum(layout.layer_bytes)
    stages = layout.split(2)
    split = [s.stop - s.start for s in stages]
    assert stages[1].start == 0 and stages[0].stop == layers and sum(split) == layers
    for stage in stages:
        gc.collect()
        mx.clear_cache()
        before = mx.get_active_memory()
        args, module, _ = load_lm_dir(directory, mx.float32, weights, Rank(stage.rank), split)
        held = layout.shared_bytes + sum(layout.layer_bytes[stage.start : stage.stop])
        assert nbytes(module) == held < nbytes(whole)
        assert mx.get_active_memory() - before <= held + max(extra, 0) + 4096  # no other layer was read
        assert args.layouts == whole_args.layouts[stage.start : stage.stop]  # its own layers' caches
        assert args.group is None and args.vocab_size == whole_args.vocab_size
        del module, args


def test_stage_traits_join_over_the_ranks():
    attention = StageTraits(pads_prompts=True, has_states=False, prefix_blocks=True, can_verify=True)
    mamba = StageTraits(pads_prompts=False, has_states=True, prefix_blocks=False, can_verify=False)
    for traits in (attention, mamba, *(StageTraits(*bits) for bits in itertools.product([False, True], repeat=4))):
        assert StageTraits.unpacked(traits.packed()) == traits
    assert StageTraits.join([attention, attention]) == attention
    assert StageTraits.join([attention, mamba]) == mamba  # one stage's states rule the group


def test_the_group_traits_answer_for_every_stage(tmp_path):
    directory = tmp_path / "qwen2"
    write_mlx_lm_dir(directory, {**TINY_CONFIGS["qwen2"], "num_hidden_layers": 3})
    args, _, _ = load_lm_dir(directory, mx.float32, "dequantized", Rank(0), [1, 2])
    assert args.traits() == StageTraits(True, False, True, True)
    other = StageTraits(pads_prompts=False, has_states=True, prefix_blocks=False, can_verify=False)
    joined = args.joined([args.traits(), other])
    assert joined.has_states and not joined.pads_prompts and not joined.prefix_blocks and not joined.can_verify
    assert not joined.state_layouts and joined.layouts == args.layouts


@pytest.mark.parametrize("name", ["llama", "phi3"])
def test_a_module_without_pipeline_mixin_is_refused_naming_it(tmp_path, name):
    directory = tmp_path / name
    write_mlx_lm_dir(directory, TINY_CONFIGS[name])
    for call in (
        lambda: lm_layout(directory, mx.float32, "dequantized"),
        lambda: load_lm_dir(directory, mx.float32, "dequantized", Rank(0), [1, 1]),
    ):
        with pytest.raises(ModelLoadError) as info:
            call()
        message = str(info.value)
        assert f"model_type '{name}' cannot be split into pipeline stages" in message
        assert f"mlx-lm's {name} has no PipelineMixin" in message and "one process" in message


def test_a_split_that_does_not_fit_the_layers_is_refused(tmp_path):
    directory = tmp_path / "qwen2"
    write_mlx_lm_dir(directory, {**TINY_CONFIGS["qwen2"], "num_hidden_layers": 3})
    with pytest.raises(ModelLoadError, match="must be positive and sum to 3 layers"):
        load_lm_dir(directory, mx.float32, "dequantized", Rank(0), [1, 1])


def splits_alike(name: str) -> bool:
    """Whether mlx-lm's ``name`` module (its tiny config, 2 layers) has one ``PipelineMixin``
    part and each of two stages' caches are its own layers' (the whole model's, sliced)."""
    module = importlib.import_module(f"mlx_lm.models.{name}")

    def build():
        mx.random.seed(0)
        model = module.Model(module.ModelArgs.from_dict(TINY_CONFIGS[name]))
        mx.eval(model.parameters())
        return model

    model = build()
    if sum(isinstance(m, PipelineMixin) for m in model.modules()) != 1:
        return False
    whole = AdapterArgs.from_module(model).layouts
    for rank in (0, 1):
        stage = build()
        part = next(m for m in stage.modules() if isinstance(m, PipelineMixin))
        try:
            part.pipeline(Rank(rank), [len(whole) // 2, len(whole) - len(whole) // 2])
        except ValueError:  # (bailing_hybrid: each rank needs one of its latent-attention layers)
            return name == "bailing_hybrid"
        with _alone(part):
            if AdapterArgs.from_module(stage).layouts != whole[part.start_idx : part.end_idx]:
                return False
    return True


def test_the_types_that_split_are_mlx_lms_pipeline_modules_whose_caches_follow_the_stage():
    assert {n for n in SUPPORTED if n in TINY_CONFIGS and splits_alike(n)} == PIPELINE_SPLITS


def test_a_gguf_file_through_mlx_lm_is_refused_for_a_group_naming_the_fix():
    from models.default import default_model_path

    with pytest.raises(
        ModelLoadError, match="GGUF file served through mlx-lm's classes cannot be split.*stepserve convert"
    ):
        lm_layout(default_model_path(), mx.float32, "dequantized")
