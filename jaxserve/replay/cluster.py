"""Re-send replay on N simulated replicas behind a router.

Re-send mode drives the engine as an OpenAI client drives an agent: each
segment of a trace request arrives as a new request carrying the whole
conversation so far (segment ``k``'s prompt = the original prompt + every
earlier completion and API return) and generating segment ``k``'s tokens; the
next segment arrives when this one has finished plus the API call's duration.
A trailing API call (after the last segment) has nothing left to generate and
is dropped. Every segment request of a conversation lists the conversation's
page names (``PageNamer.conversation``; a Mooncake request's input pages are named by its
blocks, ``PageNamer.blocks``), so with the prefix cache on a
follow-up re-links the pages its predecessors computed, if they are still
cached on the replica it lands on.

Replicas: ``N`` ``EngineCore``s, each with its own ``Scheduler``,
``SimExecutor`` and ``SimClock``; they share nothing but the arrival stream.
The driver is an exact discrete-event loop: it always handles the earliest
event next — an arrival (routed then, on the replicas' state as of their
latest step) or the pass of the replica whose next pass is earliest (one
``EngineCore.step``: deliver returned calls, schedule, execute). A replica
with nothing to run sleeps until its next API return or a new arrival,
whichever comes first. With
one replica this is ``EngineCore.run``'s loop, pass for pass.

Routers (``ROUTERS``): ``round_robin``; ``least_loaded`` (fewest live
requests, ties in rotation); ``affinity`` (the longest cached prefix of the
request's pages on any replica, ties to the replica that served the
conversation last, then least loaded; no hit anywhere: least loaded).
Parked client-side tool contexts do not occur here: a re-sent turn arrives
only after its predecessor finished.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

from jaxserve.core import EngineCore, SimClock
from jaxserve.executor.sim import SimExecutor
from jaxserve.replay.page_keys import PageNamer
from jaxserve.replay.simulate import SimulationStalled, check_fits_pool, cyclic_gc_paused
from jaxserve.replay.workload import WorkloadItem
from scheduler import Request, Scheduler, Segment
from scheduler.fast_forward import DecodeRun

ROUTERS = ("round_robin", "least_loaded", "affinity")


@dataclass(eq=False, slots=True)
class Conversation:
    """One trace request replayed as re-sent segment requests (built lazily)."""

    item: WorkloadItem
    index: int = 0                       # the next segment to send
    names: list | None = None            # page names of the whole conversation (prefix cache on)
    previous: Request | None = None      # the last segment request sent
    replica: int | None = None           # where it went
    visited: set = field(default_factory=set)   # every replica a segment request of it went to
    context: int = 0                     # the next segment request's prompt (tokens), once one was sent

    @property
    def num_segments(self) -> int:
        return len(self.item.entry.segments)

    def next_request(self, arrival_time: float) -> Request:
        """Segment ``index`` as a new request arriving at ``arrival_time`` (s)."""
        entry, k = self.item.entry, self.index
        prompt = self.context if k else entry.prompt_len
        segment = entry.segments[k]
        tokens = segment.num_tokens
        request = Request(f"{self.item.request_id}/{k}", arrival_time=arrival_time, prompt_len=prompt,
                          max_tokens=tokens, segments=[Segment(tokens)], ignore_eos=True,
                          predictions=dict(entry.predictions), priority=self.item.priority)
        self.context = prompt + tokens + segment.num_returned_tokens
        self.index += 1
        return request

    @property
    def total_tokens(self) -> int:
        """Context length of the whole conversation, returned tokens included."""
        e = self.item.entry
        return e.prompt_len + sum(s.num_tokens + s.num_returned_tokens for s in e.segments)


@dataclass(eq=False, slots=True)
class Replica:
    """One simulated engine: a core over its own scheduler, executor and clock."""

    index: int
    core: EngineCore
    clock: SimClock
    executor: SimExecutor

    @property
    def live(self) -> dict:
        """Live requests (running, waiting, paused) by id: the scheduler's own map."""
        return self.core.scheduler.requests

    @property
    def load(self) -> int:
        """How many requests are live."""
        return len(self.live)

    def cached_prefix_pages(self, names: Sequence, limit: int) -> int:
        """Leading pages of ``names[:limit]`` this replica's prefix cache holds."""
        cache = self.core.scheduler.kv.cache
        if cache is None or limit <= 0:
            return 0
        page_of = cache.page_of
        n = 0
        for name in itertools.islice(names, limit):
            if name not in page_of:
                break
            n += 1
        return n


class Router:
    """Picks the replica of each arriving request (see module doc)."""

    def __init__(self, name: str) -> None:
        if name not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
        self.name = name
        self._turn = 0
        self._live_of: Sequence[Replica] | None = None   # the replica list ``_live`` was gathered from
        self._live: list[dict] = []                        # each replica's ``live`` map

    def _least_loaded(self, replicas: Sequence[Replica], among: Sequence[int] | None = None) -> int:
        """The least loaded replica of ``among`` (default all), ties in rotation."""
        n = len(replicas)
        start, self._turn = self._turn, (self._turn + 1) % n
        if among is not None:
            return min(among, key=lambda i: (replicas[i].load, (i - start) % n))
        # All of them (64 and more in a simulated cluster: every arrival without a hit) in C-level
        # passes: the first minimum of the loads rotated to start at ``start``.
        if self._live_of is not replicas:   # the maps themselves: gathered once per replica list, always current
            self._live_of, self._live = replicas, [r.live for r in replicas]
        loads = list(map(len, self._live))
        rotated = loads[start:] + loads[:start]
        return (start + rotated.index(min(rotated))) % n

    def route(self, request: Request, conversation: Conversation, replicas: Sequence[Replica]) -> int:
        if self.name == "round_robin":
            i, self._turn = self._turn, (self._turn + 1) % len(replicas)
            return i
        if self.name == "least_loaded" or conversation.names is None:
            return self._least_loaded(replicas)
        limit = (request.num_tokens - 1) // replicas[0].core.scheduler.page_size
        # A conversation's page names are its own (``PageNamer.conversation``): only a replica that
        # served it can hold any of them, so the others (0 pages) need not be asked.
        hits = {i: replicas[i].cached_prefix_pages(conversation.names, limit) for i in sorted(conversation.visited)}
        best = max(hits.values(), default=0)
        if best == 0:
            return self._least_loaded(replicas)
        tied = [i for i, h in hits.items() if h == best]
        if conversation.replica in tied:
            return conversation.replica
        return self._least_loaded(replicas, tied)


@dataclass(slots=True)
class ClusterResult:
    """What a re-send run produced; ``requests`` are every segment request sent."""

    requests: list[Request]
    end_time_s: float
    num_steps: int
    busy_time_s: float              # simulated step seconds, summed over replicas
    batched_tokens: int
    num_preemptions: int
    recomputed_tokens: int          # within requests (Discard, preemption) + re-sent context not cached
    follow_ups: int                 # segment requests after a conversation's first
    follow_up_hits: int             # of those, requests that re-linked at least one cached page
    follow_ups_same_replica: int    # of those, routed to the replica of their predecessor
    requests_by_replica: list[int] = field(default_factory=list)
    quiet_steps: int = 0            # of ``num_steps``, decode steps run late in one go (``DecodeRun.plan_quiet``)
    quiet_steps_dropped: int = 0    # quiet steps planned, then dropped by an arrival (or the horizon)

    @property
    def affinity_hit_rate(self) -> float | None:
        return self.follow_up_hits / self.follow_ups if self.follow_ups else None


def run_resend(schedulers: Sequence[Scheduler], workload: Sequence[WorkloadItem],
               router: str = "round_robin", *, horizon_s: float | None = None, check_invariants: bool = False,
               progress: Callable[[int, float], None] | None = None, fast_forward: bool = True) -> ClusterResult:
    """Replay ``workload`` in re-send mode on one replica per scheduler (see module doc).

    Each replica's steps are timed by its scheduler's ``cost`` (the model its policy prices with).
    ``progress(num_requests_finished_since_last_call, now)`` every 2,000 passes and at the end.
    ``fast_forward``: a replica's decode-only steps run as ``DecodeRun`` steps (the same
    result; each still one pass in time order, as routing reads every replica's state).
    Runs with the cyclic garbage collector paused (``cyclic_gc_paused``).
    """
    with cyclic_gc_paused():
        return _run_resend(schedulers, workload, router, horizon_s, check_invariants, progress, fast_forward)


def _run_resend(schedulers: Sequence[Scheduler], workload: Sequence[WorkloadItem], router: str,
                horizon_s: float | None, check_invariants: bool, progress: Callable[[int, float], None] | None,
                fast_forward: bool) -> ClusterResult:
    """``run_resend``'s event loop."""
    if not schedulers:
        raise ValueError("need at least one replica")
    smallest = min(schedulers, key=lambda s: s.device_pool.num_pages)
    for w in {id(w.entry): w for w in workload}.values():   # (trace entries repeat: each checked once)
        check_fits_pool(w.request_id, Conversation(w).total_tokens, smallest)   # its last turn re-sends it all
    page_size = schedulers[0].page_size
    caching = schedulers[0].kv.cache is not None
    namer = PageNamer(page_size)
    replicas = []
    for i, sched in enumerate(schedulers):
        clock = SimClock()
        executor = SimExecutor(sched.cost, page_size, clock)
        replicas.append(Replica(i, EngineCore(sched, executor, clock, check_invariants=check_invariants),
                                clock, executor))
    pick = Router(router)
    seq = itertools.count()
    # Arrivals in (time, seq) order: the workload's first segments, sorted once and taken from the end
    # (``firsts``), and a heap of the follow-ups (``arrivals``; far smaller: only conversations in
    # flight); ``head`` is the earlier of their fronts. (seq is unique: a Conversation is never compared.)
    firsts: list[tuple[float, int, Conversation]] = sorted(
        ((w.arrival_time, next(seq), Conversation(w)) for w in workload), reverse=True)
    arrivals: list[tuple[float, int, Conversation]] = []
    head = firsts[-1] if firsts else None
    active: list[tuple[float, int]] = []        # (next pass time, replica); stale unless it is next_pass's
    next_pass: list[float | None] = [None] * len(replicas)   # None: nothing to do until an arrival
    sent: list[Request] = []
    conversation_of: dict[str, Conversation] = {}
    follow_ups: list[tuple[Request, Request]] = []   # (follow-up, its predecessor)
    same_replica = 0
    finished = passes = 0
    reported = 0
    runs: list[DecodeRun | None] = [None] * len(replicas)   # open decode-only runs, by replica

    quiet = [0, 0]   # quiet steps run, dropped: summed over closed runs

    def end_run(i: int) -> None:
        run = runs[i]
        if run is not None:
            replicas[i].core.end_decode_run(run)
            quiet[0] += run.quiet_steps
            quiet[1] += run.quiet_steps_dropped
            runs[i] = None

    def follow_up(request: Request) -> None:
        """``request`` finished: its conversation's next segment arrives after the API call."""
        nonlocal finished, head
        conv = conversation_of.pop(request.request_id, None)
        if conv is None:
            return
        finished += 1
        if conv.index < conv.num_segments:
            api_s = conv.item.entry.segments[conv.index - 1].api_duration_s or 0.0
            arrival = (request.finish_time + api_s, next(seq), conv)
            heapq.heappush(arrivals, arrival)
            if head is None or arrival < head:
                head = arrival

    def wake_at(i: int, at: float) -> None:
        """Replica ``i``'s next pass is at ``at`` (s), or earlier if one was due sooner."""
        at = max(at, replicas[i].clock.now())
        if next_pass[i] is None or at < next_pass[i]:
            next_pass[i] = at
            heapq.heappush(active, (at, i))

    while head is not None or active:
        t_arrival = head[0] if head is not None else float("inf")
        t_pass = active[0][0] if active else float("inf")
        if horizon_s is not None and min(t_arrival, t_pass) >= horizon_s:
            break
        if t_arrival <= t_pass:
            conv = head[2]
            if firsts and firsts[-1] is head:
                firsts.pop()
            else:
                heapq.heappop(arrivals)
            if firsts and (not arrivals or firsts[-1] < arrivals[0]):
                head = firsts[-1]
            else:
                head = arrivals[0] if arrivals else None
            request = conv.next_request(t_arrival)
            if caching:
                if conv.names is None:   # (a Mooncake request's input: its blocks' names, shared by id)
                    entry = conv.item.entry
                    conv.names = namer.blocks(entry.block_ids, entry.prompt_len, conv.total_tokens) \
                        if entry.block_ids else namer.conversation(conv.total_tokens)
                request.block_hashes = conv.names
            i = pick.route(request, conv, replicas)
            if conv.previous is not None:
                follow_ups.append((request, conv.previous))
                same_replica += i == conv.replica
            conv.previous, conv.replica = request, i
            conv.visited.add(i)
            conversation_of[request.request_id] = conv
            sent.append(request)
            run = runs[i]
            if run is not None:
                run.run_quiet(t_arrival)   # its quiet steps before the arrival; the next one admits it
            replicas[i].core.add(request, t_arrival)   # an open run admits it at its next step (or ends there)
            wake_at(i, t_arrival)
            continue
        t, i = heapq.heappop(active)
        if next_pass[i] != t:
            continue                            # superseded by an earlier wake-up
        next_pass[i] = None
        replica = replicas[i]
        core, clock = replica.core, replica.clock
        passes += 1
        run = runs[i]
        if run is None:
            clock.sleep_until(t)   # (a run's next pass is at its clock's time: nothing to sleep)
        else:
            run.run_quiet(t)   # (planned quiet steps all start before t)
            if not core.api.poll_ready(t) and run.step(t) is not None:
                if run.finished:
                    for r in run.finished:
                        follow_up(r)
                    run.finished.clear()
                # wake_at(i, clock.now()), inlined (the hot path), after the coming quiet steps
                next_pass[i] = at = run.plan_quiet(clock.t, core.api.ready_after())
                heapq.heappush(active, (at, i))
                continue
            end_run(i)
        for r in core.step():
            if r.is_finished:
                follow_up(r)
        if progress is not None and passes % 2000 == 0:
            progress(finished - reported, clock.now())
            reported = finished
        if core.last_step_ran or core.api.poll_ready(clock.now()):
            if fast_forward and core.last_step_ran:
                runs[i] = core.decode_run(finishes=True, admits=True)
            wake_at(i, clock.now())
            continue
        wake = core.next_wakeup()
        if wake is not None:
            wake_at(i, wake)
        elif core.scheduler.has_unfinished():
            raise SimulationStalled(
                f"replica {i}: {len(core.scheduler.requests)} request(s) left but nothing can run at "
                f"t={clock.now():.3f}s (device pool {core.scheduler.device_pool.num_pages} pages)")
    for i in range(len(replicas)):
        if runs[i] is not None:
            runs[i].run_quiet(float("inf") if horizon_s is None else horizon_s)
        end_run(i)
    if progress is not None:
        progress(finished - reported, max(r.clock.now() for r in replicas))
    result = _result(replicas, sent, follow_ups, same_replica)
    result.quiet_steps, result.quiet_steps_dropped = quiet
    return result


def _result(replicas: Sequence[Replica], sent: list[Request], follow_ups: list[tuple[Request, Request]],
            same_replica: int) -> ClusterResult:
    """Totals over replicas. A follow-up recomputes the context its predecessor
    computed (``max_computed_tokens``) less what it re-linked from the cache."""
    resent_uncached = hits = 0
    for request, previous in follow_ups:
        if request.first_scheduled_time is not None:
            resent_uncached += max(0, previous.max_computed_tokens - request.num_cached_tokens)
        hits += request.num_cached_tokens > 0
    stats = [rep.core.stats for rep in replicas]
    return ClusterResult(
        requests=sorted(sent, key=lambda r: r.arrival_time),
        end_time_s=max(rep.clock.now() for rep in replicas),
        num_steps=sum(s.steps for s in stats), busy_time_s=sum(s.busy_time_s for s in stats),
        batched_tokens=sum(s.batched_tokens for s in stats),
        num_preemptions=sum(rep.core.scheduler.num_preemptions for rep in replicas),
        recomputed_tokens=sum(s.recomputed_tokens for s in stats) + resent_uncached,
        follow_ups=len(follow_ups), follow_up_hits=hits, follow_ups_same_replica=same_replica,
        requests_by_replica=[s.requests for s in stats])
