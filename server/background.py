"""Background responses: ``POST /v1/responses`` with ``background: true``.

A background response runs on the server whatever its client does, as OpenAI's
background mode does for long agent runs:

- the create call answers at once with the response ``queued``; streamed
  (``stream: true`` too), its connection follows the run's events, and dropping
  it does not stop the run;
- ``GET /v1/responses/{id}`` polls it: ``queued`` until the engine produced its
  first output, then ``in_progress`` with the text so far, then the final
  object (``completed``, ``incomplete``, ``failed`` or ``cancelled``), which is
  stored as any stored response is (``ResponseStore``);
- ``GET /v1/responses/{id}?stream=true&starting_after=N`` replays the events
  after sequence number N and follows the rest (a dropped stream resumes);
- ``POST /v1/responses/{id}/cancel`` stops it: its engine requests are aborted
  (their KV freed) and it ends ``cancelled`` with what it had produced.

``BackgroundRun`` is one run's event log and state; ``BackgroundRuns`` keeps the
runs of the server: live ones until they end, ended ones (for resumed streams)
for ``retention_s`` seconds (OpenAI keeps background data about 10 minutes)
within ``max_event_bytes`` of events. Only the API key that created a run sees
it. Used from the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import AsyncIterator, Callable, Coroutine

log = logging.getLogger("jaxserve.server")


class BackgroundRun:
    """One background response: its stream's events (index = ``sequence_number``), its
    state while it runs, its final object once it ended."""

    def __init__(self, response_id: str, owner: str, snapshot: Callable[[str], dict],
                 input_items: list[dict]) -> None:
        """``snapshot(status)``: the response object while it runs (``ResponsesWire.snapshot``);
        ``input_items``: its input as the API lists it (``responses.input_items``)."""
        self.response_id, self.owner, self.input_items = response_id, owner, input_items
        self.status = "queued"            # then "in_progress" (``started``); the final status once ended
        self.events: list[str] = []
        self.num_bytes = 0                # of ``events``
        self.final: dict | None = None
        self.ended_at: float | None = None   # when its task ended (``BackgroundRuns.clock``)
        self.task: asyncio.Task | None = None
        self.snapshot = snapshot
        self._wake = asyncio.Event()      # set (and replaced) whenever an event is added or the run ends

    @property
    def done(self) -> bool:
        return self.final is not None

    def response(self) -> dict:
        """The response object now: the final one, or a snapshot of the run."""
        return self.final if self.final is not None else self.snapshot(self.status)

    def started(self) -> None:
        self.status = "in_progress"

    def add(self, events: list[str]) -> None:
        if events:
            self.events += events
            self.num_bytes += sum(map(len, events))
            self._notify()

    def end(self, final: dict) -> None:
        self.final, self.status = final, final["status"]
        self.snapshot = None   # (it holds the run's choices and merger: not kept with an ended run)
        self._notify()

    def _notify(self) -> None:
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number ``starting_after``, those to come included,
        until the run ends (its last event: ``response.completed``, ``.incomplete`` (for a
        cancelled run too: the API has no event for that), or ``.failed``)."""
        at = starting_after + 1
        while True:
            wake = self._wake
            while at < len(self.events):
                yield self.events[at]
                at += 1
            if self.done:
                return
            await wake.wait()


class BackgroundRuns:
    """The server's background runs, by response id."""

    def __init__(self, retention_s: float = 600.0, max_event_bytes: int = 64 * 2**20,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.retention_s, self.max_event_bytes, self.clock = retention_s, max_event_bytes, clock
        self._live: dict[str, BackgroundRun] = {}
        self._ended: OrderedDict[str, BackgroundRun] = OrderedDict()   # oldest end first
        self._ended_bytes = 0

    @property
    def num_live(self) -> int:
        return len(self._live)

    async def start(self, run: BackgroundRun, body: Coroutine) -> None:
        """Run ``body`` (which ends ``run`` and frees what it holds) as a task; ``run`` is
        listed from now on. Returns once the task has taken its first step: a task
        cancelled before that would never enter ``body``, whose cleanup would not run."""
        self._live[run.response_id] = run
        run.task = asyncio.get_running_loop().create_task(body)
        run.task.add_done_callback(lambda _: self._ended_run(run))
        await asyncio.sleep(0)   # (tasks take their steps in order: the new one goes first)

    def _ended_run(self, run: BackgroundRun) -> None:
        if not run.done:   # ``body`` failed to end it (a bug): never leave a poller or a stream waiting
            log.error("background response %s ended without a final object", run.response_id)
            run.end({**run.snapshot("failed"),
                     "error": {"code": "server_error", "message": "the background run ended unexpectedly"}})
        run.ended_at = self.clock()
        if self._live.pop(run.response_id, None) is None:
            return   # (dropped while it ran: ``drop``)
        self._ended[run.response_id] = run
        self._ended_bytes += run.num_bytes
        self._prune()

    def _prune(self) -> None:
        """Forget ended runs older than ``retention_s``, then the oldest while over ``max_event_bytes``."""
        now = self.clock()
        while self._ended:
            run = next(iter(self._ended.values()))
            if now - run.ended_at <= self.retention_s and self._ended_bytes <= self.max_event_bytes:
                break
            self.drop(run.response_id)

    def get(self, response_id: str, owner: str) -> BackgroundRun | None:
        """The run, live or ended within retention, if ``owner`` created it."""
        self._prune()
        run = self._live.get(response_id) or self._ended.get(response_id)
        return run if run is not None and run.owner == owner else None

    def drop(self, response_id: str) -> None:
        """Forget the run (its task, if live, goes on: cancel it first)."""
        self._live.pop(response_id, None)
        run = self._ended.pop(response_id, None)
        if run is not None:
            self._ended_bytes -= run.num_bytes

    async def cancel(self, run: BackgroundRun) -> dict:
        """Stop ``run`` if it still runs; its final object (as it ended: cancelling an ended
        run changes nothing)."""
        if not run.done and run.task is not None:
            if not run.task.cancelling():   # (a second cancel would cut the first one's cleanup short)
                run.task.cancel()
            await asyncio.wait({run.task})   # (never cancels the task, even if this caller is cancelled)
        return run.response()

    async def close(self) -> None:
        """Cancel every live run (server shutdown)."""
        await asyncio.gather(*(self.cancel(run) for run in list(self._live.values())))
