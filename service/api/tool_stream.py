"""Tool calls parsed out of a chat answer as it streams (:class:`ToolCallStream`), in OpenAI's
streamed ``tool_calls`` deltas; the forms and the whole-text parser are in
:mod:`service.api.tools`."""

from __future__ import annotations

from service.api.tools import CLOSE, OPEN, TOOL_CALLS, Form, block_calls, may_be_llama3, parse_tool_calls


def _open_prefix(text: str, marker: str = OPEN) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


class ToolCallStream:
    """Tool calls parsed from text deltas as they arrive, as OpenAI streams them.

    :meth:`feed` and :meth:`finish` return deltas: ``{"content": str}`` and ``{"tool_calls":
    [{"index", "id", "type": "function", "function": {"name", "arguments"}}]}``, one call a delta
    with its whole arguments once its block is complete. Text that may begin ``<tool_call>`` is
    held back, so markup never reaches content; so is whitespace that may precede a call. In the
    Llama 3 form, text that may be calls (it starts with ``{``) is held until :meth:`finish`;
    in the Mistral forms, the text from ``[TOOL_CALLS]`` on. Qwen's XML blocks stream as
    Hermes blocks do.
    The deltas add up to :func:`parse_tool_calls` of the whole text, ids aside.
    """

    def __init__(self, form: Form):
        self.form: Form = form
        self.calls: list[dict] = []  # parsed so far; finish_reason "tool_calls" when any
        self._buf = ""  # text not yet decided
        self._in_block = False  # hermes: inside <tool_call>, _buf is the body so far
        self._ws = ""  # hermes: whitespace held after content, dropped if a call follows
        self._after_call = False  # hermes: drop whitespace that follows a call
        self._passthrough = False  # llama3: the text is not calls; send it as it comes
        self._calls_text: str | None = None  # mistral: the text from [TOOL_CALLS] on

    def feed(self, text: str) -> list[dict]:
        """Deltas made certain by ``text``, the next piece of the generated text."""
        self._buf += text
        if self.form == "llama3":
            return self._llama3(final=False)
        if self.form in ("mistral", "mistral_args"):
            return self._mistral(final=False)
        out: list[dict] = []
        while self._buf:
            if self._in_block:
                end = self._buf.find(CLOSE)
                if end < 0:
                    break
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
                self._close_block(body, CLOSE, out)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                self._text(self._buf[:start], out)
                self._buf, self._in_block = self._buf[start + len(OPEN) :], True
                continue
            keep = _open_prefix(self._buf)
            self._text(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return out

    def finish(self) -> list[dict]:
        """The deltas left at the end of the text (an unclosed block, held text)."""
        if self.form == "llama3":
            return self._llama3(final=True)
        if self.form in ("mistral", "mistral_args"):
            return self._mistral(final=True)
        out: list[dict] = []
        if self._in_block:
            self._close_block(self._buf, "", out)
        else:
            self._text(self._buf, out)
        self._buf = ""
        if self._ws:
            out.append({"content": self._ws})
            self._ws = ""
        return out

    def _text(self, text: str, out: list[dict]) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            out.append({"content": body})

    def _close_block(self, body: str, close: str, out: list[dict]) -> None:
        self._in_block = False
        calls = block_calls(body, self.form)
        if calls is None:
            self._text(OPEN + body + close, out)
            return
        self._ws, self._after_call = "", True
        for call in calls:
            out.append({"tool_calls": [{"index": len(self.calls), **call}]})
            self.calls.append(call)

    def _llama3(self, final: bool) -> list[dict]:
        if not self._passthrough and may_be_llama3(self._buf) and not final:
            return []
        text, self._buf = self._buf, ""
        if self._passthrough or not may_be_llama3(text):
            self._passthrough = True
            return [{"content": text}] if text else []
        content, calls = parse_tool_calls(text, "llama3")
        for call in calls:
            self.calls.append(call)
        if calls:
            return [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(calls)]
        return [{"content": content}] if content else []

    def _mistral(self, final: bool) -> list[dict]:
        """Text before ``[TOOL_CALLS]`` as it comes (trailing whitespace held); from it on, held
        and parsed at the end (:func:`parse_tool_calls`)."""
        out: list[dict] = []
        if self._calls_text is None:
            at = self._buf.find(TOOL_CALLS)
            if at >= 0:
                self._calls_text, self._buf = self._buf[at:], self._buf[:at]
            keep = 0 if final or self._calls_text is not None else _open_prefix(self._buf, TOOL_CALLS)
            self._text(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
        else:
            self._calls_text, self._buf = self._calls_text + self._buf, ""
        if not final:
            return out
        content, calls = parse_tool_calls(self._calls_text or "", self.form)
        if calls:
            self._ws = ""
            for call in calls:
                out.append({"tool_calls": [{"index": len(self.calls), **call}]})
                self.calls.append(call)
        else:
            self._text(content or "", out)
        if self._ws:
            out.append({"content": self._ws})
            self._ws = ""
        return out
