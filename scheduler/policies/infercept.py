"""InferCept / APISERVE min-waste handling (DESIGN section 6, seed 003)."""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

from scheduler.cost_model import CostModel, waste_discard_chunked, waste_preserve, waste_swap
from scheduler.plan import MemoryView
from scheduler.policies.base import Policy, register_policy
from scheduler.request import Handling, Request


def min_waste_choice(cost: CostModel, context_tokens: int, other_tokens: int, num_running: int,
                     api_duration_s: float, swap_ok: bool = True, cached_tokens: int = 0) -> tuple[Handling, float]:
    """The handling with the least memory waste (byte-seconds) for a call of
    ``api_duration_s`` seconds by a request holding ``context_tokens`` of KV,
    while others hold ``other_tokens``. Discard is InferCept's chunked
    recompute: chunks of ``S − num_running`` tokens (the saturation point minus
    the decode tokens the running batch already puts in each step). Swap is a
    candidate only when ``swap_ok`` (the host pool has room). ``cached_tokens``
    of the context are expected still in the prefix cache at the return, so a
    (soft) Discard recomputes only the rest (docs/scheduling.md)."""
    options = {
        Handling.PRESERVE: waste_preserve(cost, context_tokens, api_duration_s),
        Handling.DISCARD: waste_discard_chunked(cost, max(0, context_tokens - cached_tokens), other_tokens,
                                                num_running),
    }
    if swap_ok:
        options[Handling.SWAP] = waste_swap(cost, context_tokens, other_tokens)
    best = min(options, key=options.get)
    return best, options[best]


def min_waste_handling(request: Request, view: MemoryView, api_duration_s: float) -> tuple[Handling, float]:
    """``min_waste_choice`` for ``request`` calling an API now: ``C_i`` is its
    computed context, ``C_other`` the rest of the running tokens."""
    c_i = request.num_computed_tokens
    c_other = max(0, view.running_tokens - request.num_tokens)
    swap_ok = view.free_host_pages * view.page_size >= c_i
    return min_waste_choice(view.cost, c_i, c_other, view.num_running, api_duration_s, swap_ok,
                            view.expected_cached_tokens(c_i, api_duration_s))


@register_policy("infercept")
class InferceptPolicy(Policy):
    """Min-waste handling chosen when the call happens; FCFS by original arrival
    (a returning request keeps its arrival time); the swap-out budget goes to
    the paused requests with the largest waste first.

    The call's duration is the predictor's (``oracle``: the declared one),
    else the ``api_duration_s`` the engine passes. Unknown duration (neither
    has one, or the predictor is ``elapsed``): it is estimated as
    ``t_now − t_call``, which is 0 at the call, so the call starts under
    Preserve; every step the choice is re-made with the grown estimate, and
    once Discard or Swap wastes less the request is switched (``redecide``
    yields it; the scheduler applies it) — seed 003 §4.4.
    """

    def __init__(self, predictor=None, **options) -> None:
        super().__init__(predictor, **options)
        self._watch: dict[str, Request] = {}   # Preserve calls with an elapsed-time estimate

    def handling(self, request: Request, view: MemoryView, now: float,
                 api_duration_s: float | None) -> Handling:
        duration = self.predictor.api_duration(request, now, now)
        if duration is None:
            duration = api_duration_s
        unknown = duration is None or self.predictor.grows_while_waiting
        best, waste = min_waste_handling(request, view, duration or 0.0)
        request.policy_state["waste"] = waste
        if best == Handling.PRESERVE and unknown:
            self._watch[request.request_id] = request   # re-decided every step (``redecide``)
        return best

    def redecide(self, now: float, preserved: Mapping[str, Request],
                 view: Callable[[], MemoryView]) -> Iterator[tuple[Request, Handling]]:
        if not self._watch:
            return
        current = view()
        for rid, request in list(self._watch.items()):
            if rid not in preserved:
                del self._watch[rid]   # returned, evicted, switched or ended
                continue
            elapsed = max(0.0, now - request.api_calls[-1].call_time)
            c_i = request.num_computed_tokens
            swap_ok = current.free_host_pages * current.page_size >= c_i
            best, waste = min_waste_choice(current.cost, c_i, current.running_tokens, current.num_running,
                                           elapsed, swap_ok)
            request.policy_state["waste"] = waste
            if best != Handling.PRESERVE:
                del self._watch[rid]
                yield request, best
                current = view()

    def on_finish(self, request: Request, now: float) -> None:
        self._watch.pop(request.request_id, None)

    def order_swap_out(self, swapping: list[Request], view: MemoryView) -> list[Request]:
        return sorted(swapping, key=lambda r: -r.policy_state.get("waste", 0.0))
