"""The pipeline split by memory, and loading one stage only: GGUF tensors read alone equal
``mx.load``'s, a stage's parameters equal the whole model's, and loading a stage of the
default GGUF never holds the whole model in MLX memory. (Two real ranks: tests/e2e/test_pipeline.py.)"""

from __future__ import annotations

import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from models.default import default_model_path
from models.gguf.tensors import F16, F32, Q4_0, Q4_1, Q8_0, read_index, read_tensors
from models.loader import load_model
from models.pipeline import plan_stages, stage_params
from models.stage_loader import load_stage, model_layout
from tests.support import no_buffer_cache, write_dir


def test_split_balances_memory_with_the_ends_and_capacities():
    # 30 equal layers; a tied table of 8 layers' bytes sits on both ends: 15 and 15.
    stages = plan_stages([10] * 30, 80, 1, 2, tied=True)
    assert [(s.rank, s.start, s.stop, s.nbytes) for s in stages] == [(0, 15, 30, 231), (1, 0, 15, 230)]
    assert stages[1].first and stages[1].holds_embedding and stages[0].last and stages[0].holds_embedding
    # Untied: the table on the first stage only, the head (norm) on the last.
    assert [(s.start, s.stop) for s in plan_stages([10] * 30, 80, 1, 2, tied=False)] == [(11, 30), (0, 11)]
    assert not plan_stages([10] * 30, 80, 1, 2, tied=False)[0].holds_embedding
    # An odd count: the earlier stage takes the extra layer; a rank with twice the memory, twice the share.
    assert [(s.start, s.stop) for s in plan_stages([10] * 5, 0, 0, 2, tied=False)] == [(3, 5), (0, 3)]
    assert [(s.start, s.stop) for s in plan_stages([10] * 9, 0, 0, 2, tied=False, capacities=[2, 1])] == [
        (3, 9),
        (0, 3),
    ]
    # Uneven layers: contiguous, minimizing the largest stage.
    assert max(s.nbytes for s in plan_stages([1, 1, 1, 1, 50, 1, 1, 1], 0, 0, 3, tied=False)) == 50
    one = plan_stages([10] * 4, 80, 1, 1, tied=True)[0]  # one process holds the tied table once
    assert (one.start, one.stop, one.nbytes) == (0, 4, 121)
    with pytest.raises(ValueError, match="3 layers over 4"):
        plan_stages([1, 1, 1], 0, 0, 4, tied=True)
    with pytest.raises(ValueError, match="capacities"):
        plan_stages([1, 1, 1], 0, 0, 2, tied=True, capacities=[1])


def write_quantized_gguf(path, seed: int = 0):
    """A GGUF (version 3) holding one tensor of each type the stage reader converts, with random
    blocks (finite float16 scales)."""
    rng = np.random.default_rng(seed)
    rows, cols = 6, 64
    blocks = rows * cols // 32

    def half(n):
        return (rng.standard_normal(n) * 0.05).astype(np.float16).tobytes()

    data = {
        ("q4_0.weight", Q4_0): b"".join(half(1) + rng.bytes(16) for _ in range(blocks)),
        ("q4_1.weight", Q4_1): b"".join(half(2) + rng.bytes(16) for _ in range(blocks)),
        ("q8_0.weight", Q8_0): b"".join(half(1) + rng.bytes(32) for _ in range(blocks)),
        ("f16.weight", F16): half(rows * cols),
        ("f32.weight", F32): rng.standard_normal(rows * cols).astype(np.float32).tobytes(),
    }

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, len(data), 1) + string("general.architecture")
    header += struct.pack("<I", 8) + string("llama")
    body, offsets = b"", []
    for (_, _), raw in data.items():
        body += b"\0" * (-len(body) % 32)
        offsets.append(len(body))
        body += raw
    for ((name, kind), _), offset in zip(data.items(), offsets, strict=True):
        header += string(name) + struct.pack("<IQQIQ", 2, cols, rows, kind, offset)
    path.write_bytes(header + b"\0" * (-len(header) % 32) + body)
    return path


def test_gguf_tensors_read_alone_equal_mx_load(tmp_path):
    for path in (write_quantized_gguf(tmp_path / "types.gguf"), default_model_path()):
        metadata, infos = read_index(path)
        loaded = mx.load(str(path), return_metadata=True)
        assert isinstance(loaded, tuple)
        expected, expected_metadata = loaded
        got = read_tensors(path, infos.values())
        assert set(got) == set(expected)
        for name, want in expected.items():
            assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
            assert mx.array_equal(got[name], want).item(), name
        assert set(metadata) == set(expected_metadata)
        assert metadata["general.architecture"] == "llama"
    assert metadata["llama.block_count"] == 30
    assert metadata["tokenizer.ggml.tokens"][:2] == ["<|endoftext|>", "<|im_start|>"]


def test_a_stage_of_a_directory_is_the_whole_model_s_part(tmp_path):
    directory = tmp_path / "tiny5"
    write_dir(directory, model_keys={"num_hidden_layers": 5, "tie_word_embeddings": False})
    whole = load_model(directory, "tiny", mx.float32, "dequantized")
    layout = model_layout(directory, mx.float32, "dequantized")
    stages = layout.split(2)
    assert [(s.start, s.stop) for s in stages] == [(3, 5), (0, 3)]
    for stage in stages:
        loaded = load_stage(directory, stage, mx.float32, "dequantized")
        want = dict(tree_flatten(stage_params(whole.params, stage)))
        got = dict(tree_flatten(loaded.params))
        assert set(got) == set(want) and all(mx.array_equal(got[k], want[k]).item() for k in want)
        assert ("lm_head.weight" in got) == stage.last and ("embed_tokens.weight" in got) == stage.first
        assert (loaded.tokenizer is not None) == stage.last and loaded.nbytes == stage.nbytes


def test_a_stage_of_the_default_gguf_reads_its_tensors_only():
    path = default_model_path()
    layout = model_layout(path, mx.float32, "dequantized")
    whole = sum(layout.layer_bytes) + layout.embed_bytes + layout.head_bytes
    first = layout.split(2)[1]  # the embedding and layers 0..14: what rank 1 holds
    with no_buffer_cache():
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        loaded = load_stage(path, first, mx.float32, "dequantized")
        held, peak = mx.get_active_memory() - before, mx.get_peak_memory() - before
    assert loaded.nbytes == first.nbytes  # its arrays are the stage's
    # What stays allocated is those arrays (within a page): no view keeps a file tensor alive.
    assert held < loaded.nbytes + 4096, (held, loaded.nbytes)
    assert peak < 0.7 * whole  # the stage dequantized plus its Q4_1 tensors, never the file
    assert loaded.tokenizer is None and len(loaded.params["layers"]) == first.stop - first.start == 15
