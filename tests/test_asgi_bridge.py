"""The in-process ASGI bridge a replica serves through (``jaxserve.distributed.asgi_bridge``; no Ray)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest
from fastapi import FastAPI

from jaxserve.distributed.asgi_bridge import Lifespan, call_app


def test_a_failed_startup_is_an_error_not_a_started_app():
    @asynccontextmanager
    async def lifespan(app):
        raise RuntimeError("the parked-context reaper could not start")
        yield

    app = FastAPI(lifespan=lifespan)

    async def start():
        await asyncio.wait_for(Lifespan(app).start(), timeout=10)

    with pytest.raises(RuntimeError, match=r"(?s)startup failed.*reaper could not start"):
        asyncio.run(start())


def test_startup_runs_once_then_requests_are_served_and_shutdown_runs():
    events = []

    @asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.get("/ping")
    async def ping():
        return {"ok": True}

    async def run():
        lifespan_runner = Lifespan(app)
        await asyncio.wait_for(lifespan_runner.start(), timeout=10)
        items = [item async for item in call_app(app, "GET", "/ping", b"", [], b"")]
        await lifespan_runner.stop()
        return items

    head, body = asyncio.run(run())
    assert head["status"] == 200 and body == b'{"ok":true}'
    assert events == ["startup", "shutdown"]
