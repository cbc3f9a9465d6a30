"""Speculative decoding's token selection as pure MLX functions, compiled per batch bucket by
``service.engine.compile_cache`` (the proposers and the bookkeeping live in
``service.engine.speculative``).

A verify step scores, for each row, its newest token and K proposed tokens (``models.llama.verify``).
Output position j of a row (j = 0..K) has its own noise key ``noise[b, j]``, the j-th link of the
row's key chain (``mx.random.split`` once per token, exactly as :func:`models.sampling.sample`
advances a seeded row), so a row's tokens do not depend on how many it proposed.

Acceptance (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"), two ways, both exact (the output is distributed as the target's p):

* **matching** (greedy rows; prompt lookup, whose proposal q is one-hot; a seeded row's draft):
  y_j = the target's own choice at j with noise j (argmax for greedy rows, Gumbel-max over p
  with the same noise as :func:`models.sampling.sample` otherwise); proposal j is accepted while
  it equals y_j, and the first y_j that differs is the next token. For a one-hot q this is
  Leviathan's rule: x is accepted with probability p(x) and a rejection samples p with x
  removed, renormalised; and the tokens are exactly those of decoding without speculation.
* **rejection sampling** (an unseeded row's draft, q its draft's distribution): accept x_j when
  u_j < p_j(x_j) / q_j(x_j); the first rejection samples ``norm(max(0, p_j - q_j))``; when all
  are accepted, the next token is y_K, a sample of p_K.
"""

from __future__ import annotations

import mlx.core as mx

from models.sampling import filter_logits, gumbel


def spec_keys(keys: mx.array, seeded: mx.array, template: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Each row's key chain over the W = ``template.shape[0]`` output positions of one verify step.

    Args:
        keys: uint32 [B, 2], each row's PRNG key (seeded rows).
        seeded: bool [B]; other rows start from a fresh key of the global generator.
        template: any array [W]; only its length is read (static per compiled bucket).

    Returns:
        (noise uint32 [B, W, 2]: position j's noise key, ``split(key_j)[0]``; chain uint32
        [B, W + 1, 2]: ``key_0`` = the row's key and ``key_{j+1} = split(key_j)[1]``, so a row
        that emitted c tokens continues with ``chain[:, c]``; extra uint32 [B, W, 2]: fresh keys
        for rejection sampling's uniforms and residual samples, independent of the noise).
    """
    B, W = keys.shape[0], template.shape[0]
    fresh = mx.random.randint(0, 2**31 - 1, (B, 2)).astype(mx.uint32)
    key = mx.where(seeded[:, None], keys, fresh)
    chain, noise = [key], []
    for _ in range(W):
        split = mx.vmap(mx.random.split)(chain[-1])  # [B, 2, 2]
        noise.append(split[:, 0])
        chain.append(split[:, 1])
    extra = mx.random.randint(0, 2**31 - 1, (B, W, 2)).astype(mx.uint32)
    return mx.stack(noise, axis=1), mx.stack(chain, axis=1), extra


def draft_pick(
    logits: mx.array,
    temperature: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    min_p: mx.array,
    noise: mx.array,
) -> tuple[mx.array, mx.array]:
    """A draft model's proposal for each row and the distribution it came from.

    Args:
        logits: float32 [B, V], the draft's logits; sampling parameters as
            :func:`models.sampling.sample` (the target's, per row).
        noise: uint32 [B, 2], the noise key of the output position proposed for (see
            :func:`spec_keys`), so that a matching row's proposal and the target's choice share
            their Gumbel noise.

    Returns:
        (tokens int32 [B]: argmax for greedy rows, Gumbel-max over q otherwise; q float32 [B, V],
        the draft's filtered distribution).
    """
    V = logits.shape[-1]
    filtered = filter_logits(logits, temperature, top_p, top_k, min_p)
    sampled = mx.argmax(filtered + gumbel(noise, V), axis=-1)
    tokens = mx.where(temperature > 0, sampled, mx.argmax(logits, axis=-1))
    return tokens.astype(mx.int32), mx.softmax(filtered, axis=-1)


def spec_accept(
    logits: mx.array,
    proposals: mx.array,
    q: mx.array,
    temperature: mx.array,
    top_p: mx.array,
    top_k: mx.array,
    min_p: mx.array,
    noise: mx.array,
    extra: mx.array,
) -> tuple[mx.array, mx.array, mx.array]:
    """The target's side of acceptance for a verify step; the host takes each row's prefix.

    Args:
        logits: float32 [B, W, V], the verify step's logits (W = K + 1).
        proposals: int32 [B, K], each row's proposed tokens (padding where it proposed fewer).
        q: float32 [B, K, V], the draft's distributions of the proposals (rejection-sampling rows;
            anything for the others).
        temperature, top_p, top_k, min_p: [B], each row's sampling parameters (as
            :func:`models.sampling.sample`): they define the target distribution p.
        noise, extra: uint32 [B, W, 2], from :func:`spec_keys`.

    Returns:
        (y int32 [B, W]: the target's choice at each position with that position's noise, the
        token decoding without speculation would pick there; accept bool [B, K]: rejection
        sampling's test ``u * q(x) < p(x)``; residual int32 [B, K]: a sample of
        ``norm(max(0, p_j - q_j))``, the token after a rejection at j).
    """
    B, W, V = logits.shape
    K = W - 1
    flat = logits.reshape(B * W, V)

    def per_position(a: mx.array) -> mx.array:
        return mx.repeat(a, W, axis=0)

    filtered = filter_logits(flat, *(per_position(a) for a in (temperature, top_p, top_k, min_p)))
    sampled = mx.argmax(filtered + gumbel(noise.reshape(B * W, 2), V), axis=-1)
    y = mx.where(per_position(temperature) > 0, sampled, mx.argmax(flat, axis=-1)).astype(mx.int32)
    p = mx.softmax(filtered, axis=-1).reshape(B, W, V)[:, :K]
    px = mx.take_along_axis(p, proposals[..., None], axis=-1)[..., 0]
    qx = mx.take_along_axis(q, proposals[..., None], axis=-1)[..., 0]
    draws = mx.vmap(lambda k: mx.random.uniform(shape=(V + 1,), key=k))(extra[:, :K].reshape(B * K, 2))
    u = draws[:, 0].reshape(B, K)
    noise_r = -mx.log(-mx.log(draws[:, 1:])).reshape(B, K, V)
    residual = mx.argmax(mx.log(mx.maximum(p - q, 0.0)) + noise_r, axis=-1).astype(mx.int32)
    return y.reshape(B, W), u * qx < px, residual


def take_prefix(
    y: list[int], proposals: list[int], k: int, accept: list[bool] | None = None, residual: list[int] | None = None
) -> list[int]:
    """The tokens a row emits from one verify step (host side): its first ``k`` proposals while
    they are accepted, then one more token. ``accept``/``residual`` None: matching (proposal j
    accepted while it equals ``y[j]``; the next token is ``y`` at the first mismatch); else
    rejection sampling (the next token is ``residual[j]`` at a rejection, ``y[k]`` after k
    acceptances). Returns 1 to k + 1 token ids."""
    out = []
    for j in range(k):
        ok = proposals[j] == y[j] if accept is None else accept[j]
        if not ok:
            return [*out, y[j] if residual is None else residual[j]]
        out.append(proposals[j])
    return [*out, y[k]]
