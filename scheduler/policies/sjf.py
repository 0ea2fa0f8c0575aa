"""Shortest job first by predicted length (DESIGN 7; the size-based baselines of seeds 000/001)."""

from __future__ import annotations

from scheduler.cost_model import decode_cost
from scheduler.plan import MemoryView
from scheduler.policies.base import register_policy
from scheduler.policies.infercept import InferceptPolicy
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
    """Waiting order by predicted remaining time: the seconds of decoding the
    predicted output tokens from the current context (``decode_cost``: the cost
    model's ``T_step(S, C + k)`` per token) plus the predicted durations of the
    API calls still ahead, shortest first; ties by arrival. Handling as ``sjf``."""

    def priority(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        decode_s = decode_cost(self.context.cost, request.num_tokens, self.predictor.total_output_len(request))[0]
        total = decode_s + self.predictor.total_api_duration(request, now)
        return (total, request.arrival_time)
