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
    min_p: mx.array,
    keys: mx.array,
    seeded: mx.array,
) -> tuple[mx.array, mx.array]:
    """Sample one token per row with temperature, top-k, top-p (nucleus) and min-p filtering.

    Args:
        logits: float32 [B, V].
        temperature: float32 [B]; 0 selects greedy decoding for that row.
        top_p: float32 [B] in (0, 1]; 1 disables nucleus filtering (Holtzman et al. 2019).
        top_k: int32 [B] in [1, V]; V disables top-k (the engine maps "0 = off" to V).
        min_p: float32 [B] in [0, 1]; keep tokens whose probability is at least ``min_p`` times
            the most likely one's (Nguyen et al. 2024, "min-p sampling"); 0 disables it.
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
    filtered = filter_logits(logits, temperature, top_p, top_k, min_p)
    sampled = mx.argmax(filtered + gumbel(noise_keys, V), axis=-1)
    tokens = mx.where(temperature > 0, sampled, mx.argmax(logits, axis=-1))
    return tokens.astype(mx.int32), next_keys


def gumbel(keys: mx.array, vocab: int) -> mx.array:
    """Standard Gumbel noise float32 [B, vocab], row b drawn from key ``keys[b]`` (uint32 [B, 2])
    as ``-log(-log(U))`` with U uniform (Gumbel 1954)."""
    uniform = mx.vmap(lambda k: mx.random.uniform(shape=(vocab,), key=k))(keys)  # [B, V]
    return -mx.log(-mx.log(uniform))


def filter_logits(
    logits: mx.array, temperature: mx.array, top_p: mx.array, top_k: mx.array, min_p: mx.array
) -> mx.array:
    """The sampled distribution of :func:`sample` as logits: ``logits / temperature`` with the
    tokens that top-k, then top-p on the renormalized remainder, then min-p filter out at
    -inf, so that ``softmax`` of the result is the distribution a row samples from (and
    speculative decoding's target distribution p). Shapes and parameters as :func:`sample`;
    returns float32 [B, V]."""
    V = logits.shape[-1]
    scaled = logits / mx.maximum(temperature, 1e-5)[:, None]
    ordered = mx.sort(scaled, axis=-1)[:, ::-1]  # descending
    rank = mx.arange(V)[None, :]
    ordered = mx.where(rank < top_k[:, None], ordered, -mx.inf)
    probs = mx.softmax(ordered, axis=-1)
    # Keep a token while the mass before it is below top_p (the first token always stays).
    keep = (mx.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    n_keep = mx.maximum(keep.sum(axis=-1), 1)
    threshold = mx.take_along_axis(ordered, (n_keep - 1)[:, None], axis=-1)  # [B, 1]
    # min-p on the temperature-scaled distribution: p_i >= min_p * p_max  <=>  s_i >= s_max + log(min_p).
    floor = ordered[:, :1] + mx.log(mx.maximum(min_p, 1e-30))[:, None]
    threshold = mx.maximum(threshold, mx.where(min_p[:, None] > 0, floor, -mx.inf))
    return mx.where(scaled >= threshold, scaled, -mx.inf)


def process(
    logits: mx.array,
    bias: mx.array,
    allowed: mx.array,
    repetition: mx.array,
    seen: mx.array,
) -> mx.array:
    """Apply per-row logits processors before sampling; compiled once per batch bucket.

    Args:
        logits: float32 [B, V], the model's logits.
        bias: float32 [B, V], added to the logits: OpenAI's ``logit_bias`` and its presence and
            frequency penalties (``-presence * [count > 0] - frequency * count`` over the
            row's generated tokens, as OpenAI's API reference defines them), built on the host.
        allowed: int32 [B, ceil(V / 32)], a bitmask of the tokens a row may take (bit j % 32 of
            word j // 32); the grammar of a structured-output row, all ones otherwise.
        repetition: float32 [B], the repetition penalty (CTRL, Keskar et al. 2019, as Hugging
            Face applies it: a seen token's logit is divided by it when positive and multiplied
            when negative); 1 disables it.
        seen: bool [B, V], the tokens of the row's prompt and output so far.

    Returns: float32 [B, V], with disallowed tokens at -inf.
    """
    V = logits.shape[-1]
    shifted = mx.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None])
    logits = mx.where(seen, shifted, logits) + bias
    return mx.where(unpack_bits(allowed, V), logits, -mx.inf)


def unpack_bits(words: mx.array, width: int) -> mx.array:
    """int32 [B, W] bitmask -> bool [B, width]: bit j % 32 of word j // 32 (little-endian
    within a word, as llguidance and xgrammar lay out their token bitmasks)."""
    j = mx.arange(width)
    w = words.astype(mx.uint32)[:, j // 32]
    return ((w >> (j % 32).astype(mx.uint32)) & 1).astype(mx.bool_)


TOP_LOGPROBS = 20  # OpenAI's most ``top_logprobs``; every row computes this many


def logprobs(logits: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Log-probabilities of the model's distribution (log-softmax of the raw logits, before any
    penalty, bias, grammar mask, temperature or filter, as vLLM reports them by default).

    Args:
        logits: float32 [B, V], the model's logits.
        tokens: int32 [B], the tokens sampled.

    Returns: (the sampled tokens' logprobs float32 [B], the ``TOP_LOGPROBS`` most likely ids
    int32 [B, K] and their logprobs float32 [B, K], most likely first).
    """
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
    top = mx.argpartition(-lp, TOP_LOGPROBS - 1, axis=-1)[:, :TOP_LOGPROBS]
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    return chosen, mx.take_along_axis(top, order, axis=-1).astype(mx.int32), mx.take_along_axis(top_lp, order, axis=-1)
