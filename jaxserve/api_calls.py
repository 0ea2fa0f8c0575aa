"""``ApiCalls``: the API calls in flight. Runs them concurrently with the
engine loop and hands results back at step boundaries (``poll(now)``).

Three kinds: simulated calls (a timer on the engine's clock: return given
tokens, or just a token count in the simulator, after a duration),
registered tools (sync callables on a thread pool, async ones on an event loop
thread; each with a timeout), and external calls resumed by the caller
(``resume``). A tool that raises or times out yields an error text as its
result, so a request never hangs on a tool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import threading
from dataclasses import dataclass

from jaxserve.tools import Tool, call_arguments


@dataclass
class ApiResult:
    """A returned call. Exactly one of ``token_ids``/``text``/``error`` is the
    result, or none when only ``num_tokens`` is known (the simulator);
    ``time`` is when it returned on the engine's clock (a timer's due time;
    None: when polled)."""

    request_id: str
    token_ids: list[int] | None = None   # given directly (declared calls, or resume with ids)
    text: str | None = None              # to be tokenized (and wrapped) by the engine's front end
    error: str | None = None
    num_tokens: int = 0                  # returned tokens when no ids are known (simulator)
    time: float | None = None


class ApiCalls:
    """Timers, tool futures and external waits, keyed by request id."""

    def __init__(self, max_workers: int = 16) -> None:
        self._timers: list[tuple[float, int, ApiResult]] = []
        self._seq = 0
        self._pending: dict[str, tuple[concurrent.futures.Future, float, str]] = {}
        self._external: set[str] = set()
        self._ready: list[ApiResult] = []
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="jaxserve-tool")
        self._loop: asyncio.AbstractEventLoop | None = None

    # -------------------------------------------------------------- submit
    def call_simulated(self, request_id: str, due_time: float, token_ids: list[int] | None,
                       num_tokens: int = 0) -> None:
        """A call that returns ``token_ids`` (or, without ids, ``num_tokens``) at ``due_time``."""
        self._seq += 1
        result = ApiResult(request_id, token_ids=None if token_ids is None else list(token_ids),
                           num_tokens=len(token_ids) if token_ids is not None else num_tokens, time=due_time)
        heapq.heappush(self._timers, (due_time, self._seq, result))

    def call_tool(self, request_id: str, tool: Tool, arguments: str, now: float) -> None:
        try:
            kwargs = call_arguments(arguments)
        except ValueError as e:
            self.fail(request_id, str(e))
            return
        if tool.is_async:
            try:
                coroutine = tool.fn(**kwargs)   # binds the arguments here, on the engine thread
            except TypeError as e:
                self.fail(request_id, f"tool {tool.name!r} failed: {e}")
                return
            future = asyncio.run_coroutine_threadsafe(coroutine, self._event_loop())
        else:
            future = self._pool.submit(tool.fn, **kwargs)
        self._pending[request_id] = (future, now + tool.timeout_s, tool.name)

    def fail(self, request_id: str, error: str) -> None:
        """Answer a call with an error right away (e.g. a malformed call)."""
        with self._lock:
            self._ready.append(ApiResult(request_id, error=error))

    def expect_external(self, request_id: str) -> None:
        with self._lock:
            self._external.add(request_id)

    def resume(self, request_id: str, token_ids: list[int] | None = None, text: str | None = None) -> None:
        """Deliver an external call's result (thread-safe); ``KeyError`` if none is awaited."""
        with self._lock:
            if request_id not in self._external:
                raise KeyError(request_id)
            self._external.discard(request_id)
            self._ready.append(ApiResult(request_id, token_ids=token_ids, text=text))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._external.discard(request_id)
            entry = self._pending.pop(request_id, None)
            self._timers = [t for t in self._timers if t[2].request_id != request_id]
            heapq.heapify(self._timers)
        if entry is not None:
            entry[0].cancel()

    def is_waiting_external(self, request_id: str) -> bool:
        return request_id in self._external

    # ---------------------------------------------------------------- poll
    def poll(self, now: float) -> list[ApiResult]:
        """Results that are ready at ``now``."""
        with self._lock:
            out, self._ready = self._ready, []
        while self._timers and self._timers[0][0] <= now:
            out.append(heapq.heappop(self._timers)[2])
        for request_id, (future, deadline, name) in list(self._pending.items()):
            if future.done():
                del self._pending[request_id]
                try:
                    out.append(ApiResult(request_id, text=str(future.result())))
                except Exception as e:  # the tool's own failure becomes the call's result
                    out.append(ApiResult(request_id, error=f"tool {name!r} failed: {type(e).__name__}: {e}"))
            elif now >= deadline:
                del self._pending[request_id]
                future.cancel()
                out.append(ApiResult(request_id, error=f"tool {name!r} timed out"))
        return out

    def poll_ready(self, now: float) -> bool:
        """True when ``poll(now)`` would return something (cheap check, no side effects)."""
        if self._ready or (self._timers and self._timers[0][0] <= now):
            return True
        return any(f.done() or now >= d for f, d, _ in self._pending.values())

    def next_due(self) -> float | None:
        """Earliest time a timer or tool deadline falls due (None if none)."""
        times = [self._timers[0][0]] if self._timers else []
        times += [deadline for _, deadline, _ in self._pending.values()]
        return min(times) if times else None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="jaxserve-async-tools", daemon=True).start()
        return self._loop

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
