"""Generate from Python without HTTP (as vLLM's ``LLM`` and nano-vllm's ``LLM.generate``)::

    from service.offline import LLM

    llm = LLM()  # the default model, warmed up for this host
    for out in llm.generate(["The capital of France is"], max_tokens=16):
        print(out.text)

:class:`LLM` takes the settings of ``stepserve serve`` (:class:`service.config.Settings`, from
keyword arguments and ``STEPSERVE_*`` variables), loads the model and checks its memory as
``serve`` does, builds its engine with the same builder (:mod:`service.process.build`) and
starts the engine thread, which warms up before :class:`LLM` returns. :meth:`LLM.generate`
submits every prompt at once: the engine batches them (continuous batching) as it batches a
server's requests.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from models.loader import device_name
from service import __version__
from service.config import load_settings
from service.engine.core import Engine
from service.engine.scheduler import QueueFullError
from service.engine.sequence import FinalEvent, FinishReason, SamplingParams, Sequence
from service.metrics import Metrics
from service.process.build import build_engine, start_engine, warmup_spec
from service.process.startup import apply_memory_limit, check_memory, draft_name, load_models

READY_POLL_S = 0.1  # how often the constructor checks that the warming engine thread is alive


@dataclass(frozen=True)
class Completion:
    """One prompt's generation.

    Attributes:
        prompt: the prompt as given (text or token ids).
        text: the generated text (a stop string and what follows it cut off).
        token_ids: the generated token ids (a stop token included, as the engine counts them).
        finish_reason: ``"stop"`` (a stop token or string) or ``"length"`` (``max_tokens`` or
            the largest KV capacity bucket).
        prompt_tokens: tokens of the prompt.
        cached_tokens: prompt tokens served from the prefix cache.
    """

    prompt: str | list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int


class LLM:
    """A model served in this process, without HTTP.

    Args:
        model: a GGUF file or model directory (``serve``'s ``--model``); None: the default model.
        **settings: any other :class:`service.config.Settings` field (``compile="off"``,
            ``warmup_prompt_tokens=64``, ``prefix_cache_bytes=0``, ...), over the environment's
            ``STEPSERVE_*`` and ``$STEPSERVE_CONFIG``'s (:func:`service.config.load_settings`).
            With several ``models``, the first is served.

    Raises:
        service.config.ConfigError: a setting is invalid (the message says which and how to fix it).
        models.loader.ModelLoadError: the model cannot be loaded.
        service.process.startup.MemoryBudgetError: it does not fit the memory budget.
        RuntimeError: its warm-up failed (the message says why).
    """

    def __init__(self, model: str | Path | None = None, **settings: Any):
        if model is not None:
            settings["model"] = Path(model)
        config = load_settings(**settings)
        apply_memory_limit(config)
        models = load_models(config)
        self.settings = check_memory(config, models)
        served = self.settings.served_models()[0]
        metrics = Metrics(CollectorRegistry(), version=__version__, device=device_name())
        draft = models.get(draft_name(served.name))
        self.engine: Engine = build_engine(self.settings, served, models[served.name], metrics, draft)
        start_engine(self.engine, warmup_spec(self.settings, served, self.engine)[0])
        while not self.engine.ready.wait(READY_POLL_S):
            if not self.engine.alive:
                raise RuntimeError(f"model '{served.name}' is not ready: {self.engine.not_ready_reason}")

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        max_tokens: int | None = None,
        temperature: float = 0.0,
        **sampling: Any,
    ) -> list[Completion]:
        """Generate a completion of each prompt, all submitted at once; returns them in the
        prompts' order.

        Args:
            prompts: a text, texts, or lists of token ids (used as they are: no chat template).
            max_tokens: tokens to generate at most per prompt (default: ``default_max_tokens``).
            temperature: 0 is greedy.
            **sampling: any other :class:`service.engine.sequence.SamplingParams` field
                (``top_p``, ``top_k``, ``seed``, ``stop``, ``min_p``, the penalties, ...).

        Raises:
            ValueError: a prompt and ``max_tokens`` do not fit the largest KV capacity bucket.
            RuntimeError: the engine failed a request (the message says why) or stopped.
        """
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        params = SamplingParams(
            max_tokens=max_tokens or self.settings.default_max_tokens, temperature=temperature, **sampling
        )
        ids = [self._ids(p, params.max_tokens) for p in batch]
        finals: queue.SimpleQueue[tuple[int, FinalEvent]] = queue.SimpleQueue()
        seqs = [self._sequence(i, prompt, params, finals) for i, prompt in enumerate(ids)]
        done: dict[int, FinalEvent] = {}
        for seq in seqs:
            while True:
                try:
                    self.engine.submit(seq)
                    break
                except QueueFullError:  # more prompts than the waiting queue holds: wait for one to end
                    self._wait_one(finals, done)
        while len(done) < len(seqs):
            self._wait_one(finals, done)
        return [self._completion(batch[i], seq, done[i]) for i, seq in enumerate(seqs)]

    def close(self) -> None:
        """Stop the engine thread (a request still running ends as cancelled)."""
        self.engine.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ids(self, prompt: str | list[int], max_tokens: int) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.engine.model.tokenizer.encode(prompt)
        limit = self.engine.capacity_limit
        if not ids or len(ids) + max_tokens - 1 > limit:
            raise ValueError(
                f"a prompt of {len(ids)} tokens and max_tokens {max_tokens} do not fit: prompt + max_tokens - 1 "
                f"must be <= {limit} (the largest KV capacity bucket), and a prompt at least one token"
            )
        return ids

    def _sequence(
        self, i: int, ids: list[int], params: SamplingParams, finals: queue.SimpleQueue[tuple[int, FinalEvent]]
    ) -> Sequence:
        def emit(event: object) -> None:  # on the engine thread
            if isinstance(event, FinalEvent):
                finals.put((i, event))

        return Sequence(ids, params, self.engine.model.tokenizer.detokenizer(), emit)

    def _wait_one(self, finals: queue.SimpleQueue[tuple[int, FinalEvent]], done: dict[int, FinalEvent]) -> None:
        """Wait for the next request to end; raise RuntimeError if the engine thread is gone."""
        while True:
            try:
                i, final = finals.get(timeout=READY_POLL_S)
                break
            except queue.Empty:
                if not self.engine.alive:
                    raise RuntimeError(f"the engine stopped: {self.engine.failure or 'closed'}") from None
        if final.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED, FinishReason.TIMEOUT):
            raise RuntimeError(f"a request ended with {final.finish_reason.value}: {final.error}")
        done[i] = final

    @staticmethod
    def _completion(prompt: str | list[int], seq: Sequence, final: FinalEvent) -> Completion:
        return Completion(
            prompt, seq.text, list(seq.output_ids), final.finish_reason.value, final.prompt_tokens, final.cached_tokens
        )
