"""Paged decode attention in one CUDA kernel: each query reads its row's keys and values straight
from the pool through the block table, with no gathered view.

The portable path (:class:`models.paged.PagedAttention`) gathers every layer's keys and values
into a transient [B, Hkv, M * bt, D] view and runs ``mx.fast.scaled_dot_product_attention`` over
it: two gathers, their reshapes and a mask per layer, and the gathers move the whole view through
memory once more. This kernel replaces the gathers and the attention of a decode step (one new
token per row) on MLX's CUDA back-end. There is no Metal kernel: nothing here could test one.

The kernel is single-pass attention with an online softmax (Milakov and Gimelshein 2018, "Online
normalizer calculation for softmax"; as FlashAttention, Dao et al. 2022, and vLLM's paged
attention, Kwon et al. 2023, use it): one thread block per (row, query head), its warps taking
tiles of 32 positions in turn, each lane one position's score, then the warp's weighted values
accumulated in float32, the warps' partial results merged at the end.

A view longer than 1,024 positions is split (:func:`partitions`): one thread block per (row,
query head, partition of 512 positions or more), so a long row's positions are read by many
blocks at once instead of one per query head, and the partitions' results are merged by their
softmax sums in a second kernel (Flash-Decoding's split of the keys, Dao et al. 2023; vLLM's
paged attention v2 and its reduce kernel). Shorter views keep the single pass, which writes the
output itself with no second kernel (the threshold was measured: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import mlx.core as mx

#: Whether decode steps over a paged pool use :func:`decode_attention` where it applies
#: (:func:`applies`); set from the ``paged_attention_kernel`` setting at start-up.
_enabled = True
#: Positions per partition of a row (vLLM's paged attention v2 ``PARTITION_SIZE``), the most
#: partitions a step uses (bounding the float32 partials: [B * Hq, 32, D] per layer), and the
#: longest view read in a single pass (measured: docs/BENCHMARKS.md).
_PARTITION, _MAX_PARTITIONS, _SINGLE_PASS_VIEW = 512, 32, 1024

#: The kernel's body; STEPSERVE_SPLIT (defined before it by :func:`_kernel`) picks what it reads
#: and writes: a partition of P positions of the row (a template constant: 512 for the ladder's
#: views from 1,536 to 16,384, one build for those), its normalized output and its (largest score,
#: softmax sum) for :func:`reduce_partitions`; or all the row's positions and the attention
#: output itself, with no constant that depends on the view (one build for every bucket).
_SOURCE = """
    constexpr int G = HQ / HKV;
    constexpr int THREADS = NW * 32;
    constexpr int DL = D / 32;           // output dims per lane
    constexpr int VEC = 16 / sizeof(T);  // elements per 16-byte load
    const float NEG = -__int_as_float(0x7f800000);
    const int row = blockIdx.y;          // b * HQ + h
    const int b = row / HQ, kvh = (row % HQ) / G;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = pos[b] + 1;            // positions 0..pos[b] are written
    const int lo = W > 0 ? max(0, n - W) : 0;
    const int* trow = table + b * cols[0];  // the table's columns: an input, so one build serves every bucket
#if STEPSERVE_SPLIT
    const int part = blockIdx.z, parts = gridDim.z;  // this block's partition of the row's positions (P each)
    const int first = max(lo, part * P), last = min(n, (part + 1) * P);  // [first, last) of the row here
    float* orow = o + ((long long)row * parts + part) * D;
    float* mlrow = ml + ((long long)row * parts + part) * 2;
    if (first >= last) {                 // none of this row's positions: a partial that weighs nothing
        for (int d = threadIdx.x; d < D; d += THREADS) orow[d] = 0.f;
        if (threadIdx.x == 0) {
            mlrow[0] = NEG;
            mlrow[1] = 0.f;
        }
        return;
    }
#else
    const int first = lo, last = n;      // the row's positions, all in this block
#endif

    __shared__ float qs[D];
    __shared__ float ms[NW];
    __shared__ float ls[NW];
    __shared__ float accs[NW][D];
    for (int d = threadIdx.x; d < D; d += THREADS) {
        qs[d] = static_cast<float>(q[row * D + d]) * scale[0];
    }
    __syncthreads();
    const bool aligned = (reinterpret_cast<unsigned long long>(kp) % 16) == 0 && (D * sizeof(T)) % 16 == 0;

    float m = NEG, l = 0.f;
    float acc[DL];
    #pragma unroll
    for (int i = 0; i < DL; ++i) acc[i] = 0.f;

    for (int start = first + warp * 32; start < last; start += THREADS) {
        const int p = start + lane;
        float s = NEG;
        long long base = 0;
        if (p < last) {
            base = ((long long)(trow[p / BT] * HKV + kvh) * BT + p % BT) * D;
            const T* kr = kp + base;
            float dot = 0.f;
            if (aligned) {
                const uint4* k4 = reinterpret_cast<const uint4*>(kr);
                #pragma unroll
                for (int c = 0; c < D / VEC; ++c) {
                    uint4 raw = k4[c];
                    const T* e = reinterpret_cast<const T*>(&raw);
                    #pragma unroll
                    for (int i = 0; i < VEC; ++i) dot += qs[c * VEC + i] * static_cast<float>(e[i]);
                }
            } else {
                for (int d = 0; d < D; ++d) dot += qs[d] * static_cast<float>(kr[d]);
            }
            s = dot;
        }
        float tmax = s;
        #pragma unroll
        for (int off = 16; off > 0; off /= 2) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffff, tmax, off));
        const float mnew = fmaxf(m, tmax);
        const float corr = expf(m - mnew);
        const float pj = p < last ? expf(s - mnew) : 0.f;
        float psum = pj;
        #pragma unroll
        for (int off = 16; off > 0; off /= 2) psum += __shfl_xor_sync(0xffffffff, psum, off);
        l = l * corr + psum;
        #pragma unroll
        for (int i = 0; i < DL; ++i) acc[i] *= corr;
        const int valid = min(32, last - start);
        #pragma unroll 4
        for (int j = 0; j < valid; ++j) {
            const float w = __shfl_sync(0xffffffff, pj, j);
            const long long vb = __shfl_sync(0xffffffff, base, j);
            const T* vr = vp + vb + lane * DL;
            #pragma unroll
            for (int i = 0; i < DL; ++i) acc[i] += w * static_cast<float>(vr[i]);
        }
        m = mnew;
    }

    if (lane == 0) {
        ms[warp] = m;
        ls[warp] = l;
    }
    #pragma unroll
    for (int i = 0; i < DL; ++i) accs[warp][lane * DL + i] = acc[i];
    __syncthreads();
    float mmax = NEG;
    for (int w = 0; w < NW; ++w) mmax = fmaxf(mmax, ms[w]);
    float total = 0.f;
    for (int w = 0; w < NW; ++w) total += ls[w] * expf(ms[w] - mmax);  // a warp with no position adds 0
    for (int d = threadIdx.x; d < D; d += THREADS) {
        float o_d = 0.f;
        for (int w = 0; w < NW; ++w) o_d += accs[w][d] * expf(ms[w] - mmax);
#if STEPSERVE_SPLIT
        orow[d] = o_d / total;
#else
        out[row * D + d] = static_cast<T>(o_d / total);
#endif
    }
#if STEPSERVE_SPLIT
    if (threadIdx.x == 0) {
        mlrow[0] = mmax;
        mlrow[1] = total;
    }
#endif
"""


#: The partitions' merge, one thread block per (row, query head) and one thread per output
#: dimension (vLLM's paged attention v2 ``reduce`` kernel does the same): one launch per layer,
#: where the same arithmetic in MLX operations took several.
_REDUCE_SOURCE = """
    const int row = blockIdx.y, d = threadIdx.x;
    constexpr int parts = S;
    const float* mlrow = ml + (long long)row * parts * 2;
    float top = -__int_as_float(0x7f800000);
    for (int s = 0; s < parts; ++s) top = fmaxf(top, mlrow[2 * s]);
    float num = 0.f, den = 0.f;
    for (int s = 0; s < parts; ++s) {
        const float w = mlrow[2 * s + 1] * expf(mlrow[2 * s] - top);  // an empty partition: 0 * exp(-inf) = 0
        num += o[((long long)row * parts + s) * D + d] * w;
        den += w;
    }
    out[(long long)row * D + d] = static_cast<T>(num / den);
"""


@functools.cache
def _reduce_kernel() -> Callable[..., list[mx.array]]:
    """The compiled-on-first-use merge kernel (raises RuntimeError without MLX's CUDA back-end)."""
    return cast(
        Callable[..., list[mx.array]],
        mx.fast.cuda_kernel(
            name="stepserve_paged_decode_reduce",
            input_names=["o", "ml"],
            output_names=["out"],
            source=_REDUCE_SOURCE,
        ),
    )


def reduce_partitions(o: mx.array, ml: mx.array, dtype: mx.Dtype) -> mx.array:
    """Attention over a row's positions from its partitions' results, in one CUDA kernel
    (Flash-Decoding's reduction, Dao et al. 2023; vLLM's paged attention v2 ``reduce`` kernel).

    Args:
        o: float32 [R, S, D]: each partition's attention output over its own positions, already
            normalized by its softmax sum (zeros for a partition with no positions).
        ml: float32 [R, S, 2]: each partition's largest score ``m`` and its softmax sum
            ``l = sum exp(score - m)`` (``-inf`` and 0 for an empty partition).
        dtype: the output's dtype (the queries').

    Returns:
        [R, D] in ``dtype``: sum_s o_s * l_s * exp(m_s - M) / sum_s l_s * exp(m_s - M), M =
        max_s m_s: the softmax over all the partitions' positions at once. Every row needs one
        partition with a position (else the division is 0 / 0).

    Raises:
        RuntimeError: without MLX's CUDA back-end.
    """
    R, S, D = o.shape
    (out,) = _reduce_kernel()(
        inputs=[o, ml],
        template=[("T", dtype), ("D", D), ("S", S)],
        grid=(D, R, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(R, D)],
        output_dtypes=[dtype],
    )
    return out


@functools.cache
def _kernel(split: bool) -> Callable[..., list[mx.array]]:
    """The compiled-on-first-use kernel, writing partitions' results (``split``) or the output
    (MLX JIT-compiles it per template; raises RuntimeError without MLX's CUDA back-end)."""
    return cast(
        Callable[..., list[mx.array]],
        mx.fast.cuda_kernel(
            name="stepserve_paged_decode_split" if split else "stepserve_paged_decode",
            input_names=["q", "kp", "vp", "table", "cols", "pos", "scale"],
            output_names=["o", "ml"] if split else ["out"],
            source=f"#define STEPSERVE_SPLIT {int(split)}\n{_SOURCE}",
        ),
    )


def enable(on: bool) -> None:
    """Use the kernel where it applies (True, the default) or always the portable gather path
    (False): the ``paged_attention_kernel`` setting. Steps traced afterwards follow it."""
    global _enabled
    _enabled = on


def available() -> bool:
    """Whether this process can run the kernel: MLX's CUDA back-end, the GPU the default
    device, and :func:`enable` not turned it off."""
    return _enabled and mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()


def applies(q: mx.array, pool: mx.array) -> bool:
    """Whether :func:`decode_attention` serves queries ``q`` [B, Hq, L, D] over a layer's pool
    ``pool`` [N, Hkv, bt, D] here: :func:`available`, one query per row (decode), a float pool
    (not ``kv_bits``), D a multiple of 32 up to 256, and Hq a multiple of Hkv."""
    return (
        available()
        and q.shape[2] == 1
        and pool.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and q.shape[3] == pool.shape[3]
        and pool.shape[3] % 32 == 0
        and pool.shape[3] <= 256
        and q.shape[1] % pool.shape[1] == 0
    )


def decode_attention(
    q: mx.array,
    keys: mx.array,
    values: mx.array,
    block_table: mx.array,
    positions: mx.array,
    scale: float,
    window: int | None = None,
) -> mx.array:
    """One decode step's attention over a paged pool, read through the block table.

    Args:
        q: [B, Hq, 1, D] queries (float16, bfloat16 or float32: the pool's dtype).
        keys, values: a layer's pools [N, Hkv, bt, D], the step's new keys and values already
            written (:func:`models.paged.write_at`).
        block_table: int32 [B, M]: row b's position p is at offset p % bt of block
            ``block_table[b, p // bt]`` (:mod:`models.paged`'s layout).
        positions: int32 [B], each row's new token's position: its query sees positions
            0..positions[b] (full attention) or the last ``window`` of them (sliding).
        scale: the attention scale (multiplies q . k).
        window: the layer's sliding window in positions, or None.

    Returns:
        [B, Hq, 1, D] in q's dtype: softmax(scale * q . k) . v over the seen positions, as
        ``mx.fast.scaled_dot_product_attention`` over :func:`models.paged.gather`'s view with
        :func:`models.attention.cache_layout`'s mask (accumulated in float32).

    Raises:
        RuntimeError: without MLX's CUDA back-end (check :func:`applies` first).
    """
    B, Hq, _, D = q.shape
    _, Hkv, bt, _ = keys.shape
    M = block_table.shape[1]
    parts, per_part = partitions(M * bt)
    split = parts > 1
    warps = 8 if B * Hq * parts < 64 else 4
    outputs = _kernel(split)(
        inputs=[
            q.reshape(B * Hq, D).astype(keys.dtype),
            keys,
            values,
            block_table.astype(mx.int32),
            mx.array([M], mx.int32),
            positions.astype(mx.int32),
            mx.array([scale], mx.float32),
        ],
        template=[
            ("T", keys.dtype),
            ("D", D),
            ("BT", bt),
            ("HQ", Hq),
            ("HKV", Hkv),
            ("W", window or 0),
            ("NW", warps),
            *([("P", per_part)] if split else []),
        ],
        grid=(warps * 32, B * Hq, parts),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(B * Hq, parts, D), (B * Hq, parts, 2)] if split else [(B * Hq, D)],
        output_dtypes=[mx.float32, mx.float32] if split else [keys.dtype],
    )
    out = reduce_partitions(outputs[0], outputs[1], q.dtype) if split else outputs[0]
    return out.reshape(B, Hq, 1, D).astype(q.dtype)


def partitions(view: int) -> tuple[int, int]:
    """(partitions, positions per partition) for a decode step's ``view`` positions (the block
    table's width times the block size): one partition, the whole view in a single pass, up to
    1,024 positions; beyond that, partitions of 512 positions (vLLM's paged attention v2
    partition size, as Flash-Decoding, Dao et al. 2023, splits the keys), at most 32 of them
    (longer views get longer partitions, in whole tiles of 32). A row's partitions past its
    length return at once, so short rows beside a long one cost little more than alone."""
    if view <= _SINGLE_PASS_VIEW:
        return 1, -(-view // 32) * 32
    parts = min(_MAX_PARTITIONS, -(-view // _PARTITION))
    per_part = -(-view // parts)
    return parts, -(-per_part // 32) * 32
