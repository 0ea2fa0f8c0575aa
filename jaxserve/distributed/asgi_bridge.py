"""Call an ASGI app in-process: one HTTP request in, its response out as a stream.

A replica runs the single server's app (``server.app.create_app``) unchanged
and serves each forwarded request through it, so routes, validation, errors
and auth are the single server's. No socket is involved: the request's scope
and body are handed to the app, and what it sends comes back as a head
(``{"status": int, "headers": [[name, value], ...]}``, ``str`` names and
values) followed by body chunks (``bytes``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

log = logging.getLogger("jaxserve.distributed")


class Lifespan:
    """Runs an app's ASGI lifespan (startup now, shutdown on ``stop``). A startup
    the app reports failed raises ``RuntimeError`` from ``start``."""

    def __init__(self, app) -> None:
        self.app = app
        self._started = asyncio.Event()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failure: str | None = None

    async def start(self) -> None:
        sent_startup = False

        async def receive():
            nonlocal sent_startup
            if not sent_startup:
                sent_startup = True
                return {"type": "lifespan.startup"}
            await self._stopping.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message):
            if message["type"] == "lifespan.startup.failed":
                self._failure = message.get("message", "")
            if message["type"].startswith("lifespan.startup"):
                self._started.set()

        self._task = asyncio.create_task(self.app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
        await self._started.wait()
        if self._failure is not None:
            await asyncio.gather(self._task, return_exceptions=True)   # the app re-raises after reporting it
            raise RuntimeError(f"app startup failed: {self._failure}")

    async def stop(self) -> None:
        self._stopping.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, timeout=10)


async def call_app(app, method: str, path: str, query_string: bytes, headers: list[tuple[str, str]],
                   body: bytes, client: tuple[str, int] = ("127.0.0.1", 0),
                   scope_extra: dict | None = None) -> AsyncIterator[dict | bytes]:
    """Serve one request with ``app``: yields the head dict, then body chunks.
    Closing the iterator early tells the app the client disconnected. ``scope_extra``:
    more ASGI scope entries (an in-process caller's, ``server.middleware.TRUSTED_OWNERS``)."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await messages.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": query_string, "client": client, "server": ("127.0.0.1", 0),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             **(scope_extra or {})}
    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
                return
            if message["type"] == "http.response.start":
                yield {"status": message["status"],
                       "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=10)
            except Exception:  # noqa: BLE001 - the app's own teardown failed or hung: drop it
                log.warning("request %s %s did not end after its client left", method, path)
