"""The answers of ``POST /v1/responses`` kept for ``previous_response_id`` and ``GET
/v1/responses/{id}``: in memory, bounded in bytes, least recently used evicted first.

Each entry is a response object (the JSON the route answered) and the conversation it ended,
as chat turns (:meth:`service.api.schemas.ChatMessage.for_template` dicts: the earlier turns,
the request's input, the response's output; never the ``instructions``, which OpenAI does not
carry over to a follow-up). Its size is the length of both as JSON text, an estimate of what it
holds (Python's objects take a few times more).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    """A kept answer: ``response`` (the response object), ``turns`` (the conversation through
    its output) and ``nbytes`` (both as JSON text, bytes)."""

    response: dict[str, Any]
    turns: list[dict[str, Any]]
    nbytes: int


class ResponseStore:
    """Responses by id, at most ``max_bytes`` of them (0: none kept); the least recently put or
    read go first. Used on the event loop only (no lock)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the kept entries take, bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], turns: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (its ``id`` the key) and ``turns``, evicting the least recently
        used entries until it fits. Returns False, keeping nothing, for an entry larger than the
        whole store."""
        nbytes = len(json.dumps(response).encode()) + len(json.dumps(turns).encode())
        self.pop(response["id"])
        if nbytes > self.max_bytes:
            return False
        while self.nbytes + nbytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.nbytes -= oldest.nbytes
        self._entries[response["id"]] = StoredResponse(response, turns, nbytes)
        self.nbytes += nbytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry of ``response_id`` (now the most recently used), or None: never kept,
        evicted, or kept with ``store: false``."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> StoredResponse | None:
        """Remove and return the entry of ``response_id`` (None if absent)."""
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry
