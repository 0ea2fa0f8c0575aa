"""Decode-only steps in bulk, for simulators (``open_decode_run``).

Most steps of a simulated run only give each running request its next token:
no admission, no swap, no stop rule, nothing returning. A ``DecodeRun`` does
what ``schedule()`` + executor + ``update()`` would do for such steps, one
step per ``step(t)`` call, at a cost that does not grow with the batch:

- it applies while no request of a priority class other than 0 was added (a
  class may preempt for a waiting one), every running request decodes, nothing can be admitted
  (empty queue, or ``max_num_seqs`` running), nothing swaps or resumes, and
  the policy neither orders the batch (``order_running``), nor watches plans
  (``on_plan``), nor re-decides calls held under Preserve;
- it ends (``step`` returns None) before a step that would pause a request
  (the end of a declared segment that calls an API), lack pages (the ordered
  pass would preempt), or exceed a dynamic token budget; before a step that
  would end a request (max_tokens, the context limit, the last segment)
  unless the caller takes ends (``on_finish``: the run ends them as
  ``update()`` would, in batch order, and goes on with the others); and
  before a step that would admit requests added meanwhile unless the caller
  takes admissions (``admit``: the run plans them with ``schedule()``'s own
  admission code, they come first in the batch, and those whose context is
  then computed join the run; one still computing stays as a filler whose
  next chunks the run plans with ``schedule()``'s code for them,
  ``Scheduler.fillers_on_hand``, while the token budget is static; a run
  with ``admit`` may also open with fillers). The caller ends
  it before anything else from outside (an API return) and then calls
  ``close``;
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

from scheduler.plan import StepPlan, StepResult, SwapOp
from scheduler.request import Request, RequestState
from scheduler.scheduler import Scheduler

StepsOf = Callable[[int], Callable[[int, SwapOp | None], float]]
# ``steps_of(n)`` returns the executor's step for ``n`` one-token chunks, ``(context_tokens, copy_out) -> s``,
# with an attribute ``seconds``: ``context_tokens -> s``, the same step's time without running it (``plan_quiet``).
AdmitStep = Callable[[StepPlan, int, int], float]   # (plan of admitted chunks, decoders, their attention reads) -> s

_ALLOCATE, _COMMIT, _END = 0, 1, 2   # page events: a page before the step, a filled page into the cache after it; a request ending after it


def open_decode_run(scheduler: Scheduler, steps_of: StepsOf,
                    on_finish: Callable[[Request, int], None] | None = None,
                    admit: AdmitStep | None = None) -> DecodeRun | None:
    """A ``DecodeRun`` over ``scheduler``'s coming decode-only steps, or None when
    the next step is not one. ``steps_of(num_tokens)``: the executor's step for
    that many one-token chunks, ``(context_tokens, copy_out) -> seconds``.
    ``on_finish(request, steps)``: the run also runs steps in which requests
    finish and reports each after ``Scheduler.finish``, with the run's steps it
    decoded in; None: the run ends before such a step. ``admit(plan,
    num_decoders, decoder_context_tokens)``: the run also runs steps that admit
    requests added meanwhile (``plan``: the admitted chunks, which come first in
    the batch; the executor's step of it with the decoders, counted as
    ``step()`` counts it; returns its seconds); None: the run ends before such
    a step."""
    decoders = scheduler.quiet_decoders(with_fillers=admit is not None)   # fillers' steps are mixed steps
    if not decoders:
        return None
    run = DecodeRun(scheduler, decoders, steps_of, on_finish, admit)
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
                 on_finish: Callable[[Request, int], None] | None = None,
                 admit: AdmitStep | None = None) -> None:
        self.scheduler = scheduler
        self.steps = 0
        self._quiet: list[float] = []   # start times (s) of planned quiet steps not run yet (``plan_quiet``)
        self.quiet_steps = 0            # planned quiet steps run (``run_quiet``), of ``steps``
        self.quiet_steps_dropped = 0    # planned quiet steps dropped (an arrival, the horizon)
        self.finished: list[Request] = []   # requests the run ended (``on_finish``), for the caller to take
        kv, config = scheduler.kv, scheduler.config
        self._page_size = kv.page_size
        limit = scheduler.context_limit
        self._limit = float("inf") if limit is None else limit
        self._on_finish, self._admit = on_finish, admit
        stops = [decode_stop(r, self._limit) for r in decoders]
        self.headroom = min((last for last, ends in stops if not (ends and on_finish)), default=float("inf"))
        self._dynamic_budget = scheduler.budget_is_dynamic
        self._static_budget = None if self._dynamic_budget else max(1, scheduler._token_budget(scheduler.view()))
        if self._static_budget is not None and self._static_budget < len(decoders):
            self.headroom = 0
        if scheduler._filling and self._static_budget is None:
            self.headroom = 0   # a filler's chunk depends on the step's budget
        if self.headroom <= 0:
            return   # not a run: the caller drops it (the rest is built only for a run)
        # (step, _ALLOCATE | _COMMIT | _END, position, request): a heap, so a step touches only its events.
        self._events = [e for i, (r, stop) in enumerate(zip(decoders, stops)) for e in self._events_of(r, i, stop)]
        heapq.heapify(self._events)
        self._steps_of = steps_of
        self.run_step = steps_of(len(decoders))
        self._swap_pages = max(1, config.swap_budget_tokens // self._page_size)
        self._reads = sum(r.num_computed_tokens for r in decoders) + len(decoders)   # the next step's attention reads
        self._synced = dict.fromkeys(decoders, 0)   # run steps already added to each request's counters
        self._joined = dict.fromkeys(decoders, 0)   # the run step each request's decoding in the run began at
        self._live = dict.fromkeys(decoders)        # not ended, in the order they joined
        self._positions = len(decoders)             # the next joiner's position (event tie-break)
        self._last_start = 0.0

    def _events_of(self, request: Request, pos: int, stop: tuple[int, bool]) -> list[tuple]:
        """The events of ``request`` (joined at position ``pos``), decoding from run step
        ``self.steps`` on: its next page, its next filled page, its end (``stop``:
        ``decode_stop``; an end the run cannot run lowers ``headroom`` instead)."""
        k, ps = self.steps, self._page_size
        computed = request.num_computed_tokens
        events = [(k + len(request.device_pages) * ps - computed, _ALLOCATE, pos, request)]
        if self.scheduler.kv.cache is not None:
            events.append((k + (ps - (computed + 1) % ps) % ps, _COMMIT, pos, request))
        last, ends = stop
        if ends and self._on_finish is not None:
            events.append((k + last, _END, pos, request))
        elif k + last < self.headroom:
            self.headroom = k + last
        return events

    def plan_quiet(self, start: float, until: float) -> float:
        """Plan the run's coming quiet steps, the first starting at ``start`` (s:
        the clock after the last step), those that start before ``until`` (s;
        the replica's next API return); returns the start time of the step after
        them, the run's next step that is not quiet (``start`` when there is none).

        A quiet step is one ``step`` would run as a plain decode step in which
        nothing happens but the tokens: no page starts or fills, nothing ends,
        nothing is admitted (the waiting queue is empty or the batch full, as
        now), no filler, a static token budget. It changes nothing outside the
        run's own counters and clock (not the live requests, not a page, not the
        prefix cache), so a simulator of many replicas may run it late: in one go
        before the run's next step, or before a request is added to the replica;
        the caller runs them with ``run_quiet`` before the run's next ``step`` or
        ``close``. Its time is the executor's
        (``steps_of(n).seconds``), the same arithmetic the step's run does, so the
        same floats."""
        sched, events = self.scheduler, self._events
        if (self._dynamic_budget or sched._filling or sched.classes_in_use
                or (sched.waiting and len(sched.running) < sched.config.max_num_seqs)):
            return start
        k = self.steps
        stop = min(self.headroom, events[0][0]) if events else self.headroom
        seconds, reads, n = self.run_step.seconds, self._reads, len(self._live)
        quiet, t = self._quiet, start
        while k < stop and t < until:
            quiet.append(t)
            t += seconds(reads)
            reads += n
            k += 1
        return t

    def run_quiet(self, before: float) -> None:
        """Run the planned quiet steps (``plan_quiet``) that start before ``before``
        (s), as ``step`` runs them, and drop the others: a request added to the
        replica at ``before`` makes the step at the first of those an admitting one."""
        quiet = self._quiet
        if not quiet:
            return
        self._quiet = []
        sched, kv, n = self.scheduler, self.scheduler.kv, len(self._live)
        policy_step, run_step, steps = sched._policy_step, self.run_step, self.steps
        for t in quiet:
            if t >= before:
                break
            sched.iteration += 1
            kv.now = t
            policy_step(t)
            run_step(self._reads, None)
            sched._running_tokens += n
            self._reads += n
            self.steps += 1
            self._last_start = t
        self.quiet_steps += self.steps - steps
        self.quiet_steps_dropped += len(quiet) - (self.steps - steps)

    def step(self, t: float) -> float | None:
        """Run the next step, starting at ``t`` (s); its seconds, or None (nothing
        run) when it is not a decode step the run can run. Requests it ended are
        appended to ``finished``. With ``admit``, a step that would admit waiting
        requests runs too, and one in which requests it admitted still compute their
        context (``_mixed_step``). Planned quiet steps (``plan_quiet``) must have run."""
        k = self.steps
        if k >= self.headroom:
            return None
        sched, live, events = self.scheduler, self._live, self._events
        if sched.classes_in_use:
            return None   # ``schedule()`` may preempt for a higher class (``_make_room_for_class``)
        n = len(live)
        kv = sched.kv
        if self._dynamic_budget and max(1, sched._token_budget(sched.view())) < n:
            return None
        admitting = bool(sched.waiting) and len(sched.running) < sched.config.max_num_seqs   # (one __bool__ call)
        if admitting and not self._can_admit():
            return None
        due = None
        if events[0][0] == k and events[0][1] == _ALLOCATE:
            due = []   # (position, request) whose token this step starts a page
            while events and events[0][0] == k and events[0][1] == _ALLOCATE:
                event = heapq.heappop(events)
                if event[3] in live:
                    due.append(event[2:])
        fillers = None
        if sched._filling:   # requests still computing their context: their chunks as schedule() plans them
            if self._static_budget is not None:
                fillers = sched.fillers_on_hand(self._static_budget - n, len(due) if due else 0)
            if fillers is None or not self._fillers_can_run(fillers):   # (fillers_on_hand counted ``due``'s pages)
                self._put_back(due)
                return None
        elif due and len(due) > kv.num_free_device:
            self._put_back(due)
            return None   # the ordered pass preempts here
        mixed = admitting or fillers is not None
        if mixed:
            plan, dt = self._mixed_step(t, n, due, fillers)
        else:
            sched.iteration += 1
            kv.now = t   # (``sched.now = t`` without the property's call)
            sched._policy_step(t)
            copy_out = None
            if due:
                kv.copy_budget = self._swap_pages
                kv.add_page_each([r for _, r in due])
                if kv.host_tier:
                    copy_out = kv.take_copies()[0]
                kv.copy_budget = 0
            dt = self.run_step(self._reads, copy_out)
            if due:
                kv.copies_done()
        if due:
            for pos, r in due:
                heapq.heappush(events, (k + self._page_size, _ALLOCATE, pos, r))
        sched._running_tokens += n
        self._reads += n
        self.steps = k + 1
        self._last_start = t
        if mixed:   # the fillers' and admissions' chunks come first in the batch: their tokens and commits first
            sched.update(plan, StepResult(elapsed_s=dt), t + dt)
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
        if mixed:
            self._join_computed(plan)
        return dt

    def _put_back(self, due: list | None) -> None:
        """Return the page events of ``due`` (popped for this step) to the heap."""
        for pos, r in due or ():
            heapq.heappush(self._events, (self.steps, _ALLOCATE, pos, r))

    def _fillers_can_run(self, fillers: list[tuple[Request, int, int, int]]) -> bool:
        """Whether no chunk of ``fillers`` (``Scheduler.fillers_on_hand``) that completes its
        request's context samples a token on which a stop rule fires (ended or paused in
        ``update()``: the ordered pass takes that step)."""
        limit = self._limit
        return all(start + n < r.num_tokens or decode_stop(r, limit)[0] >= 1 for r, start, n, _ in fillers)

    def _can_admit(self) -> bool:
        """Whether a step that admits can run here: ``admit`` is given, and no
        waiting request would need what the run does not do at admission
        (a swap-in; a stop rule firing on its first token)."""
        if self._admit is None:
            return False
        limit, swapped = self._limit, RequestState.SWAPPED
        return all(r.state is not swapped and decode_stop(r, limit)[0] >= 1 for r in self.scheduler.waiting)

    def _mixed_step(self, t: float, n: int, due: list | None,
                    fillers: list[tuple[Request, int, int, int]] | None) -> tuple[StepPlan, float]:
        """``schedule()``'s work for a step whose batch is the run's ``n`` decoders
        (with ``due`` starting a page), the chunks of ``fillers`` (still computing
        their context; ``Scheduler.fillers_on_hand``) and what ``_admit_waiting``
        admits from the waiting queue, then the step itself (``admit``). Returns
        the plan of the fillers' and admitted chunks and the step's seconds."""
        sched = self.scheduler
        plan, _ = sched._open_plan(t, want_view=False)
        kv = sched.kv
        kv.copy_budget = self._swap_pages
        if due:
            kv.add_page_each([r for _, r in due])
        left = plan.token_budget - n
        if fillers:
            left = sched.give_fillers(plan, fillers, left, t)
        sched._admit_waiting(plan, left, t)
        return sched._close_plan(plan, t), self._admit(plan, n, self._reads)

    def _join_computed(self, plan: StepPlan) -> None:
        """The requests of ``plan`` (fillers and admitted) join the run once they
        decode; one still computing its context stays a filler of the run (with a
        static budget; else it ends the run: the next step is the ordered pass's)."""
        sched = self.scheduler
        for chunk in plan.chunks:
            r = chunk.request
            if r not in sched._decoding:
                if r not in sched._filling or self._static_budget is None:
                    self.headroom = self.steps
                continue
            pos = self._positions
            self._positions += 1
            self._live[r] = None
            self._synced[r] = self._joined[r] = self.steps
            self._reads += r.num_computed_tokens + 1
            for event in self._events_of(r, pos, decode_stop(r, self._limit)):
                heapq.heappush(self._events, event)
        if plan.chunks:
            self.run_step = self._steps_of(len(self._live))
            if self._static_budget is not None and self._static_budget < len(self._live):
                self.headroom = self.steps   # the whole batch no longer fits the budget: the ordered pass's step

    def _finish(self, ending: list[Request], now: float) -> None:
        """End ``ending`` (their last token just ran) as ``update()`` would: in batch
        order, at ``now`` (s); the run goes on with the others while nothing can
        be admitted."""
        sched, live = self.scheduler, self._live
        decoding = sched._decoding
        ending.sort(key=lambda r: decoding[r].place)
        for r in ending:
            del live[r]
            self._reads -= r.num_computed_tokens + 1
            sched.finish(r, "length", now)
            self._on_finish(r, self.steps_taken(r))
            del self._synced[r], self._joined[r]
            self.finished.append(r)
        if not live or (self._admit is None and sched.waiting and len(sched.running) < sched.config.max_num_seqs):
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
        """The steps of this run ``request`` decoded in (up to date after ``close``)."""
        return self._synced[request] - self._joined[request]

    @property
    def live(self) -> list[Request]:
        """The decoders the run has not ended, in the order they joined."""
        return list(self._live)

    def close(self) -> None:
        """Bring every request up to date (the scheduler is then as after ``steps`` steps);
        planned quiet steps not run by now are dropped (``run_quiet`` first to run them)."""
        self.quiet_steps_dropped += len(self._quiet)
        self._quiet = []
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
