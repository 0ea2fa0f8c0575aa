"""Continuum: program-level FCFS, KV pinned through a tool call for a time-to-live."""

from __future__ import annotations

import heapq
from typing import Callable, Iterator, Mapping

from scheduler.plan import MemoryView
from scheduler.policies.base import Policy, register_policy
from scheduler.request import Handling, Request


@register_policy("continuum")
class ContinuumPolicy(Policy):
    """Continuum's two ideas on one engine:

    - Program-level FCFS: a request (one agent program) is ranked by its first
      arrival, also after each tool call returns, so a program in flight is
      not overtaken by programs that started after it.
    - KV time-to-live: at a tool call the KV stays on the device (Preserve)
      for a TTL of the predicted call duration (seconds; capped at
      ``ttl_max_s`` when given); when the TTL runs out before the call
      returns, the KV is dropped (Discard) and the context is recomputed on
      return. A call with no predicted duration (or a TTL of 0) is Discarded
      at once. With the ``oracle`` predictor the TTL is exactly the call, so
      every call is Preserved; a noisy predictor or ``ttl_max_s`` shows the
      TTL at work. The scheduler may still evict pinned KV for work at the
      head of the queue (as for any Preserve).
    """

    def __init__(self, predictor=None, *, ttl_max_s: float | None = None, **options) -> None:
        super().__init__(predictor, **options)
        if ttl_max_s is not None and ttl_max_s < 0:
            raise ValueError("ttl_max_s must be >= 0 or None")
        self.ttl_max_s = ttl_max_s
        self._deadlines: list[tuple[float, int, int, Request]] = []   # (TTL end, push order, call index, request)
        self._pushed = 0

    def handling(self, request: Request, view: MemoryView, now: float,
                 api_duration_s: float | None) -> Handling:
        duration = self.predictor.api_duration(request, now, now)
        if duration is None:
            duration = api_duration_s
        ttl = duration or 0.0
        if self.ttl_max_s is not None:
            ttl = min(ttl, self.ttl_max_s)
        if ttl <= 0:
            return Handling.DISCARD
        self._pushed += 1
        heapq.heappush(self._deadlines, (now + ttl, self._pushed, len(request.api_calls), request))
        return Handling.PRESERVE

    def redecide(self, now: float, preserved: Mapping[str, Request],
                 view: Callable[[], MemoryView]) -> Iterator[tuple[Request, Handling]]:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, call, request = heapq.heappop(self._deadlines)
            # still inside the call that set this TTL, its KV still pinned (the same request: a finished
            # one's entry must not touch a later request given its id)
            if preserved.get(request.request_id) is request and len(request.api_calls) == call + 1:
                yield request, Handling.DISCARD

    def priority(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        return (request.arrival_time,)
