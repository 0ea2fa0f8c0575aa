"""vLLM's baseline: every API call is Discard (DESIGN section 7)."""

from __future__ import annotations

from scheduler.plan import MemoryView
from scheduler.policies.base import RankedPolicy, register_policy
from scheduler.request import Request


class FcfsOrder(RankedPolicy):
    """Waiting order by queue time (``queue_key_time``), then arrival. The key
    never changes while a request waits, so it is filed once per queue entry."""

    def rank_key(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        return (request.queue_key_time, request.arrival_time)


@register_policy("fcfs")
class FcfsPolicy(FcfsOrder):
    """First come, first served; a request returning from its API re-enters at the
    tail (its queue time becomes the return time), as vLLM treats it as new."""

    def on_api_return(self, request: Request, now: float, view: MemoryView) -> None:
        request.queue_key_time = now


@register_policy("fcfs-improved")
class FcfsImprovedPolicy(FcfsOrder):
    """Like ``fcfs`` but a returning request keeps its original arrival time, so
    it resumes ahead of requests that arrived after it."""
