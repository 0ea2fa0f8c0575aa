"""ASGI middleware in front of every route: a request id on every response, API-key
check, request-body size and read-time limits, and a last-resort 500 that keeps the
connection usable.

Plain ASGI (not ``BaseHTTPMiddleware``) so streaming responses and client
disconnects pass through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
import time
import uuid

from server.errors import APIError

log = logging.getLogger("jaxserve.server")

UNGUARDED_PATHS = frozenset({"/health", "/metrics"})
# An in-process caller's owners (``server.batches``: a batch's lines run as its creator): the
# ASGI scope key ``user`` -> owner (``owner_of``). Such a request comes from inside the
# server (no HTTP server puts this key in a scope): it is trusted and needs no API key.
TRUSTED_OWNERS = "jaxserve.owners"
REQUEST_ID_HEADER = b"x-request-id"
_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")   # an id a client may give for its request


def owner_of(authorization: str, user: str = "") -> str:
    """Who a request is (the API key sent, and a request's ``user`` field where it
    matters): hashed, so the key is not kept next to what it owns."""
    return hashlib.sha256(f"{authorization}\0{user}".encode("utf-8", "surrogatepass")).hexdigest()


def request_id(scope) -> str | None:
    """The id ``RequestIdMiddleware`` gave the request of ``scope`` (None outside it)."""
    return (scope.get("state") or {}).get("request_id")


class RequestIdMiddleware:
    """Every HTTP response carries ``x-request-id``, which OpenAI's clients read as a
    response's ``_request_id``: the id the client sent in that header (1 to 128 of
    ``A-Za-z0-9._:-``; another value is replaced), else a new ``req_<32 hex>``. The
    server's logs of the request name it (``request_id(scope)``). Behind the replica
    front, Ray Serve's proxy's id arrives in the header and is kept."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER)
        rid = given.decode() if given is not None and _CLIENT_REQUEST_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


MULTIPART_SLACK_BYTES = 1 << 20   # a form's boundaries and headers around an uploaded file
UPLOAD_TIMEOUT_S = 600.0          # the least time an upload may take to arrive (200 MiB at ~3 Mbit/s)


class GuardMiddleware:
    """Rejects requests without the API key (401; constant-time compare) and
    bodies over ``max_body_bytes`` (413). The body is read here, bounded, and
    replayed to the app; later ``receive`` calls (disconnect) pass through."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, body_timeout_s: float = 30.0,
                 upload_paths: frozenset[str] = frozenset(), max_upload_bytes: int = 0) -> None:
        """``upload_paths``: routes that take files, whose bodies may reach ``max_upload_bytes``
        and ``MULTIPART_SLACK_BYTES`` of form around it, in at least ``UPLOAD_TIMEOUT_S``."""
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.upload_paths, self.max_upload_bytes = upload_paths, max_upload_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope.get("path") not in UNGUARDED_PATHS and scope.get(TRUSTED_OWNERS) is None:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                return await _send_error(send, APIError(
                    401, "missing or invalid API key: send 'Authorization: Bearer <key>'", param="authorization",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        upload = scope.get("path") in self.upload_paths
        limit = self.max_upload_bytes + MULTIPART_SLACK_BYTES if upload else self.max_body_bytes
        timeout_s = max(self.body_timeout_s, UPLOAD_TIMEOUT_S) if upload else self.body_timeout_s
        too_large = APIError(413, f"request body exceeds {limit} bytes", param="body", code="request_too_large")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await _send_error(send, too_large)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await _send_error(send, APIError(
                    408, f"request body not received within {timeout_s:g} s", param="body",
                    code="request_timeout", headers={"Connection": "close"}))
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await _send_error(send, too_large)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class CatchAllMiddleware:
    """An exception no handler took becomes a 500 answered here, so it is not re-raised
    to the server (which would drop the keep-alive connection). Logged in full; the
    client gets only the exception's type. After the response started there is
    nothing to answer: the exception propagates and the server closes the stream."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            # The server cancels what still runs when its shutdown grace ends (uvicorn's
            # ``timeout_graceful_shutdown``): a response not begun is an OpenAI-shaped 503, not
            # uvicorn's plain-text 500 (and its traceback in the log); the request ends here.
            if started:
                raise
            log.warning("request %s on %s cancelled by the server's shutdown: answered 503", request_id(scope),
                        scope.get("path"))
            with contextlib.suppress(Exception):
                await _send_error(send, APIError(503, "the server is shutting down: retry the request",
                                                 code="server_shutting_down"))
        except Exception as e:  # noqa: BLE001 - the last line of defence
            if started:
                raise
            log.exception("unhandled error on %s (request %s)", scope.get("path"), request_id(scope))
            await _send_error(send, APIError(500, f"internal error: {type(e).__name__}"))
