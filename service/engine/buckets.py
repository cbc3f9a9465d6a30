"""Bucket lookup: pad a batch size, prompt length or KV length up to the smallest bucket."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


class BucketLimitError(ValueError):
    """A shape beyond the largest bucket; ``limit`` is that bucket, ``what`` names the axis."""

    def __init__(self, what: str, size: int, limit: int):
        super().__init__(f"{what} {size} exceeds the largest {what} bucket ({limit})")
        self.what, self.size, self.limit = what, size, limit


@dataclass(frozen=True)
class BucketTable:
    """Ascending bucket lists for the three compiled dimensions.

    Attributes:
        batch: batch-size buckets (rows of a step).
        prompt: prompt-length buckets (tokens of a prefill).
        capacity: KV-cache capacity buckets (positions per row).
    """

    batch: tuple[int, ...]
    prompt: tuple[int, ...]
    capacity: tuple[int, ...]

    @staticmethod
    def _fit(buckets: tuple[int, ...], size: int, what: str) -> int:
        i = bisect.bisect_left(buckets, size)
        if i == len(buckets):
            raise BucketLimitError(what, size, buckets[-1])
        return buckets[i]

    def batch_for(self, rows: int) -> int:
        """Smallest batch bucket >= rows. Raises BucketLimitError."""
        return self._fit(self.batch, rows, "batch size")

    def prompt_for(self, tokens: int) -> int:
        """Smallest prompt bucket >= tokens. Raises BucketLimitError."""
        return self._fit(self.prompt, tokens, "prompt length")

    def capacity_for(self, positions: int) -> int:
        """Smallest capacity bucket >= positions. Raises BucketLimitError."""
        return self._fit(self.capacity, positions, "KV capacity")

    def warmup_shapes(
        self, prompt_tokens: int, max_rows: int = 1, max_prefill_rows: int = 1, batched_positions: int | None = None
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (batch, prompt) prefill and (batch, capacity) decode shapes to warm up.

        Prefill: every prompt bucket up to ``prompt_tokens`` at the batch buckets of up to
        ``max_prefill_rows`` prompts. Decode: batch 1 at every capacity bucket (one request
        can grow into any of them), and the batch buckets of up to ``max_rows`` concurrent
        requests at the capacities holding ``batched_positions`` positions (all if None).
        """
        if prompt_tokens <= 0:
            return [], []
        top_prompt = self.prompt_for(min(prompt_tokens, self.prompt[-1]))
        prompts = [t for t in self.prompt if t <= top_prompt]
        prefill_batches = [b for b in self.batch if b <= self.batch_for(max(1, min(max_prefill_rows, max_rows)))]
        decode_batches = [b for b in self.batch if b <= self.batch_for(max_rows)]
        top_capacity = (
            self.capacity[-1]
            if batched_positions is None
            else self.capacity_for(min(batched_positions, self.capacity[-1]))
        )
        prefill = [(b, t) for b in prefill_batches for t in prompts]
        decode = [(b, c) for b in decode_batches for c in self.capacity if b == 1 or c <= top_capacity]
        return prefill, decode
