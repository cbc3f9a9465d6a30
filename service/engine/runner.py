"""The model runner: executes compiled prefill/decode/sample steps at bucketed shapes and
owns the running batch's KV cache. Called only from the engine thread."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import mlx.core as mx

from models import llama, sampling
from models.kv_cache import KVCache
from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache, StepKey, StepSpec
from service.engine.sequence import Sequence


class ModelRunner:
    """Compiled steps for one model plus the decode batch's KV cache.

    The cache has ``batch`` slots (a batch bucket) and ``capacity`` positions (a capacity
    bucket). Slot ``s`` holds the sequence with ``seq.slot == s``; free slots hold garbage
    that masking keeps away from real rows.
    """

    def __init__(self, model: LoadedModel, buckets: BucketTable, cache: CompileCache):
        self.model, self.buckets, self.compiled = model, buckets, cache
        a = model.args
        self._dtype_name = str(model.dtype).rsplit(".", 1)[-1]
        self._specs = {
            "prefill": StepSpec(partial(llama.prefill, args=a)),
            "decode": StepSpec(partial(llama.decode, args=a)),
            "sample": StepSpec(sampling.sample, random_state=True),
            "greedy": StepSpec(sampling.greedy, shapeless=True),
        }
        self.kv: KVCache | None = None
        self.vocab = a.vocab_size

    # -- compiled functions --------------------------------------------------------------

    def step_fn(self, phase: str, batch: int = 0, size: int = 0) -> Callable:
        """The compiled function of ``phase`` at bucket (batch, size); counts a hit or miss."""
        key = StepKey(self.model.name, phase, batch, size, self._dtype_name)
        return self.compiled.get(key, self._specs[phase])

    def new_kv(self, batch: int, capacity: int) -> KVCache:
        """A zeroed KV cache [batch, Hkv, capacity, D] per layer in the compute dtype."""
        a = self.model.args
        return KVCache.allocate(
            a.num_hidden_layers, batch, a.num_key_value_heads, capacity, a.dim_per_head, self.model.dtype
        )

    # -- sampling ------------------------------------------------------------------------

    def select(
        self, logits: mx.array, rows: list[Sequence | None], keys: list[mx.array | None]
    ) -> tuple[mx.array, list[mx.array | None]]:
        """Pick one token per row of ``logits`` [B, V] with each row's parameters.

        ``keys[i]`` is row i's PRNG key (uint32 [2]) or None (unseeded or empty row).
        Returns (tokens int32 [B], the rows' next keys), both lazy: the caller evaluates them
        (the engine with ``mx.async_eval``), so keys never chain unevaluated for long. An
        all-greedy batch uses the
        shapeless greedy step; otherwise the sampler of batch bucket B.
        """
        B = logits.shape[0]
        live = [s for s in rows if s is not None]
        if all(s.params.temperature == 0 for s in live):
            return self.step_fn("greedy")(logits), keys
        zero_key = mx.zeros((2,), mx.uint32)
        temperature = mx.array([s.params.temperature if s else 0.0 for s in rows], mx.float32)
        top_p = mx.array([s.params.top_p if s else 1.0 for s in rows], mx.float32)
        top_k = mx.array([min(s.params.top_k or self.vocab, self.vocab) if s else self.vocab for s in rows], mx.int32)
        seeded = mx.array([k is not None for k in keys])
        key_rows = mx.stack([k if k is not None else zero_key for k in keys])
        tokens, next_keys = self.step_fn("sample", B)(logits, temperature, top_p, top_k, key_rows, seeded)
        return tokens, [next_keys[i] if k is not None else None for i, k in enumerate(keys)]

    # -- prefill -------------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]]) -> tuple[mx.array, KVCache]:
        """Prefill prompts together at bucket (batch_for(n), prompt_for(longest)).

        Returns (logits float32 [B, V] at each prompt's last token, the prompts' KV cache
        [B, Hkv, T, D] per layer); rows >= n are padding.
        Raises BucketLimitError when the prompts do not fit a bucket.
        """
        n = len(prompts)
        B = self.buckets.batch_for(n)
        T = self.buckets.prompt_for(max(len(p) for p in prompts))
        rows = [p + [0] * (T - len(p)) for p in prompts] + [[0] * T] * (B - n)
        lengths = [len(p) for p in prompts] + [1] * (B - n)
        tokens = mx.array(rows, mx.int32)
        logits, kv = self.step_fn("prefill", B, T)(
            self.model.params, tokens, mx.array(lengths, mx.int32), self.new_kv(B, T)
        )
        return logits, kv

    # -- the decode batch ----------------------------------------------------------------

    def fit(self, live: Iterable[Sequence], joining: Iterable[Sequence] = ()) -> list[str]:
        """Re-bucket the decode cache for the ``live`` sequences plus ``joining`` arrivals.

        Moves live rows into slots 0..n-1 when the batch bucket shrinks and resizes the
        capacity to the smallest bucket holding every row's next position (arrivals
        included). Each change is one copy of the cache. Returns the moves made: "batch"
        and/or "capacity".
        """
        live, joining = sorted(live, key=lambda s: s.slot), list(joining)
        B = self.buckets.batch_for(max(len(live) + len(joining), 1))
        C = self.buckets.capacity_for(max((s.position + 1 for s in live + joining), default=1))
        if self.kv is None:
            self.kv = self.new_kv(B, C)
            return []
        kv, moves = self.kv, []
        if B < kv.batch or any(s.slot >= B for s in live):
            order = mx.array([s.slot for s in live] or [0], mx.int32)
            kv = KVCache([k[order] for k in kv.keys], [v[order] for v in kv.values])
            for i, s in enumerate(live):
                s.slot = i
        if kv.capacity != C:
            kv, moves = kv.resized(C), ["capacity"]
        if kv.batch != B:
            kv = _resize_batch(kv, B)
        if B != self.kv.batch:
            moves.append("batch")
        self.kv = kv
        return moves

    def insert(self, seq: Sequence, slot: int, prompt_kv: KVCache, row: int) -> None:
        """Copy row ``row`` of a prefill cache into decode slot ``slot``.

        Raises:
            ValueError: the slot's capacity cannot hold the sequence (call :meth:`fit` first).
        """
        kv = self.kv
        if seq.position >= kv.capacity:
            raise ValueError(f"sequence at position {seq.position} does not fit capacity {kv.capacity}")
        src = prompt_kv.resized(kv.capacity)
        for layer in range(len(kv.keys)):
            kv.keys[layer][slot] = src.keys[layer][row]
            kv.values[layer][slot] = src.values[layer][row]
        seq.slot = slot

    def decode(self, slots: list[Sequence | None], tokens: mx.array | None = None) -> mx.array:
        """One decode step over all slots; returns logits float32 [B, V] (lazy).

        ``tokens``: int32 [B], each slot's input token, possibly still lazy (the previous
        step's output); default: each sequence's ``last_token``. Each row's token is
        written at ``seq.position``.

        Raises:
            ValueError: a position is beyond the cache's capacity (call :meth:`fit` first).
        """
        kv = self.kv
        positions_list = [s.position if s else 0 for s in slots]
        if max(positions_list) >= kv.capacity:  # a scatter past the buffer would corrupt memory
            raise ValueError(f"position {max(positions_list)} is beyond the KV capacity {kv.capacity}")
        if tokens is None:
            tokens = mx.array([s.last_token if s else 0 for s in slots], mx.int32)
        positions = mx.array(positions_list, mx.int32)
        fn = self.step_fn("decode", kv.batch, kv.capacity)
        logits, self.kv = fn(self.model.params, tokens, positions, kv)
        return logits

    def reset(self) -> None:
        """Drop the decode cache (no sequences left)."""
        self.kv = None

    # -- warm-up -------------------------------------------------------------------------

    def warmup_plan(
        self, prompt_tokens: int, max_rows: int = 1, max_admit: int = 1, batched_positions: int | None = None
    ) -> list[tuple[str, int, int]]:
        """(phase, batch, size) of the buckets to warm up (see BucketTable.warmup_shapes),
        plus the sampler of each batch bucket and the shapeless greedy step."""
        prefill, decode = self.buckets.warmup_shapes(
            prompt_tokens, max_rows, min(max_rows, max_admit), batched_positions
        )
        if not prefill:
            return []
        plan = [("prefill", b, t) for b, t in prefill] + [("decode", b, c) for b, c in decode]
        plan += [("sample", b, 0) for b in sorted({b for b, _ in prefill + decode})] + [("greedy", 0, 0)]
        return plan

    def warm(self, phase: str, batch: int, size: int, repeats: int = 3) -> bool:
        """Compile and run one bucket's step on dummy inputs. Under the ``auto`` policy, time
        it compiled and eager (``repeats`` runs each) and keep the faster. Returns whether
        the bucket runs compiled."""
        fn = self.step_fn(phase, batch, size)
        if phase == "prefill":
            args = (
                self.model.params,
                mx.zeros((batch, size), mx.int32),
                mx.ones((batch,), mx.int32),
                self.new_kv(batch, size),
            )
        elif phase == "decode":
            args = (
                self.model.params,
                mx.zeros((batch,), mx.int32),
                mx.zeros((batch,), mx.int32),
                self.new_kv(batch, size),
            )
        elif phase == "greedy":
            args = (mx.zeros((1, self.vocab), mx.float32),)
        else:
            ones = mx.ones((batch,), mx.float32)
            args = (
                mx.zeros((batch, self.vocab), mx.float32),
                ones,
                ones,
                mx.full((batch,), self.vocab, mx.int32),
                mx.zeros((batch, 2), mx.uint32),
                mx.zeros((batch,), mx.bool_),
            )
        if self.compiled.policy == "auto":
            return fn.calibrate(args, repeats)
        mx.eval(fn(*args))
        return fn.compiled


def _resize_batch(kv: KVCache, batch: int) -> KVCache:
    """Pad (with empty slots) or cut the batch axis to ``batch`` rows."""
    if batch < kv.batch:
        return KVCache([k[:batch] for k in kv.keys], [v[:batch] for v in kv.values])
    pad = [(0, batch - kv.batch), (0, 0), (0, 0), (0, 0)]
    return KVCache([mx.pad(k, pad) for k in kv.keys], [mx.pad(v, pad) for v in kv.values])
