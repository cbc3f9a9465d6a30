"""gpt-oss's Harmony output (docs/format.md of openai/harmony) split as it streams into
reasoning (the ``analysis`` channel), the answer (``final``, and ``commentary`` without a
recipient) and function calls (a message to ``functions.NAME``, its body the arguments).

The text is the detokenized output *with* special tokens (``<|channel|>``, ``<|message|>``,
``<|end|>``, ``<|start|>``, ``<|constrain|>``): a Harmony model's sequences keep them
(:func:`service.api.pipeline.start`'s ``keep_special``). The prompt ends with
``<|start|>assistant``, so the output starts inside the first message's header::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>

``<|call|>`` and ``<|return|>`` end the generation (they are stop tokens), so a last message
ends with the text. The package ``openai-harmony`` renders and parses the same format from
token ids, but its encoding needs the ``o200k_base`` vocabulary file downloaded at run time,
which an offline server cannot do; this parser works on the text the server already has.
"""

from __future__ import annotations

import json
import re
import secrets

MESSAGE, CHANNEL = "<|message|>", "<|channel|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_START = "<|start|>"
_MARKERS = (*_ENDS, _START, MESSAGE)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def _held(text: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of a Harmony marker."""
    for n in range(min(len(text), max(len(m) for m in _MARKERS) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in _MARKERS):
            return n
    return 0


def header_route(header: str) -> tuple[str, str | None]:
    """(channel, recipient) of a message header, e.g. ``assistant<|channel|>commentary
    to=functions.f <|constrain|>json`` -> ``("commentary", "functions.f")``; the channel is ""
    when absent, the recipient None."""
    channel = ""
    if CHANNEL in header:
        channel = re.split(r"[\s<]", header.split(CHANNEL, 1)[1].strip(), maxsplit=1)[0]
    found = _RECIPIENT.search(header)
    return channel, found.group(1) if found else None


class HarmonyStream:
    """Harmony output split as it arrives into the chat route's deltas: ``{"reasoning_content":
    str}`` (``analysis``), ``{"content": str}`` (``final``; ``commentary`` to no one) and
    ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name", "arguments"}}]}``
    (a message to ``functions.NAME``, sent whole once it ends). Messages to other recipients
    (built-in tools) are dropped. Text that may begin a marker is held back."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._buf = ""
        self._in_header = True  # _buf is a message's header so far (until <|message|>)
        self._route: tuple[str, str | None] = ("", None)
        self._body = ""  # a function call's arguments so far
        self.reasoned = False  # in an analysis message's body at some point of the last feed

    @property
    def reasoning(self) -> bool:
        """In the body of an ``analysis`` message (reasoning) now."""
        return not self._in_header and self._route == ("analysis", None)

    @property
    def undecided(self) -> bool:
        """In a message's header (its channel is not known yet)."""
        return self._in_header

    def feed(self, text: str) -> list[dict]:
        """Deltas made certain by ``text``, the next piece of the output."""
        self._buf += text
        self.reasoned = self.reasoning
        out: list[dict] = []
        while self._buf:
            if self._in_header:
                at = self._buf.find(MESSAGE)
                if at < 0:
                    break
                self._route = header_route(self._buf[:at])
                self._in_header, self._buf = False, self._buf[at + len(MESSAGE) :]
                self.reasoned = self.reasoned or self.reasoning
                continue
            ends = [(i, m) for m in _ENDS if (i := self._buf.find(m)) >= 0]
            if ends:
                at, marker = min(ends)
                self._body_text(self._buf[:at], out)
                self._end(out)
                self._buf = self._buf[at + len(marker) :]
                continue
            keep = _held(self._buf)
            self._body_text(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return out

    def finish(self) -> list[dict]:
        """The deltas left at the end of the output (the last message ends with it)."""
        out: list[dict] = []
        if not self._in_header:
            self._body_text(self._buf, out)
            self._end(out)
        self._buf, self._in_header = "", True
        return out

    def _body_text(self, text: str, out: list[dict]) -> None:
        if not text:
            return
        channel, recipient = self._route
        if recipient is not None:
            self._body += text
        elif channel == "analysis":
            out.append({"reasoning_content": text})
        elif channel in ("final", "commentary", ""):
            out.append({"content": text})

    def _end(self, out: list[dict]) -> None:
        """A message ended: a function call's whole arguments become a call."""
        _, recipient = self._route
        body, self._body, self._route, self._in_header = self._body, "", ("", None), True
        if recipient is None or not recipient.startswith("functions."):
            return
        try:
            arguments = json.dumps(json.loads(body), ensure_ascii=False)
        except ValueError:
            arguments = body  # as written: the client sees what the model sent
        function = {"name": recipient.removeprefix("functions."), "arguments": arguments}
        call = {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": function}
        out.append({"tool_calls": [{"index": len(self.calls), **call}]})
        self.calls.append(call)
