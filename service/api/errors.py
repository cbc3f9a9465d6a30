"""Error responses. Every failure, on every route, answers OpenAI's error object and nothing
else: ``{"error": {"message": str, "type": str, "param": str | null, "code": str}}``, where
``code`` is the HTTP status as a string (``"404"``). A stream that fails after its first event
sends the same object as its last ``data:`` event (with the status it would have had)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.schemas import ErrorBody

log = logging.getLogger("stepserve.api")

CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer
# The error statuses a generation route may answer, for the OpenAPI schema.
ERRORS: dict[int | str, dict] = {code: {"model": ErrorBody} for code in (400, 404, 413, 422, 429, 500, 503, 504)}


class ApiError(Exception):
    """An error to answer as-is: ``status`` (HTTP), ``message``, ``type`` (OpenAI's error
    type, e.g. ``invalid_request_error``), ``param`` (the offending field, if any) and extra
    response ``headers`` (e.g. ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.type, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=dict(self.headers or {}))


def error_body(status: int, message: str, type: str, param: str | None = None) -> dict:
    """The JSON body of every error: ``{"error": {message, type, param, code}}``, ``code``
    being ``str(status)``."""
    return {"error": {"message": message, "type": type, "param": param, "code": str(status)}}


def client_closed() -> JSONResponse:
    """The answer to a client that went away (499): logged and counted, never read."""
    return ApiError(CLIENT_CLOSED, "client closed request", type="client_closed").response()


async def send_error(
    send,
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    headers: list[tuple[bytes, bytes]] | tuple = (),
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


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "literal"}


def _field_path(loc) -> str:
    """The field's dotted path; pydantic's union-member tags (``str``, ``list[ContentPart]``,
    ``function-after[...]``) are not fields and are left out."""

    def tag(p) -> bool:
        return isinstance(p, str) and (p in _UNION_TAGS or "[" in p or p.startswith("function-"))

    return ".".join(str(p) for p in loc if p != "body" and not tag(p)) or "body"


def validation_error(exc: RequestValidationError) -> ApiError:
    """422 naming the first invalid field in ``param``; the message lists every problem as
    ``path: problem``, joined by ``; ``."""
    errors = exc.errors() or [{"loc": ("body",), "msg": "invalid request", "type": "invalid"}]
    paths = ["body" if e.get("type") == "json_invalid" else _field_path(e["loc"]) for e in errors]
    message = "; ".join(f"{path}: {e['msg']}" for path, e in zip(paths, errors, strict=True))
    return ApiError(422, message, param=paths[0])


def install_error_handlers(app: FastAPI) -> None:
    """Register JSON handlers for validation errors, ApiError, HTTP errors and crashes."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        # FastAPI raises a bare 400 when reading the body fails past JSON syntax (e.g. nesting
        # deeper than Python's recursion limit); routes raise ApiError, never this.
        param = "body" if exc.status_code == 400 else None
        return ApiError(exc.status_code, str(exc.detail), param=param, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return ApiError(500, "internal server error", type="server_error").response()
