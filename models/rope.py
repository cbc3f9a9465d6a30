"""Rotary position embeddings (Su et al. 2021, "RoFormer") with the context-extension
schemes checkpoints ask for in ``rope_scaling`` (or transformers >= 5's ``rope_parameters``).

Every variant is one call of ``mx.fast.rope``: plain RoPE passes ``base``; ``linear`` scales
the positions (``scale = 1 / factor``); ``llama3`` and ``yarn`` pass per-pair ``freqs``, which
MLX takes as *periods* (``base ** (2i / dims)`` for plain RoPE: the inverse of the usual
inverse frequencies, MLX's ``fast.rope`` documentation and mlx-lm's rope_utils use the same
convention). YaRN also multiplies queries and keys by its attention factor before rotating
them. Positions stay ``mx.array`` inputs: nothing here depends on a sequence's length.

The formulas are Hugging Face transformers' ``modeling_rope_utils`` (``_compute_llama3_parameters``,
``_compute_yarn_parameters``; Meta's Llama 3.1 reference code and Peng et al. 2023, "YaRN").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import mlx.core as mx

#: ``rope_type`` values implemented, and the keys each may carry. Any other key of a
#: scaling dict changes the math in a way not implemented here and is refused
#: (:func:`rope_problems`); ``rope_theta`` and ``partial_rotary_factor`` are checked apart.
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset(
        {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}
    ),
}
#: Keys every scaling dict may carry without changing the math here: the type's own name,
#: the base (read apart), and what transformers writes alongside.
_NEUTRAL_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
#: Keys each type requires (transformers' ``_compute_*_parameters`` read them without a default).
_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The ``rope_type`` (or legacy ``type``) of a scaling dict; ``default`` for None or {}."""
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def rope_problems(key: str, scaling: Any) -> list[str]:
    """What in ``scaling`` (the value of config key ``key``) is not implemented, one message
    per problem naming the key, the value and what is supported; empty when all is.

    Refused: a type outside :data:`ROPE_KEYS` (``dynamic``, ``longrope``, ...); a key the type
    does not take (YaRN's ``attention_factor``); a missing required key; YaRN's ``truncate:
    false``; YaRN with only one of ``mscale``/``mscale_all_dim`` (transformers then ignores it,
    mlx-lm does not: the two disagree, so neither is followed); ``partial_rotary_factor`` != 1.
    """
    if scaling is None:
        return []
    if not isinstance(scaling, dict):
        return [f"{key}={_json(scaling)} is not implemented (supported: null or a dict with a rope_type)"]
    kind = rope_type(scaling)
    if kind not in ROPE_KEYS:
        supported = ", ".join(f'"{t}"' for t in ROPE_KEYS)
        return [f"{key}={_json(scaling)} is not implemented (supported: rope_type {supported})"]
    found = []
    extra = sorted(set(scaling) - ROPE_KEYS[kind] - _NEUTRAL_KEYS)
    if extra:
        allowed = ", ".join(sorted(ROPE_KEYS[kind])) or "none"
        found.append(f"{key}={_json(scaling)}: {extra} is not implemented (supported: {allowed} for {kind})")
    missing = [k for k in _REQUIRED.get(kind, ()) if scaling.get(k) is None]
    if missing:
        required = ", ".join(_REQUIRED[kind])
        found.append(f"{key}={_json(scaling)} without {missing} is not implemented (supported: {kind} with {required})")
    if kind == "yarn" and scaling.get("truncate", True) is not True:
        found.append(f"{key}={_json(scaling)}: truncate=false is not implemented (supported: true)")
    if kind == "yarn" and (scaling.get("mscale") is None) != (scaling.get("mscale_all_dim") is None):
        found.append(
            f"{key}={_json(scaling)}: mscale without mscale_all_dim (or the reverse) is not implemented "
            "(supported: both or neither)"
        )
    if scaling.get("partial_rotary_factor", 1) not in (1, 1.0, None):
        found.append(f"{key}={_json(scaling)}: partial_rotary_factor is not implemented (supported: 1)")
    return found


@dataclass(frozen=True)
class RoPE:
    """One layer's rotary embedding, static (hashable) so a traced step can close over it.

    Attributes:
        dims: D, the head dimensions rotated (the whole head).
        base: the RoPE base (``rope_theta``), used when ``periods`` is None.
        traditional: rotate interleaved pairs (2i, 2i+1) (llama.cpp's GGUF layout) rather
            than the two halves of the head (Hugging Face's layout).
        scale: multiplies the positions (``linear`` scaling: 1 / factor).
        periods: per-pair periods (D/2 float32 values) replacing ``base`` (llama3, yarn).
        input_scale: multiplies queries and keys before rotation (YaRN's attention factor).
    """

    dims: int
    base: float
    traditional: bool = False
    scale: float = 1.0
    periods: tuple[float, ...] | None = None
    input_scale: float = 1.0

    @cached_property
    def _freqs(self) -> mx.array | None:
        return None if self.periods is None else mx.array(self.periods, mx.float32)

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        """Rotate x [B, H, L, D] whose first token is at ``offset`` (int 0 or int32 [B])."""
        if self.input_scale != 1.0:
            x = x * self.input_scale
        base = None if self.periods is not None else self.base
        return mx.fast.rope(
            x, self.dims, traditional=self.traditional, base=base, scale=self.scale, offset=offset, freqs=self._freqs
        )


def make_rope(dims: int, base: float, traditional: bool, scaling: dict[str, Any] | None) -> RoPE:
    """The :class:`RoPE` of a head of ``dims`` at ``base`` under ``scaling`` (a checked
    ``rope_scaling`` dict, see :func:`rope_problems`; None or default: plain RoPE).

    Raises:
        ValueError: a rope type :func:`rope_problems` refuses (check first).
    """
    kind = rope_type(scaling)
    if kind == "default":
        return RoPE(dims, base, traditional)
    assert scaling is not None
    if kind == "linear":
        return RoPE(dims, base, traditional, scale=1.0 / float(scaling["factor"]))
    if kind == "llama3":
        return RoPE(dims, base, traditional, periods=_llama3_periods(dims, base, scaling))
    if kind == "yarn":
        periods, factor = _yarn(dims, base, scaling)
        return RoPE(dims, base, traditional, periods=periods, input_scale=factor)
    raise ValueError(f"rope_type {kind!r} is not implemented")


def _plain_periods(dims: int, base: float) -> mx.array:
    """base ** (2i / dims), i = 0..dims/2-1, float32 (RoFormer's wavelengths / 2 pi)."""
    return base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def _llama3_periods(dims: int, base: float, s: dict[str, Any]) -> tuple[float, ...]:
    """Llama 3.1's frequency-dependent scaling: pairs whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor are slowed by ``factor``, those below
    original / high_freq_factor kept, those between interpolated smoothly."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    context = float(s["original_max_position_embeddings"])
    periods = _plain_periods(dims, base)
    wavelens = 2 * math.pi * periods
    scaled = mx.where(wavelens > context / low, periods * factor, periods)
    smooth = (context / wavelens - low) / (high - low)
    smoothed = scaled / ((1 - smooth) / factor + smooth)
    medium = (wavelens > context / high) & (wavelens < context / low)
    return tuple(mx.where(medium, smoothed, scaled).tolist())  # type: ignore[arg-type]  # 1-D: a list


def _yarn(dims: int, base: float, s: dict[str, Any]) -> tuple[tuple[float, ...], float]:
    """YaRN's periods (a linear ramp, over the pairs between the correction dims of
    ``beta_fast`` and ``beta_slow`` rotations, from plain RoPE to positions divided by
    ``factor``) and its attention factor, 0.1 ln(factor) + 1 (or the mscale ratio)."""
    factor, context = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dims * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dims - 1)
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / ((high - low) or 0.001), 0, 1)
    extrapolated = _plain_periods(dims, base)
    interpolated = factor * extrapolated
    keep = 1.0 - ramp  # 1: plain RoPE, 0: interpolated
    periods = (interpolated * extrapolated) / (interpolated * keep + extrapolated * (1 - keep))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = mscale(factor)
    if s.get("mscale") is not None and s.get("mscale_all_dim") is not None:
        attention = mscale(factor, float(s["mscale"])) / mscale(factor, float(s["mscale_all_dim"]))
    return tuple(periods.tolist()), attention  # type: ignore[arg-type]  # 1-D: a list


def _json(value: Any) -> str:
    return json.dumps(value)
