"""Simulated replay: an ``EngineCore`` with the simulated executor
(``jaxserve.executor.sim``) run over a list of requests.

``run_simulation`` drives the same core loop as the real engine; what the
simulator adds is bookkeeping: memory occupancy sampled over simulated time,
progress, a horizon, and a ``SimulationStalled`` error when requests are left
that nothing can ever run. API calls start when the step that produced their
last token ends and return exactly ``api_time`` later; returns and arrivals
are delivered at the start of the next pass, stamped with their own time.
When nothing can run, the clock jumps to the next arrival or API return.
Scheduling itself costs no simulated time beyond the profile's
``step_overhead_s``.
"""

from __future__ import annotations

import dataclasses
import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from jaxserve.core import EngineCore, SimClock, StepTally
from jaxserve.executor.sim import SimExecutor
from jaxserve.replay.page_keys import PageNamer
from scheduler import CostModel, Handling, PageAllocator, Policy, Request, Scheduler, SchedulerConfig

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
    prefill_decode_split: bool = False   # Prophet's disaggregation: prefill and decode on two executors
    # Model the prefix cache. Trace requests carry no token ids: their pages get names from the
    # trace's structure (jaxserve.replay.page_keys) — their own by default, a conversation's
    # in re-send mode, a Mooncake trace's hash_ids.
    enable_prefix_caching: bool = False
    host_cache: bool = True   # the cache's host tier in the host pool (SchedulerConfig.host_cache)
    priority_aging_s: float | None = None   # SchedulerConfig.priority_aging_s (None: strict classes)

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
    """A ``Scheduler`` with page pools sized by ``config`` (resolved against ``cost``);
    its ``cost`` is ``cost`` with ``config``'s step model and scale, the one cost
    model of its policies and of ``run_simulation``'s clock."""
    cost = cost.timed(config.step_model, config.step_time_scale)
    c = config.resolve(cost)
    sched_config = SchedulerConfig(max_num_batched_tokens=c.max_num_batched_tokens,
                                   max_num_seqs=c.max_num_seqs,
                                   swap_budget_tokens=c.swap_budget_tokens, handling=c.handling,
                                   enable_prefix_caching=c.enable_prefix_caching, host_cache=c.host_cache,
                                   priority_aging_s=c.priority_aging_s)
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
    recomputed_tokens: int = 0   # context tokens computed again (after Discard or preemption)
    cached_tokens: int = 0       # tokens re-linked from the prefix cache at admissions

    @property
    def mean_step_s(self) -> float:
        return self.busy_time_s / self.num_steps if self.num_steps else 0.0


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Run a simulation without Python's cyclic garbage collector.

    A long replay keeps millions of live objects (requests, page names), and
    every collection walks them: at 64 replicas the collector took a quarter
    of the run, while the hot path makes almost no reference cycles (25
    objects over a 64-replica minute). Reference counting frees everything
    else as usual; the few cycles wait for the collector's next pass after
    the run (a collection here would walk every live result for seconds). At
    the end the run's objects, all in the youngest generation, are moved to
    the oldest as they are (``gc.freeze`` then ``gc.unfreeze``) rather than
    walked by the first collection after the run (2 % of a 64-replica run):
    they are results, not garbage, and a full collection still walks them
    when one falls due."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


class SimulationStalled(RuntimeError):
    """Requests remain but no step can run and no event is pending."""


def check_fits_pool(request_id: str, context_tokens: int, scheduler: Scheduler) -> None:
    """``ValueError`` (as the engine answers such a request) unless a context of
    ``context_tokens`` (its prompt, outputs and API returns) fits ``scheduler``'s
    whole device pool: one that does not could never run, and the simulator would
    preempt it and everything else forever."""
    pool = scheduler.device_pool
    need = pool.pages_for_tokens(context_tokens)
    if need > pool.num_pages:
        raise ValueError(f"request {request_id!r} needs {need} KV pages ({context_tokens} tokens of context) but "
                         f"the device pool has only {pool.num_pages}; raise the pool (--num-pages) or shorten the trace")


def run_simulation(scheduler: Scheduler, requests: Sequence[Request], *,
                   horizon_s: float | None = None, progress: Callable[[int, float], None] | None = None,
                   sample_interval_s: float = 1.0, check_invariants: bool = False,
                   prefill_decode_split: bool = False,
                   page_names: Callable[[Request], list] | None = None,
                   fast_forward: bool = True) -> SimResult:
    """Simulate ``requests`` (fresh, never scheduled; ``arrival_time`` says when
    each enters) until every one ends, or the clock passes ``horizon_s``. Steps
    are timed by ``scheduler.cost``, the cost model its policy prices with.
    ``progress(num_finished_since_last_call, now)`` is called every 500 steps
    and at the end. With a prefix cache, each request without token ids or
    names gets ``page_names(request)`` (default: names of its own,
    ``PageNamer.fresh``) when it arrives, so a long trace never holds every
    request's names at once. ``fast_forward``: run stretches of decode-only
    steps in bulk (``EngineCore.fast_forward``; the same result, step for step)."""
    for r in requests:
        check_fits_pool(r.request_id, r.max_context_tokens, scheduler)
    naming = sorted(requests, key=lambda r: r.arrival_time) if scheduler.kv.cache is not None else []
    name_pages = page_names or PageNamer(scheduler.page_size).fresh
    clock = SimClock()
    executor = SimExecutor(scheduler.cost, scheduler.page_size, clock, prefill_decode_split=prefill_decode_split)
    core = EngineCore(scheduler, executor, clock, check_invariants=check_invariants)
    total = len(requests)
    occ = Occupancy()
    device_pool, host_pool = scheduler.device_pool, scheduler.host_pool
    marks = {"next_sample": 0.0, "reported_steps": 0, "reported_finished": 0, "named": 0}

    def finished() -> int:
        return sum(core.stats.finished.values())

    def observe(now: float) -> None:
        named = marks["named"]
        while named < len(naming) and naming[named].arrival_time <= now:   # the arrivals just added
            r = naming[named]
            if not r.token_ids and not r.block_hashes:
                r.block_hashes = name_pages(r)
            named += 1
        marks["named"] = named
        if now >= marks["next_sample"]:
            occ.time_s.append(now)
            occ.device_used.append(device_pool.num_used)
            occ.host_used.append(host_pool.num_used)
            occ.running.append(len(scheduler.running))
            occ.waiting.append(len(scheduler.waiting))
            marks["next_sample"] = (now // sample_interval_s + 1) * sample_interval_s
        if progress is not None and core.stats.steps - marks["reported_steps"] >= 500:
            done_now = finished()
            progress(done_now - marks["reported_finished"], now)
            marks["reported_finished"], marks["reported_steps"] = done_now, core.stats.steps

    def done() -> bool:
        if horizon_s is not None and clock.now() >= horizon_s:
            return True
        return core.stats.requests == total and not scheduler.has_unfinished()

    def idle(until: float | None) -> None:
        if until is None:
            raise SimulationStalled(
                f"{len(scheduler.requests)} request(s) left but nothing can run at t={clock.now():.3f}s "
                f"(device pool {device_pool.num_pages} pages of {scheduler.page_size} tokens)")
        clock.sleep_until(until)

    def fast_forward_until() -> float:
        # Passes that sample occupancy or stop at the horizon run as steps (steps every 500: progress only).
        until = marks["next_sample"]
        return until if horizon_s is None else min(until, horizon_s)

    with cyclic_gc_paused():
        core.run(done=done, arrivals=requests, observe=observe, idle=idle,
                 fast_forward_until=fast_forward_until if fast_forward and not prefill_decode_split else None)
    if progress is not None:
        progress(finished() - marks["reported_finished"], clock.now())
    return SimResult(requests=sorted(requests, key=lambda r: r.arrival_time), end_time_s=clock.now(),
                     num_steps=core.stats.steps, busy_time_s=core.stats.busy_time_s,
                     forward_time_s=executor.forward_time_s, swap_stall_s=executor.swap_stall_s,
                     batched_tokens=core.stats.batched_tokens, swapped_tokens=executor.swapped_tokens,
                     num_preemptions=scheduler.num_preemptions, occupancy=occ,
                     steps_by_bucket=core.stats.steps_by_bucket, total_device_pages=device_pool.num_pages,
                     total_host_pages=host_pool.num_pages, recomputed_tokens=core.stats.recomputed_tokens,
                     cached_tokens=scheduler.kv.cache.hit_tokens if scheduler.kv.cache is not None else 0)

