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

    def chunk_tokens(self, requested: int) -> int:
        """Prompt tokens one chunked-prefill step takes at most: ``requested`` (the
        ``prefill_chunk_tokens`` setting), but no more than the largest prompt bucket, since a
        chunk pads up to a prompt bucket."""
        return min(requested, self.prompt[-1])

    def prefill_rows(self, prompt_bucket: int, tokens: int) -> int:
        """The most prompts of one prompt bucket a whole prefill runs together: the largest
        batch bucket whose padded tokens stay within ``tokens`` (at least 1)."""
        fitting = [b for b in self.batch if b * prompt_bucket <= tokens]
        return fitting[-1] if fitting else 1

    def staging_for(self, positions: int) -> int:
        """The capacity of a prompt's staging cache for chunked prefill: the smallest capacity
        bucket >= positions that is a power of two or the largest (a coarser ladder than decode's,
        so fewer chunk steps to compile; a chunk's attention costs its whole capacity).
        Raises BucketLimitError."""
        ladder = [c for c in self.capacity if c & (c - 1) == 0 or c == self.capacity[-1]]
        return self._fit(tuple(ladder), positions, "KV capacity")


def unpadded_prompt_ladder(prompt: tuple[int, ...]) -> tuple[int, ...]:
    """The prompt buckets for a model whose prompt rows cannot be right-padded (recurrent layers
    that read every position of a row, :attr:`models.adapter.AdapterArgs.pads_prompts` False):
    ``prompt`` (ascending) with the powers of two below its smallest bucket added.

    Such a model's every chunk is exactly a prompt bucket long, and what is left below the
    smallest bucket ran one token per call (:func:`service.engine.prefill.chunk_plan`): a
    30-token prompt was 30 calls of the whole model before its first token. With 2, 4, 8 and 16
    below 32 it is 16 + 8 + 4 + 2, four calls: at most log2 of the smallest bucket, plus one
    token for an odd length."""
    smallest = prompt[0]
    below = (2**k for k in range(1, smallest.bit_length()) if 2**k < smallest)
    return tuple(sorted({*below, *prompt}))
