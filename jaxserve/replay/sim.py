"""``SimExecutor``: the engine loop of DESIGN section 3 with a cost model in
place of the model.

It drives the same ``scheduler.Scheduler`` the real engine drives, through the
same calls — ``add_request``, ``api_return``, ``schedule``, ``update`` — and
only replaces "run the forward" with "advance a simulated clock".

The simulator's model (see ``docs/replay.md``):

* A step over ``n`` batched query tokens takes ``T_fwd(n)`` from the profile
  (prefill chunks, recompute chunks and decode tokens cost the same per token)
  — the ``linear`` step model. A profile measured by ``jaxserve profile``
  also carries the time of each padded token bucket (``meta.step_times_s``);
  with the ``buckets`` step model a step costs the measured time of the
  power-of-two bucket its ``n`` tokens are padded to, as the engine pads them.
  ``auto`` (the default) uses buckets when the profile has them. Every step
  that runs the model also pays the profile's ``step_overhead_s`` (the
  engine's host-side work), and all step times are multiplied by
  ``step_time_scale`` (1 unless asked: a what-if, or a sensitivity check).
* Swaps run on the host link. With a profile whose ``swap_overlaps_forward``
  is true (the GPT-J/A100 constants: InferCept's layer-pipelined swap, §4.1) a
  step that copies ``k`` tokens' KV (out and in together) takes
  ``max(T_fwd(n), T_swap(k))`` — only the part of the copy that the forward
  cannot hide is added. A measured profile of jaxserve's engine, which copies
  before the forward, says false: the step takes ``T_fwd(n) + T_swap(k)``.
  A step with swaps and no forward takes ``T_swap(k)``.
* API calls start when the step that produced their last token ends and
  return exactly ``api_time`` later; returns and arrivals are delivered at the
  start of the next step, stamped with their own time.
* When nothing can run (everyone is inside an API call, or the queue is
  empty), the clock jumps to the next arrival or API return. Scheduling itself
  costs no simulated time beyond the profile's ``step_overhead_s``.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

from jaxserve.replay.metrics import StepTally
from scheduler import (CostModel, EventKind, Handling, PageAllocator, Policy, Request, Scheduler,
                       SchedulerConfig, StepPlan, StepResult)

STEP_MODELS = ("linear", "buckets", "auto")


def bucket_step_times(cost: CostModel) -> list[tuple[int, float]] | None:
    """``[(bucket tokens, step seconds), ...]`` ascending, from a measured
    profile's ``meta["step_times_s"]``; ``None`` when the profile has none."""
    table = (cost.meta or {}).get("step_times_s")
    if not table:
        return None
    return sorted((int(k), float(v)) for k, v in table.items())


class StepTimer:
    """Seconds of a step over ``n`` batched tokens, memoised per ``n``:
    ``scale · (forward(n) + cost.step_overhead_s)``, 0 for ``n == 0``.

    forward — ``linear``: ``T_fwd(n)``. ``buckets``: the measured time of the
    smallest bucket ``>= n`` (beyond the largest, that bucket's time plus
    ``fwd_per_token_s`` per extra token). ``auto``: buckets when the profile
    has them, else linear.
    """

    def __init__(self, cost: CostModel, model: str = "auto", scale: float = 1.0) -> None:
        if model not in STEP_MODELS:
            raise ValueError(f"step model must be one of {', '.join(STEP_MODELS)}, got {model!r}")
        if not scale > 0:
            raise ValueError(f"step time scale must be > 0, got {scale}")
        table = bucket_step_times(cost)
        if model == "buckets" and table is None:
            raise ValueError(f"profile {cost.name!r} has no measured step times (meta.step_times_s); "
                             "use the linear step model")
        self.model = "buckets" if (model == "auto" and table) or model == "buckets" else "linear"
        self.cost = cost
        self.scale = scale
        self._table = table if self.model == "buckets" else None
        self._cache: dict[int, float] = {}

    def __call__(self, n: int) -> float:
        t = self._cache.get(n)
        if t is None:
            t = self._cache[n] = self._compute(n)
        return t

    def _compute(self, n: int) -> float:
        if n <= 0:
            return 0.0
        return self.scale * (self._forward(n) + self.cost.step_overhead_s)

    def _forward(self, n: int) -> float:
        if self._table is None:
            return self.cost.t_fwd(n)
        for bucket, seconds in self._table:
            if bucket >= n:
                return seconds
        bucket, seconds = self._table[-1]
        return seconds + self.cost.fwd_per_token_s * (n - bucket)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Engine limits for a simulated run; ``None`` fields come from the profile.

    * ``num_device_pages``: ``device_kv_bytes // (bytes_per_token · page_size)``
    * ``num_host_pages``: ``host_kv_bytes // (bytes_per_token · page_size)``
    * ``max_num_batched_tokens``: the profile's
    * ``swap_budget_tokens``: the tokens whose copy one full step hides,
      ``T_fwd(max_num_batched_tokens) / T_swap(1)``, rounded down to whole pages.
    """

    page_size: int = 16
    num_device_pages: int | None = None
    num_host_pages: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    swap_budget_tokens: int | None = None
    handling: Handling | None = None
    sample_interval_s: float = 1.0       # memory occupancy sampling period (simulated s)
    check_invariants: bool = False       # page invariants after every step (tests; slow)
    step_model: str = "auto"             # "linear" T_fwd(n), "buckets" measured per padded bucket, "auto"
    step_time_scale: float = 1.0         # multiplies every simulated step time

    def resolve(self, cost: CostModel) -> "SimConfig":
        """A copy with every ``None`` sized from ``cost``."""
        page_bytes = cost.bytes_per_token * self.page_size
        device = self.num_device_pages
        if device is None:
            if cost.device_kv_bytes <= 0:
                raise ValueError(f"profile {cost.name!r} has no device_kv_bytes; give --num-pages")
            device = cost.device_kv_bytes // page_bytes
        host = self.num_host_pages if self.num_host_pages is not None else cost.host_kv_bytes // page_bytes
        batched = self.max_num_batched_tokens or cost.max_num_batched_tokens
        swap = self.swap_budget_tokens
        if swap is None:
            per_token = cost.t_swap(1)
            hidden = cost.t_fwd(batched) / per_token if per_token > 0 else batched
            swap = max(self.page_size, int(hidden) // self.page_size * self.page_size)
        if device <= 0:
            raise ValueError(f"the device pool must have pages, got {device}")
        return dataclasses.replace(self, num_device_pages=int(device), num_host_pages=int(host),
                                   max_num_batched_tokens=int(batched), swap_budget_tokens=int(swap))


def build_scheduler(cost: CostModel, policy: Policy, config: SimConfig) -> Scheduler:
    """A ``Scheduler`` with page pools sized by ``config`` (resolved against ``cost``)."""
    c = config.resolve(cost)
    sched_config = SchedulerConfig(max_num_batched_tokens=c.max_num_batched_tokens,
                                   max_num_seqs=c.max_num_seqs,
                                   swap_budget_tokens=c.swap_budget_tokens, handling=c.handling)
    return Scheduler(sched_config, policy, PageAllocator(c.num_device_pages, c.page_size, "device"),
                     PageAllocator(c.num_host_pages, c.page_size, "host"), cost)


@dataclass(slots=True)
class Occupancy:
    """Pool use sampled over simulated time: parallel lists (s, pages, pages, count, count)."""

    time_s: list[float] = field(default_factory=list)
    device_used: list[int] = field(default_factory=list)
    host_used: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SimResult:
    """What a simulated run produced; ``requests`` carry their timing marks."""

    requests: list[Request]
    end_time_s: float            # simulated time of the last event processed
    num_steps: int
    busy_time_s: float           # simulated seconds spent in steps
    forward_time_s: float        # of which the forwards
    swap_stall_s: float          # of which un-hidden swap time
    batched_tokens: int
    swapped_tokens: int
    num_preemptions: int
    occupancy: Occupancy
    steps_by_bucket: StepTally
    total_device_pages: int
    total_host_pages: int

    @property
    def mean_step_s(self) -> float:
        return self.busy_time_s / self.num_steps if self.num_steps else 0.0


class SimulationStalled(RuntimeError):
    """Requests remain but no step can run and no event is pending (e.g. a prompt
    larger than the whole device pool)."""


class SimExecutor:
    """Discrete-event executor: runs ``scheduler`` over a list of requests."""

    def __init__(self, scheduler: Scheduler, cost: CostModel, *, sample_interval_s: float = 1.0,
                 check_invariants: bool = False, step_model: str = "auto", step_time_scale: float = 1.0) -> None:
        self.scheduler = scheduler
        self.cost = cost
        self.sample_interval_s = sample_interval_s
        self.check_invariants = check_invariants
        self.t_fwd = StepTimer(cost, step_model, step_time_scale)

    def step_time(self, plan: StepPlan) -> tuple[float, float, int]:
        """(step seconds, un-hidden swap seconds, tokens swapped) for ``plan``."""
        cost = self.cost
        fwd = self.t_fwd(plan.num_batched_tokens)
        swapped = 0
        if plan.swap_out or plan.swap_in:
            pages = sum(len(op.device_pages) for op in plan.swap_out)
            pages += sum(len(op.device_pages) for op in plan.swap_in)
            swapped = pages * self.scheduler.page_size
        if not swapped:
            return fwd, 0.0, 0
        copy = cost.t_swap(swapped) * self.t_fwd.scale
        if not cost.swap_overlaps_forward:
            return fwd + copy, copy, swapped
        return max(fwd, copy), max(0.0, copy - fwd), swapped

    def run(self, requests: Sequence[Request], *, horizon_s: float | None = None,
            progress: Callable[[int, float], None] | None = None) -> SimResult:
        """Simulate until every request ends (or the clock passes ``horizon_s``).

        ``requests`` are fresh (never scheduled); their ``arrival_time`` says
        when each enters. ``progress(num_finished_since_last_call, now)`` is
        called every few hundred steps and at the end.
        """
        sched = self.scheduler
        arrivals = sorted(requests, key=lambda r: r.arrival_time)
        num_arrivals = len(arrivals)
        returns: list[tuple[float, int, Request, int]] = []   # (time, seq, request, returned tokens)
        seq = 0
        now = 0.0
        next_arrival = 0
        steps = 0
        busy = fwd_total = stall_total = 0.0
        batched_total = swapped_total = 0
        finished = 0
        reported = 0
        occ = Occupancy()
        tally = StepTally()
        next_sample = 0.0
        interval = self.sample_interval_s
        device_pool, host_pool = sched.device_pool, sched.host_pool
        t_fwd = self.t_fwd
        add_request, api_return, schedule = sched.add_request, sched.api_return, sched.schedule
        update, no_tokens = sched.update, StepResult()
        heappush, heappop = heapq.heappush, heapq.heappop

        while True:
            while next_arrival < num_arrivals and arrivals[next_arrival].arrival_time <= now:
                r = arrivals[next_arrival]
                add_request(r, r.arrival_time)
                next_arrival += 1
            while returns and returns[0][0] <= now:
                t, _, r, num_returned = heappop(returns)
                if api_return(r, num_returned, t):
                    finished += 1
            if horizon_s is not None and now >= horizon_s:
                break
            if now >= next_sample:
                occ.time_s.append(now)
                occ.device_used.append(device_pool.num_used)
                occ.host_used.append(host_pool.num_used)
                occ.running.append(len(sched.running))
                occ.waiting.append(len(sched.waiting))
                next_sample = (now // interval + 1) * interval
            if progress is not None and steps - reported >= 500:
                progress(finished, now)
                finished = 0
                reported = steps

            plan = schedule(now) if sched.has_work() else None
            if plan is None or plan.is_empty:
                upcoming = []
                if next_arrival < num_arrivals:
                    upcoming.append(arrivals[next_arrival].arrival_time)
                if returns:
                    upcoming.append(returns[0][0])
                if not upcoming:
                    if sched.has_unfinished():
                        raise SimulationStalled(
                            f"{len(sched.requests)} request(s) left but nothing can run at t={now:.3f}s "
                            f"(device pool {device_pool.num_pages} pages of {sched.page_size} tokens)")
                    break
                now = max(now, min(upcoming))
                continue

            n = plan.num_batched_tokens
            if plan.swap_out or plan.swap_in:
                dt, stall, swapped = self.step_time(plan)
                stall_total += stall
                swapped_total += swapped
                fwd_total += dt - stall
            else:
                dt = t_fwd(n)
                fwd_total += dt
            batched_total += n
            tally.add(n, dt)
            busy += dt
            now += dt
            steps += 1
            for event in update(plan, no_tokens, now):
                if event.kind is EventKind.API_CALL:   # update() paused it; its call's segment is behind it now
                    r = event.request
                    seg = r.segments[r.segment_index - 1]
                    seq += 1
                    heappush(returns, (now + seg.api_duration_s, seq, r, seg.num_returned_tokens))
                elif event.kind is EventKind.FINISHED:
                    finished += 1
            if self.check_invariants:
                sched.check_invariants()

        if progress is not None:
            progress(finished, now)
        return SimResult(requests=list(arrivals), end_time_s=now, num_steps=steps, busy_time_s=busy,
                         forward_time_s=fwd_total, swap_stall_s=stall_total,
                         batched_tokens=batched_total, swapped_tokens=swapped_total,
                         num_preemptions=sched.num_preemptions, occupancy=occ, steps_by_bucket=tally,
                         total_device_pages=device_pool.num_pages, total_host_pages=host_pool.num_pages)
