"""Shortest job first by predicted length (DESIGN 7; the size-based baselines of seeds 000/001)."""

from __future__ import annotations

from scheduler.plan import MemoryView
from scheduler.policies.base import register_policy
from scheduler.policies.infercept import InferceptPolicy
from scheduler.policies.lamps import step_time
from scheduler.request import Request


@register_policy("sjf")
class SjfPolicy(InferceptPolicy):
    """Waiting order by predicted remaining output tokens over the whole
    request (all remaining segments), fewest first; ties by arrival.

    Handling is InferCept's (min waste when the call happens), so ``sjf``
    differs from ``infercept`` only in the ranking. The key is filed once per
    queue entry (it is fixed while a request waits); no starvation guard —
    that is what the ranking baselines lack.
    """

    def priority(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        return (self.predictor.total_output_len(request), request.arrival_time)


@register_policy("sjf-total")
class SjfTotalPolicy(InferceptPolicy):
    """Waiting order by predicted remaining time: output tokens × the step
    time ``T_fwd(S)`` plus the predicted durations of the API calls still
    ahead (seconds), shortest first; ties by arrival. Handling as ``sjf``."""

    def priority(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        tau = step_time(self.context.cost)
        total = self.predictor.total_output_len(request) * tau + self.predictor.total_api_duration(request, now)
        return (total, request.arrival_time)
