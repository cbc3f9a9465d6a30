"""Which mlx-lm ``model_type``s the adapter serves, how each was tested, and which it refuses.

STAND-IN (branch ``integ``): a minimal local version of the support table that the parity-matrix
work provides under the same names (``SUPPORTED``, ``REFUSED``, :func:`check_supported`). It
lists only the types ``tests/unit/test_adapter_parity.py`` checks and the refusals issue #27
names; replace it with the parity matrix's table when that lands.
"""

from __future__ import annotations

from models.errors import ModelLoadError

_PARITY = "tiny random config, batched adapter steps against each row alone with mlx-lm's caches"

#: mlx-lm module name (``model_type`` after mlx-lm's remapping) -> how it was tested.
SUPPORTED: dict[str, str] = {
    name: _PARITY
    for name in (
        "deepseek_v3",
        "falcon_h1",
        "gemma3_text",
        "glm4_moe",
        "gpt_oss",
        "lfm2",
        "llama",
        "mistral3",
        "olmo2",
        "phi3",
        "qwen3",
        "qwen3_next",
    )
}

_EXACT = (
    "its recurrent layers ignore the padding of a prompt row (mlx-lm's ArraysCache.lengths), and stepserve "
    "prefills prompts padded to buckets (exact-length prefill is not implemented)"
)

#: mlx-lm module name -> why the adapter cannot run it.
REFUSED: dict[str, str] = {
    "baichuan_m1": _EXACT,
    "mamba": _EXACT,
    "gpt_bigcode": "its attention reads cache.offset on the host (np.arange), which a compiled step cannot",
    "dbrx": "its router calls .tolist() inside the forward pass, a host sync a compiled step cannot make",
    "deepseek_v32": "its second 'indexer' cache is not held by the adapter",
    "glm_moe_dsa": "its second 'indexer' cache is not held by the adapter",
    "llama4": "its chunked attention cache (ChunkedKVCache) is not held by the adapter",
    "olmo": "its additive attention mask is not built by the adapter",
    "phi3small": "its block-sparse attention mask is not built by the adapter",
}


def check_supported(model_type: str) -> None:
    """Refuse a ``model_type`` the adapter does not serve.

    Raises:
        ModelLoadError: naming the type, the reason (refused, or not tested) and
            ``stepserve models`` (which lists every supported type).
    """
    if model_type in REFUSED:
        raise ModelLoadError(
            f"model_type '{model_type}' is not supported: {REFUSED[model_type]}; "
            "'stepserve models' lists the supported types"
        )
    if model_type not in SUPPORTED:
        raise ModelLoadError(
            f"model_type '{model_type}' is not supported: it has not passed the adapter's parity tests; "
            "'stepserve models' lists the supported types"
        )
