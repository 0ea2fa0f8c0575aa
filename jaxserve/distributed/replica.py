"""``EngineReplica``: one engine and the single server's app, as a Ray Serve deployment.

Each replica is its own process (a Ray actor) with its own ``AsyncEngine``
and its own devices; it builds exactly what ``jaxserve serve`` builds
(``server.build.build_app``) and serves the requests the front forwards
through that app in-process (``asgi_bridge.call_app``), adding the header
``x-jaxserve-replica: <name>`` to every response.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import AsyncIterator

from jaxserve.distributed.asgi_bridge import Lifespan, call_app

log = logging.getLogger("jaxserve.distributed")

REPLICA_HEADER = "x-jaxserve-replica"


class EngineReplica:
    """A Ray Serve deployment class (decorated by ``launch.build_application``).

    ``settings``: the parsed ``jaxserve serve`` arguments (``vars(args)``);
    ``name``: the replica's name in headers and metric labels; ``prefill``: the
    prefill deployment's handle for a disaggregated decode replica (its engine
    then runs ``--decode-policy``, ``kv_transfer``), else ``None``.
    """

    def __init__(self, settings: dict, name: str, prefill=None) -> None:
        from server.build import build_app

        self.name = name
        args = argparse.Namespace(**settings)
        store = f"responses-{name}.sqlite3"   # (a replica restarted by Ray reopens its own stored responses)
        if prefill is None:
            self.engine, self.app = build_app(args, store_name=store)
        else:
            from jaxserve.distributed.kv_transfer import DisaggregatedEngine, TransferMetrics

            self.engine, self.app = build_app(args, DisaggregatedEngine, store_name=store,
                                              policy=settings["decode_policy"])
            self.engine.prefill = prefill
            self.engine.metrics = TransferMetrics(self.app.state.server.metrics.registry)
        self._lifespan: Lifespan | None = None
        self._starting = asyncio.Lock()   # concurrent first requests start the app once

    async def _started(self) -> None:
        if self._lifespan is not None:
            return
        async with self._starting:
            if self._lifespan is None:
                lifespan = Lifespan(self.app)
                await lifespan.start()   # raises if the app's startup failed: the request fails, the next tries again
                self._lifespan = lifespan

    async def handle(self, method: str, path: str, query_string: bytes, headers: list[tuple[str, str]],
                     body: bytes) -> AsyncIterator[dict | bytes]:
        """Serve one forwarded HTTP request: yields the head, then body chunks."""
        await self._started()
        async for item in call_app(self.app, method, path, query_string, headers, body):
            if isinstance(item, dict):
                item["headers"].append([REPLICA_HEADER, self.name])
            yield item

    async def health(self) -> dict:
        """``{"name", "alive", "cached_pages"}``: whether this replica's engine loop
        runs, and the pages its prefix cache holds (device and host tiers: the
        front keeps as many of its routed prefixes)."""
        usage = self.engine.usage_snapshot   # refreshed by the engine thread
        return {"name": self.name, "alive": self.engine.is_alive,
                "cached_pages": usage["prefix_cached_pages"] + usage["prefix_cached_host_pages"]}

    async def metrics(self) -> str:
        """This replica's Prometheus text (the single server's ``/metrics``)."""
        await self._started()
        return self.app.state.server.metrics.render().decode()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
