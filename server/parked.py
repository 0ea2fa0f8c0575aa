"""Paused client-side tool-call contexts kept for the follow-up request.

When a chat response ends with ``finish_reason: "tool_calls"`` the engine
request stays paused (its KV cache handled by the policy: preserved, swapped
or discarded). The client then sends the whole conversation again with the
tool's result. If that conversation, rendered with the chat template, starts
with the paused request's context token ids (prompt + generated), the server
resumes the paused request with only the remaining tokens instead of
computing the conversation from scratch. A context belongs to its ``owner``
(the API key and ``user`` that created it): another owner's follow-up never
matches it. Contexts nobody comes back for are aborted after ``ttl_s``
seconds, which frees their pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("jaxserve.server")


@dataclass
class ParkedContext:
    request_id: str
    context_ids: list[int]      # every token in the request's context at the pause
    sampling_key: tuple         # sampling settings the continuation must share (all but max_tokens)
    calls_seen: int             # API calls of the request whose pause time was already observed
    expires_at: float
    owner: str = ""             # who created it (a hash of API key and user); only they may resume it


class ParkedContexts:
    def __init__(self, engine, ttl_s: float, clock=time.monotonic) -> None:
        if ttl_s < 0:
            raise ValueError(f"paused_context_ttl_s must be >= 0, got {ttl_s}")
        self.engine = engine
        self.ttl_s = ttl_s
        self.clock = clock
        self._contexts: dict[str, ParkedContext] = {}
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._contexts)

    async def park(self, request_id: str, context_ids: list[int], sampling_key: tuple, calls_seen: int,
                   owner: str = "") -> None:
        """Keep a paused request for resumption (aborted at once when the TTL is 0)."""
        if self.ttl_s == 0:
            await self._abort(request_id)
            return
        self._contexts[request_id] = ParkedContext(request_id, list(context_ids), sampling_key, calls_seen,
                                                   self.clock() + self.ttl_s, owner)

    async def take(self, token_ids: list[int], sampling_key: tuple, owner: str = "") -> ParkedContext | None:
        """Remove and return ``owner``'s parked context with the longest context that is a
        strict prefix of ``token_ids``; ``None`` when none is. A matching context
        with other sampling settings cannot continue this request: it is aborted.
        Other owners' contexts are neither matched nor touched."""
        best = None
        for ctx in self._contexts.values():
            n = len(ctx.context_ids)
            if ctx.owner == owner and n < len(token_ids) and (best is None or n > len(best.context_ids)) \
                    and token_ids[:n] == ctx.context_ids:
                best = ctx
        if best is None:
            return None
        del self._contexts[best.request_id]
        if best.sampling_key != sampling_key:
            await self._abort(best.request_id)
            return None
        return best

    def start(self) -> None:
        """Start the expiry loop (call from within the running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._expire_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for request_id in list(self._contexts):
            del self._contexts[request_id]
            await self._abort(request_id)

    async def expire(self) -> int:
        """Abort contexts past their TTL; returns how many."""
        now = self.clock()
        expired = [c.request_id for c in self._contexts.values() if c.expires_at <= now]
        for request_id in expired:
            del self._contexts[request_id]
            await self._abort(request_id)
        return len(expired)

    async def _expire_loop(self) -> None:
        interval = min(1.0, max(0.05, self.ttl_s / 4))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire()
            except Exception:  # noqa: BLE001 - keep expiring even if one abort fails
                log.exception("expiring paused tool contexts failed")

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 - the engine may be dead; nothing left to free then
            log.warning("abort of paused context %s failed", request_id, exc_info=True)
