"""Every error as a JSON error object: OpenAI's shape, or Anthropic's under /v1/messages."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.server.anthropic import error_body as anthropic_error_body
from kvtier.server.protocol import APIError


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected_error)


def error_response(err: APIError, path: str) -> JSONResponse:
    """In the shape of the API the path belongs to: Anthropic's under /v1/messages, else OpenAI's."""
    body = anthropic_error_body(err.status_code, err.message) if path.startswith("/v1/messages") else err.body()
    return JSONResponse(body, status_code=err.status_code)


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI answers 422; OpenAI answers 400 with one message
    messages, params = [], []
    for e in exc.errors():
        if e["type"] == "json_invalid":
            return error_response(APIError(400, f"the request body is not valid JSON: {e['ctx']['error']}"),
                                   request.url.path)
        loc = [str(part) for part in e["loc"] if part != "body"]
        if not loc:   # no body, or not an object (also what a form content-type gives)
            return error_response(APIError(400, "the request body must be a JSON object "
                                                  "sent with 'Content-Type: application/json'"), request.url.path)
        if e["type"] == "extra_forbidden":
            messages.append(f"{'.'.join(loc)}: kvtier does not support this field (see the README's table of "
                            "request fields)")
        else:
            messages.append(f"{'.'.join(loc)}: {e['msg'].removeprefix('Value error, ')}")
        params.append(loc[0])
    return error_response(APIError(400, "; ".join(messages), param=params[0]), request.url.path)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = f"{request.method} {request.url.path}: {exc.detail}"
    code = "not_found" if exc.status_code == 404 else None
    return error_response(APIError(exc.status_code, message, code=code), request.url.path)


async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises the exception after this answer, so the server still logs its traceback
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}", type="server_error"),
                           request.url.path)
