"""Error responses: every failure answers JSON ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("stepserve.api")


class ApiError(Exception):
    """An error to return as-is. ``param`` names the offending field, if any."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers


def error_body(status: int, message: str, type: str, param: str | None = None) -> dict:
    """The JSON body of every error: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": status}}


def error_response(
    status: int, message: str, type: str, param: str | None = None, headers: dict | None = None, **extra
) -> JSONResponse:
    return JSONResponse({**error_body(status, message, type, param), **extra}, status_code=status, headers=headers)


async def send_error(
    send,
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    headers: list[tuple[bytes, bytes]] = (),
) -> None:
    """Send a whole JSON error response through a raw ASGI ``send`` (for middleware that
    answers before the app runs). ``headers`` are extra (name, value) byte pairs."""
    body = json.dumps(error_body(status, message, type, param)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _field_path(loc) -> str:
    return ".".join(str(p) for p in loc if p != "body") or "body"


def install_error_handlers(app: FastAPI) -> None:
    """Register JSON handlers for validation errors, ApiError, HTTP errors and crashes."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
        param = "body" if first.get("type") == "json_invalid" else _field_path(first["loc"])
        detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors]
        return error_response(422, f"{param}: {first['msg']}", "invalid_request_error", param, detail=detail)

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        # FastAPI raises a bare 400 when reading the body fails past JSON syntax (e.g. nesting
        # deeper than Python's recursion limit); routes raise ApiError, never this.
        param = "body" if exc.status_code == 400 else None
        return error_response(
            exc.status_code, str(exc.detail), "invalid_request_error", param, getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error", "server_error")
