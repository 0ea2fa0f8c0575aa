"""The scheduler: which requests run each step, with how many tokens, and
what happens to their pages (DESIGN section 3).

Pure Python. The executor (real model or simulator) calls, per step:
``schedule(now)`` -> applies the plan -> ``on_step_done(plan, now)`` -> for
each request that produced a token, ``finish``/``pause`` as its stop rules say.
API results come back through ``api_return``.

``waiting`` and ``running`` are ``RequestQueue``s (insertion-ordered, O(1)
remove); read them freely but change them only through the scheduler's
methods, which also keep the policy's ranked index in step (``on_enqueue`` /
``on_dequeue``).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.cost_model import CostModel
from scheduler.pages import PageAllocator
from scheduler.plan import MemoryView, ScheduledChunk, StepPlan, SwapOp
from scheduler.policies.base import Policy
from scheduler.queues import RequestQueue
from scheduler.request import ApiCallRecord, Handling, Request, RequestState
from scheduler.token_budget import TOKEN_BUDGET_MODES, DynamicBudget


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step limits. Tokens are query tokens batched into one forward.

    ``token_budget`` picks the per-step token limit for every policy:
    ``"policy"`` (default) lets the policy decide (``augserve`` and any policy
    built with ``token_budget="dynamic"`` use AugServe's dynamic budget, the
    others ``max_num_batched_tokens``), ``"static"`` always uses
    ``max_num_batched_tokens``, ``"dynamic"`` always uses the dynamic budget
    (``scheduler.token_budget``) with ``budget_gamma``/``budget_beta_low``/
    ``budget_beta_high`` and ``max_num_batched_tokens`` as ``target_max``.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    swap_budget_tokens: int = 512      # KV tokens copied host<->device per step (both ways together)
    handling: Handling | None = None   # force one handling for every call; None = the policy decides
    token_budget: str = "policy"       # "policy" | "static" | "dynamic"
    budget_gamma: float = 1.0
    budget_beta_low: float = 0.25
    budget_beta_high: float = 1.0

    def __post_init__(self) -> None:
        if self.token_budget not in TOKEN_BUDGET_MODES:
            raise ValueError(f"token_budget must be one of {TOKEN_BUDGET_MODES}, got {self.token_budget!r}")
        DynamicBudget(self.budget_gamma, self.budget_beta_low, self.budget_beta_high)  # validates
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be > 0")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be > 0")
        if self.swap_budget_tokens <= 0:
            raise ValueError("swap_budget_tokens must be > 0")


class Scheduler:
    """Continuous batching with API pauses, swap, preemption by recompute."""

    def __init__(self, config: SchedulerConfig, policy: Policy, device_pool: PageAllocator,
                 host_pool: PageAllocator, cost: CostModel) -> None:
        if device_pool.page_size != host_pool.page_size:
            raise ValueError("device and host pools must use the same page size")
        self.config = config
        self.policy = policy
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.cost = cost
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue()          # WAITING, or SWAPPED after the API returned
        self.running = RequestQueue()          # in admission order
        self.paused: dict[str, Request] = {}   # inside an API call (PAUSED, SWAPPING_OUT, SWAPPED)
        self.swapping_out: list[Request] = []
        self.swapping_in: list[Request] = []
        self.iteration = 0
        self.num_preemptions = 0
        self.now = 0.0                          # time passed to the latest schedule()/event
        # Requests that hold device KV without running (eviction candidates):
        # paused under Preserve, and back from the API (or preempted) still waiting.
        self._paused_holders: dict[str, Request] = {}
        self._waiting_holders: dict[str, Request] = {}
        self._dynamic_budget = DynamicBudget(config.budget_gamma, config.budget_beta_low,
                                             config.budget_beta_high)
        policy.attach(self)

    # ------------------------------------------------------------------ views
    @property
    def page_size(self) -> int:
        return self.device_pool.page_size

    def view(self) -> MemoryView:
        paused_pages = sum(len(r.device_pages) for r in self._paused_holders.values())
        return MemoryView(
            free_device_pages=self.device_pool.num_free,
            total_device_pages=self.device_pool.num_pages,
            free_host_pages=self.host_pool.num_free,
            total_host_pages=self.host_pool.num_pages,
            page_size=self.page_size,
            running_tokens=sum(r.num_tokens for r in self.running),
            num_running=len(self.running),
            paused_device_pages=paused_pages,
            cost=self.cost,
        )

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """True when a step could make progress now (not only waiting on APIs)."""
        return bool(self.waiting or self.running or self.swapping_out or self.swapping_in)

    # ------------------------------------------------------------- lifecycle
    def add_request(self, request: Request, now: float) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.prompt_len <= 0:
            raise ValueError("prompt must have at least one token")
        request.state = RequestState.WAITING
        self.requests[request.request_id] = request
        self.now = now
        self.policy.on_arrival(request, now, self.view())
        self._enqueue(request, now)

    def finish(self, request: Request, reason: str, now: float) -> None:
        """End ``request`` (``reason``: "stop", "length", "abort", …) and free all its pages."""
        self._detach(request)
        if reason != "abort":
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

    def _detach(self, request: Request) -> None:
        """Remove ``request`` from every queue and free its pages."""
        self.requests.pop(request.request_id, None)
        self.paused.pop(request.request_id, None)
        self._paused_holders.pop(request.request_id, None)
        if request in self.waiting:
            self._dequeue(request)
        self.running.discard(request)
        for q in (self.swapping_out, self.swapping_in):
            if request in q:
                q.remove(request)
        self._free_device(request)
        self._free_host(request)

    def _enqueue(self, request: Request, now: float) -> None:
        """Put ``request`` in the waiting queue and tell the policy."""
        self.waiting.append(request)
        if request.device_pages:
            self._waiting_holders[request.request_id] = request
        self.policy.on_enqueue(request, now)

    def _dequeue(self, request: Request) -> None:
        self.waiting.remove(request)
        self._waiting_holders.pop(request.request_id, None)
        self.policy.on_dequeue(request)

    def _free_device(self, request: Request) -> None:
        if request.device_pages:
            self.device_pool.free(request.request_id, request.device_pages)
            request.device_pages = []

    def _free_host(self, request: Request) -> None:
        if request.host_pages:
            self.host_pool.free(request.request_id, request.host_pages)
            request.host_pages = []

    # ------------------------------------------------------------- API calls
    def pause(self, request: Request, now: float, api_type: str,
              api_duration_s: float | None = None) -> Handling:
        """``request`` just emitted an API call: take it out of the batch and
        apply the handling (engine-forced, else the policy's). Returns it."""
        self.now = now
        view = self.view()
        chosen = self.config.handling or self.policy.handling(request, view, now, api_duration_s)
        record = ApiCallRecord(api_type=api_type, handling=chosen, call_time=now,
                               context_tokens=request.num_computed_tokens)
        request.api_calls.append(record)
        request.api_returned = False
        self.policy.predictor.observe_output(request)   # learned predictor: per-class running mean
        self.running.remove(request)
        self.paused[request.request_id] = request
        if request.current_segment is not None and request.declared_call_due():
            request.segment_index += 1
            request.segment_generated = 0

        if chosen == Handling.SWAP:
            n = len(request.device_pages)
            if n and self.host_pool.can_allocate(n):
                request.host_pages = self.host_pool.allocate(request.request_id, n)
                request.pages_swapped = 0
                request.state = RequestState.SWAPPING_OUT
                self.swapping_out.append(request)
            elif n:
                record.fell_back_from, chosen = Handling.SWAP, Handling.DISCARD
            else:
                chosen = Handling.DISCARD
        if chosen == Handling.DISCARD:
            self._drop_kv(request)
            request.state = RequestState.PAUSED
        elif chosen == Handling.PRESERVE:
            request.state = RequestState.PAUSED
            if request.device_pages:
                self._paused_holders[request.request_id] = request
        record.handling = chosen
        request.handling = chosen
        return chosen

    def api_return(self, request: Request, num_returned_tokens: int, now: float) -> None:
        """The API call of a paused ``request`` returned ``num_returned_tokens`` tokens
        (already appended to its context by the caller)."""
        if request.request_id not in self.paused or request.api_returned:
            raise ValueError(f"request {request.request_id!r} is not waiting for an API call")
        self.now = now
        record = request.api_calls[-1]
        record.return_time = now
        record.num_returned_tokens = num_returned_tokens
        request.num_tokens += num_returned_tokens
        request.api_returned = True
        self.policy.predictor.observe_api(record.api_type, now - record.call_time)
        self.policy.on_api_return(request, now, self.view())
        if request.state != RequestState.SWAPPING_OUT:
            self._requeue_returned(request)

    def change_handling(self, request: Request, handling: Handling, now: float) -> Handling:
        """Re-decide the handling of a request paused under Preserve whose call
        has not returned (InferCept re-evaluates as its elapsed-time estimate of
        the call grows). Preserve -> Discard frees the pages now; -> Swap starts
        a chunked swap-out (Discard when the host pool is full). Returns the
        handling in force afterwards."""
        if (request.request_id not in self._paused_holders or request.api_returned
                or handling == Handling.PRESERVE):
            return request.handling
        record = request.api_calls[-1]
        n = len(request.device_pages)
        if handling == Handling.SWAP and self.host_pool.can_allocate(n):
            del self._paused_holders[request.request_id]
            request.host_pages = self.host_pool.allocate(request.request_id, n)
            request.pages_swapped = 0
            request.state = RequestState.SWAPPING_OUT
            self.swapping_out.append(request)
        else:
            if handling == Handling.SWAP:
                record.fell_back_from = Handling.SWAP
            handling = Handling.DISCARD
            self._drop_kv(request)
        record.handling = request.handling = handling
        return handling

    def _requeue_returned(self, request: Request) -> None:
        del self.paused[request.request_id]
        self._paused_holders.pop(request.request_id, None)
        if request.state != RequestState.SWAPPED:
            request.state = RequestState.WAITING
        self._enqueue(request, self.now)

    def _drop_kv(self, request: Request) -> None:
        """Free the device KV; the context will be recomputed."""
        self._free_device(request)
        request.num_computed_tokens = 0
        self._paused_holders.pop(request.request_id, None)
        self._waiting_holders.pop(request.request_id, None)

    # ------------------------------------------------------------- schedule
    def schedule(self, now: float) -> StepPlan:
        self.iteration += 1
        self.now = now
        self.policy.on_step(self, now)
        view = self.view()
        plan = StepPlan(token_budget=max(1, self._token_budget(view)))
        swap_pages = max(1, self.config.swap_budget_tokens // self.page_size)
        swap_pages = self._continue_swap_out(plan, swap_pages, view)
        swap_pages = self._continue_swap_in(plan, swap_pages)
        budget = self._schedule_running(plan, plan.token_budget, now, view)
        self._admit_waiting(plan, budget, swap_pages, now, view)
        self.policy.on_plan(plan, now)
        return plan

    def _token_budget(self, view: MemoryView) -> int:
        mode, target = self.config.token_budget, self.config.max_num_batched_tokens
        if mode == "static":
            return target
        if mode == "dynamic":
            return self._dynamic_budget(target, view)
        return self.policy.token_budget(target, view)

    def _continue_swap_out(self, plan: StepPlan, swap_pages: int, view: MemoryView) -> int:
        for request in list(self.policy.order_swap_out(self.swapping_out, view)):
            if swap_pages <= 0:
                break
            start = request.pages_swapped
            n = min(swap_pages, len(request.device_pages) - start)
            plan.swap_out.append(SwapOp(request, request.device_pages[start:start + n],
                                        request.host_pages[start:start + n]))
            request.pages_swapped += n
            swap_pages -= n
            if request.pages_swapped == len(request.device_pages):
                # The executor copies before this step's forward, so the pages can be reused now.
                self.swapping_out.remove(request)
                self._free_device(request)
                request.pages_swapped = 0
                request.state = RequestState.SWAPPED
                if request.api_returned:
                    self._requeue_returned(request)
        return swap_pages

    def _continue_swap_in(self, plan: StepPlan, swap_pages: int) -> int:
        for request in list(self.swapping_in):
            if swap_pages <= 0:
                break
            swap_pages = self._swap_in_chunk(plan, request, swap_pages)
        return swap_pages

    def _swap_in_chunk(self, plan: StepPlan, request: Request, swap_pages: int) -> int:
        start = request.pages_swapped
        n = min(swap_pages, len(request.host_pages) - start)
        if n > 0:
            plan.swap_in.append(SwapOp(request, request.device_pages[start:start + n],
                                       request.host_pages[start:start + n]))
            request.pages_swapped += n
        if request.pages_swapped == len(request.host_pages):
            self.swapping_in.remove(request)
            self._free_host(request)
            request.pages_swapped = 0
            request.state = RequestState.RUNNING
            self.running.append(request)
        return swap_pages - n

    def _pages_needed(self, request: Request, num_new_tokens: int) -> int:
        total = self.device_pool.pages_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.device_pages))

    def _schedule_running(self, plan: StepPlan, budget: int, now: float, view: MemoryView) -> int:
        # The hot loop of every step (one pass over the running batch), so the
        # common case (pages on hand) is inlined; running out of pages takes
        # the slow path (evict an idle holder, else preempt the lowest priority).
        pool = self.device_pool
        page_size = pool.page_size
        chunks = plan.chunks
        running_state = RequestState.RUNNING
        for request in self.policy.order_running(self.running, now, view, budget):
            if budget <= 0:
                break
            if request.state is not running_state:
                continue  # preempted earlier in this loop
            start = request.num_computed_tokens
            n = request.num_tokens - start
            if n <= 0:
                continue
            if n > budget:
                n = budget
            need = -(-(start + n) // page_size) - len(request.device_pages)
            if need > 0:
                while need > pool.num_free:
                    if self._evict_idle_holder():
                        continue
                    victim = self._pick_victim(plan, now, view)
                    if victim is None:
                        break
                    self._preempt(victim, plan)
                    if victim is request:
                        break
                if request.state is not running_state or need > pool.num_free:
                    continue
                request.device_pages.extend(pool.allocate(request.request_id, need))
            chunks.append(ScheduledChunk(request, start, n, start + n == request.num_tokens))
            if request.first_scheduled_time is None or (
                    request.api_returned and request.api_calls[-1].resume_time is None):
                self._mark_scheduled(request, now)
            request.last_scheduled_time = now
            budget -= n
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int, swap_pages: int, now: float,
                       step_view: MemoryView) -> None:
        if not self.waiting:
            return
        # Memory after the running batch took its pages (running tokens as at the step's start).
        view = MemoryView(
            free_device_pages=self.device_pool.num_free,
            total_device_pages=step_view.total_device_pages,
            free_host_pages=self.host_pool.num_free,
            total_host_pages=step_view.total_host_pages,
            page_size=step_view.page_size,
            running_tokens=step_view.running_tokens,
            num_running=len(self.running),
            paused_device_pages=sum(len(r.device_pages) for r in self._paused_holders.values()),
            cost=self.cost,
        )
        for request in self.policy.iter_waiting(self.waiting, now, view):
            if budget <= 0 or len(self.running) + len(self.swapping_in) >= self.config.max_num_seqs:
                break
            if request.state == RequestState.SWAPPED:
                n_pages = len(request.host_pages)
                while not self.device_pool.can_allocate(n_pages) and \
                        self._evict_idle_holder(request, now, view):
                    pass
                if not self.device_pool.can_allocate(n_pages):
                    break
                self._dequeue(request)
                request.device_pages = self.device_pool.allocate(request.request_id, n_pages)
                request.pages_swapped = 0
                request.state = RequestState.SWAPPING_IN
                self.swapping_in.append(request)
                swap_pages = self._swap_in_chunk(plan, request, swap_pages)
                if request.state != RequestState.RUNNING:
                    continue
                n = min(request.num_uncomputed_tokens, budget)
                need = self._pages_needed(request, n)
                if need > self.device_pool.num_free:
                    continue  # runs next step
                self._add_chunk(plan, request, n, need, now)
                budget -= n
                continue
            n = min(request.num_uncomputed_tokens, budget)
            need = self._pages_needed(request, n)
            while need > self.device_pool.num_free and self._evict_idle_holder(request, now, view):
                need = self._pages_needed(request, n)
            if need > self.device_pool.num_free:
                break  # keep the policy's order: no skipping ahead of the head
            self._dequeue(request)
            request.state = RequestState.RUNNING
            self.running.append(request)
            self._add_chunk(plan, request, n, need, now)
            budget -= n

    def _add_chunk(self, plan: StepPlan, request: Request, n: int, need: int, now: float) -> None:
        if need:
            request.device_pages.extend(self.device_pool.allocate(request.request_id, need))
        start = request.num_computed_tokens
        plan.chunks.append(ScheduledChunk(request, start, n, samples=start + n == request.num_tokens))
        self._mark_scheduled(request, now)
        request.last_scheduled_time = now

    @staticmethod
    def _mark_scheduled(request: Request, now: float) -> None:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        if request.api_calls and request.api_calls[-1].resume_time is None and request.api_returned:
            request.api_calls[-1].resume_time = now

    def _pick_victim(self, plan: StepPlan, now: float, view: MemoryView) -> Request | None:
        """The lowest-priority running request not yet given tokens this step."""
        scheduled = {c.request.request_id for c in plan.chunks}
        candidates = [r for r in self.running if r.request_id not in scheduled]
        if not candidates:
            return None
        return max(candidates, key=lambda r: self.policy.priority(r, now, view))

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Preempt by recompute: free its pages and put it back in the waiting queue."""
        self.running.remove(request)
        self._drop_kv(request)
        request.state = RequestState.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, self.now)
        plan.preempted.append(request)

    def _evict_idle_holder(self, behind: Request | None = None, now: float | None = None,
                           view: MemoryView | None = None) -> bool:
        """Free the pages of one request that holds device KV but is not running
        (paused under Preserve first, then one back from its API and still
        waiting, lowest-ranked first): it will be recomputed. When ``behind`` is
        given, waiting candidates are limited to those the policy ranks after
        it. Returns False when there is none."""
        victim = next(iter(self._paused_holders.values()), None)
        if victim is None and self._waiting_holders:
            now = self.now if now is None else now
            view = self.view() if view is None else view
            rank = self.policy.waiting_rank
            floor = rank(behind, now, view) if behind is not None else None
            ranked = [(rank(r, now, view), r) for r in self._waiting_holders.values() if r is not behind]
            ranked = [(k, r) for k, r in ranked if floor is None or k > floor]
            if ranked:
                victim = max(ranked, key=lambda kr: kr[0])[1]
        if victim is None:
            return False
        self._drop_kv(victim)
        if victim.api_calls and victim.api_calls[-1].handling == Handling.PRESERVE:
            victim.api_calls[-1].fell_back_from = Handling.PRESERVE
            victim.api_calls[-1].handling = Handling.DISCARD
            victim.handling = Handling.DISCARD
        if victim in self.waiting:
            self.policy.on_requeue(victim, now if now is not None else self.now)
        return True

    # ------------------------------------------------------------ after step
    def on_step_done(self, plan: StepPlan, now: float) -> list[Request]:
        """Advance counts for the chunks that ran; returns the requests that
        produced a token this step (the caller then applies stop rules and
        API triggers via ``finish``/``pause``)."""
        produced = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.is_finished or request.state != RequestState.RUNNING:
                continue
            request.num_computed_tokens += chunk.num_tokens
            if chunk.samples:
                request.num_tokens += 1
                request.num_generated += 1
                request.segment_generated += 1
                if request.first_token_time is None:
                    request.first_token_time = now
                produced.append(request)
        return produced

    def declared_event(self, request: Request) -> str | None:
        """Stop rules shared by every executor, for a request that just produced
        a token: ``"api"`` when its declared segment ends in a call now,
        ``"length"`` when ``max_tokens`` is reached or its declared segments are
        all generated, else ``None``. (Stop tokens, stop strings and parsed tool
        calls need token ids, so the model executor checks those itself.)"""
        if request.declared_call_due():
            return "api"
        if request.num_generated >= request.max_tokens:
            return "length"
        if request.segments and request.segment_index == len(request.segments) - 1 \
                and request.segment_generated >= request.segments[-1].num_tokens:
            return "length"
        return None

    def finished_after_return(self, request: Request) -> bool:
        """True when a returned call was the request's last declared step (it ends there)."""
        return bool(request.segments) and request.segment_index >= len(request.segments)

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Pages are free or owned by exactly the request that lists them; queues agree with states."""
        live = list(self.requests.values())
        self.device_pool.check_invariants({r.request_id: r.device_pages for r in live})
        self.host_pool.check_invariants({r.request_id: r.host_pages for r in live})
        for r in live:
            assert r.num_computed_tokens <= r.num_tokens, f"{r.request_id}: computed > tokens"
            if r.state == RequestState.RUNNING:
                assert r in self.running, f"{r.request_id} RUNNING but not in running"
                assert len(r.device_pages) >= self.device_pool.pages_for_tokens(r.num_computed_tokens)
            if r.state == RequestState.SWAPPED:
                assert not r.device_pages and r.host_pages, f"{r.request_id}: SWAPPED without host-only KV"
        queued = [r.request_id for q in (self.waiting, self.running, self.swapping_in) for r in q]
        queued += [r.request_id for r in self.paused.values()]
        assert len(queued) == len(set(queued)), "a request is in two queues"
        assert set(queued) == set(self.requests), "queues and live requests disagree"
        holders = {r.request_id for r in self.paused.values() if r.state == RequestState.PAUSED and r.device_pages}
        assert set(self._paused_holders) == holders, "paused-holder index out of step"
        holders = {r.request_id for r in self.waiting if r.device_pages}
        assert set(self._waiting_holders) == holders, "waiting-holder index out of step"
        self.policy.check_invariants(self)
