"""The policy interface and its registry.

A policy decides two things (DESIGN section 4): how a request's KV is held
while it waits for an API (``handling``) and in which order waiting requests
are admitted (``priority``, lower runs first). Policies are plain classes
registered by name; adding one is one file.

A policy holds no reference to the scheduler. It decides from what it is
given: a read-only ``PolicyContext`` (the scheduler's limits and cost model,
given once by ``bind``) and, in each call, the time ``now``, the step
``iteration`` and a ``MemoryView``. Where it wants something changed, a hook
returns it and the scheduler applies it (``on_step`` returns requests to
re-rank; ``redecide`` yields new handlings).

The waiting queue's mechanics are the scheduler's: it files each waiting
request under ``priority(request, now, None)`` when the request enters the
queue, walks the queue head-first, and re-files a request only when its
inputs change — its KV was evicted, ``on_step`` names it, or ``rescore_due``
says every key is stale (the predictor was retrained, or every
``refresh_interval + 1`` steps). So a key must not depend on per-step
memory state, and a step costs O(admitted · log n), not O(n log n).

Optional hooks (all no-ops by default): ``token_budget``, ``order_running``,
``order_swap_out``, ``redecide``, ``on_arrival``, ``on_api_return``,
``on_enqueue``, ``on_dequeue``, ``on_step``, ``on_rescore``, ``on_plan``,
``on_finish``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Iterable, Iterator, Mapping

from scheduler.cost_model import CostModel
from scheduler.plan import MemoryView, StepPlan
from scheduler.request import Handling, Request
from scheduler.token_budget import DynamicBudget

if TYPE_CHECKING:
    from scheduler.predictors import Predictor


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy may know about the scheduler driving it (read-only).

    ``max_num_batched_tokens`` and ``swap_budget_tokens`` are per-step limits
    in tokens; ``page_size`` is tokens per KV page.
    """

    cost: CostModel
    max_num_batched_tokens: int
    swap_budget_tokens: int
    page_size: int


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
    ``budget_beta_high``; ``refresh_interval=K`` re-ranks the whole waiting
    queue every ``K + 1`` steps instead of when the predictor is retrained.
    """

    name: ClassVar[str] = "base"
    default_token_budget: ClassVar[str] = "static"
    # Algorithm 1 of seed 004: a call held under Preserve resumes straight into the
    # running batch when it returns (False: it re-enters the ranked waiting queue).
    resume_preserved_to_running: ClassVar[bool] = False

    def __init__(self, predictor: "Predictor | None" = None, *, token_budget: str | None = None,
                 budget_gamma: float = 1.0, budget_beta_low: float = 0.25,
                 budget_beta_high: float = 1.0, refresh_interval: int | None = None, **options) -> None:
        from scheduler.predictors import make_predictor
        if options:
            raise ValueError(f"policy {self.name!r} got unknown options {sorted(options)}")
        self.predictor = predictor if predictor is not None else make_predictor("oracle")
        mode = token_budget or self.default_token_budget
        if mode not in ("static", "dynamic"):
            raise ValueError(f"token_budget must be 'static' or 'dynamic', got {token_budget!r}")
        self.dynamic_budget = DynamicBudget(budget_gamma, budget_beta_low, budget_beta_high) \
            if mode == "dynamic" else None
        if refresh_interval is not None and refresh_interval < 0:
            raise ValueError("refresh_interval must be >= 0 (re-score every K+1 steps) or None")
        self.refresh_interval = refresh_interval
        self._scored_version = self.predictor.version
        self._last_refresh = 0
        self._context: PolicyContext | None = None

    def bind(self, context: PolicyContext) -> None:
        """Called once by the scheduler that will drive this policy."""
        if self._context is not None and self._context is not context:
            raise ValueError(f"policy {self.name!r} is already bound to another scheduler")
        self._context = context

    @property
    def context(self) -> PolicyContext:
        if self._context is None:
            raise RuntimeError(f"policy {self.name!r} is not bound to a scheduler yet")
        return self._context

    # ---------------------------------------------------------------- decisions
    def handling(self, request: Request, view: MemoryView, now: float,
                 api_duration_s: float | None) -> Handling:
        """How to hold ``request``'s KV through the API call that starts ``now``."""
        return Handling.DISCARD

    def priority(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        """Sort key for admission, lower runs first; ties keep queue order. Also
        ranks preemption victims among running requests (highest goes first).
        ``view`` is None when the key is filed for the waiting queue."""
        return (request.queue_key_time, request.arrival_time)

    # -------------------------------------------------------------------- hooks
    def token_budget(self, default: int, view: MemoryView) -> int:
        """Tokens this step may batch; ``default`` is the engine's ``max_num_batched_tokens``."""
        if self.dynamic_budget is not None:
            return self.dynamic_budget(default, view)
        return default

    def max_step_tokens(self, default: int) -> int:
        """The most tokens ``token_budget`` can ever return (the executor sizes its
        step shapes for it); ``default`` is the engine's ``max_num_batched_tokens``."""
        if self.dynamic_budget is not None:
            return self.dynamic_budget.max_tokens(default)
        return default

    def order_running(self, running: Iterable[Request], now: float, view: MemoryView,
                      budget: int | None = None, iteration: int = 0) -> list[Request]:
        """Running requests in the order they get this step's ``budget`` tokens
        (a new list; leaving one out skips it this step, keeping its pages)."""
        return list(running)

    def may_admit(self, request: Request, plan: StepPlan) -> bool:
        """Whether ``request`` (next in the waiting order) may join this step's ``plan``;
        False stops admission for the step (the order is kept: nothing skips ahead)."""
        return True

    def order_swap_out(self, swapping: list[Request], view: MemoryView) -> list[Request]:
        """Which in-progress swap-outs get this step's swap budget first."""
        return swapping

    def redecide(self, now: float, preserved: Mapping[str, Request],
                 view: Callable[[], MemoryView]) -> Iterator[tuple[Request, Handling]]:
        """Hook, at the start of every step in which some call is paused under
        Preserve with its KV on device: switch such calls.
        ``preserved`` (read-only) holds those requests by id, call still out
        and KV on device. Yield ``(request, handling)`` one at a time; the
        scheduler applies each (Discard frees the pages, Swap starts a
        swap-out) before asking for the next, so ``view()`` is current."""
        return iter(())

    def on_arrival(self, request: Request, now: float, view: MemoryView) -> None:
        """Hook: a request entered the system (before it is queued)."""

    def on_api_return(self, request: Request, now: float, view: MemoryView) -> None:
        """Hook: ``request``'s API call returned; it is about to re-enter the waiting queue."""

    def on_enqueue(self, request: Request, now: float, iteration: int) -> None:
        """Hook: ``request`` is entering the waiting queue (new, back from an API,
        preempted); it is filed under ``priority`` right after."""

    def on_dequeue(self, request: Request, iteration: int) -> None:
        """Hook: ``request`` left the waiting queue (admitted, or finished/aborted)."""

    def rescore_due(self, iteration: int) -> bool:
        """Whether every waiting key is stale at the start of step ``iteration``
        (the predictor was retrained, or ``refresh_interval`` steps passed)."""
        if self.refresh_interval is None:
            due = self.predictor.version != self._scored_version
        else:
            due = iteration - self._last_refresh > self.refresh_interval
        if due:
            self._last_refresh = iteration
        self._scored_version = self.predictor.version
        return due

    def on_rescore(self, waiting: list[Request], now: float, view: MemoryView) -> None:
        """Hook: ``waiting`` (in queue order) is about to be re-filed by fresh keys."""

    def on_step(self, now: float, iteration: int) -> Iterable[Request]:
        """Hook, at the start of every ``schedule()``: returns requests whose key
        changed (the scheduler re-files those still waiting)."""
        return ()

    def on_plan(self, plan: StepPlan, now: float, iteration: int) -> None:
        """Hook: ``plan`` is what step ``iteration`` runs (called at the end of ``schedule()``)."""

    def on_finish(self, request: Request, now: float) -> None:
        """Hook: ``request`` finished or was aborted; drop anything kept for it."""
