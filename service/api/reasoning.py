"""Reasoning kept apart from the answer (docs/TOOL_CALLS.md, "Reasoning"): which parser a
model's output takes (:func:`resolve`), and :class:`AnswerStream`, which splits the output
as it streams into reasoning, answer text and tool calls, as the chat route's deltas
(``reasoning_content``, ``content``, ``tool_calls``; vLLM's names).

Two parsers:

- ``think`` (Qwen3, QwQ, DeepSeek-R1 and its distills): reasoning between ``<think>`` and
  ``</think>``. Where the prompt already opened ``<think>`` (DeepSeek-R1's template, or
  Qwen3's with a forced prefix) the output starts inside the reasoning
  (:func:`prompt_opens_thinking`); where it closed it (Qwen3 with ``enable_thinking``
  false) there is none.
- ``harmony`` (gpt-oss): the ``analysis`` channel is reasoning (:mod:`service.api.harmony`,
  which also parses its function calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from service.api.harmony import HarmonyStream
from service.api.tool_stream import ToolCallStream
from service.api.tools import SPECIAL_MARKERS, Form

Parser = Literal["think", "harmony"]
Setting = Literal["auto", "none", "think", "harmony"]
THINK, END_THINK = "<think>", "</think>"


def resolve(setting: Setting, chat_template: str | None) -> Parser | None:
    """The parser of a model's ``reasoning_parser`` setting; ``auto`` reads the chat template:
    ``harmony`` where it writes Harmony's ``<|channel|>``, ``think`` where it writes
    ``<think>``, else none (None)."""
    if setting != "auto":
        return None if setting == "none" else setting
    template = chat_template or ""
    if "<|channel|>" in template:
        return "harmony"
    return "think" if THINK in template else None


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether ``prompt`` ends inside a ``<think>`` block (its last ``<think>`` is after its
    last ``</think>``): the model's output then starts as reasoning."""
    return prompt.rfind(THINK) > prompt.rfind(END_THINK)


def _held(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


class ThinkSplitter:
    """``<think>…</think>`` output split as it arrives into ``{"reasoning_content": str}`` and
    ``{"content": str}`` deltas. Whitespace right after either tag is dropped (the newlines
    templates put there); text that may begin a tag is held back until it is decided."""

    def __init__(self, thinking: bool):
        self.thinking = thinking  # inside <think>
        self._buf = ""
        self._lead = True  # at the start of a segment: drop whitespace
        self.reasoned = thinking  # inside <think> at some point of the last feed
        self.undecided = False  # (a header whose channel is not known yet: never, for <think>)

    @property
    def reasoning(self) -> bool:
        """Inside ``<think>`` now."""
        return self.thinking

    def feed(self, text: str) -> list[dict]:
        """Deltas made certain by ``text``, the next piece of the output."""
        self._buf += text
        self.reasoned = self.thinking
        out: list[dict] = []
        while self._buf:
            tag = END_THINK if self.thinking else THINK
            at = self._buf.find(tag)
            if at >= 0:
                self._emit(self._buf[:at], out)
                self._buf, self.thinking, self._lead = self._buf[at + len(tag) :], not self.thinking, True
                self.reasoned = self.reasoned or self.thinking
                continue
            keep = _held(self._buf, tag)
            self._emit(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return out

    def finish(self) -> list[dict]:
        """The held text, at the end of the output."""
        out: list[dict] = []
        self._emit(self._buf, out)
        self._buf = ""
        return out

    def _emit(self, text: str, out: list[dict]) -> None:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        if text:
            out.append({"reasoning_content" if self.thinking else "content": text})


class AnswerStream:
    """A chat answer split as it streams: reasoning (``parser``; ``thinking``: the prompt opened
    it), answer text, and tool calls in ``form`` (None: not parsed). :meth:`feed` and
    :meth:`finish` return the chat route's deltas; :attr:`calls` holds the calls so far.

    :attr:`reasoning_tokens` counts the output tokens spent reasoning, from the cumulative token
    counts passed with each piece (:attr:`service.engine.sequence.TokenEvent.tokens`): a piece's
    tokens count when the output was inside the reasoning at any point of it: ``<think>``
    through ``</think>`` (the tags included), or a Harmony ``analysis`` message from its
    ``<|start|>`` header through its ``<|end|>``. Nothing is counted without a parser."""

    def __init__(self, parser: Parser | None, thinking: bool, form: Form | None):
        # a Harmony model's calls are read from its channels, whatever reasoning_parser says
        self._harmony = HarmonyStream() if "harmony" in (parser, form) else None
        self._think = ThinkSplitter(thinking) if parser == "think" else None
        self._tools = ToolCallStream(form) if form is not None and self._harmony is None else None
        self.tool_form: bool = form is not None  # calls parsed (harmony: only with tools)
        # reasoning is told apart only where a parser reads it (a Harmony model without one: none)
        self._reader = self._think or (self._harmony if parser == "harmony" else None)
        self.reasoning_tokens = 0  # output tokens spent reasoning so far (with token counts fed)
        self._tokens = 0  # the output tokens fed so far
        self._pending = 0  # tokens of a Harmony header whose channel is not known yet

    def _count(self, tokens: int | None, before: bool) -> None:
        """Add the tokens through ``tokens`` (cumulative) to :attr:`reasoning_tokens` when the
        output was in the reasoning ``before`` the piece or during it."""
        if tokens is None or self._reader is None:
            return
        new, self._tokens = tokens - self._tokens, tokens
        if before or self._reader.reasoned:
            self.reasoning_tokens += self._pending + new
            self._pending = 0
        elif self._reader.undecided:
            self._pending += new
        else:
            self._pending = 0

    @property
    def calls(self) -> list[dict]:
        if self._harmony is not None:
            return self._harmony.calls if self.tool_form else []
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str, tokens: int | None = None) -> list[dict]:
        """The deltas of the output's next piece ``text``; ``tokens``: the output tokens generated
        through it (cumulative; None: not counted)."""
        before = self._reader is not None and self._reader.reasoning
        if self._harmony is not None:
            out = self._harmony_deltas(self._harmony.feed(text))
        else:
            pieces = self._think.feed(text) if self._think is not None else [{"content": text}]
            out = self._answer(pieces, final=False)
        self._count(tokens, before)
        return out

    def finish(self, tokens: int | None = None) -> list[dict]:
        """The deltas left at the end of the output; ``tokens``: all the output's tokens (the
        request's ``completion_tokens``; those after the last piece count as reasoning when the
        output ended inside it)."""
        if self._reader is not None and tokens is not None:
            new, self._tokens = tokens - self._tokens, tokens
            self.reasoning_tokens += new if self._reader.reasoning else 0
        if self._harmony is not None:
            return self._harmony_deltas(self._harmony.finish())
        pieces = self._think.finish() if self._think is not None else []
        return self._answer(pieces, final=True)

    def _harmony_deltas(self, deltas: list[dict]) -> list[dict]:
        if self.tool_form:
            return deltas
        return [d for d in deltas if "tool_calls" not in d]

    def _answer(self, pieces: list[dict], final: bool) -> list[dict]:
        """Reasoning as it is; answer text through the tool call parser."""
        out: list[dict] = []
        for piece in pieces:
            if "content" in piece and self._tools is not None:
                out += self._tools.feed(piece["content"])
            else:
                out.append(piece)
        if final and self._tools is not None:
            out += self._tools.finish()
        return out


@dataclass(frozen=True)
class AnswerPlan:
    """How one request's answer is read: its model's reasoning ``parser``, its tool call
    ``form`` (None: calls not parsed) and whether the prompt opened the reasoning
    (``thinking``, :func:`prompt_opens_thinking`)."""

    parser: Parser | None
    form: Form | None
    thinking: bool = False

    @property
    def keep_special(self) -> bool:
        """Whether the answer's text must keep special tokens (the markers are special tokens)."""
        return self.parser == "harmony" or self.form in SPECIAL_MARKERS

    def stream(self) -> AnswerStream:
        """A fresh streamed parser of this answer."""
        return AnswerStream(self.parser, self.thinking, self.form)

    def parse(self, text: str) -> tuple[str | None, str, list[dict]]:
        """(reasoning or None, answer text, tool calls) of the whole answer."""
        return parse_answer(text, self.parser, self.thinking, self.form)

    def reasoning_tokens(self, pieces: list[tuple[str, int]], total: int) -> int:
        """Output tokens spent reasoning (as :attr:`AnswerStream.reasoning_tokens` counts them) of
        an answer that came as ``pieces`` (text, output tokens through it, cumulative) and
        ``total`` output tokens in all; 0 without a parser."""
        if self.parser is None:
            return 0
        stream = self.stream()
        for text, tokens in pieces:
            stream.feed(text, tokens)
        stream.finish(total)
        return stream.reasoning_tokens


def parse_answer(text: str, parser: Parser | None, thinking: bool, form: Form | None) -> tuple[str | None, str, list]:
    """(reasoning or None, answer text, tool calls) of a whole output: what
    :class:`AnswerStream`'s deltas add up to."""
    stream = AnswerStream(parser, thinking, form)
    deltas = stream.feed(text) + stream.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    return reasoning or None, content, stream.calls


def template_controls(parser: Parser | None, chat_template: str | None, effort: str | None, field: str) -> dict:
    """The chat template's variables that honour a request's reasoning ``effort`` (the chat
    route's ``reasoning_effort``, Responses' ``reasoning.effort``; Messages' ``thinking`` as
    ``none``/``medium``), or ValueError naming ``field`` when it cannot be honoured:

    - a model without a parser (it does not reason): null or ``none`` only;
    - a template that takes ``reasoning_effort`` (gpt-oss): ``low``, ``medium``, ``high``,
      passed through;
    - a template that takes ``enable_thinking`` (Qwen3): ``none`` turns thinking off,
      ``medium`` on (the model thinks at one level);
    - any other thinking model (DeepSeek-R1, whose template always opens ``<think>``):
      ``medium`` only.
    """
    if effort is None:
        return {}
    template = chat_template or ""
    if parser is None:
        if effort == "none":
            return {}
        raise ValueError(f"{field}: this model does not reason: only null or 'none' is served")
    if "reasoning_effort" in template:
        if effort in ("low", "medium", "high"):
            return {"reasoning_effort": effort}
        raise ValueError(f"{field}: this model's template takes 'low', 'medium' or 'high', not '{effort}'")
    if "enable_thinking" in template and effort in ("none", "medium"):
        return {"enable_thinking": effort == "medium"}
    if effort == "medium":
        return {}
    allowed = "'none' (off) or 'medium' (on)" if "enable_thinking" in template else "'medium' (it always thinks)"
    raise ValueError(f"{field}: this model thinks at one level: {allowed}, not '{effort}'")
