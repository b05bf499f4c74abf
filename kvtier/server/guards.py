"""ASGI middleware in front of every route: the request body limit and the API keys."""
from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.server.errors import error_response
from kvtier.server.protocol import APIError


class BodyLimit:
    """ASGI middleware: a body over max_bytes gets a 413, from its Content-Length before any of it is read,
    else as soon as what arrived passes the limit."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await error_response(self._too_large(), scope)(scope, receive, send)
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise StarletteHTTPException(413, self._too_large().message)   # answered by _on_http_error
            return message
        await self.app(scope, receive_within_limit, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                             "(--max-request-bytes)", code="request_too_large")


class APIKeyGuard:
    """ASGI middleware: every route but /health needs one of the API keys, as 'Authorization: Bearer KEY'
    (the scheme in any case) or 'x-api-key: KEY'. The key that matched is left in the request's state."""

    def __init__(self, app, api_keys: list[str]):
        self.app = app
        self.keys = [key.encode() for key in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            key = self._matching_key(Headers(scope=scope))
            if key is None:
                err = APIError(401, "missing or incorrect API key; send it as 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                return await error_response(err, scope)(scope, receive, send)
            scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)

    def _matching_key(self, headers: Headers) -> str | None:
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = headers.get("x-api-key", "")
        given = given.strip().encode()
        # compare with every key, so the time taken says nothing about which one nearly matched
        matches = [key for key in self.keys if secrets.compare_digest(given, key)]
        return matches[0].decode() if matches else None
