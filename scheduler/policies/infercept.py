"""InferCept / APISERVE min-waste handling (DESIGN section 6, seed 003)."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

from scheduler.cost_model import CostModel, waste_discard_chunked, waste_preserve, waste_swap
from scheduler.plan import MemoryView
from scheduler.policies.base import Policy, register_policy
from scheduler.request import Handling, Request, RequestState


def min_waste_choice(cost: CostModel, context_tokens: int, other_tokens: int, num_running: int,
                     api_duration_s: float, swap_ok: bool = True, cached_tokens: int = 0) -> tuple[Handling, float]:
    """The handling with the least memory waste (byte-seconds) for a call of
    ``api_duration_s`` seconds by a request holding ``context_tokens`` of KV,
    while others hold ``other_tokens``. Discard is InferCept's chunked
    recompute: chunks of ``S − num_running`` tokens (the saturation point minus
    the decode tokens the running batch already puts in each step). Swap is a
    candidate only when ``swap_ok`` (the host pool has room). ``cached_tokens``
    of the context are expected still in the prefix cache at the return, so a
    (soft) Discard recomputes only the rest (docs/scheduling.md)."""
    options = {
        Handling.PRESERVE: waste_preserve(cost, context_tokens, api_duration_s),
        Handling.DISCARD: waste_discard_chunked(cost, max(0, context_tokens - cached_tokens), other_tokens,
                                                num_running),
    }
    if swap_ok:
        options[Handling.SWAP] = waste_swap(cost, context_tokens, other_tokens)
    best = min(options, key=options.get)
    return best, options[best]


def min_waste_handling(request: Request, view: MemoryView, api_duration_s: float) -> tuple[Handling, float]:
    """``min_waste_choice`` for ``request`` calling an API now: ``C_i`` is its
    computed context, ``C_other`` the rest of the running tokens."""
    c_i = request.num_computed_tokens
    c_other = max(0, view.running_tokens - request.num_tokens)
    swap_ok = view.free_host_pages * view.page_size >= c_i
    return min_waste_choice(view.cost, c_i, c_other, view.num_running, api_duration_s, swap_ok,
                            view.expected_cached_tokens(c_i, api_duration_s))


def preserve_or_discard(cost: CostModel, context_tokens: int, other_tokens: int, num_running: int,
                        api_duration_s: float) -> tuple[Handling, float]:
    """Seed 003 eq. 5: ``min(WastePreserve, WasteChunkDiscard)`` (byte-seconds) and
    the handling it picks (Swap is not a candidate at the call; it gets the swap budget)."""
    return min_waste_choice(cost, context_tokens, other_tokens, num_running, api_duration_s, swap_ok=False)


@register_policy("infercept")
class InferceptPolicy(Policy):
    """InferCept as seed 003 (§4.3) describes it; FCFS by original arrival (a
    returning request keeps its arrival time).

    - At the call, each API-preempted request's waste is eq. 5,
      ``min(WastePreserve, WasteChunkDiscard)``, and that minimum picks
      Preserve or (chunked) Discard.
    - The swap budget goes to the API-preempted requests with the largest
      waste: a request is switched to Swap (its KV joins the swap-out queue,
      copied ``swap_budget_tokens`` per step, largest waste first) only while
      the tokens still waiting in that queue are less than one step's swap
      budget — so the queue never holds more than a step's worth ahead. At the
      call the request itself is the candidate; at the start of every step the
      requests still paused under Preserve compete, largest waste first.
      Whatever the budget does not reach keeps its Preserve/Discard choice.
    - The call's duration is the predictor's (``oracle``: the declared one),
      else the ``api_duration_s`` the engine passes. Unknown duration (neither
      has one, or the predictor is ``elapsed``): it is estimated as
      ``t_now − t_call``, which is 0 at the call, so the call starts under
      Preserve; every step the choice is re-made with the grown estimate and
      the request is switched to Discard once that wastes less (§4.4).

    ``infercept-minwaste`` (``swap_at_call=True``) is the variant jaxserve
    shipped before: at the call it takes the minimum of Preserve, chunked
    Discard *and* Swap (eq. 3's ``2·T_swap·C_batch·M``), with no budget on how
    much enters the swap queue; a stronger baseline than the paper's (most long
    calls become swaps), kept to show how much of a comparison rides on it.
    """

    swap_at_call = False

    def __init__(self, predictor=None, **options) -> None:
        super().__init__(predictor, **options)
        self._watch: dict[str, Request] = {}      # Preserve calls: re-decided (unknown duration) and
                                                  # competing for the swap budget every step
        self._swapping: dict[str, Request] = {}   # requests this policy sent to the swap-out queue
        self._granted: list[Request] = []         # swaps granted at calls since the step began

    # -------------------------------------------------------------- the swap budget
    def _swap_backlog(self) -> int:
        """Tokens still to be copied out by the requests this policy switched to Swap
        (those granted at a call this step count in full: they start next step)."""
        backlog = 0
        for rid, r in list(self._swapping.items()):
            if r.state is RequestState.SWAPPING_OUT:
                backlog += len(r.device_pages)
            else:
                del self._swapping[rid]
        backlog += sum(len(r.device_pages) for r in self._granted)
        return backlog * self.context.page_size

    def _grant_swap(self, request: Request, view: MemoryView, duration_s: float) -> bool:
        """Whether ``request`` gets the swap budget now: it wastes memory (waste > 0),
        its call of ``duration_s`` outlasts the copy out and back (``2·T_swap(C_i)``:
        otherwise it would be back before its KV left), the host has room for it,
        and the swap-out queue holds less than one step's budget."""
        c_i = request.num_computed_tokens
        if c_i <= 0 or request.policy_state.get("waste", 0.0) <= 0.0:
            return False
        if duration_s <= 2 * view.cost.t_swap(c_i) or view.free_host_pages * view.page_size < c_i:
            return False
        return self._swap_backlog() < self.context.swap_budget_tokens

    def on_step(self, now: float, iteration: int) -> Iterable[Request]:
        for r in self._granted:
            self._swapping[r.request_id] = r
        self._granted.clear()
        return ()

    # ---------------------------------------------------------------- decisions
    def handling(self, request: Request, view: MemoryView, now: float,
                 api_duration_s: float | None) -> Handling:
        duration = self.predictor.api_duration(request, now, now)
        if duration is None:
            duration = api_duration_s
        unknown = duration is None or self.predictor.grows_while_waiting
        if self.swap_at_call:
            best, waste = min_waste_handling(request, view, duration or 0.0)
            request.policy_state["waste"] = waste
            request.policy_state["unknown_duration"] = unknown
            if best == Handling.PRESERVE and unknown:
                self._watch[request.request_id] = request
            return best
        c_other = max(0, view.running_tokens - request.num_tokens)
        best, waste = preserve_or_discard(view.cost, request.num_computed_tokens, c_other, view.num_running,
                                          duration or 0.0)
        request.policy_state["waste"] = waste
        request.policy_state["unknown_duration"] = unknown
        request.policy_state["api_duration_s"] = duration or 0.0
        if not unknown and self._grant_swap(request, view, duration or 0.0):
            self._granted.append(request)
            return Handling.SWAP
        if best == Handling.PRESERVE:
            self._watch[request.request_id] = request   # competes for the swap budget every step
        return best

    def redecide(self, now: float, preserved: Mapping[str, Request],
                 view: Callable[[], MemoryView]) -> Iterator[tuple[Request, Handling]]:
        if not self._watch:
            return
        current = view()
        for rid, request in list(self._watch.items()):
            if rid not in preserved:
                del self._watch[rid]   # returned, evicted, switched or ended
        # Unknown durations: re-make the choice with the grown estimate; then the swap
        # budget goes to the largest wastes.
        for request in sorted(self._watch.values(), key=lambda r: -r.policy_state.get("waste", 0.0)):
            best = Handling.PRESERVE
            duration = request.policy_state.get("api_duration_s", 0.0)
            if request.policy_state.get("unknown_duration"):
                elapsed = duration = max(0.0, now - request.api_calls[-1].call_time)
                swap_ok = self.swap_at_call and current.free_host_pages * current.page_size >= \
                    request.num_computed_tokens
                best, waste = min_waste_choice(current.cost, request.num_computed_tokens, current.running_tokens,
                                               current.num_running, elapsed, swap_ok)
                request.policy_state["waste"] = waste
            if not self.swap_at_call and self._grant_swap(request, current, duration):
                best = Handling.SWAP
                self._swapping[request.request_id] = request
            if best != Handling.PRESERVE:
                del self._watch[request.request_id]
                yield request, best
                current = view()

    def on_finish(self, request: Request, now: float) -> None:
        self._watch.pop(request.request_id, None)
        self._swapping.pop(request.request_id, None)
        if request in self._granted:
            self._granted.remove(request)

    def order_swap_out(self, swapping: list[Request], view: MemoryView) -> list[Request]:
        return sorted(swapping, key=lambda r: -r.policy_state.get("waste", 0.0))


@register_policy("infercept-minwaste")
class InferceptMinWastePolicy(InferceptPolicy):
    """``infercept`` with Swap as a third candidate at the call and no swap-queue
    budget (jaxserve's behaviour before issue 19; see ``InferceptPolicy``)."""

    swap_at_call = True
