"""The policy interface and its registry.

A policy decides two things (DESIGN section 4): how a request's KV is handled
while it waits for an API (``handling``) and in which order waiting requests
are admitted (``priority``, lower runs first). Policies are plain classes
registered by name; adding one is one file.

Two bases:

- ``Policy`` sorts the waiting queue by ``priority`` whenever asked (simple,
  O(n log n) per step; fine for keys that change every step).
- ``RankedPolicy`` files each waiting request in a ``RankedQueue`` under a key
  computed once when the request enters the queue (``rank_key``), and re-files
  it only when its inputs change (re-queued, predictor retrained, optional
  refresh interval). ``schedule()`` then walks the queue head-first and stops
  as soon as the batch is full, so a step costs O(admitted · log n), not
  O(n log n).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Iterable

from scheduler.plan import MemoryView, StepPlan
from scheduler.queues import RankedQueue
from scheduler.request import Handling, Request
from scheduler.token_budget import DynamicBudget

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


def make_policy(name: str, predictor: "Predictor | str | None" = None, **options) -> "Policy":
    """Build a registered policy; an unknown name is a ``ValueError`` listing the known ones.

    ``predictor`` may be a ``Predictor`` or a spec string such as ``"noisy:0.3"``.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available_policies())}") from None
    if isinstance(predictor, str):
        from scheduler.predictors import make_predictor
        predictor = make_predictor(predictor)
    return cls(predictor=predictor, **options)


class Policy:
    """Base policy: FCFS by queue time, Discard at every API call.

    Options every policy accepts: ``token_budget`` (``"static"``: the engine's
    ``max_num_batched_tokens``; ``"dynamic"``: AugServe's eqs. 27–32, see
    ``scheduler.token_budget``) with ``budget_gamma``, ``budget_beta_low``,
    ``budget_beta_high``.
    """

    name: ClassVar[str] = "base"
    default_token_budget: ClassVar[str] = "static"

    def __init__(self, predictor: "Predictor | None" = None, *, token_budget: str | None = None,
                 budget_gamma: float = 1.0, budget_beta_low: float = 0.25,
                 budget_beta_high: float = 1.0, **options) -> None:
        from scheduler.predictors import make_predictor
        if options:
            raise ValueError(f"policy {self.name!r} got unknown options {sorted(options)}")
        self.predictor = predictor if predictor is not None else make_predictor("oracle")
        mode = token_budget or self.default_token_budget
        if mode not in ("static", "dynamic"):
            raise ValueError(f"token_budget must be 'static' or 'dynamic', got {token_budget!r}")
        self.dynamic_budget = DynamicBudget(budget_gamma, budget_beta_low, budget_beta_high) \
            if mode == "dynamic" else None
        self.scheduler: Scheduler | None = None

    # ---------------------------------------------------------------- decisions
    def handling(self, request: Request, view: MemoryView, now: float,
                 api_duration_s: float | None) -> Handling:
        """How to hold ``request``'s KV through the API call that starts ``now``."""
        return Handling.DISCARD

    def priority(self, request: Request, now: float, view: MemoryView) -> tuple:
        """Sort key for admission; lower runs first. Also ranks preemption victims (highest goes first)."""
        return (request.queue_key_time, request.arrival_time)

    def order_waiting(self, waiting: Iterable[Request], now: float, view: MemoryView) -> list[Request]:
        """Waiting (and swapped-out, returned) requests in the order to admit them."""
        return sorted(waiting, key=lambda r: self.priority(r, now, view))

    def iter_waiting(self, waiting: Iterable[Request], now: float, view: MemoryView) -> Iterable[Request]:
        """The admission order as the scheduler consumes it: it stops at the
        first request that does not fit, and removes each admitted request
        (the one just yielded) from the queue while iterating."""
        return self.order_waiting(waiting, now, view)

    def waiting_rank(self, request: Request, now: float, view: MemoryView):
        """A waiting request's position in the admission order, totally ordered
        (ties in ``priority`` broken as ``order_waiting`` breaks them)."""
        return (self.priority(request, now, view), self.scheduler.waiting.index(request))

    def order_running(self, running: Iterable[Request], now: float, view: MemoryView,
                      budget: int | None = None) -> list[Request]:
        """Running requests in the order they get this step's ``budget`` tokens
        (a new list; leaving one out skips it this step, keeping its pages)."""
        return list(running)

    def order_swap_out(self, swapping: list[Request], view: MemoryView) -> list[Request]:
        """Which in-progress swap-outs get this step's swap budget first."""
        return swapping

    def token_budget(self, default: int, view: MemoryView) -> int:
        """Tokens this step may batch; ``default`` is the engine's ``max_num_batched_tokens``."""
        if self.dynamic_budget is not None:
            return self.dynamic_budget(default, view)
        return default

    # -------------------------------------------------------------------- hooks
    def attach(self, scheduler: "Scheduler") -> None:
        """Hook: the scheduler that will drive this policy (called once, at construction)."""
        if self.scheduler is not None and self.scheduler is not scheduler:
            raise ValueError(f"policy {self.name!r} is already attached to another scheduler")
        self.scheduler = scheduler

    def on_arrival(self, request: Request, now: float, view: MemoryView) -> None:
        """Hook: a request entered the system (before it is queued)."""

    def on_api_return(self, request: Request, now: float, view: MemoryView) -> None:
        """Hook: ``request``'s API call returned; it is about to re-enter the waiting queue."""

    def on_enqueue(self, request: Request, now: float) -> None:
        """Hook: ``request`` entered the waiting queue (new, back from an API, preempted)."""

    def on_dequeue(self, request: Request) -> None:
        """Hook: ``request`` left the waiting queue (admitted, or finished/aborted)."""

    def on_requeue(self, request: Request, now: float) -> None:
        """Hook: a waiting request's inputs changed in place (its KV was evicted)."""

    def on_step(self, scheduler: "Scheduler", now: float) -> None:
        """Hook: called at the start of every ``schedule()``."""

    def on_plan(self, plan: StepPlan, now: float) -> None:
        """Hook: ``plan`` is what this step runs (called at the end of ``schedule()``)."""

    def on_finish(self, request: Request, now: float) -> None:
        """Hook: ``request`` finished or was aborted; drop anything kept for it."""

    def check_invariants(self, scheduler: "Scheduler") -> None:
        """Hook for tests: assert the policy's own indexes agree with the scheduler."""


class RankedPolicy(Policy):
    """A policy whose waiting order is a cached key per request (see module doc).

    Subclasses implement ``rank_key(request, now, view)``. Keys are recomputed
    when a request (re-)enters the waiting queue, when the predictor's
    ``version`` changes (at the next step), and, with ``refresh_interval=K``,
    for the whole queue every ``K + 1`` steps instead of on predictor change.
    ``priority`` returns the cached key while a request waits, else a fresh one.
    """

    def __init__(self, predictor: "Predictor | None" = None, *, refresh_interval: int | None = None,
                 **options) -> None:
        super().__init__(predictor, **options)
        if refresh_interval is not None and refresh_interval < 0:
            raise ValueError("refresh_interval must be >= 0 (re-score every K+1 steps) or None")
        self.refresh_interval = refresh_interval
        self.queue = RankedQueue()
        self._scored_version = self.predictor.version
        self._last_refresh = 0

    def rank_key(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        """Sort key for a waiting request; lower runs first. ``view`` may be None
        (keys must not depend on per-step memory state, or they go stale)."""
        raise NotImplementedError

    def priority(self, request: Request, now: float, view: MemoryView) -> tuple:
        key = self.queue.key(request)
        return key if key is not None else self.rank_key(request, now, view)

    def order_waiting(self, waiting: Iterable[Request], now: float, view: MemoryView) -> list[Request]:
        return sorted(waiting, key=lambda r: self.waiting_rank(r, now, view))

    def waiting_rank(self, request: Request, now: float, view: MemoryView):
        entry = self.queue.entry(request)
        return entry if entry is not None else (*self.rank_key(request, now, view), float("inf"))

    def iter_waiting(self, waiting: Iterable[Request], now: float, view: MemoryView) -> Iterable[Request]:
        return iter(self.queue)

    def on_enqueue(self, request: Request, now: float) -> None:
        self.queue.add(request, self.rank_key(request, now, None))

    def on_dequeue(self, request: Request) -> None:
        self.queue.remove(request)

    def on_requeue(self, request: Request, now: float) -> None:
        if request in self.queue:
            self.queue.add(request, self.rank_key(request, now, None))

    def on_step(self, scheduler: "Scheduler", now: float) -> None:
        it = scheduler.iteration
        if self.refresh_interval is None:
            due = self.predictor.version != self._scored_version
        else:
            due = it - self._last_refresh > self.refresh_interval
        if due:
            self.rescore_all(now)
            self._last_refresh = it
        self._scored_version = self.predictor.version

    def rescore_all(self, now: float) -> None:
        requests = self.queue.ordered()
        self.queue.clear()
        for r in requests:
            self.queue.add(r, self.rank_key(r, now, None))

    def check_invariants(self, scheduler: "Scheduler") -> None:
        assert len(self.queue) == len(scheduler.waiting), \
            f"{self.name}: ranked queue has {len(self.queue)} entries, waiting {len(scheduler.waiting)}"
        assert all(r in self.queue for r in scheduler.waiting), f"{self.name}: ranked queue out of step"
