"""The scheduler: which requests run each step, with how many tokens, and
what happens to their pages (DESIGN section 3).

Pure Python. The executor (real model or simulator) calls, per step:
``schedule(now)`` -> runs the plan -> ``update(plan, result, now)``, which
applies the stop rules and pauses declared API calls. API results come back
through ``api_return``.

The scheduler decides who runs (admission, preemption, API handling, stop
rules); which pages a request holds is the ``KVManager``'s job, and the order
of the waiting queue is the policy's ``priority``, filed in a ``RankedQueue``
(see ``scheduler.policies.base``). ``waiting`` and ``running`` are
``RequestQueue``s (insertion-ordered, O(1) remove); read them freely but change
them only through the scheduler's methods.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from operator import attrgetter, itemgetter
from types import MappingProxyType

from scheduler.config import SchedulerConfig
from scheduler.cost_model import CostModel
from scheduler.kv_manager import KVManager
from scheduler.pages import PageAllocator
from scheduler.plan import DecodeChunk, EventKind, MemoryView, RequestEvent, ScheduledChunk, StepPlan, StepResult
from scheduler.policies.base import Policy, PolicyContext
from scheduler.prefix_cache import PrefixCache
from scheduler.queues import RankedQueue, RequestQueue
from scheduler.request import ApiCallRecord, Handling, Request, RequestState, Segment
from scheduler.token_budget import DynamicBudget


_tokens_of = attrgetter("num_tokens")
_priority_of = attrgetter("priority")
_place_of = itemgetter(0)


class Scheduler:
    """Continuous batching with API pauses, swap, preemption by recompute.

    Built from its pools (``Scheduler(config, policy, device_pool, host_pool,
    cost)``) or around a ready ``KVManager`` (``Scheduler.with_kv(config,
    policy, kv, cost)``).
    """

    def __init__(self, config: SchedulerConfig, policy: Policy, device_pool: PageAllocator,
                 host_pool: PageAllocator, cost: CostModel) -> None:
        cache = PrefixCache(config.prefix_cache_key) if config.enable_prefix_caching else None
        self.kv = KVManager(device_pool, host_pool, cache, config.prefix_retention_s, config.host_cache)
        self.config = config
        self.policy = policy
        self.cost = cost
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue()          # WAITING, or SWAPPED after the API returned
        self.running = RequestQueue()          # in admission order
        # ``running`` split in two (see _schedule_running): the decoding requests (next chunk: one
        # sampled token) with their reusable chunk, and the others (prompt or returned tokens left),
        # each with its place in ``running`` (a sequence number, rising with each entry).
        self._decoding: dict[Request, DecodeChunk] = {}
        self._filling: dict[Request, int] = {}
        self._entries = itertools.count()
        self._decoder_places: list[tuple[int, Request]] = []   # (-place, decoder): a max-heap, stale skipped
        # Decoding requests whose next token starts a new page (from ``update``; stale entries,
        # no longer decoding or already given the page, are skipped).
        self._page_due: dict[Request, None] = {}
        self._running_tokens = 0   # context tokens of the running batch (kept as it changes)
        # Whether the policy orders the running batch itself (else: the order requests entered it).
        self._reorders_running = type(policy).order_running is not Policy.order_running
        self.paused: dict[str, Request] = {}   # inside an API call (PAUSED, SWAPPING_OUT, SWAPPED)
        self.swapping_out: list[Request] = []
        self.swapping_in: list[Request] = []
        self.iteration = 0
        self.num_preemptions = 0
        self.api_calls_by_handling: dict[str, int] = {h.value: 0 for h in Handling}   # pauses, by the handling chosen
        self._ranked = RankedQueue()            # ``waiting`` in admission order (``_rank_key``)
        self._classed = 0                       # live requests of a priority class other than 0
        self.classes_in_use = False             # whether there are any (``_count_class``)
        # Aging (``config.priority_aging_s``): (due time, seq, request id) of each waiting request
        # above class 0, a min-heap; an entry is current while ``_aging_due`` maps its id to its seq
        # (stale ones are skipped when they come due, or dropped when they outnumber current ones).
        self._aging: list[tuple[float, int, str]] = []
        self._aging_due: dict[str, int] = {}
        self._aging_seq = itertools.count()
        # Back from an API call straight into ``running`` (Preserve resumed, swap-in done), not yet
        # given a chunk: the first step that runs it marks its call resumed (see _schedule_running).
        self._resume_pending: dict[str, Request] = {}
        self._preserved = MappingProxyType(self.kv.paused_holders)   # what ``policy.redecide`` may read
        self._dynamic_budget = DynamicBudget(config.budget_gamma, config.budget_beta_low,
                                             config.budget_beta_high)
        policy.bind(PolicyContext(cost, config.max_num_batched_tokens, config.swap_budget_tokens,
                                  self.kv.page_size))

    @classmethod
    def with_kv(cls, config: SchedulerConfig, policy: Policy, kv: KVManager, cost: CostModel) -> "Scheduler":
        """A scheduler over an existing ``KVManager`` (its pools and holder indexes)."""
        sched = cls(config, policy, kv.device_pool, kv.host_pool, cost)
        sched.kv = kv
        sched._preserved = MappingProxyType(kv.paused_holders)
        return sched

    @property
    def now(self) -> float:
        """The time passed to the latest schedule()/event (the KV manager's clock too)."""
        return self.kv.now

    @now.setter
    def now(self, value: float) -> None:
        self.kv.now = value

    # ------------------------------------------------------------------ views
    @property
    def device_pool(self) -> PageAllocator:
        return self.kv.device_pool

    @property
    def host_pool(self) -> PageAllocator:
        return self.kv.host_pool

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def view(self, running_tokens: int | None = None) -> MemoryView:
        """Memory now; ``running_tokens`` defaults to the running batch's context tokens."""
        if running_tokens is None:
            running_tokens = self._running_tokens
        device, host = self.kv.device_pool, self.kv.host_pool
        return MemoryView(self.kv.num_free_device, device.num_pages, self.kv.num_free_host, host.num_pages,
                          self.page_size,
                          running_tokens, len(self.running), self.kv.paused_device_pages(), self.cost,
                          self.kv.cache_horizon_s())

    def admission_order(self) -> list[Request]:
        """The waiting queue in the order ``schedule()`` admits from it."""
        return self._ranked.ordered()

    def admission_key(self, request: Request) -> tuple | None:
        """The key ``request`` is filed under in the waiting queue, ``(priority class,
        *policy key)`` (None: not waiting)."""
        return self._ranked.key(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """True when a step could make progress now (not only waiting on APIs)."""
        return bool(self.waiting or self.running or self.swapping_out or self.swapping_in)

    @property
    def max_step_tokens(self) -> int:
        """The most query tokens one step can batch (the executor sizes its shapes
        for it): ``max_num_batched_tokens``, or above it where a dynamic budget's
        ``β_high > 1`` lets the budget expand."""
        target = self.config.max_num_batched_tokens
        if self.config.token_budget == "static":
            return target
        if self.config.token_budget == "dynamic":
            return max(target, self._dynamic_budget.max_tokens(target))
        return max(target, self.policy.max_step_tokens(target))

    @property
    def context_limit(self) -> int | None:
        """Tokens a context may reach: ``max_model_len`` capped by the device pool (a
        context larger than the pool would preempt itself forever); None: unlimited."""
        if self.config.max_model_len is None:
            return None
        return min(self.config.max_model_len, self.kv.device_pool.num_pages * self.page_size)

    # ------------------------------------------------------------- lifecycle
    def add_request(self, request: Request, now: float) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.prompt_len <= 0:
            raise ValueError("prompt must have at least one token")
        request.state = RequestState.WAITING
        self.requests[request.request_id] = request
        if request.priority:
            self._count_class(1)
        self.now = now
        self.kv.hash_context(request)
        self.policy.on_arrival(request, now, self.view())
        self._enqueue(request, now)

    def set_priority(self, request: Request, priority: int) -> None:
        """Move live ``request`` to class ``priority``, the caller's choice: it counts as the
        class it asked for from now (``priority_aged`` back to 0)."""
        request.priority_aged = 0
        self._move_class(request, priority)

    def _move_class(self, request: Request, priority: int) -> None:
        """Put ``request`` in class ``priority`` (re-filed if it is waiting; one already in
        that class keeps its place)."""
        if priority == request.priority:
            return
        self._count_class(bool(priority) - bool(request.priority))
        request.priority = priority
        if request in self._ranked:
            self._ranked.add(request, self._rank_key(request, self.now))
            self._age_later(request, self.now)

    def _age_later(self, request: Request, since: float) -> None:
        """With aging on, file waiting ``request`` to move one class lower ``priority_aging_s``
        after ``since`` if it is above class 0 (replacing what was filed for it)."""
        aging_s = self.config.priority_aging_s
        if aging_s is None:
            return
        if request.priority <= 0:
            self._aging_due.pop(request.request_id, None)
            return
        seq = next(self._aging_seq)
        self._aging_due[request.request_id] = seq
        heapq.heappush(self._aging, (since + aging_s, seq, request.request_id))
        if len(self._aging) > 2 * len(self._aging_due) + 64:   # (mostly stale: requests admitted, ended)
            due_of = self._aging_due
            self._aging = [entry for entry in self._aging if due_of.get(entry[2]) == entry[1]]
            heapq.heapify(self._aging)

    def _age(self, now: float) -> None:
        """Move each waiting request whose aging time has come one class lower (``_move_class``:
        re-filed in the queue; its next move is filed while it is above class 0)."""
        due_of = self._aging_due
        while self._aging and self._aging[0][0] <= now:
            _, seq, request_id = heapq.heappop(self._aging)
            if due_of.get(request_id) != seq:
                continue   # (admitted, ended, or filed again since)
            request = self.requests[request_id]
            request.priority_aged += 1
            self._move_class(request, request.priority - 1)   # (files its next move, from now)

    def _count_class(self, change: int) -> None:
        """Live requests of a class other than 0 changed by ``change``: while there are
        any, classes are in use (class order and room-making; no decode runs)."""
        self._classed += change
        self.classes_in_use = self._classed > 0

    def finish(self, request: Request, reason: str, now: float) -> None:
        """End ``request`` (``reason``: "stop", "length", "abort", …) and free all its pages."""
        if self.requests.pop(request.request_id, None) is not None and request.priority:
            self._count_class(-1)
            self._aging_due.pop(request.request_id, None)
        self._resume_pending.pop(request.request_id, None)
        in_call = self.paused.pop(request.request_id, None) is not None
        if request in self.waiting:
            self._dequeue(request)
        self._stop_running(request)
        for q in (self.swapping_out, self.swapping_in):
            if request in q:
                q.remove(request)
        self.kv.free(request, retain=in_call)   # a context parked in a call may be resumed by a follow-up
        if reason not in ("abort", "error"):   # (a request cut short says nothing of how long outputs run)
            self.policy.predictor.observe_output(request)   # learned predictor: per-class running mean
        request.state = RequestState.ABORTED if reason == "abort" else RequestState.FINISHED
        request.finish_reason = reason
        request.finish_time = now
        self.policy.on_finish(request, now)

    def abort(self, request_id: str, now: float) -> Request | None:
        """Abort a live request; returns it, or ``None`` if unknown or already ended."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, "abort", now)
        return request

    def _enqueue(self, request: Request, now: float) -> None:
        """Put ``request`` in the waiting queue, filed under the policy's key."""
        self.waiting.append(request)
        self.kv.hold_waiting(request)
        self.policy.on_enqueue(request, now, self.iteration)
        self._ranked.add(request, self._rank_key(request, now))
        self._age_later(request, now)   # (its wait for aging starts: in the queue only)

    def _rank_key(self, request: Request, now: float) -> tuple:
        """The waiting queue's key of ``request``: its priority class first (lower is
        admitted first), then the policy's ``priority`` within the class."""
        return (request.priority, *self.policy.priority(request, now, None))

    def _dequeue(self, request: Request) -> None:
        self.waiting.remove(request)
        self._ranked.remove(request)
        if self._aging_due:
            self._aging_due.pop(request.request_id, None)   # (aging counts waiting in the queue only)
        self.kv.release(request)
        self.policy.on_dequeue(request, self.iteration)

    def _start_running(self, request: Request) -> None:
        request.state = RequestState.RUNNING
        self.running.append(request)
        self._filling[request] = next(self._entries)
        self._running_tokens += request.num_tokens

    def _stop_running(self, request: Request) -> None:
        """Take ``request`` out of the running batch (if it is there)."""
        if request not in self.running:
            return
        self.running.remove(request)
        self._running_tokens -= request.num_tokens
        if self._decoding.pop(request, None) is None:
            del self._filling[request]

    def _drop_kv(self, request: Request, retain: bool = False) -> None:
        """Free the device KV; the context will be recomputed, except the full
        pages still in the prefix cache when it is admitted again (``retain``:
        it is inside an API call, its pages get the retention bonus)."""
        self.kv.free_device(request, retain)
        request.service_offset += request.num_computed_tokens
        request.num_computed_tokens = 0

    # ------------------------------------------------------------- API calls
    def pause(self, request: Request, now: float, api_type: str,
              api_duration_s: float | None = None) -> Handling:
        """``request`` just emitted an API call: take it out of the batch and
        apply the handling (engine-forced, else the policy's). Returns it."""
        self.now = now
        chosen = self.config.handling or self.policy.handling(request, self.view(), now, api_duration_s)
        self.api_calls_by_handling[chosen.value] += 1
        request.api_calls.append(ApiCallRecord(api_type=api_type, handling=chosen, call_time=now,
                                               context_tokens=request.num_computed_tokens))
        request.api_returned = False
        self.policy.predictor.observe_output(request)   # learned predictor: per-class running mean
        self._stop_running(request)
        self.paused[request.request_id] = request
        if request.current_segment is not None and request.declared_call_due():
            request.segment_index += 1
            request.segment_generated = 0
        request.state = RequestState.PAUSED
        if chosen == Handling.PRESERVE:
            request.handling = Handling.PRESERVE
            self.kv.hold_paused(request)
        else:
            self._release_paused_kv(request, chosen)
        return request.handling

    def _release_paused_kv(self, request: Request, handling: Handling) -> None:
        """Apply Swap (chunked swap-out; Discard when the host pool is full) or
        Discard to a paused request's device KV."""
        record = request.api_calls[-1]
        if handling == Handling.SWAP:
            if request.device_pages and self.kv.start_swap_out(request):
                request.state = RequestState.SWAPPING_OUT
                self.swapping_out.append(request)
                request.handling = record.handling = handling
                return
            if request.device_pages:
                record.fell_back_from = Handling.SWAP
            handling = Handling.DISCARD
        self._drop_kv(request, retain=True)   # soft discard: into the prefix cache
        request.handling = record.handling = handling

    def api_return(self, request: Request, num_returned_tokens: int, now: float,
                   token_ids: list[int] | None = None) -> bool:
        """The API call of a paused ``request`` returned ``num_returned_tokens``
        tokens (``token_ids``, when known, are appended to its context, cut to
        fit the context limit). Returns True when that ended the request: the
        call was its last declared step ("stop"), or the context is full
        ("length")."""
        if request.request_id not in self.paused or request.api_returned:
            raise ValueError(f"request {request.request_id!r} is not waiting for an API call")
        limit = self.context_limit
        last_step = bool(request.segments) and request.segment_index >= len(request.segments)
        if limit is not None:   # (room for the token sampled after the return, unless it ends the request)
            num_returned_tokens = max(0, min(num_returned_tokens, limit - request.num_tokens - (0 if last_step else 1)))
        if token_ids is not None:
            request.token_ids.extend(token_ids[:num_returned_tokens])
        self.now = now
        record = request.api_calls[-1]
        record.return_time = now
        record.num_returned_tokens = num_returned_tokens
        request.num_tokens += num_returned_tokens
        request.api_returned = True
        self.policy.predictor.observe_api(record.api_type, now - record.call_time)
        if last_step:
            self.finish(request, "stop", now)   # the call was the request's last declared step
            return True
        if limit is not None and request.num_tokens >= limit:
            self.finish(request, "length", now)
            return True
        self.policy.on_api_return(request, now, self.view())
        self.kv.hash_context(request)
        if request.state != RequestState.SWAPPING_OUT:
            self._requeue_returned(request)
        return False

    def _requeue_returned(self, request: Request) -> None:
        del self.paused[request.request_id]
        self.kv.release(request)
        if (self.policy.resume_preserved_to_running and request.handling == Handling.PRESERVE
                and request.device_pages and len(self.running) + len(self.swapping_in) < self.config.max_num_seqs):
            # Seed 004 Algorithm 1: a Preserve call resumes straight into the batch.
            self._start_running(request)
            self._resume_pending[request.request_id] = request
            return
        if request.state != RequestState.SWAPPED:
            request.state = RequestState.WAITING
        self._enqueue(request, self.now)

    def _redecide_paused(self, now: float) -> None:
        """Apply the policy's switches of calls paused under Preserve (``Policy.redecide``;
        the caller checked that a call is held so)."""
        for request, handling in self.policy.redecide(now, self._preserved, self.view):
            if handling != Handling.PRESERVE and request.request_id in self.kv.paused_holders:
                self.kv.release(request)
                self._release_paused_kv(request, handling)

    # ------------------------------------------------------------- schedule
    def schedule(self, now: float) -> StepPlan:
        plan, view = self._open_plan(now)
        kv = self.kv
        swap_pages = max(1, self.config.swap_budget_tokens // self.page_size)
        kv.copy_budget = self._continue_swaps(plan, swap_pages, view)   # what swaps left: host-tier copies, swap-ins
        if self.classes_in_use:
            self._make_room_for_class(plan, now, view)
        budget = self._schedule_running(plan, plan.token_budget, now, view)
        self._admit_waiting(plan, budget, now)
        return self._close_plan(plan, now)

    def _open_plan(self, now: float, want_view: bool = True) -> tuple[StepPlan, MemoryView | None]:
        """Start step ``iteration + 1`` at ``now``: the policy's per-step work, and an
        empty plan with the step's token budget (with the memory view it saw; None
        when not ``want_view`` and the budget is static: no view was needed)."""
        self.iteration += 1
        self.now = now
        self.kv.copies_done()
        self._policy_step(now)
        view = self.view() if want_view or self.budget_is_dynamic else None
        return StepPlan(token_budget=max(1, self._token_budget(view)), time=now), view

    def _close_plan(self, plan: StepPlan, now: float) -> StepPlan:
        """Add the step's host-tier copies to ``plan``, which is then fixed; the policy sees it."""
        kv = self.kv
        if kv.host_tier:
            copy_out, copy_in = kv.take_copies()
            if copy_out is not None:
                plan.swap_out.append(copy_out)
            if copy_in is not None:
                plan.swap_in.append(copy_in)
            kv.copy_budget = 0   # the plan is fixed: a copy planned after it (adopt between steps) would never run
        self.policy.on_plan(plan, now, self.iteration)
        return plan

    def _policy_step(self, now: float) -> None:
        """Start-of-step policy work: re-rank stale keys, then re-decide paused calls."""
        policy, ranked = self.policy, self._ranked
        if self._aging and self._aging[0][0] <= now:
            self._age(now)
        if policy.rescore_due(self.iteration):
            requests = ranked.ordered()
            policy.on_rescore(requests, now, self.view())
            ranked.clear()
            for r in requests:
                ranked.add(r, self._rank_key(r, now))
        for r in policy.on_step(now, self.iteration):
            if r in ranked:
                ranked.add(r, self._rank_key(r, now))
        if self.kv.paused_holders:   # (most steps hold no call under Preserve)
            self._redecide_paused(now)

    @property
    def budget_is_dynamic(self) -> bool:
        """Whether a step's token budget depends on memory (``_token_budget`` reads its view)."""
        mode = self.config.token_budget
        return mode == "dynamic" or (mode == "policy" and self.policy.dynamic_budget is not None)

    def _token_budget(self, view: MemoryView | None) -> int:
        """Tokens the step may batch; ``view`` may be None when not ``budget_is_dynamic``."""
        mode, target = self.config.token_budget, self.config.max_num_batched_tokens
        if mode == "static":
            return target
        if mode == "dynamic":
            return self._dynamic_budget(target, view)
        return self.policy.token_budget(target, view)

    def _continue_swaps(self, plan: StepPlan, swap_pages: int, view: MemoryView) -> int:
        """Spend the step's swap budget (pages): swap-outs in the policy's order, then swap-ins."""
        for request in list(self.policy.order_swap_out(self.swapping_out, view)):
            if swap_pages <= 0:
                break
            swap_pages = self._swap_chunk(plan, request, swap_pages, out=True)
        for request in list(self.swapping_in):
            if swap_pages <= 0:
                break
            swap_pages = self._swap_chunk(plan, request, swap_pages, out=False)
        return swap_pages

    def _swap_chunk(self, plan: StepPlan, request: Request, swap_pages: int, out: bool) -> int:
        """Plan the next chunk of ``request``'s swap; on completion move it on
        (swap-out: SWAPPED, re-queued if its call returned; swap-in: RUNNING)."""
        op, n, done = self.kv.swap_chunk(request, swap_pages, out)
        if op is not None:
            (plan.swap_out if out else plan.swap_in).append(op)
        if done and out:
            self.swapping_out.remove(request)
            request.state = RequestState.SWAPPED
            if request.api_returned:
                self._requeue_returned(request)
        elif done:
            self.swapping_in.remove(request)
            self._start_running(request)
            if request.api_returned:
                self._resume_pending[request.request_id] = request
        return swap_pages - n

    def _schedule_running(self, plan: StepPlan, budget: int, now: float, view: MemoryView) -> int:
        """Give the running batch its tokens in the policy's order (``order_running``;
        by default the order the requests entered the batch), each what the
        budget leaves. Returns the budget left."""
        if not self._reorders_running and not self.classes_in_use and len(self._decoding) <= budget:
            left = self._schedule_on_hand(plan, budget, now)
            if left is not None:
                return left
        return self._schedule_in_order(plan, budget, now, view)

    def _schedule_on_hand(self, plan: StepPlan, budget: int, now: float) -> int | None:
        """The common step, planned as the ordered pass would plan it but in
        O(non-decoding requests + decoders starting a page), not O(running):
        each decoding request's chunk is reused. It applies when the pages the
        step takes are on hand and serving the decoders first gives what the
        batch order gives (the whole batch fits the budget, or no decoder
        entered the batch after a request still computing its context).
        Returns the budget left, or None, planning nothing, when it does not
        apply (then ``_schedule_in_order``)."""
        kv, decoding = self.kv, self._decoding
        page_size = kv.page_size
        # kv.pages_needed(r, 1), inlined: a decoder whose next token starts a page
        due = [r for r in self._page_due if r in decoding and r.num_computed_tokens >= len(r.device_pages) * page_size]
        fillers = self.fillers_on_hand(budget - len(decoding), len(due))
        if fillers is None:
            return None
        self._page_due.clear()
        if due:
            kv.add_page_each(due)
        left = self.give_fillers(plan, fillers, budget - len(decoding), now)
        plan.chunks.extend(decoding.values())
        return left

    def fillers_on_hand(self, left: int, pages: int) -> list[tuple[Request, int, int, int]] | None:
        """The chunks of the running requests still computing their context (in
        batch order) when the decoders' tokens come first, ``left`` tokens
        remaining after them and ``pages`` device pages already wanted this step:
        ``[(request, start, tokens, pages it lacks)]``; None when the pages are
        not on hand or serving the decoders first is not what the batch order
        gives (see ``_schedule_on_hand``). Plans and allocates nothing."""
        page_size = self.kv.page_size
        others: list[tuple[Request, int, int, int]] = []
        short = False   # the budget did not cover every request's whole chunk
        for request in self._filling:
            if left <= 0:
                short = True
                break
            start = request.num_computed_tokens
            n = request.num_tokens - start
            if n > left:
                n, short = left, True
            elif n <= 0:
                continue
            need = max(0, -(-(start + n) // page_size) - len(request.device_pages))
            others.append((request, start, n, need))
            pages += need
            left -= n
        if pages > self.kv.num_free_device or (short and self._decoder_after(next(iter(self._filling.values())))):
            return None
        return others

    def give_fillers(self, plan: StepPlan, fillers: list[tuple[Request, int, int, int]], left: int,
                     now: float) -> int:
        """Plan ``fillers`` (from ``fillers_on_hand``, still current): their pages and
        chunks. Returns ``left`` less their tokens."""
        kv, chunks, resuming = self.kv, plan.chunks, self._resume_pending
        for request, start, n, need in fillers:
            kv.allocate_slots(request, need)
            chunks.append(ScheduledChunk(request, start, n, start + n == request.num_tokens))
            if request.request_id in resuming:
                self._mark_scheduled(request, now)
            left -= n
        return left

    def _push_decoder_place(self, place: int, request: Request) -> None:
        """File decoder ``request`` at ``place`` for ``_decoder_after``. Stale entries (ended,
        or decoding again from a later place) leave only from the top, and the top is the
        newest: once they outnumber the decoders 2 to 1 (+64) the heap is rebuilt from
        the decoders, or it would hold every request that ever decoded, ended ones too."""
        heap = self._decoder_places
        heapq.heappush(heap, (-place, request))
        if len(heap) > 2 * len(self._decoding) + 64:
            self._decoder_places = heap = [(-chunk.place, r) for r, chunk in self._decoding.items()]
            heapq.heapify(heap)

    def _decoder_after(self, place: int) -> bool:
        """Whether a decoding request entered the batch after place ``place``."""
        heap, decoding = self._decoder_places, self._decoding
        while heap:
            top, request = heap[0]
            chunk = decoding.get(request)
            if chunk is not None and chunk.place == -top:
                return -top > place
            heapq.heappop(heap)   # stale: no longer decoding, or decoding from a later entry
        return False

    def _schedule_in_order(self, plan: StepPlan, budget: int, now: float, view: MemoryView) -> int:
        """One pass over the running batch in the policy's order (by priority class
        first when classes are in use), preempting when pages run out (evict an idle
        holder first, else the lowest priority not yet served). While a waiting
        request of a lower class number than some running one is queued, the
        prompt chunks of those running ones leave it the tokens it needs."""
        kv = self.kv
        page_size = kv.page_size
        append_chunk = plan.chunks.append
        new_chunk = tuple.__new__   # ScheduledChunk(...) without its Python-level __new__ frame
        running_state = RequestState.RUNNING
        decoding, resuming = self._decoding, self._resume_pending
        order = self.policy.order_running(self.running, now, view, budget, self.iteration)
        head_class, reserve = None, 0
        if self.classes_in_use:
            order = sorted(order, key=_priority_of)   # (stable: the policy's order within a class)
            head_class, reserve = self._head_reserve(budget)
        for request in order:
            if request.state is not running_state:
                continue  # preempted earlier in this loop
            start = request.num_computed_tokens
            end = request.num_tokens
            n = end - start
            if head_class is not None and request.priority > head_class and request in self._filling:
                n = min(n, budget - reserve)   # (the waiting head's tokens come first)
                if n <= 0:
                    continue
            if n > budget:
                if budget <= 0:
                    break
                n = budget
            elif n <= 0:
                continue
            need = -(-(start + n) // page_size) - len(request.device_pages)   # kv.pages_needed, inlined
            if need > 0:
                while need > kv.num_free_device:
                    if self._evict_idle_holder():
                        continue
                    victim = self._pick_victim(plan, now, view)
                    if victim is None:
                        break
                    self._preempt(victim, plan)
                    if victim is request:
                        break
                if request.state is not running_state or not kv.allocate_slots(request, need):
                    continue
            chunk = decoding.get(request)
            append_chunk(chunk if chunk is not None else new_chunk(ScheduledChunk, (request, start, n, start + n == end)))
            if resuming and request.request_id in resuming:
                self._mark_scheduled(request, now)
            budget -= n
            if budget <= 0:
                break
        self._page_due = {r: None for r in self._page_due
                          if r in decoding and r.num_computed_tokens >= len(r.device_pages) * page_size}
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int, now: float) -> None:
        """Admit waiting requests in rank order while the budget, seats and pages allow."""
        if not self.waiting:
            return
        kv = self.kv
        running, swapping_in, max_seqs = self.running, self.swapping_in, self.config.max_num_seqs
        may_admit, swapped, preempted = self.policy.may_admit, RequestState.SWAPPED, plan.preempted
        frontiers: dict[bytes, Request] | None = None   # built on first need (``_filling_frontiers``)
        for request in self._ranked:
            if budget <= 0 or len(running) + len(swapping_in) >= max_seqs:
                break
            if not may_admit(request, plan):
                break
            if preempted and request in preempted:
                break   # preempted by this step for want of room: not re-admitted in it to recompute what it dropped
            if request.state is swapped:
                while not kv.start_swap_in(request) and self._evict_idle_holder(request, now):
                    pass
                if not request.device_pages:
                    break
                self._dequeue(request)
                request.state = RequestState.SWAPPING_IN
                self.swapping_in.append(request)
                kv.copy_budget = self._swap_chunk(plan, request, kv.copy_budget, out=False)
                if request.state != RequestState.RUNNING:
                    continue
                n = min(request.num_uncomputed_tokens, budget)
                need = kv.pages_needed(request, n)
                fits = kv.allocate_slots(request, need)
                while not fits and self._evict_idle_holder(now=now):   # (every holder left ranks behind it)
                    fits = kv.allocate_slots(request, need)
                if not fits:
                    continue  # runs next step
                self._add_chunk(plan, request, n, now)
                budget -= n
                continue
            # The longest cached run of its full pages (none when it holds device KV).
            hits = kv.lookup(request)
            if self._filling and len(request.block_hashes) > len(hits) and kv.cache is not None \
                    and not request.device_pages and not request.scores_prompt:
                if frontiers is None:
                    frontiers = self._filling_frontiers()
                if request.block_hashes[len(hits)] in frontiers:
                    continue   # its next page is being computed for another request: linked from the cache later
            n, need = self._admission_need(request, hits, budget)
            # Linking the hits makes those of them that are evictable unavailable, and
            # each host-resident one takes a device page (``fits`` counts both).
            fits = kv.fits(need, hits)
            while not fits and self._evict_idle_holder(request, now):
                fits = kv.fits(need, hits)   # the evicted holder may have shared some hits
            if not fits:
                break  # keep the policy's order: no skipping ahead of the head
            self._dequeue(request)
            if not request.device_pages:
                kv.link(request, hits)
                if request.first_scheduled_time is None:
                    request.num_cached_tokens = min(request.num_computed_tokens, request.prompt_len)
            self._start_running(request)
            kv.allocate_slots(request, need)
            self._add_chunk(plan, request, n, now)
            budget -= n
            if frontiers is not None:
                self._add_frontier(frontiers, request)

    def _make_room_for_class(self, plan: StepPlan, now: float, view: MemoryView) -> None:
        """Give the waiting queue's head a place in the batch (``max_num_seqs``) and device
        pages for its whole context when it lacks them: idle holders are evicted first
        (as admission does), then running requests of a higher class number than the
        head's are preempted, highest class number first and the policy's lowest-ranked
        within it; none when even all of them would not free enough (their private
        pages, and their shared ones no other request holds). The head is then admitted
        by ``_admit_waiting`` as usual. A head back from a call with its KV on host (a
        swap-in) is not made room for."""
        head = self._ranked.head()
        if head is None or head.state is RequestState.SWAPPED:
            return
        kv = self.kv
        hits = kv.lookup(head)
        need = self._admission_need(head, hits, head.num_tokens)[1]
        seats = self.config.max_num_seqs - len(self.running) - len(self.swapping_in)
        if seats > 0 and kv.fits(need, hits):
            return
        victims = [r for r in reversed(self.running) if r.priority > head.priority]   # (ties: the later first)
        if not victims:
            return   # (no lower class to take room from: admission goes as usual)
        while seats > 0 and not kv.fits(need, hits) and self._evict_idle_holder(head, now):
            hits = kv.lookup(head)   # (the evicted holder may have shared some of them)
            need = self._admission_need(head, hits, head.num_tokens)[1]
        if seats > 0 and kv.fits(need, hits):
            return
        if seats + len(victims) <= 0 or need > kv.num_free_device + self._pages_freed_by(victims, hits):
            return
        victims.sort(key=lambda r: (r.priority, self.policy.priority(r, now, view)), reverse=True)
        for victim in victims:
            if seats > 0 and kv.fits(need, hits):
                break
            self._preempt(victim, plan)
            seats += 1

    def _pages_freed_by(self, requests: list[Request], hits: list[int]) -> int:
        """Device pages that freeing ``requests``' KV would make free or evictable for a
        request linking ``hits``: their private pages, and each shared (prefix-cache) page
        none but them holds and that is not one of ``hits``."""
        private = sum(len(r.device_pages) - r.num_shared_pages for r in requests)
        shared = Counter(p for r in requests for p in r.device_pages[:r.num_shared_pages])
        refs, linked = (self.kv.cache.refs, set(hits)) if shared else ((), ())
        return private + sum(1 for p, n in shared.items() if refs[p] == n and p not in linked)

    def _head_reserve(self, budget: int) -> tuple[int | None, int]:
        """``(class, tokens)`` the step's running prompts of higher class numbers leave to the
        waiting queue's head: its next chunk, when ``_admit_waiting`` can admit it this step
        (a seat, the pages of that chunk, no other request computing its next page);
        ``(None, 0)`` otherwise."""
        head = self._ranked.head()
        if head is None or head.state is RequestState.SWAPPED or \
                len(self.running) + len(self.swapping_in) >= self.config.max_num_seqs:
            return None, 0
        kv = self.kv
        hits = kv.lookup(head)
        if self._filling and kv.cache is not None and not head.device_pages \
                and len(head.block_hashes) > len(hits) and head.block_hashes[len(hits)] in self._filling_frontiers():
            return None, 0   # it waits for another request's page: no tokens for it this step
        n, need = self._admission_need(head, hits, budget)
        if not kv.fits(need, hits):
            return None, 0
        return head.priority, n

    def _admission_need(self, request: Request, hits: list[int], budget: int) -> tuple[int, int]:
        """``(tokens, pages)`` for admitting waiting ``request`` after linking ``hits``
        (``kv.lookup``; empty when it keeps device KV): its first chunk within ``budget``
        tokens, and the device pages it lacks to hold it."""
        page_size = self.kv.page_size
        computed = len(hits) * page_size if hits else request.num_computed_tokens
        n = min(request.num_tokens - computed, budget)
        held = len(hits) if hits else len(request.device_pages)
        return n, max(0, -(-(computed + n) // page_size) - held)

    def _filling_frontiers(self) -> dict[bytes, Request]:
        """Hash of the page each running request still computing its context computes
        next (its first page not computed; this step's chunk starts in it) -> that request.
        A waiting request whose first uncached page is one of them waits for it to reach
        the prefix cache (its pages are committed as they fill) rather than compute it
        again: a prompt sent n times at once (``n`` choices, a burst of agents with one
        system prompt) is computed once."""
        frontiers: dict[bytes, Request] = {}
        for request in self._filling:
            self._add_frontier(frontiers, request)
        return frontiers

    def _add_frontier(self, frontiers: dict[bytes, Request], request: Request) -> None:
        """File ``request``'s next page in ``frontiers`` (see ``_filling_frontiers``)."""
        index, hashes = request.num_computed_tokens // self.kv.page_size, request.block_hashes
        if index < len(hashes):
            frontiers[hashes[index]] = request

    def _add_chunk(self, plan: StepPlan, request: Request, n: int, now: float) -> None:
        start = request.num_computed_tokens
        plan.chunks.append(tuple.__new__(ScheduledChunk, (request, start, n, start + n == request.num_tokens)))
        self._mark_scheduled(request, now)

    def _mark_scheduled(self, request: Request, now: float) -> None:
        """``request`` was given a chunk at ``now``: its first scheduling, or its call's resume."""
        self._resume_pending.pop(request.request_id, None)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if request.api_calls and request.api_calls[-1].resume_time is None and request.api_returned:
            request.api_calls[-1].resume_time = now

    def _pick_victim(self, plan: StepPlan, now: float, view: MemoryView) -> Request | None:
        """The running request not yet given tokens this step in the lowest priority
        class, the policy's lowest-ranked within it."""
        scheduled = {c.request.request_id for c in plan.chunks}
        candidates = [r for r in self.running if r.request_id not in scheduled]
        if not candidates:
            return None
        # (ties: the latest admitted, as vLLM's: ``max`` keeps the first of equal keys, and the
        # oldest one preempting itself for the next page ping-ponged two requests of equal rank)
        return max(reversed(candidates), key=lambda r: (r.priority, self.policy.priority(r, now, view)))

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Preempt by recompute: free its pages and put it back in the waiting queue."""
        self._stop_running(request)
        self._drop_kv(request)
        request.state = RequestState.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, self.now)
        plan.preempted.append(request)

    def _evict_idle_holder(self, behind: Request | None = None, now: float | None = None) -> bool:
        """Free the pages of one request that holds device KV but is not running
        (paused under Preserve first, then one back from its API and still
        waiting, lowest-ranked first): it will be recomputed. When ``behind`` is
        given, waiting candidates are limited to those ranked after it.
        Returns False when there is none."""
        now = self.now if now is None else now
        victim = next(iter(self.kv.paused_holders.values()), None)
        if victim is None and self.kv.waiting_holders:
            entry = self._ranked.entry
            floor = entry(behind) if behind is not None else None
            ranked = [(entry(r), r) for r in self.kv.waiting_holders.values() if r is not behind]
            ranked = [(k, r) for k, r in ranked if floor is None or k > floor]
            if ranked:
                victim = max(ranked, key=lambda kr: kr[0])[1]
        if victim is None:
            return False
        self._drop_kv(victim, retain=victim.request_id in self.paused)
        if victim.api_calls and victim.api_calls[-1].handling == Handling.PRESERVE:
            victim.api_calls[-1].fell_back_from = Handling.PRESERVE
            victim.api_calls[-1].handling = Handling.DISCARD
            victim.handling = Handling.DISCARD
        if victim in self._ranked:
            self._ranked.add(victim, self._rank_key(victim, now))
        return True

    # ------------------------------------------------------------ decode runs
    def quiet_decoders(self, with_fillers: bool = False) -> list[Request]:
        """The decoding requests, when the coming steps are decode-only and nothing
        but them can change (``scheduler.fast_forward``); else an empty list.
        ``with_fillers``: running requests still computing their context may be
        there too (the caller plans their chunks)."""
        policy = type(self.policy)
        if ((self._filling and not with_fillers) or not self._decoding or self.swapping_out or self.swapping_in
                or self.classes_in_use   # (a class may preempt for a waiting head: ``_make_room_for_class``)
                or self._resume_pending or self._reorders_running or policy.on_plan is not Policy.on_plan
                or (self.kv.paused_holders and policy.redecide is not Policy.redecide)
                or (self.waiting and len(self.running) < self.config.max_num_seqs)):
            return []
        return list(self._decoding)

    # ------------------------------------------------------------ after step
    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[RequestEvent]:
        """Apply what the executor produced for ``plan`` (DESIGN section 3, step 5).

        Advances every chunk's computed tokens and appends each sampled token;
        then, for each chunk that sampled (in chunk order), applies the stop
        rules every executor shares: a stop token id -> finished "stop"; the
        end of a declared segment that calls an API -> paused (``pause``);
        ``max_tokens`` reached, the last declared segment generated, or the
        context limit reached -> finished "length" (``max_tokens`` of a request
        with ``length_after_frontend``: a ``LAST_TOKEN`` event instead, its
        caller ends it after the front end unless that paused it). Returns one
        event per request that produced a token, in chunk order. (Stop strings
        and parsed tool calls need text, so the engine's front end applies those
        to ``TOKEN`` and ``LAST_TOKEN`` events.)"""
        self.kv.copies_done()
        ids, logprobs = result.token_ids, result.logprobs
        if result.prompt_logprobs is not None:
            for chunk, records in zip(plan.chunks, result.prompt_logprobs):
                if records and chunk.request.state is RequestState.RUNNING:
                    chunk.request.prompt_logprobs.extend(records)
        if ids is not None and not isinstance(ids, list):
            ids = ids.tolist() if hasattr(ids, "tolist") else list(map(int, ids))   # Python ints, in one call
        running_state = RequestState.RUNNING
        commit = self.kv.commit if self.kv.cache is not None else None
        page_size = self.kv.page_size
        planned_at = plan.time
        decoding, filling, page_due = self._decoding, self._filling, self._page_due
        produced: list[tuple[Request, int | None]] = []
        for i, chunk in enumerate(plan.chunks):
            request = chunk.request
            if request.state is not running_state:
                continue
            request.num_computed_tokens += chunk.num_tokens
            request.last_scheduled_time = planned_at
            if commit is not None and request.num_computed_tokens >= (request.num_shared_pages + 1) * page_size:
                commit(request)
            if not chunk.samples:
                continue
            if request not in decoding:   # its context is computed: from now on it decodes
                place = filling.pop(request)
                decoding[request] = DecodeChunk(request, place)
                self._push_decoder_place(place, request)
            if request.num_computed_tokens >= len(request.device_pages) * page_size:   # kv.pages_needed(r, 1)
                page_due[request] = None   # its next token starts a page
            request.num_tokens += 1
            request.num_generated += 1
            request.segment_generated += 1
            if request.first_token_time is None:
                request.first_token_time = now
            token = None
            if ids is not None:
                token = ids[i]
                request.token_ids.append(token)
                request.output_token_ids.append(token)
                if logprobs is not None and request.logprobs is not None:
                    request.logprobs.append(logprobs[i])
            produced.append((request, token))
        self._running_tokens += len(produced)
        events = []
        limit = self.context_limit
        if limit is None:
            limit = float("inf")
        new_event = tuple.__new__   # RequestEvent(...) without its Python-level __new__ frame
        token_kind = EventKind.TOKEN
        acting: list[tuple[int, Request, str, Segment | None]] = []   # (place, request, "stop"|"call"|"length", seg)
        for request, token in produced:
            segments = request.segments
            if token is not None and token in request.stop_token_ids:
                acting.append((decoding[request].place, request, "stop", None))
                continue
            if segments:   # declared segments (replay): the current one may end in a call, or be the last
                index, done = request.segment_index, request.segment_generated
                # (a call with segments after it at ``max_tokens``, replay's cap, is never made: "length" below)
                if index < len(segments) and segments[index].api_type is not None \
                        and done >= segments[index].num_tokens \
                        and (index == len(segments) - 1 or request.num_generated < request.max_tokens):
                    acting.append((decoding[request].place, request, "call", segments[index]))
                    continue
                last_done = index == len(segments) - 1 and done >= segments[-1].num_tokens
            else:
                last_done = False
            if last_done or request.num_tokens >= limit:
                acting.append((decoding[request].place, request, "length", None))
            elif request.num_generated >= request.max_tokens:
                if request.length_after_frontend:   # (the caller ends it after its front end: ``EventKind``)
                    events.append(new_event(RequestEvent, (request, EventKind.LAST_TOKEN, None)))
                else:
                    acting.append((decoding[request].place, request, "length", None))
            else:
                events.append(new_event(RequestEvent, (request, token_kind, None)))
        if acting:
            # Ends and pauses change memory (the next call's handling sees it): apply them in the
            # batch's order, entry order unless the policy ordered the batch (then the chunks' order).
            if not self._reorders_running:
                acting.sort(key=_place_of)
            for _, request, rule, seg in acting:
                if rule == "call":
                    self.pause(request, now, seg.api_type, seg.api_duration_s)
                    events.append(new_event(RequestEvent, (request, EventKind.API_CALL, seg)))
                else:
                    self.finish(request, rule, now)
                    events.append(new_event(RequestEvent, (request, EventKind.FINISHED, None)))
        return events

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Pages are free or owned by exactly the request that lists them; queues agree with states."""
        live = list(self.requests.values())
        paused = {r.request_id for r in self.paused.values() if r.state == RequestState.PAUSED and r.device_pages}
        waiting = {r.request_id for r in self.waiting if r.device_pages}
        self.kv.check_invariants(live, paused, waiting)
        for r in live:
            assert r.num_computed_tokens <= r.num_tokens, f"{r.request_id}: computed > tokens"
            if r.state == RequestState.RUNNING:
                assert r in self.running, f"{r.request_id} RUNNING but not in running"
                assert r.first_scheduled_time is not None, f"{r.request_id} RUNNING, never scheduled"
                assert len(r.device_pages) >= self.kv.device_pool.pages_for_tokens(r.num_computed_tokens)
            if r.state == RequestState.SWAPPED:
                assert not r.device_pages and r.host_pages, f"{r.request_id}: SWAPPED without host-only KV"
        queued = [r.request_id for q in (self.waiting, self.running, self.swapping_in) for r in q]
        queued += [r.request_id for r in self.paused.values()]
        assert len(queued) == len(set(queued)), "a request is in two queues"
        assert set(queued) == set(self.requests), "queues and live requests disagree"
        assert len(self._ranked) == len(self.waiting) and all(r in self._ranked for r in self.waiting), \
            "ranked waiting queue out of step"
        assert not (self._decoding.keys() & self._filling.keys()), "a request both decoding and filling"
        assert set(self._decoding) | set(self._filling) == set(self.running), "running split out of step"
        assert self._running_tokens == sum(map(_tokens_of, self.running)), "running token count out of step"
        for r, chunk in self._decoding.items():
            assert chunk.request is r and r.num_tokens - r.num_computed_tokens == 1, \
                f"{r.request_id}: decoding with {r.num_uncomputed_tokens} tokens to compute"
            assert r in self._page_due or not self.kv.pages_needed(r, 1), \
                f"{r.request_id}: its next token needs a page and it is not due one"
        assert self._classed == sum(1 for r in live if r.priority), "class count out of step"
        if self.config.priority_aging_s is not None:
            assert set(self._aging_due) == {r.request_id for r in self.waiting if r.priority > 0}, \
                "aging filed for other requests than the waiting ones above class 0"
