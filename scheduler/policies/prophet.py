"""Prophet: SRPT for prefill, MLFQ for decode, both with starvation prevention (DESIGN 7, seed 002)."""

from __future__ import annotations

from collections import deque
from typing import Iterable

from scheduler.plan import MemoryView, StepPlan
from scheduler.policies.base import register_policy
from scheduler.policies.infercept import InferceptPolicy
from scheduler.request import Request

PREFILL, DECODE = 1, 0   # within an MLFQ level, decode-phase requests go first


def in_prefill(request: Request) -> bool:
    """Never produced a token (and never called an API): still in its prefill phase."""
    return request.num_generated == 0 and not request.api_calls


@register_policy("prophet")
class ProphetPolicy(InferceptPolicy):
    """Seed 002 mapped onto one engine (Prophet splits prefill and decode over
    machines; here both phases share the waiting queue and the batch).

    - Prefill phase (no token generated yet): SRPT by remaining prompt tokens
      (``num_uncomputed_tokens``). After ``prefill_starvation_limit``
      iterations waiting (default 16, the seed's) its estimate becomes 0.
    - Decode phase: MLFQ with ``quanta`` (default 25/50/100/200/400
      iterations). A request enters at level 0; after it has run ``quanta[l]``
      iterations at level ``l`` it moves to ``l + 1`` (the last level keeps
      it). If it has not run for ``starvation_limit`` consecutive iterations
      (default 200) it is promoted back to level 0. No skip-join (seed).
    - One order: ``(level, phase, value)`` — new requests enter at level 0,
      and within a level decode-phase requests (FIFO by the time they entered
      the queue) go before prefill-phase ones (SRPT). Requests back from an
      API keep their level (they are in the decode phase).
    - The MLFQ applies to running requests too: at most ``decode_batch_size``
      of them run per step (default 16, the seed's decoder batch size, §5;
      ``None``: no cap beyond the token budget), chosen by level (starved ones
      first); the others keep their pages and skip the step, so a request
      that stays in the batch through its quantum is demoted and yields to
      newer ones. Memory preemption takes the lowest level first. Without the
      cap (or with a budget that covers every running request) the order does
      not matter and the MLFQ is inert.
    - The prefiller's batch: at most ``prefill_batch_size`` prefill-phase
      requests (default 4, the seed's Prefiller batch size, §5) get prompt
      tokens per step, admissions and chunked prompts in progress together, in
      SRPT order (``None``: no cap beyond the token budget).
    - Handling is InferCept's (min waste when the call happens).
    """

    def __init__(self, predictor=None, *, quanta: Iterable[int] = (25, 50, 100, 200, 400),
                 starvation_limit: int = 200, prefill_starvation_limit: int = 16,
                 decode_batch_size: int | None = 16, prefill_batch_size: int | None = 4, **options) -> None:
        super().__init__(predictor, **options)
        self.quanta = tuple(int(q) for q in quanta)
        if not self.quanta or min(self.quanta) < 1:
            raise ValueError("quanta must be a non-empty list of positive iteration counts")
        if starvation_limit < 1 or prefill_starvation_limit < 1:
            raise ValueError("starvation limits must be >= 1 iteration")
        for name, size in (("decode_batch_size", decode_batch_size), ("prefill_batch_size", prefill_batch_size)):
            if size is not None and size < 1:
                raise ValueError(f"{name} must be >= 1 or None")
        self.prefill_batch_size = prefill_batch_size
        self.starvation_limit = starvation_limit
        self.prefill_starvation_limit = prefill_starvation_limit
        self.decode_batch_size = decode_batch_size
        self._prefill_due: deque[tuple[int, int, Request]] = deque()
        self._decode_due: deque[tuple[int, int, Request]] = deque()
        self._entries = 0

    # ---------------------------------------------------------------- state
    @staticmethod
    def level(request: Request) -> int:
        return request.policy_state.get("mlfq_level", 0)

    def _last_run(self, request: Request) -> int:
        return request.policy_state.get("mlfq_last_run", 0)

    def priority(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        if in_prefill(request):
            value = 0 if request.policy_state.get("srpt_starved") else request.num_uncomputed_tokens
            return (0, PREFILL, value, request.arrival_time)
        return (self.level(request), DECODE, request.policy_state.get("mlfq_queued_at", now), 0.0)

    def on_enqueue(self, request: Request, now: float, iteration: int) -> None:
        self._entries += 1
        state = request.policy_state
        state["mlfq_entry"] = self._entries
        state["mlfq_queued_at"] = now
        if in_prefill(request):
            self._prefill_due.append((iteration + self.prefill_starvation_limit + 1, self._entries, request))
        else:
            state["mlfq_last_run"] = iteration   # runnable again from now: the idle clock restarts
            self._decode_due.append((iteration + self.starvation_limit + 1, self._entries, request))

    def on_dequeue(self, request: Request, iteration: int) -> None:
        request.policy_state["mlfq_entry"] = None   # its pending deadlines no longer apply

    def on_step(self, now: float, iteration: int) -> Iterable[Request]:
        changed = list(super().on_step(now, iteration))   # InferCept's swap-budget bookkeeping
        while self._prefill_due and self._prefill_due[0][0] <= iteration:
            _, entry, r = self._prefill_due.popleft()
            if r.policy_state.get("mlfq_entry") == entry and in_prefill(r):
                r.policy_state["srpt_starved"] = True
                changed.append(r)
        while self._decode_due and self._decode_due[0][0] <= iteration:
            _, entry, r = self._decode_due.popleft()
            if r.policy_state.get("mlfq_entry") == entry:
                self._set_level(r, 0)   # waited past the starvation limit: back to the top queue
                changed.append(r)
        return changed

    @staticmethod
    def _set_level(request: Request, level: int) -> None:
        request.policy_state["mlfq_level"] = level
        request.policy_state["mlfq_runs"] = 0

    def on_plan(self, plan: StepPlan, now: float, iteration: int) -> None:
        it = iteration
        last = len(self.quanta) - 1
        for chunk in plan.chunks:
            r = chunk.request
            state = r.policy_state
            state["mlfq_last_run"] = it
            if in_prefill(r):
                continue
            runs = state.get("mlfq_runs", 0) + 1
            level = state.get("mlfq_level", 0)
            if runs >= self.quanta[level] and level < last:
                level, runs = level + 1, 0
            state["mlfq_level"], state["mlfq_runs"] = level, runs

    def may_admit(self, request: Request, plan: StepPlan) -> bool:
        """A prompt joins the step only while the prefiller's batch has room."""
        cap = self.prefill_batch_size
        return cap is None or not in_prefill(request) or \
            sum(1 for c in plan.chunks if in_prefill(c.request)) < cap

    def order_running(self, running: Iterable[Request], now: float, view: MemoryView,
                      budget: int | None = None, iteration: int = 0) -> list[Request]:
        requests = list(running)
        prefill_cap = self.prefill_batch_size
        if prefill_cap is not None:
            prompts = sorted((r for r in requests if in_prefill(r)), key=lambda r: r.num_uncomputed_tokens)
            if len(prompts) > prefill_cap:   # chunked prompts in progress: the prefiller's batch, SRPT
                kept = {id(r) for r in prompts[:prefill_cap]}
                requests = [r for r in requests if not in_prefill(r) or id(r) in kept]
        cap = self.decode_batch_size
        if (cap is None or len(requests) <= cap) and budget is not None:
            demand = 0
            for r in requests:
                demand += r.num_uncomputed_tokens
            if demand <= budget:
                return requests   # everyone fits: the order does not matter
        it = iteration
        limit = self.starvation_limit

        def key(r: Request) -> int:
            if in_prefill(r) or it - self._last_run(r) > limit:
                return 0
            return self.level(r)

        requests.sort(key=key)
        return requests if cap is None else requests[:cap]
