"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers turn request-validation failures (pydantic, malformed JSON) into 400
rather than FastAPI's 422, and the engine's ``ValueError("field: ...")`` into a
400 naming ``field``. Messages never carry server paths or tracebacks.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("jaxserve.server")

_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered as ``status`` with an OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _STATUS_TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# The engine and SamplingParams name the field first: "prompt: ..." or "max_tokens must be ...".
_FIELD_RE = re.compile(r"^([a-z_]+)(?::| must)")


def from_value_error(error: ValueError, prompt_param: str = "prompt") -> APIError:
    """Map an engine ``ValueError`` to a 400 whose ``param`` is the field it names
    (``prompt``/``prompt_token_ids`` become ``prompt_param``: ``messages`` for chat)."""
    message = str(error)
    match = _FIELD_RE.match(message)
    param = match.group(1) if match else None
    if param in ("prompt", "prompt_token_ids"):
        param = prompt_param
    code = "context_length_exceeded" if "context window" in message or "KV pages" in message else None
    return APIError(400, message, param=param, code=code)


def _loc_to_param(loc: tuple) -> str | None:
    """The dotted field of a pydantic error location, as the client wrote it: without the
    ``body``/``query`` source, the union members' type and class names ("str", "list[int]",
    "ToolChoice"), and the tag a tagged union adds after an item (``input.0.message.role``
    is ``input.0.role``)."""
    parts: list[str] = []
    tag_next = False      # the next string is a tagged union's tag
    tagged_list = False   # the next index is into a list of tagged items (its tag follows the index)
    for at, part in enumerate(loc):
        if isinstance(part, int):
            parts.append(str(part))
            tag_next, tagged_list = tagged_list, False
            continue
        part = str(part)
        if tag_next:
            tag_next = False
        elif "tagged-union[" in part:
            tagged_list, tag_next = part.startswith("list["), not part.startswith("list[")
        elif not (part in ("body", "query") and not parts) and \
                not re.fullmatch(r"[a-z]+\[.*\]|str|int|float|bool|list|dict|function-after.*", part) and \
                not (re.fullmatch(r"[A-Z][A-Za-z0-9]*", part) and at + 1 < len(loc)):
            parts.append(part)   # (not a union member's type, nor its model's class name before its field:
            #                       fields are snake_case; a dict's key, last, is kept whatever its case)
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    field = tuple(first.get("loc", ()))[:2]
    # A union (``str | list[tagged union]``: Responses ``input``, a message's ``content`` parts,
    # ``stop``, ``prompt``) reports a miss per member; the deepest names the real fault (an item's
    # type or field, an element, not "should be a valid string"), the first of equals.
    first = max((e for e in errors if tuple(e.get("loc", ()))[:2] == field),
                key=lambda e: len((_loc_to_param(tuple(e.get("loc", ()))) or "").split(".")), default=first)
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"request body is not valid JSON{': ' + str(detail) if detail else ''}", param="body")
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if tuple(first.get("loc", ())) in (("body",), ()):
        field = re.match(r"[a-z_]+(?= )", message) if first.get("type") == "value_error" else None
        if field is not None:   # a rule over several fields: its message names the field first
            return APIError(400, message, param=field.group())
        return APIError(400, "request body must be a JSON object sent with Content-Type: application/json",
                        param="body")
    param = _loc_to_param(tuple(first.get("loc", ())))
    return APIError(400, f"{param}: {message}" if param else message, param=param)


FASTAPI_BODY_ERROR = "There was an error parsing the body"   # FastAPI's 400 when reading the body raised


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed"}.get(
            exc.status_code, str(exc.detail))
        if exc.detail == FASTAPI_BODY_ERROR:   # JSON reading failed otherwise than on bad JSON text
            message = "request body could not be read as JSON (bytes that are not UTF-8, a number too long, ...)"
        # (a 400 raised here is about the body: JSON FastAPI could not read, an upload's multipart form)
        param = {400: "body", 404: "path", 405: "method"}.get(exc.status_code)
        return APIError(exc.status_code, message, param=param, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()


def sse_error_event(error: APIError | Exception) -> str:
    """An error after a stream started: sent as one ``data:`` event (then ``[DONE]``)."""
    if not isinstance(error, APIError):
        error = APIError(500, f"generation failed: {type(error).__name__}: {error}")
    return f"data: {json.dumps(error.body())}\n\n"
