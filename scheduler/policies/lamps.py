"""LAMPS / MARS: memory-over-time ranking with predicted handling (DESIGN 7, seeds 000 and 001)."""

from __future__ import annotations

from collections import deque
from typing import Iterable

from scheduler.cost_model import CostModel, decode_cost, fill_cost
from scheduler.plan import MemoryView
from scheduler.policies.base import Policy, register_policy
from scheduler.policies.infercept import min_waste_choice, min_waste_handling
from scheduler.request import Handling, Request, RequestState


def memory_time_integral(cost: CostModel, context_tokens: int, uncomputed_tokens: int, output_tokens: int,
                         handling: Handling | None, api_duration_s: float, chunk_tokens: int,
                         swapped_tokens: int = 0, cached_tokens: int = 0) -> float:
    """Area under the memory-vs-time curve (byte-seconds) of one segment of a
    request, from now to the end of its API call (or of the request).

    ``context_tokens`` is the context now, of which ``uncomputed_tokens`` are
    still to be prefilled/recomputed (in chunks of ``chunk_tokens`` per step)
    and ``swapped_tokens`` sit on host and come back first. Then
    ``output_tokens`` are decoded, one per step, memory growing with the
    context; then the API call under ``handling``:

    - Preserve: memory flat at ``C`` for ``api_duration_s``;
    - Discard: zero through the call, then the context is recomputed (memory
      ramps back up over ``⌈C / chunk⌉`` steps); with ``cached_tokens`` of it
      expected still in the prefix cache, memory starts there and only the
      rest is recomputed (``⌈(C − cached) / chunk⌉`` steps);
    - Swap: zero through the call, plus a ramp down (swap-out) and a ramp up
      (swap-in) of ``T_swap(C)`` each;
    - ``None``: no call (the last segment).

    Every step is priced by the cost model the simulated clock uses,
    ``cost.t_step(n, c)``: a chunk by its tokens and the context it reads
    (``fill_cost``), a decode step as a saturated step reading the request's
    own context (``decode_cost``).
    """
    m = cost.bytes_per_token
    area = 0.0
    if swapped_tokens:
        area += 0.5 * cost.t_swap(swapped_tokens) * swapped_tokens
    if uncomputed_tokens > 0:
        area += fill_cost(cost, context_tokens - uncomputed_tokens, uncomputed_tokens, chunk_tokens)[1]
    area += decode_cost(cost, context_tokens, output_tokens)[1]
    c_call = context_tokens + output_tokens
    if handling == Handling.PRESERVE:
        area += api_duration_s * c_call
    elif handling == Handling.DISCARD:
        cached = min(cached_tokens, c_call)
        area += fill_cost(cost, cached, c_call - cached, chunk_tokens)[1]
    elif handling == Handling.SWAP:
        area += cost.t_swap(c_call) * c_call
    return area * m


@register_policy("lamps", "mars")
class LampsPolicy(Policy):
    """Rank waiting and swapped requests by the memory-over-time integral of
    their current segment under its predicted handling, smallest first.

    - Handling: predicted when the request arrives and again when each API
      call returns (multi-API: each segment is classified on its own), by
      InferCept's min waste with the predicted context at the call
      (``C + predicted segment output``), the predicted API duration (0 when
      the predictor has none), the running tokens as ``C_other`` and Swap only
      when the host pool has room then. ``handling()`` returns that decision.
    - Score: ``memory_time_integral`` with chunk size
      ``max_num_batched_tokens``; filed once per queue entry (see
      ``scheduler.policies.base``; ``refresh_interval=K`` re-scores every
      ``K+1`` steps).
    - Starvation (seed 001 §3): a request that has been scheduled once and
      then waits ``starvation_threshold`` iterations (default 100) in the
      queue is marked starving and ranked ahead of every non-starving request
      (starving ones among themselves by score) until it completes; its
      counter resets whenever it is scheduled or calls an API (each new queue
      entry starts at 0). ``starvation_threshold=None`` turns this off;
      ``count_before_first_schedule=True`` also counts never-scheduled
      requests (seed 001 Algorithm 1 counts every queued request).
    - Running requests are not re-ranked (no preemption by rank); preemption
      for memory takes the highest score first, never a starving request
      while a non-starving one is running.
    """

    def __init__(self, predictor=None, *, starvation_threshold: int | None = 100,
                 count_before_first_schedule: bool = False, **options) -> None:
        super().__init__(predictor, **options)
        if starvation_threshold is not None and starvation_threshold < 1:
            raise ValueError("starvation_threshold must be >= 1 iteration, or None to disable")
        self.starvation_threshold = starvation_threshold
        self.count_before_first_schedule = count_before_first_schedule
        self._deadlines: deque[tuple[int, int, Request]] = deque()  # (iteration, entry, request)
        self._entries = 0

    # ----------------------------------------------------------- handling
    def predict_handling(self, request: Request, now: float, view: MemoryView) -> Handling | None:
        """Min-waste handling for the call that ends the current segment (None: no call)."""
        seg = request.current_segment
        if seg is None or not seg.has_api_call:
            return None
        out = self.predictor.segment_output_len(request)
        duration = self.predictor.api_duration(request, now, None) or 0.0
        c_call = request.num_tokens + out
        swap_ok = view.free_host_pages * view.page_size >= c_call
        cached = view.expected_cached_tokens(c_call, duration)
        request.policy_state["lamps_cached"] = cached
        best, _ = min_waste_choice(view.cost, c_call, view.running_tokens, view.num_running, duration, swap_ok,
                                   cached)
        return best

    def _classify(self, request: Request, now: float, view: MemoryView) -> None:
        request.policy_state["lamps_handling"] = self.predict_handling(request, now, view)
        request.policy_state["lamps_api_s"] = self.predictor.api_duration(request, now, None) or 0.0

    def on_arrival(self, request: Request, now: float, view: MemoryView) -> None:
        self._classify(request, now, view)

    def on_api_return(self, request: Request, now: float, view: MemoryView) -> None:
        self._classify(request, now, view)   # the next segment is a new job (seed 001, Multi-API)

    def handling(self, request: Request, view: MemoryView, now: float,
                 api_duration_s: float | None) -> Handling:
        decided = request.policy_state.get("lamps_handling")
        if decided is not None:
            return decided
        duration = api_duration_s if api_duration_s is not None else \
            (self.predictor.api_duration(request, now, now) or 0.0)
        return min_waste_handling(request, view, duration)[0]

    # ------------------------------------------------------------- ranking
    def on_rescore(self, waiting: list[Request], now: float, view: MemoryView) -> None:
        """Refresh: re-predict every waiting request's handling and API duration."""
        for request in waiting:
            self._classify(request, now, view)

    def score(self, request: Request, now: float) -> float:
        """Memory-over-time integral (byte-seconds) of the current segment
        (``on_arrival`` must have classified ``request``)."""
        ctx = self.context
        state = request.policy_state
        swapped = request.num_computed_tokens if request.state == RequestState.SWAPPED else 0
        return memory_time_integral(
            ctx.cost, request.num_tokens, request.num_uncomputed_tokens,
            self.predictor.segment_output_len(request), state["lamps_handling"],
            state["lamps_api_s"], ctx.max_num_batched_tokens, swapped, state.get("lamps_cached", 0))

    def priority(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        return (0 if request.starving else 1, self.score(request, now))

    # ---------------------------------------------------------- starvation
    def on_enqueue(self, request: Request, now: float, iteration: int) -> None:
        self._entries += 1
        request.policy_state["lamps_entry"] = self._entries
        request.policy_state["lamps_enqueued_at"] = iteration
        request.waiting_iterations = 0
        if (self.starvation_threshold is not None and not request.starving
                and (request.first_scheduled_time is not None or self.count_before_first_schedule)):
            due = iteration + self.starvation_threshold + 1
            self._deadlines.append((due, self._entries, request))

    def on_dequeue(self, request: Request, iteration: int) -> None:
        request.policy_state["lamps_entry"] = None   # its pending deadline no longer applies
        start = request.policy_state.get("lamps_enqueued_at", iteration)
        request.waiting_iterations = max(0, iteration - start - 1)

    def on_step(self, now: float, iteration: int) -> Iterable[Request]:
        starved = []
        while self._deadlines and self._deadlines[0][0] <= iteration:
            _, entry, request = self._deadlines.popleft()
            if request.policy_state.get("lamps_entry") != entry:
                continue   # scheduled or called an API since: the counter was reset
            request.starving = True
            request.waiting_iterations = self.starvation_threshold
            starved.append(request)
        return starved

    def on_finish(self, request: Request, now: float) -> None:
        request.starving = False
