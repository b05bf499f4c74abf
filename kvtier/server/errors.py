"""Every error as a JSON error object: OpenAI's shape, or Anthropic's under /v1/messages. Each one is logged
with its reason (field names and kvtier's message, never the prompt) and left in the request's scope for the
request counter."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.server.anthropic import error_body as anthropic_error_body
from kvtier.server.protocol import APIError

log = logging.getLogger("kvtier.server")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)


def error_response(err: APIError, scope: dict) -> JSONResponse:
    """In the shape of the API the path belongs to: Anthropic's under /v1/messages, else OpenAI's."""
    path = scope["path"]
    log.log(logging.ERROR if err.status_code >= 500 else logging.WARNING, "%s %s: %d %s: %s",
            scope.get("method", ""), path, err.status_code, err.reason, err.message)
    scope.setdefault("state", {})["error_reason"] = err.reason
    body = anthropic_error_body(err.status_code, err.message) if path.startswith("/v1/messages") else err.body()
    return JSONResponse(body, status_code=err.status_code)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.scope)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI answers 422; OpenAI answers 400 with one message
    messages, params, reason = [], [], "invalid_field"
    for e in exc.errors():
        if e["type"] == "json_invalid":
            return error_response(APIError(400, f"the request body is not valid JSON: {e['ctx']['error']}",
                                           reason="invalid_json"), request.scope)
        loc = [str(part) for part in e["loc"] if part != "body"]
        if not loc:   # no body, or not an object (also what a form content-type gives)
            return error_response(APIError(400, "the request body must be a JSON object sent with "
                                           "'Content-Type: application/json'", reason="invalid_json"), request.scope)
        if e["type"] == "extra_forbidden":
            reason = "unsupported_field"
            messages.append(f"{'.'.join(loc)}: kvtier does not support this field (see the README's table of "
                            "request fields)")
        else:
            messages.append(f"{'.'.join(loc)}: {e['msg'].removeprefix('Value error, ')}")
        params.append(loc[0])
    return error_response(APIError(400, "; ".join(messages), param=params[0], reason=reason), request.scope)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = f"{request.method} {request.url.path}: {exc.detail}"
    code = {404: "not_found", 413: "request_too_large"}.get(exc.status_code)
    return error_response(APIError(exc.status_code, message, code=code, reason=code or f"http_{exc.status_code}"),
                          request.scope)


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises the exception after this answer, so the server still logs its traceback
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}", type="server_error"),
                          request.scope)
