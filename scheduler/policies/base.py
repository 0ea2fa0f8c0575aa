"""The policy interface and its registry.

A policy decides two things (DESIGN section 4): how a request's KV is handled
while it waits for an API (``handling``) and in which order waiting requests
are admitted (``priority``, lower runs first). Policies are plain classes
registered by name; adding one is one file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from scheduler.plan import MemoryView
from scheduler.request import Handling, Request

if TYPE_CHECKING:
    from scheduler.predictors import Predictor
    from scheduler.scheduler import Scheduler

_REGISTRY: dict[str, type["Policy"]] = {}


def register_policy(*names: str):
    """Class decorator: make the policy selectable under each of ``names``."""
    def deco(cls: type[Policy]) -> type[Policy]:
        for n in names:
            if n in _REGISTRY:
                raise ValueError(f"policy name {n!r} registered twice")
            _REGISTRY[n] = cls
        cls.name = names[0]
        return cls
    return deco


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, predictor: "Predictor | None" = None, **options) -> "Policy":
    """Build a registered policy; an unknown name is a ``ValueError`` listing the known ones."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available_policies())}") from None
    return cls(predictor=predictor, **options)


class Policy:
    """Base policy: FCFS by queue time, Discard at every API call."""

    name: ClassVar[str] = "base"

    def __init__(self, predictor: "Predictor | None" = None, **options) -> None:
        from scheduler.predictors import make_predictor
        if options:
            raise ValueError(f"policy {self.name!r} got unknown options {sorted(options)}")
        self.predictor = predictor if predictor is not None else make_predictor("oracle")

    def handling(self, request: Request, view: MemoryView, now: float,
                 api_duration_s: float | None) -> Handling:
        """How to hold ``request``'s KV through the API call that starts ``now``."""
        return Handling.DISCARD

    def priority(self, request: Request, now: float, view: MemoryView) -> tuple:
        """Sort key for admission; lower runs first. Also ranks preemption victims (highest goes first)."""
        return (request.queue_key_time, request.arrival_time)

    def order_waiting(self, waiting: list[Request], now: float, view: MemoryView) -> list[Request]:
        """Waiting (and swapped-out, returned) requests in the order to admit them."""
        return sorted(waiting, key=lambda r: self.priority(r, now, view))

    def order_swap_out(self, swapping: list[Request], view: MemoryView) -> list[Request]:
        """Which in-progress swap-outs get this step's swap budget first."""
        return swapping

    def token_budget(self, default: int, view: MemoryView) -> int:
        """Tokens this step may batch; ``default`` is the engine's ``max_num_batched_tokens``."""
        return default

    def on_arrival(self, request: Request, now: float, view: MemoryView) -> None:
        """Hook: a request entered the system."""

    def on_api_return(self, request: Request, now: float, view: MemoryView) -> None:
        """Hook: ``request``'s API call returned; it is about to re-enter the waiting queue."""

    def on_step(self, scheduler: "Scheduler", now: float) -> None:
        """Hook: called at the start of every ``schedule()``."""
