"""Request and response bodies of the HTTP API (pydantic models)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 512
MAX_TOP_K = 2**31 - 1  # top_k is an int32 in the sampler; the runner clamps it to the vocabulary


class ChatMessage(BaseModel):
    """One chat turn, rendered by the model's chat template."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class InferRequest(BaseModel):
    """``POST /infer``: exactly one of ``prompt`` (raw text) or ``messages`` (chat)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="model name; default: the server's default model")
    prompt: str | None = Field(None, min_length=1, description="raw prompt text (no chat template)")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="chat turns, rendered with the chat template"
    )
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most; default from settings")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass; 1 = off")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="keep the k most likely tokens; 0 = off")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="same seed, same output")
    stop: str | list[str] | None = Field(
        default_factory=list,
        validate_default=True,
        description=f"up to {MAX_STOP_STRINGS} strings of up to {MAX_STOP_CHARS} characters that end the text",
    )
    stream: bool = Field(False, description="answer text/event-stream: one event per text chunk, then a final event")

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):  # each token's stop check costs up to text x stop length
            raise ValueError(f"stop strings are at most {MAX_STOP_CHARS} characters")
        return stops

    @model_validator(mode="after")
    def _one_input(self) -> InferRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class PromptTokensDetails(BaseModel):
    """As OpenAI's ``usage.prompt_tokens_details``."""

    cached_tokens: int = Field(0, description="prompt tokens whose keys and values came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=lambda: PromptTokensDetails(cached_tokens=0))


class Timings(BaseModel):
    """Seconds: waiting for the engine, arrival to first token, first to last token, in all."""

    queue_s: float
    ttft_s: float | None
    decode_s: float
    total_s: float


# ``/infer``'s reasons: ``timeout`` (request_timeout_s) and ``cancelled`` (server shutdown) end a
# request that had produced tokens; one that had not answers 504 or 503 instead.
FinishReasonName = Literal["stop", "length", "timeout", "cancelled"]
ENDED_EARLY = "why the request ended early ('timeout' or 'cancelled', e.g. 'server shutting down'); else null"


class InferResponse(BaseModel):
    """``POST /infer``'s answer: the whole text, why it ended, token counts and timings."""

    id: str
    model: str
    text: str
    finish_reason: FinishReasonName
    error: str | None = Field(default=None, description=ENDED_EARLY)
    usage: Usage
    timings: Timings


class InferChunk(BaseModel):
    """One server-sent event of a streamed ``/infer``: new text, and on the last event the
    finish reason, the message of an early end, usage and timings. A request the engine
    failed after its first event ends with an :class:`ErrorBody` event instead."""

    id: str
    model: str
    text: str
    finish_reason: FinishReasonName | None = None
    error: str | None = Field(default=None, description=ENDED_EARLY)
    usage: Usage | None = None
    timings: Timings | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "stepserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="OpenAI's error type, e.g. 'invalid_request_error', 'rate_limit_error'")
    param: str | None = Field(None, description="the offending field's path, e.g. 'messages.0.role'")
    code: str = Field(description="the HTTP status as a string, e.g. '404'")


class ErrorBody(BaseModel):
    """Every error response, and the last event of a stream that fails: OpenAI's
    ``{"error": {...}}`` shape, no other key."""

    error: ErrorDetail


# -- OpenAI-compatible bodies (the fields of OpenAI's API that stepserve honours) ----------


class StreamOptions(BaseModel):
    include_usage: bool = False


class OpenAISampling(BaseModel):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``. Unknown OpenAI
    fields are ignored; ``n`` must be 1."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="not in OpenAI's API; as in vLLM")
    n: Literal[1] = 1
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(default_factory=list, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None

    _stop_list = field_validator("stop")(InferRequest._stop_list.__func__)

    def sampling(self) -> dict:
        """Arguments for :class:`service.sequence.SamplingParams` (max_tokens resolved later)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": tuple(self.stop or ()),
        }


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] = Field(..., description="one prompt (a list of exactly one is accepted)")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ValueError("exactly one prompt is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    @property
    def prompt_text(self) -> str:
        """The one prompt (the validator has unwrapped a list of one)."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
