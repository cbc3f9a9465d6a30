"""Which mlx-lm architectures the adapter serves, and why the others are refused.

Keys are the modules of ``mlx_lm.models`` (a checkpoint's ``model_type`` after mlx-lm's own
alias table, ``mlx_lm.utils.MODEL_REMAPPING``: ``mistral`` -> ``llama``, ``falcon_mamba`` ->
``mamba``, ...). Every architecture module is in exactly one of the two tables, and
:data:`SUPPORTED` is exactly what the parity matrix runs and passes
(``tests/parity/test_parity_matrix.py``, which checks both): batched rows at different offsets,
right-padded, prefill and decode under ``mx.compile``, a bucket move and chunked prefill, each
token-identical to the row run alone with mlx-lm's own caches and logits within 1e-4 in
float32. The matrix runs one tiny random configuration per module, so a configuration option
that the adapter cannot run exactly (RoPE type ``dynamic``) is refused at load by
:func:`check_module` as well.
"""

from __future__ import annotations

import mlx.nn as nn
from mlx_lm.utils import MODEL_REMAPPING

from models.errors import ModelLoadError

#: How each supported architecture was tested: "parity matrix: " and its cache kinds (kv: full
#: attention; sliding: sliding-window layers, decoded in a ring of the window; mla: latent
#: attention, keys and values of different widths; state: recurrent or convolution states;
#: list: several caches per layer), then ", equal-length prompts" where the recurrent layers
#: ignore padding (the engine prefills such rows exactly, unpadded).
SUPPORTED: dict[str, str] = {
    "Klear": "parity matrix: kv",
    "afmoe": "parity matrix: kv+sliding",
    "apertus": "parity matrix: kv",
    "baichuan_m1": "parity matrix: list, equal-length prompts",
    "bailing_hybrid": "parity matrix: mla+state",
    "bailing_moe": "parity matrix: kv",
    "bailing_moe_linear": "parity matrix: kv+state, equal-length prompts",
    "bailing_moe_v3": "parity matrix: mla+state",
    "cohere": "parity matrix: kv",
    "cohere2": "parity matrix: kv+sliding",
    "deepseek": "parity matrix: kv",
    "deepseek_v2": "parity matrix: mla",
    "deepseek_v3": "parity matrix: mla",
    "deepseek_v32": "parity matrix: list",
    "dots1": "parity matrix: kv",
    "ernie4_5": "parity matrix: kv",
    "ernie4_5_moe": "parity matrix: kv",
    "exaone": "parity matrix: kv",
    "exaone4": "parity matrix: kv+sliding",
    "exaone_moe": "parity matrix: kv+sliding",
    "falcon_h1": "parity matrix: list",
    "gear": "parity matrix: kv+sliding+state",
    "gemma": "parity matrix: kv",
    "gemma2": "parity matrix: kv",
    "gemma3": "parity matrix: kv+sliding",
    "gemma3_text": "parity matrix: kv+sliding",
    "gemma3n": "parity matrix: kv+sliding",
    "gemma4": "parity matrix: kv+sliding",
    "gemma4_text": "parity matrix: kv+sliding",
    "glm": "parity matrix: kv",
    "glm4": "parity matrix: kv",
    "glm4_moe": "parity matrix: kv",
    "glm4_moe_lite": "parity matrix: mla",
    "glm_moe_dsa": "parity matrix: list",
    "gpt2": "parity matrix: kv",
    "gpt_neox": "parity matrix: kv",
    "gpt_oss": "parity matrix: kv+sliding",
    "gptj": "parity matrix: kv",
    "granite": "parity matrix: kv",
    "granitemoe": "parity matrix: kv",
    "granitemoehybrid": "parity matrix: kv+state",
    "helium": "parity matrix: kv",
    "hunyuan": "parity matrix: kv",
    "hunyuan_v1_dense": "parity matrix: kv",
    "internlm2": "parity matrix: kv",
    "internlm3": "parity matrix: kv",
    "iquestloopcoder": "parity matrix: kv+sliding",
    "jamba": "parity matrix: kv+state, equal-length prompts",
    "kimi_k25": "parity matrix: mla",
    "kimi_k3": "parity matrix: mla+state",
    "kimi_linear": "parity matrix: mla+state",
    "kimi_vl": "parity matrix: mla",
    "laguna": "parity matrix: kv+sliding",
    "lfm2": "parity matrix: kv+state",
    "lfm2-vl": "parity matrix: kv+state",
    "lfm2_moe": "parity matrix: kv+state",
    "lille-130m": "parity matrix: kv",
    "llama": "parity matrix: kv",
    "llama4_text": "parity matrix: kv",
    "longcat_flash": "parity matrix: list",
    "longcat_flash_ngram": "parity matrix: list+state, equal-length prompts",
    "mamba": "parity matrix: state, equal-length prompts",
    "mamba2": "parity matrix: state",
    "mellum": "parity matrix: kv+sliding",
    "mimo": "parity matrix: kv",
    "mimo_v2_flash": "parity matrix: mla+sliding",
    "minicpm": "parity matrix: kv",
    "minicpm3": "parity matrix: mla",
    "minimax": "parity matrix: kv",
    "ministral3": "parity matrix: kv+sliding",
    "mistral3": "parity matrix: kv",
    "mistral4": "parity matrix: mla",
    "mixtral": "parity matrix: kv",
    "muse_glimmer": "parity matrix: kv+sliding",
    "nanbeige": "parity matrix: kv",
    "nanochat": "parity matrix: kv",
    "nemotron": "parity matrix: kv",
    "nemotron-nas": "parity matrix: kv",
    "nemotron_h": "parity matrix: kv+state, equal-length prompts",
    "olmo2": "parity matrix: kv",
    "olmo3": "parity matrix: kv+sliding",
    "olmo_hybrid": "parity matrix: kv+state, equal-length prompts",
    "olmoe": "parity matrix: kv",
    "openelm": "parity matrix: kv",
    "phi": "parity matrix: kv",
    "phi3": "parity matrix: kv",
    "phimoe": "parity matrix: kv",
    "phixtral": "parity matrix: kv",
    "pixtral": "parity matrix: kv",
    "plamo": "parity matrix: kv",
    "plamo2": "parity matrix: kv+state",
    "plamo3": "parity matrix: kv+sliding",
    "qwen": "parity matrix: kv",
    "qwen2": "parity matrix: kv",
    "qwen2_moe": "parity matrix: kv",
    "qwen2_vl": "parity matrix: kv",
    "qwen3": "parity matrix: kv",
    "qwen3_5": "parity matrix: kv+state",
    "qwen3_5_moe": "parity matrix: kv+state",
    "qwen3_moe": "parity matrix: kv",
    "qwen3_next": "parity matrix: kv+state",
    "qwen3_vl": "parity matrix: kv",
    "qwen3_vl_moe": "parity matrix: kv",
    "recurrent_gemma": "parity matrix: sliding+state, equal-length prompts",
    "rwkv7": "parity matrix: state, equal-length prompts",
    "seed_oss": "parity matrix: kv",
    "smollm3": "parity matrix: kv",
    "solar_open": "parity matrix: kv",
    "spark2_5": "parity matrix: kv+sliding",
    "stablelm": "parity matrix: kv",
    "starcoder2": "parity matrix: kv",
    "step3p5": "parity matrix: kv+sliding",
    "talkie": "parity matrix: kv",
    "telechat3": "parity matrix: kv",
    "youtu_llm": "parity matrix: mla",
}

#: The supported architectures whose mlx-lm module splits into pipeline stages: its layers sit
#: in mlx-lm's ``PipelineMixin`` and its caches follow a stage's slice of them (checked against
#: the installed mlx-lm by tests/unit/test_lm_pipeline.py). Not here: mlx-lm modules without
#: ``PipelineMixin`` (llama, gemma3, phi3, ...), and the vision wrappers kimi_vl, mistral3,
#: qwen2_vl and qwen3_vl_moe, whose caches cover every layer whatever the stage.
PIPELINE_SPLITS: frozenset[str] = frozenset(
    {
        "bailing_hybrid",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "kimi_k25",
        "ministral3",
        "mistral4",
        "qwen2",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_moe",
        "qwen3_next",
        "solar_open",
    }
)

_NOT_ON_CPU = "not verified: the parity matrix runs on the CPU, and"

#: Why each refused architecture cannot run in stepserve's compiled steps, in a user's words.
REFUSED: dict[str, str] = {
    "afm7": "its KV-reuse layers take the query's RoPE position from the length of the cache "
    "(S - L), which stepserve's fixed-size cache buffers do not give",
    "bitnet": f"{_NOT_ON_CPU} its BitLinear layers run only as a Metal kernel",
    "dbrx": "its mixture-of-experts router copies the chosen experts to the host (.tolist()) "
    "inside the forward pass, which a compiled step cannot do",
    "deepseek_v41": "it keeps its own per-layer cache (sliding window, compressed groups, index "
    "keys, pending rows), which stepserve's cache adapter does not hold",
    "gpt_bigcode": "it builds position ids on the host from the cache offset (np.arange), "
    "which a compiled step with per-row positions cannot do",
    "llama4": "its chunked-attention layers (ChunkedKVCache) build their mask from host-side "
    "cache positions, which a compiled step with per-row positions cannot do",
    "minimax_m3_vl": "its block-sparse attention indexer places queries and key blocks by the "
    "length of the cache, which stepserve's fixed-size cache buffers do not give",
    "muse_spark": f"{_NOT_ON_CPU} its fused qk-norm and RoPE run only as a Metal kernel",
    "olmo": "the retired OLMo-1 format: mlx-lm's module needs the hf_olmo package (ai2-olmo)",
    "phi3small": "its block-sparse attention adds the boolean causal mask to the scores, so even "
    "mlx-lm's own decode differs from a full forward; its forward also crashes MLX's CPU back-end",
    "prism_hadamard_qwen35": "its forward checks a value on the host (.item()), which a compiled "
    "step cannot do, and it is a 2-bit quantized pack only (qwen3_5 itself is supported)",
}

_SEE_LIST = "run `stepserve models` for the supported list"


def resolve(model_type: str) -> str:
    """The ``mlx_lm.models`` module that serves ``model_type`` (mlx-lm's alias table
    ``MODEL_REMAPPING`` applied: ``mistral`` -> ``llama``; other names unchanged)."""
    return MODEL_REMAPPING.get(model_type, model_type)


def check_supported(model_type: str) -> None:
    """Return if the adapter serves ``model_type`` (a checkpoint's ``model_type``, aliases
    resolved by :func:`resolve`); raise otherwise.

    Raises:
        models.errors.ModelLoadError: naming ``model_type``, the reason (:data:`REFUSED`, or
            that it is not an mlx-lm architecture this stepserve knows) and where to see the
            supported list.
    """
    name = resolve(model_type)
    if name in SUPPORTED:
        return
    reason = REFUSED.get(name, "it is not an mlx-lm architecture this version of stepserve knows")
    alias = f" (mlx-lm's {name})" if name != model_type else ""
    raise ModelLoadError(f"model_type {model_type!r}{alias} is not supported: {reason}; {_SEE_LIST}")


def check_module(module: nn.Module) -> None:
    """Refuse an mlx-lm model the adapter cannot run exactly: an architecture not in
    :data:`SUPPORTED` (named by the module that defines ``module``'s class), or a
    configuration whose RoPE is dynamic NTK scaling (it picks its base by comparing the
    position with the context length in Python, which per-row positions as arrays cannot do).

    Raises:
        models.errors.ModelLoadError: see :func:`check_supported`; or the configuration's
            reason, naming the architecture.
    """
    path = type(module).__module__
    name = path.removeprefix("mlx_lm.models.") if path.startswith("mlx_lm.models.") else path
    check_supported(name)
    for child in module.modules():
        if type(child).__name__ == "DynamicNTKScalingRoPE":
            raise ModelLoadError(
                f"model_type {name!r} with rope_scaling type 'dynamic' is not supported: dynamic NTK "
                f"scaling picks its RoPE base from the position on the host, which a compiled step "
                f"with per-row positions cannot do; {_SEE_LIST}"
            )
