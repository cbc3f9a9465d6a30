"""The step functions over an unmodified mlx-lm module, with the hand-written architectures'
signatures (:mod:`models.llama`): ``prefill``, ``prefill_chunk``, ``decode`` and ``verify``, and
``decode_paged`` and ``verify_paged`` over a paged KV pool, each compiled once per bucket with
``params`` an input pytree.

Inside a step the module's parameters are replaced by ``params`` (under ``mx.compile`` these
are the trace's placeholders) and always restored afterwards, so the module left behind holds
real arrays. Its caches are :mod:`models.adapter.cache` objects over the step's
:class:`models.kv_cache.KVCache`: one buffer pair per attention cache and the arrays of each
recurrent cache, in the order of :func:`models.adapter.layout.flatten`.

Shapes: B rows, T prompt or chunk tokens, C capacity, K proposed tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import CacheList

from models.adapter.args import AdapterArgs
from models.adapter.cache import QuantizedSlotKVCache, SlotKVCache, SlotStateCache, UnusedCache
from models.adapter.layout import (
    KVLayout,
    Layout,
    ListLayout,
    StateLayout,
    UnsupportedCache,
    UnusedLayout,
)
from models.kv_cache import KVCache
from models.paged import PagedIndex, PagedKV, gather_at, gather_quantized, paged_index, write_at

Params = dict[str, Any]


def prefill(
    params: Params, tokens: mx.array, lengths: mx.array, cache: KVCache, *, args: AdapterArgs
) -> tuple[mx.array, KVCache]:
    """Run prompts from position 0 (:func:`models.llama.prefill`'s contract).

    Args:
        params: the module's parameter tree (``module.parameters()``).
        tokens: int32 [B, T], prompts right-padded to T (exactly T where not
            ``args.pads_prompts``).
        lengths: int32 [B], real tokens per row (1 <= lengths <= T).
        cache: a linear cache of capacity T (:meth:`AdapterArgs.allocate`); its states are not
            read: each recurrent layer starts from its own initial state.
        args: the model (static).

    Returns:
        (float32 logits [B, V] at each row's last real token, the cache holding positions
        0..T-1 and each row's states after its last real token).
    """
    offsets = mx.zeros((tokens.shape[0],), mx.int32)
    logits, cache = _forward(args, params, tokens, cache, offsets, lengths, prefill=True)
    return _last(logits, lengths), cache


def prefill_chunk(
    params: Params, tokens: mx.array, offsets: mx.array, lengths: mx.array, cache: KVCache, *, args: AdapterArgs
) -> tuple[mx.array, KVCache]:
    """Continue each row's prompt at its offset (:func:`models.llama.prefill_chunk`'s contract).

    Args:
        params: the module's parameter tree.
        tokens: int32 [B, T], each row's next prompt tokens, right-padded to T.
        offsets: int32 [B], tokens already in each row's cache.
        lengths: int32 [B], real tokens in each row's chunk (1 <= lengths <= T).
        cache: a linear staging cache of capacity C >= offsets + T, its states each row's after
            its first offsets[b] tokens (zeros at offset 0).
        args: the model (static).

    Returns:
        (float32 logits [B, V] at each row's last real token of the chunk, the cache with the
        chunk written at offsets..offsets+T-1 and each row's states after its last real token).
    """
    logits, cache = _forward(args, params, tokens, cache, offsets, lengths, prefill=False)
    return _last(logits, lengths), cache


def decode(
    params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, *, args: AdapterArgs
) -> tuple[mx.array, KVCache]:
    """One token per row at its own position (:func:`models.llama.decode`'s contract).

    Args:
        params: the module's parameter tree.
        tokens: int32 [B], each row's newest token.
        positions: int32 [B], its position (< C; sliding layers may be rings of min(W, C)).
        cache: the decode cache.
        args: the model (static).

    Returns:
        (float32 logits [B, V], the cache with each row's token written and states advanced).
    """
    logits, cache = _forward(args, params, tokens[:, None], cache, positions, None, prefill=False)
    return logits[:, 0, :], cache


def decode_paged(
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool: PagedKV,
    *,
    args: AdapterArgs,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """One token per row at its own position over a paged KV pool
    (:func:`models.llama.decode_paged`'s contract): each attention cache sees its rows' blocks
    gathered into a linear view [B, Hkv, M * bt, D] (:func:`models.paged.gather_at`; a sliding
    layer's window is a mask there), the module writes the new token into that view, and the
    token's keys and values are scattered into the pool (:func:`models.paged.write_at`). With
    ``bits`` (``kv_bits``) the pool holds quantized triples: the view is gathered as triples
    (:func:`models.paged.gather_quantized`), each attention cache is a
    :class:`~models.adapter.cache.QuantizedSlotKVCache` (the module quantizes the new token into
    the view and attends with mlx-lm's ``quantized_scaled_dot_product_attention``), and the new
    token's quantized parts are scattered into the pool as they are, not quantized twice.

    Args:
        params: the module's parameter tree.
        tokens: int32 [B], each row's newest token.
        positions: int32 [B], its position (< M * bt).
        table: int32 [B, M], each row's blocks in position order (null-block padded).
        pool: per attention cache, [N, Hkv, bt, D] keys and values (every cache of one shape:
            :attr:`AdapterArgs.prefix_blocks`), or with ``bits`` each a
            :data:`models.paged.Quantized` triple of such pools.
        args: the model (static).
        bits, group_size: the pool's quantization (4 or 8 bits, ``group_size`` values of D per
            scale and bias), or None: full precision.

    Returns:
        (float32 logits [B, V], the pool with each row's token written).

    Raises:
        ValueError: a model whose caches a pool cannot hold (recurrent states, or attention
            caches of several shapes), or ``bits`` that disagree with the pool's storage.
    """
    logits, pool = _forward_paged(args, params, tokens[:, None], positions, table, pool, bits, group_size)
    return logits[:, 0, :], pool


def verify_paged(
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool: PagedKV,
    *,
    args: AdapterArgs,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, PagedKV]:
    """Score each row's newest token and its proposals over a paged KV pool
    (:func:`models.llama.verify_paged`'s contract): as :func:`decode_paged` with W tokens per
    row. The module sees each row's blocks as a linear view (index p is position p), writes the
    W tokens at positions[b]..positions[b] + W - 1 there as a prefill chunk does, and they are
    scattered into the pool. No ring is involved, so a sliding-window layer verifies too: its
    window is the mask :func:`models.attention.cache_layout` gives several tokens per row
    (query at position p sees p - window + 1..p), as in :func:`prefill_chunk`.

    Args:
        params: the module's parameter tree.
        tokens: int32 [B, W], each row's newest token then up to W - 1 proposals, padded.
        positions: int32 [B], the newest token's position; positions[b] + W - 1 < M * bt for
            every row (empty slots pass 0 and a table row of null blocks). A position past the
            row's own blocks must map to a null-block column: its write lands in the null
            block, which attention never reads unmasked.
        table: int32 [B, M], each row's blocks in position order (null-block padded).
        pool: per attention cache, [N, Hkv, bt, D] keys and values, or quantized triples
            (see :func:`decode_paged`).
        args: the model (static).
        bits, group_size: the pool's quantization, as :func:`decode_paged`.

    Returns:
        (float32 logits [B, W, V]: entry j scores the token after tokens[b, j]; the pool with
        tokens[b, j]'s keys and values written at positions[b] + j). A rejected proposal's keys
        and values stay in the row's block past its new position, masked until a later step
        overwrites them; every block the W positions fall in is written, so none may be shared
        or published (the caller's copy-on-write).

    Raises:
        ValueError: as :func:`decode_paged`.
    """
    return _forward_paged(args, params, tokens, positions, table, pool, bits, group_size)


def _forward_paged(
    args: AdapterArgs,
    params: Params,
    tokens: mx.array,
    positions: mx.array,
    table: mx.array,
    pool: PagedKV,
    bits: int | None,
    group_size: int,
) -> tuple[mx.array, PagedKV]:
    """The module on tokens int32 [B, L] at positions[b]..positions[b] + L - 1 over each row's
    blocks ``table`` int32 [B, M] of ``pool`` (full precision, or with ``bits`` quantized
    triples): (float32 logits [B, L, V], the pool with the L tokens' keys and values written,
    as the module wrote them into its view: quantized there with ``bits``).

    Raises:
        ValueError: see :func:`decode_paged`.
    """
    if not args.prefix_blocks or args.capacity_pair:
        raise ValueError(f"{args.model_type}: a paged pool needs attention caches of one shape and no states")
    if bool(bits) != pool.quantized:
        raise ValueError(f"{args.model_type}: kv_bits = {bits} over a {'' if pool.quantized else 'un'}quantized pool")
    L = tokens.shape[1]
    at = positions[:, None] + mx.arange(L, dtype=mx.int32)[None, :] if L > 1 else positions[:, None]  # [B, L]
    k0 = pool.keys[0][0] if pool.quantized else pool.keys[0]
    index = paged_index(table, at, k0.shape[1], k0.shape[2])
    gathered = (lambda p: gather_quantized(p, index)) if bits else (lambda p: gather_at(p, index))
    # a quantized view's triples ride in the KVCache's slots: only its cache objects read them
    view_keys: list[Any] = [gathered(k) for k in pool.keys]
    view_values: list[Any] = [gathered(v) for v in pool.values]
    view = KVCache(view_keys, view_values)
    logits, view = _forward(
        args, params, tokens, view, positions, None, prefill=False, bits=bits, group_size=group_size
    )
    keys = [_write_new(p, index, at, v) for p, v in zip(pool.keys, view.keys, strict=True)]
    values = [_write_new(p, index, at, v) for p, v in zip(pool.values, view.values, strict=True)]
    return logits, PagedKV(keys, values)


def _write_new(pool: Any, index: PagedIndex, at: mx.array, view: Any) -> Any:
    """One layer's ``pool`` (an array [N, Hkv, bt, D] or a quantized triple of such) with the
    step's new tokens copied from the module's ``view`` (its layout: [B, Hkv, M * bt, D] or
    triples), where index p is position p: the tokens at ``at`` int32 [B, L] written through
    ``index`` (:func:`models.paged.write_at`, part by part)."""
    where = at[:, None, :, None]  # [B, 1, L, 1]

    def new(buffer: mx.array) -> mx.array:  # [B, Hkv, L, *]
        shape = (*buffer.shape[:2], at.shape[1], buffer.shape[3])
        return mx.take_along_axis(buffer, mx.broadcast_to(where, shape), axis=2)

    if isinstance(pool, tuple):
        packed, scales, biases = (write_at(p, index, new(v)) for p, v in zip(pool, view, strict=True))
        return packed, scales, biases
    return write_at(pool, index, new(view))


def quantized_attention_error(args: AdapterArgs, bits: int, group_size: int, dtype: mx.Dtype) -> str | None:
    """Why the module cannot attend over a ``bits``-bit quantized pool, or None where it can:
    one eager :func:`decode_paged` step of one row over a pool of ``dtype`` scales with one
    block besides the null block (its tokens zeros). A module attends over quantized keys only
    through mlx-lm's ``base.scaled_dot_product_attention``, which sees the cache's ``bits``
    (:class:`QuantizedSlotKVCache`); one whose attention reads the keys itself (their
    ``shape``, a transpose, a matmul: mlx-lm's gemma2 and its logit soft-capping) gets a tuple
    and raises, and mlx-lm's quantized attention refuses attention sinks (gpt_oss). The answer
    is kept per (args, bits, group_size, dtype): start-up asks, then the executor.

    Returns:
        The reason (the error the step raised, or non-finite logits), naming the model type.
    """
    key = (bits, group_size, str(dtype))
    known = _QUANTIZED_PROBES.setdefault(args, {})
    if key not in known:
        known[key] = _probe_quantized(args, bits, group_size, dtype)
    return known[key]


#: :func:`quantized_attention_error`'s answers, per model (dropped with it).
_QUANTIZED_PROBES: weakref.WeakKeyDictionary[AdapterArgs, dict[tuple[int, int, str], str | None]] = (
    weakref.WeakKeyDictionary()
)


def _probe_quantized(args: AdapterArgs, bits: int, group_size: int, dtype: mx.Dtype) -> str | None:
    """:func:`quantized_attention_error` without its memo."""
    kv = args.kv_layouts[0]
    block_tokens = 2
    pool = PagedKV.allocate(len(args.kv_layouts), 2, kv.heads, block_tokens, kv.key_dim, dtype, bits, group_size)
    one = mx.ones((1,), mx.int32)
    try:
        logits, pool = decode_paged(
            args.module.parameters(), one, one, one[:, None], pool, args=args, bits=bits, group_size=group_size
        )
        finite = mx.all(mx.isfinite(logits)).item()
    except Exception as e:  # whatever the module's attention raises on a tuple is the answer
        first = str(e).splitlines()[0] if str(e) else ""
        return f"{args.model_type}'s attention fails on quantized keys ({type(e).__name__}: {first})"
    return None if finite else f"{args.model_type} gives non-finite logits over quantized keys"


def verify(
    params: Params, tokens: mx.array, positions: mx.array, cache: KVCache, *, args: AdapterArgs
) -> tuple[mx.array, KVCache]:
    """Score each row's newest token and its K proposals (:func:`models.llama.verify`'s contract).

    Args:
        params: the module's parameter tree.
        tokens: int32 [B, K+1], each row's newest token then its proposals, padded.
        positions: int32 [B], the newest token's position (positions + K < C).
        cache: the decode cache (linear: see :attr:`AdapterArgs.can_verify`).
        args: the model (static).

    Returns:
        (float32 logits [B, K+1, V], the cache with tokens[b, j] written at positions[b] + j).

    Raises:
        ValueError: the model has a sliding layer or a recurrent state.
    """
    if not args.can_verify:
        raise ValueError(f"{args.model_type}: verify needs a model without sliding-window rings or recurrent states")
    return _forward(args, params, tokens, cache, positions, None, prefill=False)


def _forward(
    args: AdapterArgs,
    params: Params,
    tokens: mx.array,
    cache: KVCache,
    offsets: mx.array,
    lengths: mx.array | None,
    *,
    prefill: bool,
    bits: int | None = None,
    group_size: int = 64,
) -> tuple[mx.array, KVCache]:
    """The module on tokens int32 [B, L] at per-row offsets int32 [B] over ``cache``:
    (float32 logits [B, L, V], the new cache). With ``bits``, ``cache`` holds quantized
    triples (a paged view: no recurrent state) and each attention cache is a
    :class:`QuantizedSlotKVCache`. The module's own parameters are restored whatever happens."""
    module = args.module
    real = module.parameters()
    module.update(params)
    try:
        caches = _open(args.layouts, cache, offsets, lengths, prefill, args.grouped_mask, bits, group_size)
        logits = module(tokens, cache=caches)
    finally:
        module.update(real)
    closed = _close(caches, args.state_layouts)
    if args.capacity_pair:  # no layer reads it: it passes through
        closed = KVCache([*closed.keys, cache.keys[-1]], [*closed.values, cache.values[-1]], closed.states)
    return logits.astype(mx.float32), closed


def _open(
    layouts: tuple[Layout, ...],
    cache: KVCache,
    offsets: mx.array,
    lengths: mx.array | None,
    prefill: bool,
    grouped: bool,
    bits: int | None = None,
    group_size: int = 64,
) -> list[Any]:
    """One mlx-lm cache object per layout over ``cache``'s buffers and states, in order
    (a prefill's states start unset: the module's own initial state; ``grouped``: masks with
    a query-group axis; ``bits``: the buffers are quantized triples, each pair a
    :class:`QuantizedSlotKVCache`)."""
    pairs = cast(Iterator[tuple[Any, Any]], iter(zip(cache.keys, cache.values, strict=True)))  # arrays or triples
    states = iter(cache.states)

    def make(layout: Layout) -> Any:
        if isinstance(layout, ListLayout):
            return CacheList(*(make(part) for part in layout.parts))
        if isinstance(layout, KVLayout):
            keys, values = next(pairs)
            if bits:
                return QuantizedSlotKVCache(keys, values, offsets, bits, group_size, layout.window, grouped)
            return SlotKVCache(keys, values, offsets, layout.window, prefix=prefill, grouped=grouped)
        if isinstance(layout, UnusedLayout):
            return UnusedCache()
        arrays = [next(states, None) for _ in layout.shapes]
        return SlotStateCache([None] * len(arrays) if prefill else arrays, lengths)

    return [make(layout) for layout in layouts]


def _close(caches: list[Any], state_layouts: list[StateLayout]) -> KVCache:
    """The :class:`KVCache` of the cache objects after the module ran (states cast to their
    layouts' dtypes, so a step's output cache has its input's dtypes).

    Raises:
        ValueError: a recurrent layer left a state unset.
    """
    keys: list[Any] = []  # arrays, or quantized triples
    values: list[Any] = []
    states: list[mx.array] = []

    def walk(c: Any) -> None:
        if isinstance(c, CacheList):
            for part in c.caches:
                walk(part)
        elif isinstance(c, SlotKVCache | QuantizedSlotKVCache):
            keys.append(c.keys)
            values.append(c.values)
        elif isinstance(c, SlotStateCache):
            if any(a is None for a in c.cache):
                raise ValueError("a recurrent layer left its state unset")
            states.extend(a for a in c.cache if a is not None)

    for c in caches:
        walk(c)
    dtypes = [d for layout in state_layouts for d in layout.dtypes]
    return KVCache(keys, values, [s.astype(d) for s, d in zip(states, dtypes, strict=True)])


def _last(logits: mx.array, lengths: mx.array) -> mx.array:
    """logits [B, T, V] -> [B, V] at each row's last real token (lengths - 1)."""
    at = (lengths.astype(mx.int32) - 1)[:, None, None]
    return mx.take_along_axis(logits, at, axis=1)[:, 0, :]


def _padding_probe(args: AdapterArgs) -> AdapterArgs:
    """``args`` with its vocabulary V, whether padded prompts keep its states exact and
    whether its masks need a query-group axis, from eager prefills: one token alone, then
    B = Hkv + 1 rows (the largest layer's key-value heads, so a mask's rows cannot broadcast
    against the heads by accident): that token padded by one, and two-token rows. The first
    row's states must equal the lone row's. A module that fails to broadcast [B, 1, N, S]
    masks is tried with [B, 1, 1, N, S] (mlx-lm's gemma2 scores grouped queries as
    [B, Hkv, repeats, N, S]).

    Raises:
        UnsupportedCache: the rows fail with both mask shapes.
    """
    params = args.module.parameters()

    def run(a: AdapterArgs, tokens: list[list[int]], lengths: list[int]) -> tuple[mx.array, KVCache]:
        cache = a.allocate(len(tokens), len(tokens[0]), mx.float32)
        return prefill(params, mx.array(tokens, mx.int32), mx.array(lengths, mx.int32), cache, args=a)

    logits, alone = run(args, [[1]], [1])
    args = dataclasses.replace(args, vocab_size=logits.shape[-1])
    rows = max((kv.heads for kv in args.kv_layouts), default=1) + 1
    tokens, lengths = [[1, 2]] * rows, [1] + [2] * (rows - 1)
    try:
        _, padded = run(args, tokens, lengths)
    except ValueError as first:
        if "broadcast" not in str(first):
            raise UnsupportedCache(f"{args.model_type} fails on a batch of {rows} rows: {first}") from first
        args = dataclasses.replace(args, grouped_mask=True)
        try:
            _, padded = run(args, tokens, lengths)
        except ValueError:
            raise UnsupportedCache(f"{args.model_type} fails on a batch of {rows} rows: {first}") from first
    same = all(mx.allclose(a, b[:1], atol=1e-5).item() for a, b in zip(alone.states, padded.states, strict=True))
    return dataclasses.replace(args, pads_prompts=same)
