"""Decode-only steps in bulk, for simulators (``open_decode_run``).

Most steps of a simulated run only give each running request its next token:
no admission, no swap, no stop rule, nothing returning. A ``DecodeRun`` does
what ``schedule()`` + executor + ``update()`` would do for such steps, one
step per ``step(t)`` call, at a cost that does not grow with the batch:

- it applies while every running request decodes, nothing can be admitted
  (empty queue, or ``max_num_seqs`` running), nothing swaps or resumes, and
  the policy neither orders the batch (``order_running``), nor watches plans
  (``on_plan``), nor re-decides calls held under Preserve;
- it ends (``step`` returns None) before a step that would end or pause a
  request (max_tokens, the context limit, the end of a declared segment),
  lack pages (the ordered pass would preempt), or exceed a dynamic token
  budget; the caller also ends it before anything from outside (an arrival,
  an API return) and then calls ``close``;
- per step it does what such a step does: the policy's per-step work
  (``Scheduler._policy_step``), the page allocations of the decoders whose
  token starts a page (evicting cached pages and planning host-tier copies
  as ``schedule()`` would), the executor's step (``steps_of(num_tokens)``
  gives the function ``(context_tokens, copy_out) -> seconds`` that runs one;
  it moves the clock and the counters) and the prefix-cache commits of
  pages that fill;
- the requests' own counters (computed tokens, generated tokens, ...) are
  added when they are next needed (a commit, ``close``), so the scheduler is
  exactly as after that many steps once the run is closed.

Pure Python, like the rest of ``scheduler``.
"""

from __future__ import annotations

import heapq
from typing import Callable

from scheduler.plan import SwapOp
from scheduler.request import Request
from scheduler.scheduler import Scheduler

StepsOf = Callable[[int], Callable[[int, SwapOp | None], float]]

_ALLOCATE, _COMMIT, _END = 0, 1, 2   # page events: a page before the step, a filled page into the cache after it; a request ending after it


def open_decode_run(scheduler: Scheduler, steps_of: StepsOf,
                    on_finish: Callable[[Request, int], None] | None = None) -> DecodeRun | None:
    """A ``DecodeRun`` over ``scheduler``'s coming decode-only steps, or None when
    the next step is not one. ``steps_of(num_tokens)``: the executor's step for
    that many one-token chunks, ``(context_tokens, copy_out) -> seconds``.
    ``on_finish(request, steps)``: the run also runs steps in which requests
    finish (see ``DecodeRun``) and reports each after ``Scheduler.finish``, with
    the run's steps it took part in; None: the run ends before such a step."""
    decoders = scheduler.quiet_decoders()
    if not decoders:
        return None
    run = DecodeRun(scheduler, decoders, steps_of, on_finish)
    return run if run.headroom > 0 else None


def decode_stop(request: Request, limit: float) -> tuple[int, bool]:
    """``(steps, ends)``: the steps ``request`` can decode (one token each) before
    one of ``update()``'s stop rules may fire on it (max_tokens, the context
    ``limit``, the end of its declared segment), and whether the rule that fires
    in the step after them ends it ("length"; False: a call, or a segment end
    that does nothing)."""
    room = min(request.max_tokens - request.num_generated, limit - request.num_tokens)
    segments = request.segments
    ends = True
    if segments and request.segment_index < len(segments):
        segment = segments[request.segment_index]
        left = segment.num_tokens - request.segment_generated
        if left < room or (left == room and segment.api_type is not None):
            room, ends = left, segment.api_type is None and request.segment_index == len(segments) - 1
    return int(room) - 1, ends


class DecodeRun:
    """Decode-only steps of ``scheduler``'s running batch ``decoders`` (see module doc)."""

    def __init__(self, scheduler: Scheduler, decoders: list[Request], steps_of: StepsOf,
                 on_finish: Callable[[Request, int], None] | None = None) -> None:
        self.scheduler = scheduler
        self.decoders = decoders
        self.steps = 0
        self.finished: list[Request] = []   # requests the run ended (``on_finish``), for the caller to take
        kv, config = scheduler.kv, scheduler.config
        self._page_size = ps = kv.page_size
        limit = scheduler.context_limit
        limit = float("inf") if limit is None else limit
        # (step, _ALLOCATE | _COMMIT | _END, position, request): a heap, so a step touches only its events.
        events = []
        headroom = float("inf")
        for i, r in enumerate(decoders):
            last, ends = decode_stop(r, limit)
            if ends and on_finish is not None:
                events.append((last, _END, i, r))
            elif last < headroom:
                headroom = last
        self.headroom = headroom   # steps before the run must end (lowered when it must end sooner)
        self._dynamic_budget = config.token_budget == "dynamic" or (
            config.token_budget == "policy" and scheduler.policy.dynamic_budget is not None)
        if not self._dynamic_budget and max(1, scheduler._token_budget(scheduler.view())) < len(decoders):
            self.headroom = 0
        if self.headroom <= 0:
            return   # not a run: the caller drops it (the rest is built only for a run)
        events += [(len(r.device_pages) * ps - r.num_computed_tokens, _ALLOCATE, i, r)
                   for i, r in enumerate(decoders)]
        if kv.cache is not None:
            events += [((ps - (r.num_computed_tokens + 1) % ps) % ps, _COMMIT, i, r) for i, r in enumerate(decoders)]
        heapq.heapify(events)
        self._events = events
        self._steps_of, self._on_finish = steps_of, on_finish
        self.run_step = steps_of(len(decoders))
        self._swap_pages = max(1, config.swap_budget_tokens // ps)
        self._reads = sum(r.num_computed_tokens for r in decoders) + len(decoders)   # the next step's attention reads
        self._synced = dict.fromkeys(decoders, 0)   # steps already added to each request's counters
        self._live = set(decoders)                  # not finished
        self._last_start = 0.0

    def step(self, t: float) -> float | None:
        """Run the next step, starting at ``t`` (s); its seconds, or None (nothing
        run) when it is not a plain decode step. Requests it ended are appended to
        ``finished``."""
        k = self.steps
        if k >= self.headroom:
            return None
        sched, live, events = self.scheduler, self._live, self._events
        n = len(live)
        kv = sched.kv
        if self._dynamic_budget and max(1, sched._token_budget(sched.view())) < n:
            return None
        due = None
        if events[0][0] == k and events[0][1] == _ALLOCATE:
            due = []   # (position, request) whose token this step starts a page
            while events and events[0][0] == k and events[0][1] == _ALLOCATE:
                event = heapq.heappop(events)
                if event[3] in live:
                    due.append(event[2:])
            if len(due) > kv.num_free_device:
                for pos, r in due:
                    heapq.heappush(events, (k, _ALLOCATE, pos, r))
                return None   # the ordered pass preempts here
        sched.iteration += 1
        sched.now = t
        sched._policy_step(t)
        copy_out = None
        if due:
            kv.copy_budget = self._swap_pages
            kv.add_page_each([r for _, r in due])
            if kv.host_tier:
                copy_out = kv.take_copies()[0]
            kv.copy_budget = 0
            for pos, r in due:
                heapq.heappush(events, (k + self._page_size, _ALLOCATE, pos, r))
        dt = self.run_step(self._reads, copy_out)
        if due:
            kv.copies_done()
        sched._running_tokens += n
        self._reads += n
        self.steps = k + 1
        self._last_start = t
        ending = None
        while events and events[0][0] == k:   # pages this step filled: into the prefix cache; then ends
            _, kind, pos, r = heapq.heappop(events)
            if r not in live:
                continue
            self._sync(r)
            if kind == _COMMIT:
                kv.commit(r)
                heapq.heappush(events, (k + self._page_size, _COMMIT, pos, r))
            else:
                ending = [r] if ending is None else ending + [r]
        if ending:
            self._finish(ending, t + dt)
        return dt

    def _finish(self, ending: list[Request], now: float) -> None:
        """End ``ending`` (their last token just ran) as ``update()`` would: in batch
        order, at ``now`` (s); the run goes on with the others while nothing can
        be admitted."""
        sched, live = self.scheduler, self._live
        decoding = sched._decoding
        ending.sort(key=lambda r: decoding[r].place)
        for r in ending:
            live.discard(r)
            self._reads -= r.num_computed_tokens + 1
            sched.finish(r, "length", now)
            self._on_finish(r, self._synced[r])
            self.finished.append(r)
        if not live or (sched.waiting and len(sched.running) < sched.config.max_num_seqs):
            self.headroom = self.steps
        else:
            self.run_step = self._steps_of(len(live))

    def _sync(self, request: Request) -> None:
        """Add the steps run since the last sync to ``request``'s counters."""
        steps = self.steps - self._synced[request]
        if steps:
            request.num_computed_tokens += steps
            request.num_tokens += steps
            request.num_generated += steps
            request.segment_generated += steps
            request.last_scheduled_time = self._last_start
            self._synced[request] = self.steps

    def steps_taken(self, request: Request) -> int:
        """The steps of this run ``request`` took part in (up to date after ``close``)."""
        return self._synced[request]

    @property
    def live(self) -> list[Request]:
        """The decoders the run has not ended, in ``decoders`` order."""
        return [r for r in self.decoders if r in self._live]

    def close(self) -> None:
        """Bring every request up to date (the scheduler is then as after ``steps`` steps)."""
        if not self.steps:
            return
        live = self.live
        for r in live:
            self._sync(r)
        sched = self.scheduler
        kv, page_due = sched.kv, sched._page_due
        for r in live:
            if kv.pages_needed(r, 1):   # its next token starts a page
                page_due[r] = None
