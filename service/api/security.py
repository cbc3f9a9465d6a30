"""Who may call stepserve and how much one call may ask: the optional API key, CORS, a
warning for exposed binds, and the prompt-size bound checked before tokenizing."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from models.tokenizer import ChatTokenizer
from service.api.docs import SWAGGER_ASSET_PATHS
from service.api.errors import ApiError, send_error, shape_of
from service.config import Settings

log = logging.getLogger("stepserve.security")

_BEARER = b"bearer "
_HOW = "'Authorization: Bearer <key>'"


class ApiKeyMiddleware:
    """Answer 401 unless the request carries the API key, as ``Authorization: Bearer <key>``
    (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's).

    The key is compared with ``hmac.compare_digest`` on SHA-256 digests, so the time taken
    reveals neither the key's bytes nor its length. Paths in ``exempt`` (exact matches)
    pass without a key; so do CORS preflights, which the CORS middleware outside this one
    answers before they get here. The 401 is in the shape of the route's API
    (:func:`service.api.errors.shape_of`).
    """

    def __init__(self, app, api_key: str, exempt: Iterable[str] = ()):
        self.app = app
        self._digest = hashlib.sha256(api_key.strip().encode()).digest()  # as the given key is stripped
        self.exempt = frozenset(exempt)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.exempt or self._authorized(scope):
            return await self.app(scope, receive, send)
        shape = shape_of(scope["path"])
        how = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if shape == "anthropic" else _HOW
        await send_error(
            send,
            401,
            f"missing or invalid API key: send the header {how}",
            type="authentication_error",
            param="Authorization",
            headers=[(b"www-authenticate", b"Bearer")],
            shape=shape,
        )

    def _authorized(self, scope) -> bool:
        """Whether the first key the request carries (Bearer, else x-api-key) is the key."""
        given = None
        for name, value in scope.get("headers") or []:
            if name == b"authorization" and value[: len(_BEARER)].lower() == _BEARER:
                given = value[len(_BEARER) :]
                break
            if name == b"x-api-key" and given is None:
                given = value
        if given is None:
            return False
        return hmac.compare_digest(hashlib.sha256(given.strip()).digest(), self._digest)


def add_auth(app: FastAPI, settings: Settings) -> None:
    """Require the API key (when ``api_key`` is set) on every route but ``auth_exempt_paths``;
    with ``/docs`` exempt, so are the script, style sheet and icon its page loads."""
    if settings.api_key is not None:
        exempt = [*settings.auth_exempt_paths, *(SWAGGER_ASSET_PATHS if "/docs" in settings.auth_exempt_paths else ())]
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key.get_secret_value(), exempt=exempt)


def add_cors(app: FastAPI, settings: Settings) -> None:
    """Answer CORS (preflights included) for ``cors_origins`` only; without origins nothing is
    added, no response carries CORS headers and browsers refuse cross-origin calls. Add it
    last, so that it runs first and a 401 still carries the CORS headers."""
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version", "anthropic-beta"],
            max_age=600,
        )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) only accepts local connections."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def warn_if_exposed(settings: Settings) -> None:
    """Log a warning when the server listens beyond loopback without an API key."""
    if not is_loopback(settings.host) and settings.api_key is None:
        log.warning(
            "listening on %s without an API key: anyone who can reach this port can generate; "
            "set api_key (STEPSERVE_API_KEY) or bind 127.0.0.1 behind a proxy that authenticates",
            settings.host,
        )


def check_prompt_chars(tokenizer: ChatTokenizer, text: str, max_tokens: int) -> None:
    """Refuse, without tokenizing it, a text too long to fit ``max_tokens`` tokens.

    Every token covers at most ``tokenizer.longest_token_bytes`` bytes and a character is at least
    one byte, so more characters than ``max_tokens`` times that cannot encode to
    ``max_tokens`` tokens or fewer: the check never refuses a prompt that would fit, and it
    keeps an oversized text (a megabyte, say) from holding the event loop in the tokenizer.

    Raises:
        ApiError: 400 naming ``prompt`` and both limits.
    """
    limit = max_tokens * tokenizer.longest_token_bytes
    if len(text) > limit:
        raise ApiError(
            400,
            f"prompt is {len(text)} characters: more than the largest KV capacity bucket ({max_tokens} "
            f"tokens) can hold, which is at most {limit} characters",
            param="prompt",
        )
