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

_ALLOCATE, _COMMIT = 0, 1   # page events: a page before the step, a filled page into the cache after it


def open_decode_run(scheduler: Scheduler, steps_of: StepsOf) -> DecodeRun | None:
    """A ``DecodeRun`` over ``scheduler``'s coming decode-only steps, or None when
    the next step is not one. ``steps_of(num_tokens)``: the executor's step for
    that many one-token chunks, ``(context_tokens, copy_out) -> seconds``."""
    decoders = scheduler.quiet_decoders()
    if not decoders:
        return None
    run = DecodeRun(scheduler, decoders, steps_of)
    return run if run.headroom > 0 else None


def decode_headroom(request: Request, limit: float) -> int:
    """Steps ``request`` can decode (one token each) before one of ``update()``'s
    stop rules may fire on it: max_tokens, the context ``limit``, the end of its
    declared segment."""
    room = min(request.max_tokens - request.num_generated, limit - request.num_tokens)
    segments = request.segments
    if segments and request.segment_index < len(segments):
        room = min(room, segments[request.segment_index].num_tokens - request.segment_generated)
    return int(room) - 1


class DecodeRun:
    """Decode-only steps of ``scheduler``'s running batch ``decoders`` (see module doc)."""

    def __init__(self, scheduler: Scheduler, decoders: list[Request], steps_of: StepsOf) -> None:
        self.scheduler = scheduler
        self.decoders = decoders
        self.steps = 0
        kv, config = scheduler.kv, scheduler.config
        self._page_size = ps = kv.page_size
        limit = scheduler.context_limit
        self.headroom = min(decode_headroom(r, float("inf") if limit is None else limit) for r in decoders)
        self._dynamic_budget = config.token_budget == "dynamic" or (
            config.token_budget == "policy" and scheduler.policy.dynamic_budget is not None)
        if not self._dynamic_budget and max(1, scheduler._token_budget(scheduler.view())) < len(decoders):
            self.headroom = 0
        if self.headroom <= 0:
            return   # not a run: the caller drops it (the rest is built only for a run)
        # (step, _ALLOCATE | _COMMIT, position, request): a heap, so a step touches only its events.
        events = [(len(r.device_pages) * ps - r.num_computed_tokens, _ALLOCATE, i, r)
                  for i, r in enumerate(decoders)]
        if kv.cache is not None:
            events += [((ps - (r.num_computed_tokens + 1) % ps) % ps, _COMMIT, i, r) for i, r in enumerate(decoders)]
        heapq.heapify(events)
        self._events = events
        self.run_step = steps_of(len(decoders))
        self._swap_pages = max(1, config.swap_budget_tokens // ps)
        self._context = sum(r.num_computed_tokens for r in decoders) + len(decoders)   # step 0's attention reads
        self._synced = dict.fromkeys(decoders, 0)   # steps already added to each request's counters
        self._last_start = 0.0

    def step(self, t: float) -> float | None:
        """Run the next step, starting at ``t`` (s); its seconds, or None (nothing
        run) when it is not a plain decode step."""
        k = self.steps
        if k >= self.headroom:
            return None
        sched, n, events = self.scheduler, len(self.decoders), self._events
        kv = sched.kv
        if self._dynamic_budget and max(1, sched._token_budget(sched.view())) < n:
            return None
        due = None
        if events[0][0] == k and events[0][1] == _ALLOCATE:
            due = []   # (position, request) whose token this step starts a page
            while events and events[0][0] == k and events[0][1] == _ALLOCATE:
                due.append(heapq.heappop(events)[2:])
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
        dt = self.run_step(self._context + n * k, copy_out)
        if due:
            kv.copies_done()
        sched._running_tokens += n
        self.steps = k + 1
        self._last_start = t
        while events and events[0][0] == k:   # pages this step filled: into the prefix cache
            _, _, pos, r = heapq.heappop(events)
            self._sync(r)
            kv.commit(r)
            heapq.heappush(events, (k + self._page_size, _COMMIT, pos, r))
        return dt

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

    def close(self) -> None:
        """Bring every request up to date (the scheduler is then as after ``steps`` steps)."""
        if not self.steps:
            return
        for r in self.decoders:
            self._sync(r)
        sched = self.scheduler
        kv, page_due = sched.kv, sched._page_due
        for r in self.decoders:
            if kv.pages_needed(r, 1):   # its next token starts a page
                page_due[r] = None
