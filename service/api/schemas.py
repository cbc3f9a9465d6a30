"""Request and response bodies of the HTTP API (pydantic models)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from service.process.on_demand import ModelState

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 512
MAX_TOP_K = 2**31 - 1  # top_k is an int32 in the sampler; the runner clamps it to the vocabulary


class ContentPart(BaseModel):
    """A part of a message's ``content`` list: only ``{"type": "text", "text": ...}`` is
    served; any other type (images, audio, files) answers 400 naming it."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    name: str = Field(..., min_length=1)
    arguments: str = Field(..., description="the arguments as a JSON object, serialized")


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn (OpenAI's ``tool_calls`` item)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat turn, rendered by the model's chat template. ``content`` may be a string or a
    list of text parts; ``tool`` turns answer an assistant's ``tool_calls``."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = Field(None, description="accepted; not shown to the model")
    tool_calls: list[ToolCall] | None = Field(None, description="assistant turns only")
    tool_call_id: str | None = Field(None, description="tool turns: the call this answers")

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for an assistant turn with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant turns carry tool_calls")
        return self

    def unsupported_part(self) -> tuple[int, str] | None:
        """(index, type) of the first content part that is not text, or None."""
        parts = self.content if isinstance(self.content, list) else []
        return next(((i, p.type) for i, p in enumerate(parts) if p.type != "text" or p.text is None), None)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, ``developer`` as ``system``,
        tool calls as OpenAI sends them (the tokenizer parses their arguments for templates)."""
        text = (
            self.content
            if isinstance(self.content, str) or self.content is None
            else "".join(p.text or "" for p in self.content)
        )
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description="a JSON Schema object")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON valid against a schema
    (enforced token by token by a grammar; see docs/STRUCTURED_OUTPUTS.md)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        return self


class Processors(BaseModel):
    """Sampling controls shared by every generation route, each applied per row inside the
    compiled sampler (extensions to OpenAI's API as in vLLM: ``min_p``, ``repetition_penalty``,
    ``stop_token_ids``, ``ignore_eos``)."""

    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="OpenAI's: minus this for each generated token seen"
    )
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's: minus this times each token's count")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="CTRL's, over prompt and output; 1 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="keep tokens at least this fraction of the top one; 0 = off")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit"
    )
    stop_token_ids: list[int] | None = Field(None, max_length=64, description="token ids that also end the text")
    ignore_eos: bool = Field(False, description="generate past the model's end-of-sequence tokens")
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias):
        for key, value in (bias or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys are token ids, got '{key}'")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values are in [-100, 100], got {value} for token {key}")
        if bias is not None and len(bias) > 300:
            raise ValueError("logit_bias takes at most 300 tokens")
        return bias

    def processors(self) -> dict:
        """Arguments for :class:`service.engine.sequence.SamplingParams` (the grammar is added
        by the route, which compiles ``response_format``)."""
        return {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
            "logit_bias": tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
        }


class InferRequest(Processors):
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
    logprobs: int | None = Field(
        None, ge=0, le=20, description="return each token's logprob and this many most likely alternatives"
    )

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


class TopLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float


class InferLogprob(BaseModel):
    """A generated token's logprob (log-softmax of the model's logits, before penalties, bias,
    grammar, temperature and filters) and the most likely alternatives, most likely first."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob]


class InferResponse(BaseModel):
    """``POST /infer``'s answer: the whole text, why it ended, token counts and timings."""

    id: str
    model: str
    text: str
    finish_reason: FinishReasonName
    error: str | None = Field(default=None, description=ENDED_EARLY)
    usage: Usage
    timings: Timings
    logprobs: list[InferLogprob] | None = Field(None, description="when the request asked for logprobs")


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
    state: ModelState = Field(
        description="'loaded': serving; 'loading': warming up (at start-up, or an on-demand model's first "
        "request); 'unloaded': an on-demand model not loaded yet, or unloaded after ttl_s idle (its next "
        "request loads it)"
    )


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


# Fields that do not change the output: accepted and not used. Any other field stepserve does
# not implement answers 400 naming it (nothing is silently ignored).
NO_OP_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "modalities"})
MAX_N = 16


class OpenAISampling(Processors):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``. Fields of OpenAI's API
    that do not change the output (``user``, ``metadata``, ``store``, ``service_tier``, …) are
    accepted; any other unknown field answers 400 naming it."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="as max_tokens; wins when both are set")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="not in OpenAI's API; as in vLLM")
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt; they share the prompt's prefill")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="choice i samples with seed + i")
    stop: str | list[str] | None = Field(default_factory=list, validate_default=True)
    stream: bool = False
    stream_options: StreamOptions | None = None

    _stop_list = field_validator("stop")(InferRequest._stop_list.__func__)

    def unsupported(self) -> str | None:
        """The first field of the body that stepserve does not implement, or None."""
        return next((k for k in (self.model_extra or {}) if k not in NO_OP_FIELDS), None)

    def sampling(self) -> dict:
        """Arguments for :class:`service.engine.sequence.SamplingParams` (max_tokens resolved later)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": tuple(self.stop or ()),
            **self.processors(),
        }


class CompletionRequest(OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="a prompt, a list of prompts, token ids, or a list of token-id lists"
    )
    logprobs: int | None = Field(None, ge=0, le=5, description="logprobs of each token and of this many alternatives")
    echo: bool = Field(False, description="prepend the prompt to the text")
    suffix: str | None = Field(None, description="not supported: a non-empty suffix answers 400")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        if prompt == "" or (isinstance(prompt, list) and any(p in ("", []) for p in prompt)):
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and len(prompt) > MAX_N and not isinstance(prompt[0], int):
            raise ValueError(f"at most {MAX_N} prompts per request")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class FunctionDef(BaseModel):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = Field(False, description="return each token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="and this many most likely alternatives")
    tools: list[Tool] | None = Field(None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    reasoning_effort: str | None = Field(
        None,
        description="honoured by models that reason (passed to templates that take it; 'none'/'medium' turn "
        "Qwen3-style thinking off/on); what a model cannot honour answers 400",
    )

    @model_validator(mode="after")
    def _tools(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', not one of the tools {names}")
        return self


# -- Anthropic Messages bodies (the fields of Anthropic's API that stepserve honours) -------
# Content blocks are told apart by ``type``; a type stepserve does not serve (image, document,
# thinking, server tools' blocks, ...) parses as :class:`UnsupportedBlock`, which the route
# answers 400 naming it. ``cache_control`` (a caching hint) is accepted everywhere and not used.


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = Field(None, description="accepted; not shown to the model")


class ToolUseBlock(BaseModel):
    """A tool call of an earlier assistant turn."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class UnsupportedBlock(BaseModel):
    """A content block of a type stepserve does not serve (answered 400 naming it)."""

    model_config = ConfigDict(extra="allow")
    type: str


def _block_tag(block: Any) -> str:
    """The union member of a content block: ``block:<type>``, ``block:other`` for a type not
    served (the ``block:`` tags are left out of error paths, :func:`service.api.errors._field_path`)."""
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return f"block:{kind}" if kind in ("text", "tool_use", "tool_result") else "block:other"


ResultPart = Annotated[
    Annotated[TextBlock, Tag("block:text")] | Annotated[UnsupportedBlock, Tag("block:other")],
    Discriminator(lambda b: "block:text" if _block_tag(b) == "block:text" else "block:other"),
]


class ToolResultBlock(BaseModel):
    """A tool's answer, in a user turn; ``is_error`` marks it as a failure (the prompt shows
    ``Error: `` before it)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: str = Field(..., min_length=1)
    content: str | list[ResultPart] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("block:text")]
    | Annotated[ToolUseBlock, Tag("block:tool_use")]
    | Annotated[ToolResultBlock, Tag("block:tool_result")]
    | Annotated[UnsupportedBlock, Tag("block:other")],
    Discriminator(_block_tag),
]


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock] = Field(..., description="text, or text, tool_use and tool_result blocks")

    @field_validator("content")
    @classmethod
    def _not_empty(cls, content):
        if isinstance(content, list) and not content:
            raise ValueError("content must not be an empty list")
        return content


class AnthropicTool(BaseModel):
    """A client tool: its arguments follow ``input_schema`` (a JSON schema of an object)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = Field(None, description="client tools only; server tools answer 400")
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(BaseModel):
    """``auto`` (the model decides), ``any`` (one or more calls, forced by the grammar),
    ``tool`` (exactly one call of ``name``, forced), ``none`` (no tools in the prompt)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = Field(
        None, description="honoured by 'tool' (one call) and 'none'; true with 'auto' or 'any' answers 400"
    )

    @model_validator(mode="after")
    def _name(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is required with type 'tool', and only with it")
        return self


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(..., description="'enabled' (without a budget), 'adaptive' or 'disabled' where the model thinks")
    budget_tokens: int | None = None


# Fields of Anthropic's API that do not change the output (billing, routing, caching hints):
# accepted and not used.
ANTHROPIC_NO_OP_FIELDS = frozenset(
    {"service_tier", "cache_control", "speed", "inference_geo", "user_profile_id", "workspace_id"}
)


class MessagesInput(BaseModel):
    """What ``/v1/messages`` renders into the prompt, and all ``/v1/messages/count_tokens``
    takes. Fields that do not change the output (``metadata``, :data:`ANTHROPIC_NO_OP_FIELDS`)
    are accepted; any other unknown field answers 400 naming it."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(..., description="a served model's name")
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(None, max_length=64)
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = Field(None, description="accepted; does not change the output")

    def unsupported(self) -> str | None:
        """The first field of the body that stepserve does not implement, or None."""
        return next((k for k in (self.model_extra or {}) if k not in ANTHROPIC_NO_OP_FIELDS), None)


class MessagesRequest(MessagesInput):
    """``POST /v1/messages``: Anthropic's Messages API."""

    max_tokens: int = Field(..., ge=1, description="tokens to generate at most")
    stop_sequences: list[str] | None = Field(
        None, description=f"up to {MAX_STOP_STRINGS} strings of up to {MAX_STOP_CHARS} characters that end the text"
    )
    temperature: float = Field(1.0, ge=0.0, le=1.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass; 1 = off")
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="keep the k most likely tokens; 0 = off")
    stream: bool = False

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, stops):
        if stops is not None and (len(stops) > MAX_STOP_STRINGS or any(not s for s in stops)):
            raise ValueError(f"at most {MAX_STOP_STRINGS} non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops or ()):
            raise ValueError(f"each at most {MAX_STOP_CHARS} characters")
        return stops


class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="Anthropic's error type, e.g. 'invalid_request_error', 'overloaded_error'")
    message: str = Field(description="what went wrong, naming the field when one is at fault")


class AnthropicErrorBody(BaseModel):
    """Every error of the Messages routes, and the ``error`` event of a stream that fails."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


class TokenCount(BaseModel):
    input_tokens: int = Field(description="the prompt tokens /v1/messages would prefill for the same body")


# -- OpenAI Responses bodies (the fields of OpenAI's Responses API that stepserve honours) --
# Input items, their content parts and tools are told apart by ``type``; a type stepserve does
# not serve (images, files, reasoning items, item references, built-in tools, ...) parses as
# :class:`UnsupportedItem`, which the route answers 400 naming it. Union tags start ``item:``
# (left out of error paths, :func:`service.api.errors._field_path`).


class UnsupportedItem(BaseModel):
    """An input item, content part or tool of a type stepserve does not serve (400 naming it)."""

    model_config = ConfigDict(extra="allow")
    type: str | None = None


def _kind(value: Any, default: str | None = None) -> Any:
    """A union member's ``type`` (``default`` when it has none)."""
    return value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)


class ResponsesText(BaseModel):
    """A text content part: ``input_text`` (user, system, developer turns, tool outputs) or
    ``output_text`` (assistant turns, as the route answered them)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = Field(None, description="accepted on output_text; not shown to the model")
    logprobs: list[Any] | None = Field(None, description="accepted on output_text; not shown to the model")


ResponsesPart = Annotated[
    Annotated[ResponsesText, Tag("item:text")] | Annotated[UnsupportedItem, Tag("item:other")],
    Discriminator(lambda p: "item:text" if _kind(p) in ("input_text", "output_text") else "item:other"),
]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponsesMessage(BaseModel):
    """A message item (``type`` may be left out): ``content`` a string or text parts."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesPart]
    id: str | None = Field(None, description="an output message's id, when one is sent back")
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = Field(None, description="accepted; not shown to the model")


class FunctionCallItem(BaseModel):
    """A function call of an earlier response (sent back with its ``call_id``)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str = Field(..., min_length=1)
    name: str = Field(..., min_length=1)
    arguments: str = Field(..., description="the arguments as a JSON object, serialized")
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(BaseModel):
    """A function's result, answering the call ``call_id``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str = Field(..., min_length=1)
    output: str | list[ResponsesPart]
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningItem(BaseModel):
    """A ``reasoning`` output item sent back (as Codex CLI does); accepted and left out of the
    prompt, as the served templates leave out the reasoning of finished turns."""

    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning"]


_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
InputItem = Annotated[
    Annotated[ResponsesMessage, Tag("item:message")]
    | Annotated[FunctionCallItem, Tag("item:function_call")]
    | Annotated[FunctionCallOutputItem, Tag("item:function_call_output")]
    | Annotated[ReasoningItem, Tag("item:reasoning")]
    | Annotated[UnsupportedItem, Tag("item:other")],
    Discriminator(
        lambda i: f"item:{k}" if (k := _kind(i, "message" if isinstance(i, dict) else None)) in _ITEMS else "item:other"
    ),
]


class ResponsesFunctionTool(BaseModel):
    """A function tool: its arguments follow ``parameters`` (a JSON schema of an object)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="accepted; arguments are forced by the grammar as on chat")


ResponsesTool = Annotated[
    Annotated[ResponsesFunctionTool, Tag("item:function")] | Annotated[UnsupportedItem, Tag("item:other")],
    Discriminator(lambda t: "item:function" if _kind(t) == "function" else "item:other"),
]


class ResponsesNamedTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class ResponsesTextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or JSON valid against ``schema``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema object")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponsesTextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("type 'json_schema' needs a 'schema'")
        return self

    def response_format(self) -> ResponseFormat:
        """The chat route's ``response_format`` of the same output (compiled by the same grammar)."""
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        spec = JsonSchemaFormat(name=self.name or "response", schema=self.schema_ or {}, strict=self.strict)
        return ResponseFormat(type="json_schema", json_schema=spec)


class ResponsesTextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="'medium' only (the default)")


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = Field(
        None, description="honoured where the model reasons (reasoning_parser); else null or 'none'"
    )
    summary: str | None = None
    generate_summary: str | None = None


# Fields of the Responses API that do not change the output (billing, caching and safety hints,
# stream framing): accepted and not used.
RESPONSES_NO_OP_FIELDS = frozenset(
    {"service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "stream_options"}
)
# ``include`` values that add nothing to an answer stepserve gives: reasoning items carry their
# text in the clear (``content``), so there is no encrypted content to add.
RESPONSES_INCLUDABLE = frozenset({"reasoning.encrypted_content"})


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's Responses API. Fields that do not change the output
    (``metadata``, ``user``, :data:`RESPONSES_NO_OP_FIELDS`) are accepted; any other unknown
    field answers 400 naming it."""

    model_config = ConfigDict(extra="allow")
    model: str | None = Field(None, description="model name; default: the server's default model")
    input: str | list[InputItem] = Field(..., description="text (one user turn), or message and function items")
    instructions: str | None = Field(None, description="a system turn first; not carried to a follow-up")
    tools: list[ResponsesTool] | None = Field(None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    text: ResponsesTextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="tokens to generate at most; default from settings")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; null = 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus sampling mass; null = 1 (off)")
    stream: bool = False
    store: bool | None = Field(None, description="keep the answer for previous_response_id (null = true)")
    previous_response_id: str | None = Field(None, description="continue the conversation of a kept response")
    metadata: dict[str, str] | None = Field(None, max_length=16, description="kept with the answer; not shown")
    parallel_tool_calls: bool | None = Field(None, description="false: honoured with a named tool_choice or none")
    user: str | None = Field(None, description="accepted; does not change the output")
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="accepted; a prompt past the largest KV bucket answers 400 either way"
    )
    background: bool | None = Field(None, description="false only")

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("input must not be an empty list")
        return value

    def unsupported(self) -> str | None:
        """The first field of the body that stepserve does not implement, or None."""
        return next((k for k in (self.model_extra or {}) if k not in RESPONSES_NO_OP_FIELDS), None)


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per /v1/embeddings request


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` (OpenAI's shape). ``input``: a text, texts, token ids or lists of
    token ids (ids are the encoder's input as given: include [CLS] and [SEP] for parity with the
    same text). ``user`` is accepted and ignored; any other unknown field answers 422 naming it."""

    model_config = ConfigDict(extra="forbid")
    input: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="a text, a list of texts, token ids, or a list of token-id lists"
    )
    model: str | None = Field(None, description="an embedding model's name; unset: the first embedding model")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="'float': lists of numbers; 'base64': little-endian float32 bytes, base64-encoded"
    )
    dimensions: int | None = Field(
        None, ge=1, description="only the model's own dimension is accepted (no Matryoshka truncation)"
    )
    user: str | None = Field(None, description="accepted; ignored")

    @field_validator("input")
    @classmethod
    def _inputs(cls, value):
        if value == "" or value == [] or (isinstance(value, list) and any(v in ("", []) for v in value)):
            raise ValueError("input must not be empty (nor hold an empty string or list)")
        if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS and not isinstance(value[0], int):
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request")
        return value

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input: a text, or token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(x, int) for x in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(..., description="floats, or base64 of little-endian float32 bytes")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
