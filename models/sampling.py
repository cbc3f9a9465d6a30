"""Token selection from logits with per-row parameters, as pure MLX functions.

Both functions are compiled by ``service.engine.compile_cache``: :func:`greedy` shapeless (it is
one ``argmax``), :func:`sample` once per batch bucket with ``mx.random.state`` captured
(``inputs=outputs=mx.random.state``, the pattern of MLX's compile guide).

Seeds: a row with a seed draws its noise from its own key chain (``mx.random.key(seed)``,
split once per token), so its samples depend on nothing else in the batch and repeat
exactly for the same seed. Rows without a seed take a fresh key from the global MLX
generator each step.
"""

from __future__ import annotations

import mlx.core as mx


def greedy(logits: mx.array) -> mx.array:
    """Most likely token per row. logits: float [B, V] -> int32 [B]."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def sample(
    logits: mx.array,
    temperature: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    keys: mx.array,
    seeded: mx.array,
) -> tuple[mx.array, mx.array]:
    """Sample one token per row with temperature, top-k and top-p (nucleus) filtering.

    Args:
        logits: float32 [B, V].
        temperature: float32 [B]; 0 selects greedy decoding for that row.
        top_p: float32 [B] in (0, 1]; 1 disables nucleus filtering (Holtzman et al. 2019).
        top_k: int32 [B] in [1, V]; V disables top-k (the engine maps "0 = off" to V).
        keys: uint32 [B, 2], each row's PRNG key (``mx.random.key``).
        seeded: bool [B]; rows marked False ignore ``keys`` and use the global generator.

    Returns:
        (tokens int32 [B], next keys uint32 [B, 2]).

    Top-k is applied first and top-p to the renormalized remainder, as in Hugging Face's
    logits processors. Sampling is Gumbel-max: ``argmax(logits/T + G)`` with G standard
    Gumbel noise draws from ``softmax(logits/T)`` (Gumbel 1954; Maddison et al. 2014).
    """
    B, V = logits.shape
    fresh = mx.random.randint(0, 2**31 - 1, (B, 2)).astype(mx.uint32)  # from the global state
    keys = mx.where(seeded[:, None], keys, fresh)
    split = mx.vmap(mx.random.split)(keys)  # [B, 2, 2]
    noise_keys, next_keys = split[:, 0], split[:, 1]
    uniform = mx.vmap(lambda k: mx.random.uniform(shape=(V,), key=k))(noise_keys)  # [B, V]
    gumbel = -mx.log(-mx.log(uniform))

    scaled = logits / mx.maximum(temperature, 1e-5)[:, None]
    ordered = mx.sort(scaled, axis=-1)[:, ::-1]  # descending
    rank = mx.arange(V)[None, :]
    ordered = mx.where(rank < top_k[:, None], ordered, -mx.inf)
    probs = mx.softmax(ordered, axis=-1)
    # Keep a token while the mass before it is below top_p (the first token always stays).
    keep = (mx.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    n_keep = mx.maximum(keep.sum(axis=-1), 1)
    threshold = mx.take_along_axis(ordered, (n_keep - 1)[:, None], axis=-1)  # [B, 1]
    filtered = mx.where(scaled >= threshold, scaled, -mx.inf)
    sampled = mx.argmax(filtered + gumbel, axis=-1)
    tokens = mx.where(temperature > 0, sampled, mx.argmax(logits, axis=-1))
    return tokens.astype(mx.int32), next_keys
