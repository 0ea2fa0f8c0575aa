"""``ApiCalls``: the API calls in flight. Runs them concurrently with the
engine loop and hands results back at step boundaries (``poll(now)``).

Three kinds: simulated calls (a timer on the engine's clock: return given
tokens, or just a token count in the simulator, after a duration),
registered tools (sync callables each on its own thread, async ones on an
event loop thread; each with a timeout; the calls of one turn run at once and
return together, in call order), and external calls resumed by the caller
(``resume``). A tool that raises or times out yields an error text as
its result, so a request never hangs on a tool. The model sees a short,
generic error unless the tool raised ``ToolError`` (text meant for it); the
full exception goes to the log.

A sync tool that hangs past its timeout keeps its thread (Python cannot stop
one), but it no longer blocks anyone: every call gets a fresh thread, so
later calls run at once. Only when ``max_tool_threads`` threads are still
alive are new calls refused (an error result, at once). An awaitable a sync
tool returns (a decorator or lambda around an async function) is awaited on
the async tools' loop, as an async tool is: its thread ends as it returns,
and the call's deadline or its request's abort cancels the awaitable. Results are turned
into text and cut to ``max_result_chars`` on the tool's thread, so a huge
result never reaches the engine thread whole.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import inspect
import logging
import threading
from dataclasses import dataclass

from jaxserve.tool_worker import ToolError
from jaxserve.tools import Tool, call_arguments

log = logging.getLogger("jaxserve")


@dataclass
class ToolOutput:
    """What one tool call returned: its text (cut to ``max_result_chars``; ``full_chars``:
    its length before the cut) or an error text for the model."""

    text: str | None = None
    error: str | None = None
    full_chars: int | None = None


@dataclass
class ApiResult:
    """A returned call. ``token_ids`` or ``outputs`` is the result, or neither when only
    ``num_tokens`` is known (the simulator);
    ``time`` is when it returned on the engine's clock (a timer's due time;
    None: when polled)."""

    request_id: str
    token_ids: list[int] | None = None   # given directly (declared calls, or resume with ids)
    outputs: list[ToolOutput] | None = None   # one turn's tool outputs, in call order (the front end wraps them)
    num_tokens: int = 0                  # returned tokens when no ids are known (simulator)
    time: float | None = None


def _bind(tool: Tool, kwargs: dict) -> None:
    """``ValueError`` (for the model) if the call's arguments do not fit the tool's signature."""
    try:
        inspect.signature(tool.fn).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"tool {tool.name!r} called with wrong arguments: {e}") from None
    except ValueError:   # no signature to check (some builtins): the call itself will tell
        pass


@dataclass
class _Running:
    """One tool call of a turn: its future until ``output`` is known."""

    name: str
    future: concurrent.futures.Future | None
    deadline: float
    output: ToolOutput | None = None


SHUTTING_DOWN = "the engine is shutting down: no tool runs"


class _Call(concurrent.futures.Future):
    """A sync tool call's future. When the tool returns an awaitable (a decorator or
    lambda around an async function), that runs on the async tools' loop as
    ``awaited`` and this future takes its outcome; cancelling this one (the call's
    deadline, its request's abort) cancels ``awaited`` too, though this one is
    already running and so stays uncancelled itself."""

    def __init__(self) -> None:
        super().__init__()
        self.awaited: concurrent.futures.Future | None = None
        self.cancel_requested = False

    def cancel(self) -> bool:
        self.cancel_requested = True
        awaited = self.awaited
        if awaited is not None:
            awaited.cancel()
        return super().cancel()

    def follow(self, awaited: concurrent.futures.Future) -> None:
        """Take ``awaited``'s outcome when it has one (cancelled: ``CancelledError``)."""
        self.awaited = awaited
        if self.cancel_requested:   # (a cancel that came before ``awaited`` was linked)
            awaited.cancel()

        def done(inner: concurrent.futures.Future) -> None:
            if inner.cancelled():
                self.set_exception(concurrent.futures.CancelledError())
            elif inner.exception() is not None:
                self.set_exception(inner.exception())
            else:
                self.set_result(inner.result())
        awaited.add_done_callback(done)


def _as_exception(error: BaseException) -> Exception:
    """A tool's ``SystemExit`` or ``KeyboardInterrupt`` (``sys.exit()`` in a tool, or in a library
    it uses; any ``BaseException`` that is no ``Exception``) as an ordinary failure of that call:
    raised again on the engine's thread or out of the async tools' loop, it would end it."""
    if isinstance(error, Exception):
        return error
    return RuntimeError(f"the tool raised {type(error).__name__}({error})")


def _finished_output(call: _Running, request_id: str, now: float) -> ToolOutput | None:
    """The call's output once its future is done or its deadline passed; else None."""
    name = call.name
    if call.future.done():
        try:
            text, full = call.future.result()
            return ToolOutput(text=text, full_chars=full)
        except ToolError as e:   # written for the model
            return ToolOutput(error=f"tool {name!r}: {str(e)[:500]}")
        except BaseException as e:  # noqa: BLE001 - the tool's own failure (any kind: it must not end the engine)
            log.warning("tool %r failed for %s", name, request_id, exc_info=e)
            return ToolOutput(error=f"tool {name!r} failed (internal error)")
    if now >= call.deadline:
        call.future.cancel()
        log.warning("tool %r timed out for %s", name, request_id)
        return ToolOutput(error=f"tool {name!r} timed out")
    return None


class ApiCalls:
    """Timers, tool threads and external waits, keyed by request id.

    ``max_tool_threads``: sync tool calls alive at once (hung ones included);
    ``max_result_chars``: longest tool result text kept (the engine then fits it
    to its token budget)."""

    def __init__(self, max_tool_threads: int = 64, max_result_chars: int = 64_000) -> None:
        self._timers: list[tuple[float, int, ApiResult]] = []
        self._seq = 0
        self._pending: dict[str, list[_Running]] = {}   # request id -> its turn's tool calls
        self._external: set[str] = set()
        self._ready: list[ApiResult] = []
        self._lock = threading.Lock()
        self.max_tool_threads = max_tool_threads
        self.max_result_chars = max_result_chars
        self.tool_threads_alive = 0
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

    # -------------------------------------------------------------- submit
    def call_simulated(self, request_id: str, due_time: float, token_ids: list[int] | None,
                       num_tokens: int = 0) -> None:
        """A call that returns ``token_ids`` (or, without ids, ``num_tokens``) at ``due_time``."""
        self._seq += 1
        result = ApiResult(request_id, token_ids=None if token_ids is None else list(token_ids),
                           num_tokens=len(token_ids) if token_ids is not None else num_tokens, time=due_time)
        heapq.heappush(self._timers, (due_time, self._seq, result))

    def call_tools(self, request_id: str, calls: list[tuple[Tool, str] | ToolOutput], now: float) -> None:
        """Run the tool calls of one turn at once: ``(tool, JSON arguments)`` each, or a
        ``ToolOutput`` already known (a malformed call's error). One result with every
        output, in call order, when the last one returns (or times out)."""
        running = []
        for call in calls:
            if isinstance(call, ToolOutput):
                running.append(_Running("", None, now, call))
                continue
            tool, arguments = call
            try:
                kwargs = call_arguments(arguments)
                _bind(tool, kwargs)
            except ValueError as e:
                running.append(_Running(tool.name, None, now, ToolOutput(error=str(e))))
                continue
            if tool.is_async:
                try:   # (the loop first, then the coroutine: calling the tool only makes it)
                    loop = self._event_loop()
                    future = asyncio.run_coroutine_threadsafe(self._as_text(tool.fn(**kwargs)), loop)
                except Exception as e:  # noqa: BLE001 - that call's failure (after shutdown; an odd ``__call__``)
                    future = concurrent.futures.Future()
                    future.set_exception(e)
            else:
                future = self._start_thread(tool, kwargs)
            running.append(_Running(tool.name, future, now + tool.timeout_s))
        self._pending[request_id] = running

    def _start_thread(self, tool: Tool, kwargs: dict) -> concurrent.futures.Future:
        future = _Call()
        with self._lock:
            if self._closed or self.tool_threads_alive >= self.max_tool_threads:
                future.set_exception(ToolError(SHUTTING_DOWN if self._closed else
                                               f"tool {tool.name!r} is unavailable: too many tool calls still "
                                               f"running ({self.tool_threads_alive})"))
                return future
            self.tool_threads_alive += 1

        def run() -> None:
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        value = tool.fn(**kwargs)
                        if inspect.isawaitable(value):   # (a decorator, lambda or wrapper returning a coroutine):
                            # awaited on the loop, whose task the call's deadline or abort cancels; the thread is free
                            self._await_on_loop(value, future)
                        else:
                            future.set_result(self._cap(value))
                    except BaseException as e:  # noqa: BLE001 - handed to poll(), as an Exception
                        future.set_exception(_as_exception(e))
            finally:
                with self._lock:
                    self.tool_threads_alive -= 1

        threading.Thread(target=run, name=f"jaxserve-tool-{tool.name}", daemon=True).start()
        return future

    def _await_on_loop(self, awaitable, future: _Call) -> None:
        """``future`` follows ``awaitable`` run on the async tools' loop; one that
        will never run (its call was cancelled while the sync part ran, or the
        engine shuts down) is closed, not left un-awaited."""
        try:
            if future.cancel_requested:
                raise concurrent.futures.CancelledError()
            loop = self._event_loop()
        except BaseException:
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()
            raise
        future.follow(asyncio.run_coroutine_threadsafe(self._as_text(awaitable), loop))

    def _cap(self, value) -> tuple[str, int]:
        """``(text cut to max_result_chars, full length in characters)``, on the tool's thread."""
        text = value if isinstance(value, str) else str(value)
        return text[:self.max_result_chars], len(text)

    async def _as_text(self, awaitable) -> tuple[str, int]:
        try:
            return self._cap(await awaitable)
        except (Exception, asyncio.CancelledError, GeneratorExit):   # (a failure poll() reports; the call's
            raise                                                      # deadline or abort; the coroutine closed)
        except BaseException as e:  # noqa: BLE001 - ``SystemExit`` and the like would end the loop, or the engine
            raise _as_exception(e) from e

    def expect_external(self, request_id: str) -> None:
        with self._lock:
            self._external.add(request_id)

    def resume(self, request_id: str, token_ids: list[int] | None = None,
               text: str | list[str] | None = None) -> None:
        """Deliver an external call's result (thread-safe): token ids, a text, or one text per
        call of the turn (in call order); ``KeyError`` if none is awaited."""
        with self._lock:
            if request_id not in self._external:
                raise KeyError(request_id)
            self._external.discard(request_id)
            texts = None if text is None else [text] if isinstance(text, str) else text
            self._ready.append(ApiResult(request_id, token_ids=token_ids,
                                         outputs=None if texts is None else [ToolOutput(text=t) for t in texts]))

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._external.discard(request_id)
            running = self._pending.pop(request_id, [])
            self._timers = [t for t in self._timers if t[2].request_id != request_id]
            heapq.heapify(self._timers)
        for call in running:
            if call.future is not None:
                call.future.cancel()

    def is_waiting_external(self, request_id: str) -> bool:
        return request_id in self._external

    # ---------------------------------------------------------------- poll
    def poll(self, now: float) -> list[ApiResult]:
        """Results that are ready at ``now``."""
        with self._lock:
            out, self._ready = self._ready, []
        while self._timers and self._timers[0][0] <= now:
            out.append(heapq.heappop(self._timers)[2])
        for request_id, running in list(self._pending.items()):
            for call in running:
                if call.output is None:
                    call.output = _finished_output(call, request_id, now)
            if all(call.output is not None for call in running):
                del self._pending[request_id]
                out.append(ApiResult(request_id, outputs=[call.output for call in running]))
        return out

    def poll_ready(self, now: float) -> bool:
        """True when ``poll(now)`` would return something (cheap check, no side effects)."""
        if self._ready or (self._timers and self._timers[0][0] <= now):
            return True
        return bool(self._pending) and any(all(c.output is not None or c.future.done() or now >= c.deadline for c in running)
                   for running in self._pending.values())

    def ready_after(self) -> float:
        """The earliest time (s) at which ``poll_ready`` can turn True with nothing
        added: the first timer's due time; ``-inf`` when a result is ready, a
        tool is out or an external result is awaited (it may come any moment);
        ``inf`` when nothing is out."""
        if self._ready or self._pending or self._external:
            return float("-inf")
        return self._timers[0][0] if self._timers else float("inf")

    def next_due(self) -> float | None:
        """Earliest time a timer or tool deadline falls due (None if none)."""
        times = [self._timers[0][0]] if self._timers else []
        times += [c.deadline for running in self._pending.values() for c in running if c.output is None]
        return min(times) if times else None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The async tools' loop, on a thread of its own (a new one if the last one ended; none
        after ``shutdown``: a ``ToolError``)."""
        with self._lock:
            if self._closed:
                raise ToolError(SHUTTING_DOWN)
            if self._loop is None or not self._loop_thread.is_alive():
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(target=self._loop.run_forever, name="jaxserve-async-tools",
                                                     daemon=True)
                self._loop_thread.start()
            return self._loop

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
