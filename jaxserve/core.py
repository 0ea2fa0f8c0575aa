"""``EngineCore``: the one engine step and the one loop (DESIGN section 3).

One ``step()``:

1. deliver the API calls that returned (``ApiCalls.poll``) -> ``Scheduler.api_return``;
2. ``plan = scheduler.schedule(now)``;
3. ``result = executor.execute(plan)`` — the model executor (JAX) or the
   simulated one (cost model + clock);
4. ``events = scheduler.update(plan, result, now)`` — stop rules, declared
   API pauses, finishes;
5. the front end (if any) applies what needs text (stop strings, parsed tool
   calls) to the events; declared calls get their return timers.

``run()`` is the only loop: ``LLM.generate``, ``AsyncEngine``, the real-engine
replay and the simulator all drive the core through it, and differ only in
their clock (wall or simulated), their executor and a few hooks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from jaxserve.api_calls import ApiCalls, ApiResult
from scheduler import EventKind, Request, RequestEvent, RequestState, Scheduler, StepPlan, StepResult, SwapOp
from scheduler.fast_forward import DecodeRun, open_decode_run

log = logging.getLogger("jaxserve")


class Clock(Protocol):
    def now(self) -> float: ...
    def sleep_until(self, t: float) -> None: ...


class WallClock:
    """Seconds of ``time.monotonic``; sleeping really sleeps."""

    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))


class SimClock:
    """Simulated seconds: executors ``advance`` it by a step's cost; sleeping jumps."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)


class Executor(Protocol):
    """Applies a plan (swaps, then one forward over the batch)."""

    def execute(self, plan: StepPlan) -> StepResult: ...

    def release(self, request: Request) -> None:
        """Forget executor-side state of an ended request (host copies of its pages)."""


class Frontend(Protocol):
    """The text layer over token events (the real engine's ``LLMEngine``)."""

    def on_event(self, event: RequestEvent, now: float) -> None:
        """Apply what needs text to a request that produced a token (stop strings, tool calls)."""

    def result_token_ids(self, request: Request, result: ApiResult) -> list[int]:
        """The context tokens of a returned call whose result is text or an error."""


class StepTally:
    """Steps counted by the power-of-two token bucket of their batched tokens
    (``0`` for a step that only copies KV), with their total seconds — the same
    tally for the engine's wall-clock steps and the simulator's simulated ones,
    so their step times can be compared bucket by bucket."""

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: dict[int, list] = {}

    def add(self, num_tokens: int, seconds: float) -> None:
        entry = self.entry(num_tokens)
        entry[0] += 1
        entry[1] += seconds

    def entry(self, num_tokens: int) -> list:
        """``[steps, seconds]`` of the bucket of ``num_tokens`` (a caller that adds
        many steps of one size may update it in place)."""
        bucket = 0 if num_tokens <= 0 else 1 << (num_tokens - 1).bit_length()
        entry = self._table.get(bucket)
        if entry is None:
            entry = self._table[bucket] = [0, 0.0]
        return entry

    def as_row(self) -> dict[str, dict]:
        """``{"<bucket>": {"steps": count, "mean_s": seconds per step}}``, buckets ascending."""
        return {str(b): {"steps": c, "mean_s": t / c} for b, (c, t) in sorted(self._table.items())}


@dataclass
class EngineStats:
    """Counters since start (tokens, pages, requests, steps)."""

    requests: int = 0              # requests added
    prompt_tokens: int = 0
    generation_tokens: int = 0
    batched_tokens: int = 0        # query tokens run through the model, all steps
    recomputed_tokens: int = 0     # tokens whose KV was computed before and computed again
    swapped_out_pages: int = 0
    swapped_in_pages: int = 0
    finished: dict = field(default_factory=dict)   # finish reason -> count
    steps: int = 0                 # steps that ran a non-empty plan
    step_time_s: float = 0.0       # wall seconds inside step() (decode runs, simulated, are not timed)
    busy_time_s: float = 0.0       # clock seconds of the steps that ran (simulated seconds in the simulator)
    steps_by_bucket: StepTally = field(default_factory=lambda: StepTally())


class EngineCore:
    """A scheduler, an executor, the API calls in flight and a clock.

    ``frontend`` (optional) turns token events into text-level decisions;
    without one (the simulator) only token-count rules apply.
    ``check_invariants`` checks the page invariants after every step (tests).
    """

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Clock, *,
                 api: ApiCalls | None = None, frontend: Frontend | None = None,
                 check_invariants: bool = False) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.api = api if api is not None else ApiCalls()
        self.frontend = frontend
        self.check_invariants = check_invariants
        self.stats = EngineStats()
        self.last_step_ran = False   # whether the latest step() ran a non-empty plan
        self._decode_steppers: dict[int, Callable[[int, SwapOp | None], float]] = {}   # ``_decode_steps``, by size

    # --------------------------------------------------------------- requests
    def add(self, request: Request, now: float | None = None) -> None:
        """Queue ``request`` (arrived at ``now``, default: the clock's now)."""
        self.scheduler.add_request(request, self.clock.now() if now is None else now)
        self.stats.requests += 1
        self.stats.prompt_tokens += request.prompt_len

    def abort(self, request_id: str) -> Request | None:
        """End a live request and free everything it holds; None if unknown or ended."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, "abort")
        return request

    def finish(self, request: Request, reason: str) -> None:
        """End ``request`` with ``reason`` ("stop", "length", "abort", ...); no-op if it has ended,
        except that "stop" replaces "length": a stop string completed by the token that also
        reached ``max_tokens`` ends the request as a stop, as OpenAI reports it."""
        if request.is_finished:
            if reason == "stop" and request.finish_reason == "length":
                self.relabel(request, "stop")
            return
        self.scheduler.finish(request, reason, self.clock.now())
        self._released(request)

    def fail(self, request: Request, error: Exception) -> None:
        """The front end raised on ``request`` (a detokenizer, grammar, tool parser or
        output defect): ``request.error`` says why and the request ends with reason
        "error" (if it had not ended already); the step and every other request of it
        go on."""
        log.exception("request %s failed in the front end", request.request_id)
        request.error = f"{type(error).__name__}: {error}"[:500]
        if not request.is_finished:
            self.finish(request, "error")
        elif request.finish_reason != "error":   # it had ended, its last output failed: an error after all
            self.relabel(request, "error")

    def relabel(self, request: Request, reason: str) -> None:
        """An ended ``request`` ends with ``reason`` after all (the front end read its last
        token otherwise than the core did); the count of finish reasons follows."""
        finished = self.stats.finished
        finished[request.finish_reason] -= 1
        finished[reason] = finished.get(reason, 0) + 1
        request.finish_reason = reason

    def _released(self, request: Request) -> None:
        """Free what a request that just ended holds outside the scheduler."""
        if request.pending_tool_calls or (request.api_calls and not request.api_returned):
            self.api.cancel(request.request_id)
        self.executor.release(request)
        request.pending_tool_calls = []
        self.stats.finished[request.finish_reason] = self.stats.finished.get(request.finish_reason, 0) + 1

    # ------------------------------------------------------------------ state
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def next_wakeup(self) -> float | None:
        """When something could next happen while nothing can run (API timers, tool deadlines)."""
        return self.api.next_due()

    # ----------------------------------------------------------- fast-forward
    def decode_run(self, finishes: bool = False, admits: bool = False) -> DecodeRun | None:
        """Simulator only (the executor has ``decode_stepper``): the coming
        decode-only steps as a ``DecodeRun`` (None: the next step is not one),
        each ``step(t)`` timed by the executor and counted as ``step()`` counts;
        end it with ``end_decode_run`` before anything else touches the core,
        but for ``add`` when ``admits``. ``finishes``: the run also runs steps in
        which requests finish, and lists them in ``run.finished`` (the caller
        takes them from there). ``admits``: it also runs the steps that admit
        requests added meanwhile (their calls must not start in that step)."""
        return open_decode_run(self.scheduler, self._decode_steps, self._decoded_finish if finishes else None,
                               self._admission_step if admits else None)

    def _admission_step(self, plan: StepPlan, num_decoders: int, decoder_context: int) -> float:
        """A decode run's step of the admitted chunks ``plan`` with ``num_decoders``
        one-token chunks reading ``decoder_context`` tokens: executed and counted
        as ``_run_plan`` counts the whole batch (``update`` is the run's)."""
        dt = self.executor.execute_with_decoders(plan, num_decoders, decoder_context)
        self._account(plan)
        stats = self.stats
        stats.batched_tokens += num_decoders
        stats.generation_tokens += num_decoders + sum(c.samples for c in plan.chunks)
        stats.steps += 1
        stats.busy_time_s += dt
        stats.steps_by_bucket.add(plan.num_batched_tokens + num_decoders, dt)
        return dt

    def _decode_steps(self, num_tokens: int) -> Callable[[int, SwapOp | None], float]:
        """Steps of ``num_tokens`` decoders: ``(context_tokens, copy_out) -> seconds``,
        counted in ``stats`` as ``step()`` and ``_account`` count them. Made once per
        size (a decode run asks again each time its batch grows or shrinks)."""
        step = self._decode_steppers.get(num_tokens)
        if step is None:
            step = self._decode_steppers[num_tokens] = self._new_decode_steps(num_tokens)
        return step

    def _new_decode_steps(self, num_tokens: int) -> Callable[[int, SwapOp | None], float]:
        """``_decode_steps`` of ``num_tokens``, made."""
        stats, execute = self.stats, self.executor.decode_stepper(num_tokens)
        by_bucket = stats.steps_by_bucket.entry(num_tokens)

        def step(context_tokens: int, copy_out: SwapOp | None) -> float:
            pages = len(copy_out.device_pages) if copy_out is not None else 0
            dt = execute(context_tokens, pages)
            stats.swapped_out_pages += pages
            stats.batched_tokens += num_tokens
            stats.generation_tokens += num_tokens
            stats.steps += 1
            stats.busy_time_s += dt
            by_bucket[0] += 1
            by_bucket[1] += dt
            return dt
        step.seconds = execute.seconds   # (``DecodeRun.plan_quiet``)
        return step

    def _decoded_finish(self, request: Request, steps: int) -> None:
        """A decode run ended ``request`` after its ``steps`` steps in the run."""
        self._account_decoded(request, steps)
        self._released(request)

    def _account_decoded(self, request: Request, steps: int) -> None:
        """``_account`` for the ``steps`` one-token chunks ``request`` ran in a decode run."""
        end = request.num_computed_tokens
        if end - steps < request.max_computed_tokens:
            self.stats.recomputed_tokens += min(end, request.max_computed_tokens) - (end - steps)
        if end > request.max_computed_tokens:
            request.max_computed_tokens = end

    def end_decode_run(self, run: DecodeRun) -> None:
        """Close ``run``: the requests' counters, and the recompute accounting that
        ``_account`` does chunk by chunk."""
        run.close()
        if not run.steps:
            return
        for request in run.live:
            self._account_decoded(request, run.steps_taken(request))
        self.last_step_ran = True
        if self.check_invariants:
            self.scheduler.check_invariants()

    def fast_forward(self, until: float) -> int:
        """Run the coming decode-only steps that start before ``until`` (s) and the
        next API return (``decode_run``); returns how many ran."""
        run = self.decode_run()
        if run is None:
            return 0
        due = self.api.next_due()
        if due is not None:
            until = min(until, due)
        clock = self.clock
        while clock.now() < until and run.step(clock.now()) is not None:
            pass
        self.end_decode_run(run)
        return run.steps

    # ------------------------------------------------------------------- step
    def deliver_api_results(self, now: float) -> list[Request]:
        """Hand every returned call to its request; returns the requests touched."""
        touched = []
        sched = self.scheduler
        for result in self.api.poll(now):
            request = sched.requests.get(result.request_id)
            if request is None or request.request_id not in sched.paused or request.api_returned:
                continue   # aborted meanwhile
            request.pending_tool_calls = []
            if result.token_ids is not None:
                ids = [int(t) for t in result.token_ids]
            elif result.outputs is not None:
                errors = [o.error for o in result.outputs]
                if any(e is not None for e in errors):
                    request.api_calls[-1].error = "; ".join(e for e in errors if e is not None)
                try:
                    ids = self.frontend.result_token_ids(request, result) if self.frontend else []
                except Exception as e:  # noqa: BLE001 - this request's results fail it, not the step
                    self.fail(request, e)
                    touched.append(request)
                    continue
            else:
                ids = None
            t = now if result.time is None else result.time
            n = len(ids) if ids is not None else result.num_tokens
            if sched.api_return(request, n, t, ids):
                self._released(request)
            touched.append(request)
        return touched

    def step(self) -> list[Request]:
        """One engine step; returns the requests whose state or output changed."""
        touched = self.deliver_api_results(self.clock.now())
        return touched + self._run_plan()

    def _run_plan(self) -> list[Request]:
        """Steps 2-5 of ``step()`` (schedule, execute, update, front end), for a caller
        that has just delivered the returned API calls; returns the requests touched."""
        start = time.perf_counter()
        now = began = self.clock.now()
        touched: list[Request] = []
        sched = self.scheduler
        plan = sched.schedule(now)
        self.last_step_ran = not plan.is_empty
        if not self.last_step_ran:
            return touched
        result = self.executor.execute(plan)
        now = self.clock.now()
        self._account(plan)
        events = sched.update(plan, result, now)
        frontend = self.frontend
        for event in events:
            request = event.request
            touched.append(request)
            self.stats.generation_tokens += 1
            if event.kind is EventKind.FINISHED:
                self._released(request)
            if frontend is not None:
                try:
                    frontend.on_event(event, now)
                except Exception as e:  # noqa: BLE001 - an error in one request's text rules fails that request only
                    self.fail(request, e)
            if event.kind is EventKind.API_CALL:
                if request.is_finished:
                    # the front end ended it at the call's token (a stop string, its grammar, a failure):
                    # the call is never made
                    request.api_calls.pop()
                    request.api_returned = bool(request.api_calls)   # (the call before it, if any, returned)
                    continue
                seg = event.segment
                self.api.call_simulated(request.request_id, now + seg.api_duration_s, seg.returned_token_ids,
                                        seg.num_returned_tokens)
            elif event.kind is EventKind.LAST_TOKEN and request.state is RequestState.RUNNING:
                sched.finish(request, "length", now)   # (the front end did not pause or end it)
                self._released(request)
        if self.check_invariants:
            sched.check_invariants()
        stats = self.stats
        stats.steps += 1
        stats.step_time_s += time.perf_counter() - start
        elapsed = result.elapsed_s or self.clock.now() - began
        stats.busy_time_s += elapsed
        stats.steps_by_bucket.add(plan.num_batched_tokens, elapsed)
        return touched

    def _account(self, plan: StepPlan) -> None:
        stats = self.stats
        if plan.swap_out:
            stats.swapped_out_pages += sum(len(op.device_pages) for op in plan.swap_out)
        if plan.swap_in:
            stats.swapped_in_pages += sum(len(op.device_pages) for op in plan.swap_in)
        for chunk in plan.chunks:
            request, end = chunk.request, chunk.start + chunk.num_tokens
            stats.batched_tokens += chunk.num_tokens
            if chunk.start < request.max_computed_tokens:
                stats.recomputed_tokens += min(end, request.max_computed_tokens) - chunk.start
            if end > request.max_computed_tokens:
                request.max_computed_tokens = end

    # ------------------------------------------------------------------- loop
    def run(self, *, done: Callable[[], bool], arrivals: Iterable[Request] = (),
            on_outputs: Callable[[list[Request]], None] | None = None,
            observe: Callable[[float], None] | None = None,
            idle: Callable[[float | None], None] | None = None,
            fast_forward_until: Callable[[], float] | None = None) -> None:
        """The engine loop: until ``done()``, add the ``arrivals`` that are due
        (by ``arrival_time`` on this core's clock), deliver returned calls,
        step while there is work, else ``idle(t)`` until ``t`` — the next
        arrival or API timer (``None``: nothing is scheduled to happen).

        Hooks: ``observe(now)`` once per pass, after arrivals and returns are
        delivered (sampling, progress, commands from other threads);
        ``on_outputs(requests)`` with the requests each pass touched;
        ``idle`` defaults to sleeping on the clock (a jump on a simulated one;
        ``None`` there sleeps 1 ms). ``fast_forward_until()`` (simulator): after
        each step, the decode-only steps that start before it (s), the next
        arrival and the next API return run in bulk (``fast_forward``); it must
        bound the passes whose ``observe``/``done`` would act (a sample time,
        the horizon).
        """
        pending = deque(sorted(arrivals, key=lambda r: r.arrival_time))
        clock = self.clock
        idle = idle or self._sleep
        while True:
            now = clock.now()
            while pending and pending[0].arrival_time <= now:
                request = pending.popleft()
                self.add(request, request.arrival_time)
            touched = self.deliver_api_results(now)
            if observe is not None:
                observe(now)
            if done():
                if touched and on_outputs is not None:
                    on_outputs(touched)
                return
            ran = False
            if self.scheduler.has_work():
                touched += self._run_plan()   # returned calls were delivered above, at this pass's time
                ran = self.last_step_ran
                if ran and fast_forward_until is not None:
                    until = fast_forward_until()
                    self.fast_forward(min(until, pending[0].arrival_time) if pending else until)
            if touched and on_outputs is not None:
                on_outputs(touched)
            if ran or self.api.poll_ready(clock.now()):
                continue
            wake = self.next_wakeup()
            if pending and (wake is None or pending[0].arrival_time < wake):
                wake = pending[0].arrival_time
            idle(wake)

    def _sleep(self, until: float | None) -> None:
        self.clock.sleep_until(self.clock.now() + 0.001 if until is None else until)


__all__ = ["Clock", "EngineCore", "EngineStats", "Executor", "Frontend", "SimClock", "WallClock"]
