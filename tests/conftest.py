"""Shared fixtures: a tiny random Llama for unit tests, real `stepserve serve` processes for
end-to-end tests."""

from __future__ import annotations

from models.blas import load_cpu_blas

load_cpu_blas()  # before MLX is imported, as `stepserve` does

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402

from models.llama import ModelArgs  # noqa: E402
from tests.server import ServerProcess  # noqa: E402

# Float32 matmuls on CUDA run at TF32-like precision (a 64x64 matmul: 2.9e-4 relative error
# on an H200, against ~1e-7 on the CPU), so logit comparisons there need a looser bound.
ON_GPU = mx.default_device().type == mx.gpu
ATOL = 3e-2 if ON_GPU else 1e-4

TINY = ModelArgs(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    rope_theta=10000.0,
    max_position_embeddings=512,
)


def random_params(args: ModelArgs = TINY, seed: int = 0) -> dict:
    """A random parameter tree in the stepserve layout (dense float32, tied embeddings)."""
    mx.random.seed(seed)
    H, inner, D = args.hidden_size, args.intermediate_size, args.dim_per_head
    q_out, kv_out = args.num_attention_heads * D, args.num_key_value_heads * D

    def dense(out_features, in_features):
        return {"weight": mx.random.normal((out_features, in_features)) * (in_features**-0.5)}

    def norm():
        return {"weight": 1.0 + 0.1 * mx.random.normal((H,))}

    layers = [
        {
            "input_layernorm": norm(),
            "post_attention_layernorm": norm(),
            "self_attn": {
                "q_proj": dense(q_out, H),
                "k_proj": dense(kv_out, H),
                "v_proj": dense(kv_out, H),
                "o_proj": dense(H, q_out),
            },
            "mlp": {"gate_proj": dense(inner, H), "up_proj": dense(inner, H), "down_proj": dense(H, inner)},
        }
        for _ in range(args.num_hidden_layers)
    ]
    params = {"embed_tokens": {"weight": mx.random.normal((args.vocab_size, H))}, "norm": norm(), "layers": layers}
    mx.eval(params)
    return params


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """The default model converted by `stepserve convert` into an mlx-community directory."""
    from models.convert import convert_gguf
    from models.gguf import default_model_path

    return convert_gguf(default_model_path(), tmp_path_factory.mktemp("smollm2-mlx"))


def _serving(args: list[str]):
    proc = ServerProcess.start(args)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def server() -> ServerProcess:
    """The default model served by a real `stepserve serve` (compile on, default settings)."""
    yield from _serving(["--compile", "on"])


@pytest.fixture(scope="session")
def eager_server() -> ServerProcess:
    """The same model with `--compile off` (the eager baseline)."""
    yield from _serving(["--compile", "off"])
