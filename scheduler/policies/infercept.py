"""InferCept / APISERVE min-waste handling (DESIGN section 6, seed 003)."""

from __future__ import annotations

from scheduler.cost_model import waste_discard_chunked, waste_preserve, waste_swap
from scheduler.plan import MemoryView
from scheduler.policies.base import Policy, register_policy
from scheduler.request import Handling, Request


def min_waste_handling(request: Request, view: MemoryView, api_duration_s: float) -> tuple[Handling, float]:
    """The handling with the least memory waste for a call of ``api_duration_s``
    seconds, and that waste in byte-seconds. Swap is only a candidate when the
    host pool has room for the whole context."""
    cost = view.cost
    c_i = request.num_computed_tokens
    c_other = max(0, view.running_tokens - request.num_tokens)
    options = {
        Handling.PRESERVE: waste_preserve(cost, c_i, api_duration_s),
        Handling.DISCARD: waste_discard_chunked(cost, c_i, c_other, view.running_tokens),
    }
    if view.free_host_pages * view.page_size >= c_i:
        options[Handling.SWAP] = waste_swap(cost, c_i, c_other)
    best = min(options, key=options.get)
    return best, options[best]


@register_policy("infercept")
class InferceptPolicy(Policy):
    """Min-waste handling chosen when the call happens; FCFS by original arrival.

    An unknown API duration is estimated as 0 at the call (InferCept's
    ``t_now − t_call`` estimate, which starts at zero), so short calls are
    preserved. Swap-out budget goes to the paused requests with the largest
    waste first.
    """

    def handling(self, request: Request, view: MemoryView, now: float,
                 api_duration_s: float | None) -> Handling:
        duration = api_duration_s
        if duration is None:
            duration = self.predictor.api_duration(request, now, now) or 0.0
        best, waste = min_waste_handling(request, view, duration)
        request.policy_state["waste"] = waste
        return best

    def order_swap_out(self, swapping: list[Request], view: MemoryView) -> list[Request]:
        return sorted(swapping, key=lambda r: -r.policy_state.get("waste", 0.0))
