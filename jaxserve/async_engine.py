"""``AsyncEngine``: the engine loop on a background thread, driven from asyncio.

The thread owns the ``LLMEngine`` exclusively; callers send it commands
through a queue and receive outputs on per-request asyncio queues. A step
that raises aborts the live requests (their streams get the error) and the
loop keeps serving; if the loop itself ends, every pending command and open
stream gets ``EngineDeadError`` (nobody waits forever).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import uuid
from typing import AsyncIterator, Callable

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.outputs import ApiCall, RequestOutput
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger("jaxserve")


@dataclasses.dataclass(slots=True)
class _Stream:
    """Where one request's outputs go: a queue read on ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    entered: bool = False   # its add/resume command ran: the engine owes it a final output or an error


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class AsyncEngine:
    """``async for out in engine.generate(prompt, params, request_id=...)`` streams
    ``RequestOutput`` deltas; ``await engine.abort(request_id)``."""

    max_consecutive_failures = 5

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, *,
                 engine: LLMEngine | None = None, **engine_kwargs) -> None:
        self.engine = engine if engine is not None else LLMEngine(model, config, **engine_kwargs)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._closing = threading.Lock()
        self._dead_reason: str | None = None
        self.usage_snapshot: dict = self.engine.usage()
        self.stats_snapshot = dataclasses.replace(self.engine.stats, finished={})
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public API
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead_reason is None and self.engine.failure is None

    async def generate(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, prompt_token_ids: list[int] | None = None,
                       api_calls: list[ApiCall] | None = None,
                       parse_tool_calls: bool | None = None,
                       parse_reasoning: bool | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream outputs until the request finishes (or pauses on a client-side
        tool call: ``finish_reason == "tool_calls"``; continue it with ``resume``).
        Closing the iterator early aborts the request. ``parse_tool_calls``,
        ``parse_reasoning`` and ``priority``: as ``LLMEngine.add_request``."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        stream = self._open_stream(request_id)
        try:
            await self._call(lambda: self._entered(request_id, self.engine.add_request(
                request_id, prompt, sampling_params, prompt_token_ids, api_calls, parse_tool_calls,
                parse_reasoning=parse_reasoning, priority=priority)))
        except BaseException as e:
            self._streams.pop(request_id, None)
            if isinstance(e, asyncio.CancelledError):  # the command may have run: never leave it orphaned
                self._post_abort(request_id)
            raise
        async for out in self._drain(request_id, stream):
            yield out

    async def resume(self, request_id: str, token_ids: list[int] | None = None,
                     text: str | list[str] | None = None, max_tokens: int | None = None,
                     priority: int | None = None) -> AsyncIterator[RequestOutput]:
        """Return a client-side tool's result to a paused request and stream the continuation
        (``max_tokens``: a fresh budget for it; ``priority``: its class, None: the request's).
        ``KeyError`` if the request is not paused on such a call."""
        stream = self._open_stream(request_id)
        try:
            await self._call(lambda: self._entered(request_id, self.engine.resume(
                request_id, token_ids=token_ids, text=text, max_tokens=max_tokens, priority=priority)))
        except BaseException as e:
            self._streams.pop(request_id, None)
            if isinstance(e, asyncio.CancelledError):
                self._post_abort(request_id)
            raise
        async for out in self._drain(request_id, stream):
            yield out

    async def abort(self, request_id: str) -> bool:
        """Abort a live request and free its pages; False if it was not live. Its stream,
        if one is open, gets the final output (``finish_reason == "abort"``) and ends."""
        if not self.is_alive:
            return False
        return await self._call(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> bool:
        """On the engine thread: abort ``request_id`` and hand its stream the final output."""
        out = self.engine.abort(request_id)
        if out is not None:
            self._deliver(request_id, out)
        return out is not None

    async def call_on_engine(self, fn: Callable):
        """Run ``fn()`` on the engine thread between steps and return its result (e.g. KV
        page export/import for disaggregation, which must not race a step)."""
        return await self._call(fn)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        self.engine.shutdown()

    # -------------------------------------------------------------- plumbing
    def _open_stream(self, request_id: str) -> asyncio.Queue:
        if not self.is_alive:
            raise EngineDeadError(self._dead_reason or self.engine.failure or "engine loop is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already streaming")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = _Stream(asyncio.get_running_loop(), q)
        return q

    def _entered(self, request_id: str, result):
        """On the engine thread, right after the command that put ``request_id`` in the
        engine (add, resume) ran: its stream is now owed a final output or an error."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.entered = True
        return result

    async def _drain(self, request_id: str, stream: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        done = False
        try:
            while True:
                try:
                    # Not ``asyncio.wait_for``: on Python 3.11 it returns the output and drops a cancel that
                    # lands as the output arrives (CPython gh-86296): the request would run to its end.
                    async with asyncio.timeout(1.0):
                        out = await stream.get()
                except asyncio.TimeoutError:
                    if not self.is_alive:   # e.g. a multi-host worker died while a step waits on it
                        done = True
                        raise EngineDeadError(self._dead_reason or self.engine.failure or "engine stopped") from None
                    continue
                if isinstance(out, BaseException):
                    done = True
                    raise out
                done = out.finished
                yield out
                if done:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not done:  # the consumer went away (e.g. client disconnect): free the request
                try:
                    await asyncio.shield(self.abort(request_id))
                except Exception:  # noqa: BLE001 - best effort during teardown
                    log.exception("abort of %s after disconnect failed", request_id)

    async def _call(self, fn: Callable):
        """Run ``fn`` on the engine thread and await its result (exceptions propagate)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._closing:  # the loop drains the inbox under this lock when it ends
            if not self.is_alive:
                raise EngineDeadError(self._dead_reason or self.engine.failure or "engine loop is not running")
            self._inbox.put((fn, future))
        return await asyncio.wrap_future(future)

    def _post_abort(self, request_id: str) -> None:
        """Queue an abort without waiting (usable while the caller is being cancelled);
        commands run in order, so it lands after any command already queued for the request."""
        with self._closing:
            if self.is_alive:
                self._inbox.put((lambda: self._abort_now(request_id), concurrent.futures.Future()))

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # that event loop has closed: nobody is listening
                self._streams.pop(request_id, None)

    def _run_commands(self, timeout: float | None) -> None:
        try:
            item = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            # A caller cancelled while its command was queued no longer wants it run; once
            # running, the future cannot be cancelled, so setting its outcome cannot fail.
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - delivered to the caller
                    future.set_exception(e)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._publish_snapshots()  # commands (abort, resume) change usage without a step

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - reported to every waiter below
            log.exception("engine loop crashed")
            self._dead_reason = self._dead_reason or f"engine loop crashed: {e}"
        finally:
            with self._closing:
                self._dead_reason = self._dead_reason or "engine stopped"
                while True:
                    try:
                        item = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None and item[1].set_running_or_notify_cancel():
                        item[1].set_exception(EngineDeadError(self._dead_reason))
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(self._dead_reason))

    def _loop(self) -> None:
        """``EngineCore.run`` with this thread's hooks: commands from the event
        loops are run once per pass and while idle; outputs go to the streams.
        A step that raises fails the requests in flight and the loop goes on,
        unless steps keep failing with no step succeeding in between."""
        engine = self.engine
        core = engine.core
        failures, steps_at_failure = 0, -1

        def idle(until: float | None) -> None:
            wait = 0.05 if until is None else min(0.05, max(0.0005, until - engine.clock.now()))
            self._run_commands(wait)

        def deliver(requests) -> None:
            for out in engine.outputs(requests):   # a request the engine failed gets its error, raised
                self._deliver(out.request_id, out if out.error is None else RuntimeError(f"request failed: {out.error}"))
            self._publish_snapshots()

        while not self._stop.is_set():
            try:
                core.run(done=self._stop.is_set, observe=lambda now: self._run_commands(None),
                         on_outputs=deliver, idle=idle)
            except Exception as e:  # noqa: BLE001 - isolate the failure to the requests in flight
                failures = failures + 1 if core.stats.steps == steps_at_failure else 1
                steps_at_failure = core.stats.steps
                log.exception("engine step failed")
                self._fail_all(e)
                if failures >= self.max_consecutive_failures:
                    self._dead_reason = f"engine step failed {failures} times in a row: {e}"
                    break

    def _publish_snapshots(self) -> None:
        self.usage_snapshot = self.engine.usage()
        self.stats_snapshot = dataclasses.replace(self.engine.stats, finished=dict(self.engine.stats.finished))

    def _fail_all(self, error: Exception) -> None:
        """End every live request with reason "error" after a failed step (its state may be
        half-applied; the finish counts say "error", not a client's "abort"), then fail every
        stream owed an output: the live ones, and one whose request ended earlier in the
        failed step (no longer live, its final output lost with the step). A stream whose
        final output is already queued stops before reading the error. The metrics' gauges
        are published again (nothing may run until the next request)."""
        core = self.engine.core
        for request in list(self.engine.scheduler.requests.values()):
            try:
                request.error = f"engine step failed: {error}"[:500]
                core.finish(request, "error")
            except Exception:  # noqa: BLE001 - keep ending the others
                log.exception("ending %s after a failed step failed", request.request_id)
        self._publish_snapshots()   # (before the streams hear of it)
        for request_id, stream in list(self._streams.items()):
            if stream.entered:
                self._deliver(request_id, RuntimeError(f"engine step failed: {error}"))
