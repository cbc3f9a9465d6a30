"""A model's tokenizer and chat template, with `tokenizers` and `jinja2`: encoding prompts,
rendering chats as Hugging Face transformers does, and incremental detokenization.

Built by the loaders from a model directory's ``tokenizer.json`` (:mod:`models.hf`) or a GGUF
file's metadata (:mod:`models.gguf.vocab`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2.sandbox
from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

from models.segments import SegmentEncoder


class TokenizerError(ValueError):
    """A tokenizer cannot be built from a file's metadata, or a chat template cannot be rendered."""


@dataclass
class ChatTokenizer:
    """A `tokenizers.Tokenizer` plus the model's chat template and stop tokens.

    Attributes:
        tokenizer: the tokenizer (byte-level BPE, or SentencePiece as transformers converts it).
        chat_template: Jinja2 source of the chat template, or None.
        bos_token_id / eos_token_id: ids from the model's metadata.
        add_bos: whether a raw prompt gets BOS prepended (GGUF's ``tokenizer.ggml.add_bos_token``).
        stop_token_ids: ids that end a generation (EOS, EOT, ``<|endoftext|>``).
    """

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int
    add_bos: bool
    stop_token_ids: frozenset[int]
    _template: Any = field(default=None, repr=False)
    #: Reuses the ids of long pieces between added tokens (a chat's system turn); None where
    #: the tokenizer's pieces are not independent (``models.segments``).
    segments: SegmentEncoder | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.segments = SegmentEncoder.build(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw prompt; special-token text (``<|im_start|>``) maps to its id.
        With ``add_bos``, BOS is prepended unless the text already starts with it (a chat
        template that writes ``{{ bos_token }}``, as Gemma's does: transformers'
        ``apply_chat_template`` does not add a second one either). Long pieces between added
        tokens seen before are not encoded again (:attr:`segments`): the ids are the same."""
        if self.segments is not None:
            ids = self.segments.encode(text)
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None, **variables: Any
    ) -> str:
        """Render ``messages`` (and ``tools``) with the model's chat template and a generation
        prompt, as Hugging Face transformers does.

        Messages are dicts: ``role``; ``content`` a string, None (an assistant turn with
        ``tool_calls``) or a list of ``{"type": "text", "text"}`` parts (joined); ``tool_calls``
        in OpenAI's shape, whose ``function.arguments`` JSON string is passed to the template
        parsed to a dict (as transformers' docs ask); ``tool_call_id`` for ``tool`` turns.
        ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``) become the template's
        ``tools`` variable; a template that does not use it ignores them (see
        ``service.api.tools.render_messages`` for the fallback). ``variables`` are further
        template variables (``enable_thinking``, ``reasoning_effort``), as transformers passes
        its extra keyword arguments.

        Rendered in Jinja2's immutable sandbox with transformers' extras: ``tojson`` without
        HTML escaping, ``raise_exception``, ``strftime_now`` and the ``loopcontrols`` extension.

        Raises:
            TokenizerError: the model has no chat template, or rendering it failed
                (e.g. the template's own ``raise_exception`` on a bad role order).
        """
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; send 'prompt' instead of 'messages'")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        tokens = self.tokenizer
        try:
            return self._template.render(
                messages=[_template_message(m) for m in messages],
                tools=tools or None,
                add_generation_prompt=True,
                bos_token=tokens.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=tokens.id_to_token(self.eos_token_id),
                **variables,
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. '\n' + None content
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def detokenizer(self, keep_special: bool = False) -> Detokenizer:
        """A fresh incremental detokenizer for one sequence; ``keep_special``: special tokens'
        text stays in the output (Harmony's ``<|channel|>``, Mistral's ``[TOOL_CALLS]``)."""
        return Detokenizer(self.tokenizer, keep_special)

    @cached_property
    def longest_token_bytes(self) -> int:
        """Bytes of the longest token in the vocabulary, added tokens included.

        Byte-level BPE vocabulary entries spell one character per byte (GPT-2's
        byte-to-unicode table), so an entry's length is its byte count; any other vocabulary
        (SentencePiece: ``▁`` for a space, ``<0x41>`` for a byte) and added tokens are plain
        text, measured in UTF-8 (never fewer bytes than the text they decode to).
        """
        added = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        if isinstance(self.tokenizer.decoder, decoders.ByteLevel):
            base = max(len(t) for t in vocab)
        else:
            base = max(len(t.encode()) for t in vocab)
        return max([base, *(len(t.encode()) for t in added)])


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """Jinja2 as transformers' ``_compile_jinja_template`` sets it up for chat templates."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message):
        raise TokenizerError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as templates take it: list content joined, tool call arguments as dicts,
    no ``tool_calls`` key unless there are calls (Llama 3.1 tests ``'tool_calls' in message``)."""
    out = dict(message)
    if isinstance(content := out.get("content"), list):
        out["content"] = "".join(p.get("text") or "" for p in content)
    if calls := out.pop("tool_calls", None):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": tool_arguments(c["function"].get("arguments"))}}
            for c in calls
        ]
    return out


def tool_arguments(value: Any) -> Any:
    """A tool call's ``function.arguments``: a JSON object string parsed to a dict, anything
    else (a dict, invalid JSON, JSON that is not an object) as it is."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


class Detokenizer:
    """Incremental detokenization: text appears as soon as it is whole UTF-8.

    Wraps ``tokenizers.decoders.DecodeStream``, which holds back bytes of a character split
    across tokens (it returns None until the character completes).
    """

    def __init__(self, tokenizer: Tokenizer, keep_special: bool = False):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=not keep_special)

    def step(self, token_id: int) -> str:
        """Feed one token id; return the newly completed text ('' while a character is partial)."""
        return self._stream.step(self._tokenizer, token_id) or ""
