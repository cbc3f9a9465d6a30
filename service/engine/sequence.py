"""Requests as the engine sees them, and the events it sends back (no MLX, no asyncio)."""

from __future__ import annotations

import enum
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from models.tokenizer import Detokenizer


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS / stop token or a stop string
    LENGTH = "length"  # max_tokens or the largest KV capacity bucket
    CANCELLED = "cancelled"  # the client went away, or the server shut down
    TIMEOUT = "timeout"  # the per-request time limit passed
    ERROR = "error"  # the engine failed this request


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    Attributes:
        max_tokens: tokens to generate at most (>= 1).
        temperature: 0 = greedy.
        top_p: nucleus mass in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 = off.
        seed: PRNG seed; the same seed gives the same output. None = fresh randomness.
        stop: strings that end the generation (not included in the text).
        min_p: keep tokens at least this fraction as likely as the most likely one; 0 = off.
        presence_penalty / frequency_penalty: OpenAI's, in [-2, 2], over generated tokens.
        repetition_penalty: CTRL's (Hugging Face's ``repetition_penalty``) over prompt and
            generated tokens, > 0; 1 = off.
        logit_bias: (token id, bias added to its logit) pairs (OpenAI's ``logit_bias``).
        stop_token_ids: token ids that end the generation besides the model's own stop tokens.
        ignore_eos: do not stop at the model's stop tokens (``stop_token_ids`` still stop).
        logprobs: return this many most likely tokens' logprobs per token (0-20) besides the
            sampled token's own; None = no logprobs.
        grammar: a :class:`service.engine.grammar.Grammar` the output must follow, or None.
        echo_ids: prompt tokens to prepend to the text (``/v1/completions``' ``echo``); not
            used by the engine.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: Any = None

    @property
    def stateful(self) -> bool:
        """The row's logits processing depends on its previous token (a grammar, a penalty):
        its next step cannot be queued before that token is read back."""
        return (
            self.grammar is not None
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def processed(self) -> bool:
        """The row needs the logits processors (:func:`models.sampling.process`)."""
        return self.stateful or bool(self.logit_bias)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the most likely alternatives (ids, logprobs)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class TokenEvent:
    """New text of one request (may be '' while a UTF-8 character is incomplete)."""

    text: str
    token_id: int
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens this text covers, when logprobs were asked
    tokens: int = 0  # output tokens generated through this event (cumulative, stop token excluded)


@dataclass(frozen=True)
class FinalEvent:
    """A request's end: why, token counts and timings (seconds)."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    queue_s: float
    ttft_s: float | None
    decode_s: float
    total_s: float
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    stop_string: str | None = None  # the stop string that ended the text, if one did


Event = TokenEvent | FinalEvent
_ids = itertools.count()


@dataclass
class Sequence:
    """One request inside the engine.

    ``emit`` delivers events to the request's owner; it must be thread-safe (the engine
    calls it from its own thread). ``position`` is the number of tokens in the KV cache,
    i.e. the position where the newest token will be written by the next decode step.
    """

    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    emit: Callable[[Event], None]
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:16]}")
    arrival: float = field(default_factory=time.perf_counter)
    order: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    position: int = 0
    slot: int = -1
    num_computed: int = 0  # prompt tokens whose keys and values are computed (or came from the prefix cache)
    preemptions: int = 0  # times its KV blocks were taken back (paged KV); it then prefills its output again
    _prefill: list[int] | None = field(default=None, repr=False)  # prompt + output at the last preemption
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache
    staging: Any = None  # KVCache [1, Hkv, C, D] holding the prompt while it is prefilled in chunks (runner only)
    prefilled: Any = None  # (prompt KVCache, row) between prefill and joining a slot (runner only)
    started: float | None = None  # admitted to the engine (end of queueing)
    first_token_at: float | None = None
    last_token_at: float | None = None
    inter_token_s: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    deadline: float | None = None  # perf_counter() time after which the request times out
    warmup: bool = False  # a dummy request of the warm-up rehearsal: no metrics
    cancel_reason: FinishReason | None = None  # set by Engine.cancel (any thread); acted on at the next schedule
    stop_string: str | None = None  # the stop string that ended the text (the earliest in it), if one did
    matcher: Any = None  # the grammar's state (runner only): advanced by each token read back
    sampled_ids: list[int] = field(default_factory=list)  # generated tokens the runner has read back
    logprob_entries: list[TokenLogprob] = field(default_factory=list)  # read back, not emitted yet
    _sent: int = 0  # characters of ``text`` already emitted

    def __post_init__(self) -> None:
        if self.params.grammar is not None and self.matcher is None:
            self.matcher = self.params.grammar.matcher()

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens prefill computes keys and values for: the prompt, or after a preemption
        the prompt and every token generated before it (whose keys and values were dropped;
        the last one's is computed now for the first time)."""
        return self._prefill if self._prefill is not None else self.prompt_ids

    def preempt(self) -> None:
        """Its KV blocks were taken back: prefill starts over on :attr:`prefill_ids` (the prefix
        cache's blocks, if any, first) and the next token follows the ones already sent."""
        self._prefill = self.prompt_ids + self.output_ids
        self.preemptions += 1
        self.num_computed = self.position = 0
        self.prefilled = self.staging = None
        self.started = None

    @property
    def prompt_done(self) -> bool:
        """Every prompt token's keys and values are computed: the request decodes."""
        return self.num_computed >= len(self.prefill_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    def append(self, token_id: int, stop_ids: frozenset[int], capacity_limit: int) -> None:
        """Record a generated token, update text and timings, and decide whether to stop."""
        now = time.perf_counter()
        if self.first_token_at is None or self.last_token_at is None:
            self.first_token_at = now
        else:
            self.inter_token_s.append(now - self.last_token_at)
        self.last_token_at = now
        self.output_ids.append(token_id)
        p = self.params
        if (token_id in stop_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
            self.finish_reason = FinishReason.STOP
            if self.logprob_entries and self.logprob_entries[-1].token_id == token_id:
                self.logprob_entries.pop()  # the stop token is not part of the text
        else:
            self.text += self.detokenizer.step(token_id)
            self._check_stop_strings()
        # The new token would be written at prompt + outputs - 1: stop when that is past the
        # largest capacity. (``position`` may already be one step ahead: the engine queues the
        # next step before it reads this token back.)
        if self.finish_reason is None and (
            len(self.output_ids) >= self.params.max_tokens
            or len(self.prompt_ids) + len(self.output_ids) - 1 >= capacity_limit
        ):
            self.finish_reason = FinishReason.LENGTH
        self._emit_text(token_id)

    def _check_stop_strings(self) -> None:
        for stop in self.params.stop:
            # Only the tail can contain a stop string that is new since the last token.
            at = self.text.find(stop, max(0, self._sent - len(stop)))
            if at >= 0:
                self.text = self.text[:at]
                self.finish_reason, self.stop_string = FinishReason.STOP, stop

    def _emit_text(self, token_id: int) -> None:
        # Hold back a tail that could still grow into a stop string.
        hold = 0
        if self.finish_reason is None:
            for stop in self.params.stop:
                for n in range(min(len(stop) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(stop[:n]):
                        hold = max(hold, n)
                        break
        ready = len(self.text) - hold
        if ready > self._sent:
            piece = self.text[self._sent : ready]
            self.emit(TokenEvent(piece, token_id, tuple(self.logprob_entries), len(self.output_ids)))
            self.logprob_entries.clear()
            self._sent = ready

    def final_event(self, error: str | None = None) -> FinalEvent:
        """The closing event (timings from arrival, in seconds)."""
        now = time.perf_counter()
        started = self.started or now
        first = self.first_token_at
        return FinalEvent(
            finish_reason=self.finish_reason or FinishReason.ERROR,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            queue_s=started - self.arrival,
            ttft_s=None if first is None else first - self.arrival,
            decode_s=0.0 if first is None else (self.last_token_at or first) - first,
            total_s=now - self.arrival,
            error=error,
            cached_tokens=min(self.cached_tokens, len(self.prompt_ids)),  # a resumed prefill may hit its output too
            stop_string=self.stop_string,
        )
