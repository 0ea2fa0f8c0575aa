"""vLLM's baseline: every API call is Discard (DESIGN section 7)."""

from __future__ import annotations

from scheduler.plan import MemoryView
from scheduler.policies.base import Policy, register_policy
from scheduler.request import Request

# ``Policy``'s own waiting order is FCFS: by queue time (``queue_key_time``), then arrival.


@register_policy("fcfs")
class FcfsPolicy(Policy):
    """First come, first served; a request returning from its API re-enters at the
    tail (its queue time becomes the return time), as vLLM treats it as new."""

    def on_api_return(self, request: Request, now: float, view: MemoryView) -> None:
        request.queue_key_time = now


@register_policy("fcfs-improved")
class FcfsImprovedPolicy(Policy):
    """Like ``fcfs`` but a returning request keeps its original arrival time, so
    it resumes ahead of requests that arrived after it."""
