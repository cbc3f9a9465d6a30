"""Slow and greedy clients, and request counting: the request-body bounds (413 too large,
408 too slow) as ASGI middleware, a uvicorn protocol that bounds the time to send headers,
and per-status request counting."""

from __future__ import annotations

import asyncio
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.api.errors import Shape, send_error, shape_of
from service.api.rehearsal import REHEARSAL
from service.metrics import Metrics

COUNTED_PATHS = ("/infer", "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/embeddings")
_DISCONNECT = {"type": "http.disconnect"}
_CLOSE = (b"connection", b"close")  # the body was not read to its end: the connection cannot be reused


class BodyLimitMiddleware:
    """Bound every request body in size and time.

    A body over ``max_bytes`` (by Content-Length, or counted as it streams in, chunked or
    not) gets 413; one not complete ``timeout_s`` seconds after the headers arrived (a slow
    or stalled client) gets 408. The app then sees a disconnect and its own answer is
    dropped; uvicorn closes the connection, since the body was never read to its end.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float = 30.0):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        shape = shape_of(scope["path"])
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(send, shape)
        body = _BoundedBody(self, receive, send, shape)
        await self.app(scope, body.receive, body.send)

    async def _too_large(self, send, shape: Shape) -> None:
        message = f"request body exceeds {self.max_bytes} bytes (max_body_bytes)"
        await send_error(send, 413, message, param="body", headers=[_CLOSE], shape=shape)

    async def _too_slow(self, send, shape: Shape) -> None:
        message = f"request body not received within {self.timeout_s:g} s (read_timeout_s)"
        await send_error(send, 408, message, param="body", headers=[_CLOSE], shape=shape)


class _BoundedBody:
    """One request's receive/send pair under :class:`BodyLimitMiddleware`'s bounds."""

    def __init__(self, limits: BodyLimitMiddleware, receive, send, shape: Shape = "openai"):
        self.limits, self._receive, self._send, self.shape = limits, receive, send, shape
        self.deadline = time.monotonic() + limits.timeout_s
        self.seen = 0
        self.complete = False  # the whole body arrived: later receives wait for a disconnect
        self.rejected = False
        self.started = False

    async def receive(self):
        if self.rejected:
            return _DISCONNECT
        if self.complete:
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            await self._reject(self.limits._too_slow)
            return _DISCONNECT
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limits.max_bytes:
                await self._reject(self.limits._too_large)
                return _DISCONNECT
            self.complete = not message.get("more_body", False)
        return message

    async def send(self, message) -> None:
        if self.rejected:  # the app's answer to the disconnect it was handed
            return
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)

    async def _reject(self, answer) -> None:
        self.rejected = True
        if not self.started:
            await answer(self._send, self.shape)


def header_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not
    all arrived ``timeout_s`` seconds after it opened or after its previous response.

    uvicorn only times out idle keep-alive connections after a response, and not once a
    byte arrived: a client that connects and sends nothing, or trickles its headers, would
    hold the connection forever. The body is bounded by :class:`BodyLimitMiddleware`.
    Pass the result as ``uvicorn.Config(http=...)``.
    """

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


class StatusCountMiddleware:
    """Count inference requests by response status in ``requests_total``."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in COUNTED_PATHS or REHEARSAL.get():
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.record_status(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
