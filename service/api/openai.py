"""OpenAI-compatible routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``,
streaming and not, in the JSON shapes of OpenAI's API (so its SDKs work unchanged).

``finish_reason`` is only ``stop`` or ``length``. A request ended early answers as an error in
OpenAI's shape (:mod:`service.api.errors`): 504 (``type`` ``timeout``) past
``request_timeout_s``, 503 (``unavailable``, "server shutting down") at shutdown, 500 when the
engine failed. A stream that had started ends instead with a ``data: {"error": {...}}`` event,
then ``data: [DONE]`` (as vLLM does). Extensions to OpenAI's API: ``top_k`` (as in vLLM).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from service.api import pipeline
from service.api.errors import ERRORS
from service.api.schemas import ChatCompletionRequest, CompletionRequest, OpenAISampling
from service.api.state import AppState, State
from service.engine.sequence import FinalEvent

router = APIRouter(prefix="/v1")


def _usage(final: FinalEvent) -> dict:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


class _OpenAIFormat:
    """What completions and chat share: ids, ``created``, usage chunks and ``[DONE]``."""

    done_marker = True
    partial_ends = False  # finish_reason is stop or length: an early end is an error
    object_name = chunk_object = prefix = ""  # set by the subclasses

    def __init__(self, model: str, include_usage: bool):
        self.id = f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.model, self.include_usage, self.created = model, include_usage, int(time.time())

    def _chunk(self, choice: dict | None, usage: dict | None = None) -> dict:
        chunk = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
        }
        if self.include_usage:
            chunk["usage"] = usage
        return chunk

    def _choice_end(self, reason: str) -> dict:
        """The last choice of a stream, with its ``finish_reason``."""
        raise NotImplementedError

    def final_chunks(self, final: FinalEvent) -> list[dict]:
        chunks = [self._chunk(self._choice_end(final.finish_reason.value))]
        if self.include_usage:
            chunks.append(self._chunk(None, _usage(final)))
        return chunks

    def _response(self, choice: dict, final: FinalEvent) -> dict:
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(final),
        }


class CompletionFormat(_OpenAIFormat):
    object_name = chunk_object = "text_completion"
    prefix = "cmpl"

    def chunks(self, text: str) -> list[dict]:
        return [self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": None})]

    def _choice_end(self, reason: str) -> dict:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": reason}

    def body(self, text: str, final: FinalEvent) -> dict:
        return self._response(
            {"index": 0, "text": text, "logprobs": None, "finish_reason": final.finish_reason.value}, final
        )


class ChatFormat(_OpenAIFormat):
    object_name, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, model: str, include_usage: bool):
        super().__init__(model, include_usage)
        self._started = False

    def chunks(self, text: str) -> list[dict]:
        delta = {"content": text} if self._started else {"role": "assistant", "content": text}
        self._started = True
        return [self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})]

    def _choice_end(self, reason: str) -> dict:
        return {
            "index": 0,
            "delta": {} if self._started else {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": reason,
        }

    def body(self, text: str, final: FinalEvent) -> dict:
        message = {"role": "assistant", "content": text}
        return self._response(
            {"index": 0, "message": message, "logprobs": None, "finish_reason": final.finish_reason.value}, final
        )


async def _generate(
    body: OpenAISampling,
    request: Request,
    state: AppState,
    prompt: str | None,
    messages: list[dict] | None,
    fmt_cls: type[CompletionFormat | ChatFormat],
):
    engine = pipeline.resolve_engine(state, body.model)
    ids = pipeline.prompt_ids(engine, prompt, messages)
    max_tokens = body.max_completion_tokens or body.max_tokens or state.settings.default_max_tokens
    params = pipeline.sampling_params(engine, len(ids), max_tokens, **body.sampling())
    gen = pipeline.start(state, engine, ids, params)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await pipeline.respond(request, gen, fmt_cls(engine.model.name, include_usage), body.stream)


@router.post("/completions", responses=ERRORS)
async def completions(body: CompletionRequest, request: Request, state: State):
    """OpenAI text completion of one prompt (``top_k`` accepted, as in vLLM). ``finish_reason``
    is ``stop`` or ``length``; a request ended early by its time limit or a shutdown answers
    504 or 503, or, once streaming, a last ``{"error": ...}`` event before ``[DONE]``."""
    return await _generate(body, request, state, body.prompt_text, None, CompletionFormat)


@router.post("/chat/completions", responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    """OpenAI chat completion, rendered with the model's chat template; ``finish_reason`` and
    early ends as in ``/v1/completions``."""
    return await _generate(body, request, state, None, [m.model_dump() for m in body.messages], ChatFormat)
