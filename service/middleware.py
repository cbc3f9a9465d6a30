"""ASGI middleware: request-body size limit (413) and per-status request counting."""

from __future__ import annotations

import json

from service.metrics import Metrics

COUNTED_PATHS = ("/infer", "/v1/completions", "/v1/chat/completions")


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Answer 413 when a body exceeds ``max_bytes``, by Content-Length or while streaming."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        seen = 0
        started = False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send):
        body = json.dumps({"error": {"message": f"request body exceeds {self.max_bytes} bytes",
                                     "type": "invalid_request_error", "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class StatusCountMiddleware:
    """Count inference requests by response status in ``requests_total``."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in COUNTED_PATHS:
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.record_status(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
