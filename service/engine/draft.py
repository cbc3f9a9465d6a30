"""A draft model's proposals for speculative decoding: a smaller model with the target's
tokenizer runs a few decode steps ahead of each row, in a KV cache of its own whose slots mirror
the target's (same batch and capacity buckets, same slot per request).

Each row's draft cache holds valid keys and values for its first ``done`` positions. A proposal
feeds the row's tokens from ``done`` to its newest (its *backlog*: one token after a partial
acceptance, two after a full one), then its own proposals, one decode step per token, all rows
of the batch together; the target's verify step rejects proposals, and the draft forgets them by
position arithmetic (``done`` stops before them). A row whose backlog is longer (it just joined,
or ran without speculation) is recomputed first: the draft prefills its whole text so far in
chunks on a staging cache, with the target's chunk and staging buckets, and the row is copied
into its slot.
"""

from __future__ import annotations

import mlx.core as mx

from models import speculative
from models.kv_cache import KVCache
from models.loader import LoadedModel
from service.engine.buckets import BucketTable
from service.engine.compile_cache import CompileCache, StepSpec
from service.engine.executor import Executor
from service.engine.prefill import chunk_plan
from service.engine.sequence import Sequence

MAX_BACKLOG = 2  # tokens a row may lag the target by and still be fed by decode steps


class DraftProposer:
    """Draft-model proposals mirroring the target's decode slots.

    Args:
        model: the draft model (same vocabulary as the target).
        buckets: the target's bucket table (the draft compiles the same shapes).
        cache: the target's compile cache (keys carry the draft's model name).
        chunk_tokens: prompt tokens per prefill chunk (the target's).
    """

    method = "draft"

    def __init__(self, model: LoadedModel, buckets: BucketTable, cache: CompileCache, chunk_tokens: int):
        self.executor = Executor(model, cache)  # the draft's own steps (keys carry its model name)
        self.executor.register("draft_pick", StepSpec(speculative.draft_pick))
        self.buckets, self.chunk_tokens = buckets, chunk_tokens
        self.kv: KVCache | None = None
        self.slot: dict[str, int] = {}  # request id -> its row in self.kv
        self.done: dict[str, int] = {}  # request id -> positions of valid keys and values

    def mirror(self, rows: list[Sequence | None], batch: int, capacity: int) -> None:
        """Lay the draft cache out as the target's: ``rows[s]`` in slot s, (batch, capacity)
        buckets. Rows that moved are copied (one gather per layer); new rows start empty."""
        where = [self.slot.get(s.request_id, -1) if s is not None else -1 for s in rows]
        kv = self.kv
        same = kv is not None and (kv.batch, kv.capacity) == (batch, capacity)
        if same and all(w in (s, -1) for s, w in enumerate(where)):
            self._keep(rows)
            return
        if kv is None or all(w < 0 for w in where):
            self.kv = self.executor.new_kv(batch, capacity)
        else:
            self.kv = kv.reordered([max(w, 0) for w in where]).resized(capacity)
        self._keep(rows, tuple(s for s, w in zip(rows, where, strict=True) if s is not None and w < 0))

    def _keep(self, rows: list[Sequence | None], fresh: tuple[Sequence, ...] = ()) -> None:
        done = {s.request_id: self.done.get(s.request_id, 0) for s in rows if s is not None}
        for s in fresh:
            done[s.request_id] = 0
        self.done = done
        self.slot = {s.request_id: i for i, s in enumerate(rows) if s is not None}

    def catch_up(self, seq: Sequence) -> None:
        """Recompute the draft's keys and values of ``seq``'s tokens before its newest (prompt
        and output) when its backlog is too long for decode steps, on a staging cache in the
        target's chunk buckets, and copy them into its slot."""
        tokens = (seq.prompt_ids + seq.output_ids)[: seq.position]
        if seq.position + 1 - self.done[seq.request_id] <= MAX_BACKLOG or not tokens:
            return
        r, kv, buckets = self.executor, self.kv, self.buckets
        assert kv is not None
        staging = r.new_kv(1, buckets.staging_for(len(tokens)))
        for offset, n, T in chunk_plan(buckets, self.chunk_tokens, len(tokens), 0):
            if staging.capacity < offset + T:
                staging = staging.resized(buckets.staging_for(offset + T))
            chunk = mx.array([tokens[offset : offset + n] + [0] * (T - n)], mx.int32)
            fn = r.step_fn("chunk", 1, T, staging.capacity)
            _, staging = fn(r.model.params, chunk, mx.array([offset], mx.int32), mx.array([n], mx.int32), staging)
        slot, m = self.slot[seq.request_id], min(staging.capacity, kv.capacity)
        for layer in range(len(kv.keys)):
            kv.keys[layer][slot : slot + 1, :, :m] = staging.keys[layer][:, :, :m]
            kv.values[layer][slot : slot + 1, :, :m] = staging.values[layer][:, :, :m]
        self.done[seq.request_id] = len(tokens)

    def propose(
        self, rows: list[Sequence | None], K: int, noise: mx.array, sampling: tuple[mx.array, ...], greedy: bool
    ) -> tuple[mx.array, mx.array | None, list[int]]:
        """K proposals per row, all lazy (the verify step takes them on the device).

        Args:
            rows: the batch's slots (the draft cache is mirrored to them).
            K: proposals per row.
            noise: uint32 [B, K + 1, 2], each row's noise key per output position.
            sampling: (temperature, top_p, top_k, min_p), each [B], the rows' parameters.
            greedy: every row is greedy (argmax proposals; no distributions).

        Returns:
            (proposals int32 [B, K], their draft distributions float32 [B, K, V] (None when
            ``greedy``), and per row the
            number of proposals fed back into the draft cache, for :meth:`accepted`).
        """
        r, kv = self.executor, self.kv
        assert kv is not None
        backlog = [self._backlog(s) for s in rows]
        steps = max(len(b) for b in backlog) + K - 1
        done = [self.done.get(s.request_id, 0) if s else 0 for s in rows]
        outputs, dists, previous = [], [], None
        pick = r.step_fn("greedy") if greedy else r.step_fn("draft_pick", kv.batch)
        decode = r.step_fn("decode", kv.batch, kv.capacity)
        for step in range(steps):
            known = mx.array([b[step] if step < len(b) else 0 for b in backlog], mx.int32)
            fed = mx.array([step < len(b) for b in backlog])
            tokens = known if previous is None else mx.where(fed, known, previous)
            positions = mx.array([d + step for d in done], mx.int32)
            logits, kv = decode(r.model.params, tokens, positions, kv)
            j = mx.array([min(max(step + 1 - len(b), 0), K) for b in backlog], mx.int32)
            step_noise = mx.take_along_axis(noise, j[:, None, None], axis=1)[:, 0]
            if greedy:
                previous = pick(logits)
            else:
                previous, q = pick(logits, *sampling, step_noise)
                dists.append(q)
            outputs.append(previous)
        self.kv = kv
        first = mx.array([len(b) - 1 for b in backlog], mx.int32)[:, None] + mx.arange(K)[None, :]  # [B, K]
        proposals = mx.take_along_axis(mx.stack(outputs, axis=1), first, axis=1)
        q_all = mx.take_along_axis(mx.stack(dists, axis=1), first[..., None], axis=1) if dists else None
        return proposals, q_all, [steps - len(b) for b in backlog]

    def accepted(self, seq: Sequence, position: int, accepted: int, fed: int) -> None:
        """``seq``'s verify step at ``position`` accepted ``accepted`` proposals, of which the
        draft had fed ``fed`` back into its cache: those stay valid, the rest are forgotten."""
        self.done[seq.request_id] = position + 1 + min(accepted, fed)

    def _backlog(self, seq: Sequence | None) -> list[int]:
        """The tokens from the row's ``done`` position to its newest (empty rows: a dummy)."""
        if seq is None:
            return [0]
        start = self.done.get(seq.request_id, 0)
        text = seq.prompt_ids + seq.output_ids
        return text[start : seq.position + 1] or [seq.last_token]


def warm(proposer: DraftProposer, phase: str, batch: int, size: int, capacity: int = 0) -> None:
    """Compile and run one of the draft's buckets on dummy inputs."""
    r = proposer.executor
    if phase != "draft_pick":
        r.warm(phase, batch, size, capacity)
        return
    ones, V = mx.ones((batch,), mx.float32), r.vocab
    args = (mx.zeros((batch, V)), ones, ones, mx.full((batch,), V, mx.int32), ones * 0, mx.zeros((batch, 2), mx.uint32))
    mx.eval(r.step_fn(phase, batch)(*args))
