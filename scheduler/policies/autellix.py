"""Autellix PLAS: least attained service first, per program."""

from __future__ import annotations

from scheduler.plan import MemoryView
from scheduler.policies.base import register_policy
from scheduler.policies.infercept import InferceptPolicy
from scheduler.request import Request


@register_policy("autellix")
class AutellixPolicy(InferceptPolicy):
    """Autellix's Program-Level Attained Service (PLAS): waiting requests are
    ranked by the service their program has received so far, least first, ties
    by arrival — no prediction needed, and a program with many short calls is
    not starved behind one long one, while a long program sinks as it is served.

    - Attained service: query tokens the request has had computed (prefill,
      decode and recompute chunks; ``Request.attained_tokens``), the
      token-count form of Autellix's cumulative execution time (steps cost
      about the same per token). One request is one program here.
    - The key is filed when the request enters the queue (its attained
      service cannot change while it waits); the running request with the
      most attained service is preempted first.
    - Handling is InferCept's, so ``autellix`` differs from ``infercept`` only
      in the ranking. Not modelled: Autellix's discretised priority queues and
      their anti-starvation promotion, and its multi-engine load balancer.
    """

    def priority(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        return (request.attained_tokens, request.arrival_time)
