"""Error responses. Every failure answers OpenAI's error object and nothing else:
``{"error": {"message": str, "type": str, "param": str | null, "code": str}}``, where ``code``
is the HTTP status as a string (``"404"``); on the Anthropic Messages routes
(:func:`is_anthropic`) it answers Anthropic's instead: ``{"type": "error", "error": {"type":
str, "message": str}}``, the message naming the field. A stream that fails after its first
event sends the same object as its last event (with the status it would have had)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.schemas import ErrorBody

log = logging.getLogger("stepserve.api")

CLIENT_CLOSED = 499  # nginx's status for a client that went away before the answer
# The error statuses a generation route may answer, for the OpenAPI schema.
ERRORS: dict[int | str, dict] = {code: {"model": ErrorBody} for code in (400, 404, 413, 422, 429, 500, 503, 504)}
ANTHROPIC_PREFIX = "/v1/messages"  # the Anthropic Messages routes: their errors in Anthropic's shape
# Anthropic's error type for each status (its "Errors" page: docs.anthropic.com/en/api/errors);
# stepserve's 503 (warming up, shutting down, over the memory limit) is Anthropic's overloaded.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
Shape = Literal["openai", "anthropic"]


def is_anthropic(path: str) -> bool:
    """Whether ``path`` is one of the Anthropic Messages routes (or below them)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def shape_of(path: str) -> Shape:
    """The error shape the route at ``path`` answers in."""
    return "anthropic" if is_anthropic(path) else "openai"


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

    def body(self, shape: Shape = "openai") -> dict:
        return error_body(self.status, self.message, self.type, self.param, shape)

    def response(self, shape: Shape = "openai") -> JSONResponse:
        return JSONResponse(self.body(shape), status_code=self.status, headers=dict(self.headers or {}))


def error_body(status: int, message: str, type: str, param: str | None = None, shape: Shape = "openai") -> dict:
    """The JSON body of an error. OpenAI's: ``{"error": {message, type, param, code}}``,
    ``code`` being ``str(status)``. Anthropic's: ``{"type": "error", "error": {type,
    message}}``, the type from the status (``api_error`` for other 5xx, else ``type``) and the
    message prefixed with ``param: `` when it does not name the field already."""
    if shape == "openai":
        return {"error": {"message": message, "type": type, "param": param, "code": str(status)}}
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else type)
    if param and param != "body" and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


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
    shape: Shape = "openai",
) -> None:
    """Send a whole JSON error response through a raw ASGI ``send`` (for middleware that
    answers before the app runs). ``headers`` are extra (name, value) byte pairs."""
    body = json.dumps(error_body(status, message, type, param, shape)).encode()
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
    ``function-after[...]``, the content blocks' ``block:text``, the Responses items'
    ``item:message``) are not fields and are left out."""

    def tag(p) -> bool:
        return isinstance(p, str) and (p in _UNION_TAGS or "[" in p or p.startswith(("function-", "block:", "item:")))

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
    async def _validation(request: Request, exc: RequestValidationError):
        error, shape = validation_error(exc), shape_of(request.url.path)
        if shape == "anthropic":  # Anthropic answers a malformed request 400, not 422
            error.status = 400
        return error.response(shape)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return exc.response(shape_of(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # FastAPI raises a bare 400 when reading the body fails past JSON syntax (e.g. nesting
        # deeper than Python's recursion limit); routes raise ApiError, never this.
        param = "body" if exc.status_code == 400 else None
        error = ApiError(exc.status_code, str(exc.detail), param=param, headers=exc.headers)
        return error.response(shape_of(request.url.path))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return ApiError(500, "internal server error", type="server_error").response(shape_of(request.url.path))
