"""AugServe: two-stage scheduling values and a dynamic token budget (DESIGN 7, seed 004)."""

from __future__ import annotations

from scheduler.cost_model import CostModel, decode_cost, fill_cost, swap_ramp_seconds, waste_discard, waste_preserve
from scheduler.plan import MemoryView
from scheduler.policies.base import Policy, register_policy
from scheduler.request import Handling, Request, RequestState

ALPHA = 10.0       # token-seconds per second waited (eq. 26), see docs/fidelity.md
BETA_HIGH = 2.0    # the dynamic budget may reach 2 x max_num_batched_tokens (eq. 32)


def augserve_handling(cost: CostModel, context_tokens: int, other_tokens: int, api_duration_s: float,
                      n_max: int, swap_ok: bool) -> Handling:
    """Eqs. 4–8: the handling with the least waiting-phase memory waste.
    Swap's waste is eq. 6, ``2 · T_swap(C_i) · N_max · M`` (a step of
    ``N_max`` tokens stalls for the copy)."""
    options = {
        Handling.PRESERVE: waste_preserve(cost, context_tokens, api_duration_s),
        Handling.DISCARD: waste_discard(cost, context_tokens, other_tokens),
    }
    if swap_ok:
        options[Handling.SWAP] = 2 * cost.t_swap(context_tokens) * n_max * cost.bytes_per_token
    return min(options, key=options.get)


@register_policy("augserve")
class AugServePolicy(Policy):
    """Rank by AugServe's scheduling value (a predicted system cost, lower
    first) minus ``α · (now − last_scheduled)``; dynamic token budget.

    - Stage I, at arrival: handling ``Ŝ`` by eqs. 4–8 with the predicted
      context at the call ``C_i = L_pre + L̂_out``; value ``V(1)`` by eqs.
      9–15 (prefill + decode, + API residency for Preserve, + swap-out for
      Swap).
    - Stage II, at each API return: ``V(2)`` by eqs. 16–22 from the handling
      actually applied and the observed return length, then ``V_final`` by
      eqs. 23–25 with the next round's predicted handling (which is also the
      handling applied at the next call). A request preempted without an API
      return keeps its last value.
    - Values are in token-seconds (byte-seconds ÷ ``M``). Where the equations
      multiply a number of steps by ``T^fwd``, each step is priced by the cost
      model the simulated clock uses (``cost.t_step(n, c)``): prefill,
      recompute and returned-token chunks of ``N_max`` (the engine's
      ``max_num_batched_tokens``) by ``fill_cost``, decode steps by
      ``decode_cost``, swap ramps of ``S_out = S_in`` (``swap_budget_tokens``)
      tokens per step by ``swap_ramp_seconds``.
    - Anti-starvation (eq. 26): printed as ``V + α·wait``, but lower values
      run first and the stated aim is that long-waiting requests gain
      priority, so the key is ``V − α·(now − t_last)`` with ``t_last`` the
      last time the request was scheduled (arrival if never) — eq. 26's
      waiting time. Since ``−α·now`` is common to all requests, the key is
      filed as ``V + α·t_last``: exact, and constant while the request waits.
      ``alpha`` is on the value's own scale, token-seconds per second waited
      (a waiting second offsets ``alpha`` token-seconds of predicted cost;
      default ``ALPHA``; ``alpha=0`` turns it off; docs/fidelity.md sweeps it).
    - Resume paths (Algorithm 1): a call held under Preserve goes straight
      back to the running batch when it returns; a swapped request is ranked
      ahead of all other waiting work (the swapped queue is served before
      waiting_resume and waiting_new); only Discard re-enters the ranking.
    - Token budget: ``token_budget="dynamic"`` by default (eqs. 27–32, see
      ``scheduler.token_budget``) with ``budget_beta_high`` (default
      ``BETA_HIGH``) above 1, so the budget expands above
      ``max_num_batched_tokens`` under light load; pass
      ``token_budget="static"`` to disable.
    """

    default_token_budget = "dynamic"
    resume_preserved_to_running = True

    def __init__(self, predictor=None, *, alpha: float | None = None, budget_beta_high: float | None = None,
                 **options) -> None:
        alpha = ALPHA if alpha is None else alpha
        super().__init__(predictor, budget_beta_high=BETA_HIGH if budget_beta_high is None else budget_beta_high,
                         **options)
        if alpha < 0:
            raise ValueError("alpha must be >= 0")
        self.alpha = alpha

    # ------------------------------------------------------------- helpers
    def _params(self) -> tuple[CostModel, int, int]:
        ctx = self.context
        return ctx.cost, ctx.max_num_batched_tokens, ctx.swap_budget_tokens

    def _ramp(self, tokens: int) -> float:
        """Token-seconds of a swap ramp (out or in) of ``tokens``: ``½ · L · t_ramp``."""
        cost, _, s_io = self._params()
        return 0.5 * tokens * swap_ramp_seconds(cost, tokens, s_io)

    def _next_call(self, request: Request, now: float) -> tuple[bool, float]:
        seg = request.current_segment
        if seg is None or not seg.has_api_call:
            return False, 0.0
        return True, self.predictor.api_duration(request, now, None) or 0.0

    def _choose(self, context: int, duration: float, view: MemoryView) -> Handling:
        cost, n_max, _ = self._params()
        swap_ok = view.free_host_pages * view.page_size >= context
        return augserve_handling(cost, context, view.running_tokens, duration, n_max, swap_ok)

    # ------------------------------------------------------------- stage I
    def stage1_value(self, request: Request, handling: Handling | None, duration: float) -> float:
        """Eqs. 9–15 (token-seconds)."""
        cost, n_max, _ = self._params()
        l_pre = request.num_tokens
        l_out = self.predictor.segment_output_len(request)
        value = fill_cost(cost, 0, l_pre, n_max)[1] + decode_cost(cost, l_pre, l_out)[1]
        if handling == Handling.PRESERVE:
            value += (l_pre + l_out) * duration
        elif handling == Handling.SWAP:
            value += self._ramp(l_pre + l_out)
        return value

    def on_arrival(self, request: Request, now: float, view: MemoryView) -> None:
        has_call, duration = self._next_call(request, now)
        handling = None
        if has_call:
            handling = self._choose(request.num_tokens + self.predictor.segment_output_len(request),
                                    duration, view)
        request.policy_state["aug_handling"] = handling
        request.policy_state["aug_value"] = self.stage1_value(request, handling, duration)
        request.policy_state["aug_stage"] = 1

    # ------------------------------------------------------------ stage II
    def stage2_value(self, applied: Handling, total: int, returned: int, out_next: int,
                     next_handling: Handling | None, next_duration: float) -> float:
        """Eqs. 16–25 (token-seconds): ``total`` = L_total, ``returned`` = L̃_ret."""
        cost, n_max, _ = self._params()
        pro_api = fill_cost(cost, total, returned, n_max)[1]
        decode_post = decode_cost(cost, total + returned, out_next)[1]
        value = pro_api + decode_post
        if applied == Handling.SWAP:
            value += self._ramp(total)
        elif applied == Handling.DISCARD:
            value += fill_cost(cost, 0, total, n_max)[1]
        c_next = total + returned + out_next
        if next_handling == Handling.SWAP:
            value += self._ramp(c_next)
        elif next_handling == Handling.PRESERVE:
            value += c_next * next_duration
        return value

    def on_api_return(self, request: Request, now: float, view: MemoryView) -> None:
        record = request.api_calls[-1]
        returned = record.num_returned_tokens
        total = request.num_tokens - returned
        out_next = self.predictor.segment_output_len(request)
        has_call, duration = self._next_call(request, now)
        next_handling = self._choose(request.num_tokens + out_next, duration, view) if has_call else None
        request.policy_state["aug_handling"] = next_handling
        request.policy_state["aug_value"] = self.stage2_value(record.handling, total, returned, out_next,
                                                              next_handling, duration)
        request.policy_state["aug_stage"] = 2

    def handling(self, request: Request, view: MemoryView, now: float,
                 api_duration_s: float | None) -> Handling:
        decided = request.policy_state.get("aug_handling")
        if decided is not None:
            return decided
        duration = api_duration_s if api_duration_s is not None else \
            (self.predictor.api_duration(request, now, now) or 0.0)
        return self._choose(request.num_computed_tokens, duration, view)

    # -------------------------------------------------------------- ranking
    def priority(self, request: Request, now: float, view: MemoryView | None) -> tuple:
        """``on_arrival`` must have valued ``request``."""
        t_last = request.last_scheduled_time if request.last_scheduled_time is not None \
            else request.arrival_time
        swapped = 0 if request.state is RequestState.SWAPPED else 1   # the swapped queue first
        return (swapped, request.policy_state["aug_value"] + self.alpha * t_last)

    def rescore_due(self, iteration: int) -> bool:
        # Stage values are fixed at arrival/return; a retrained predictor only
        # changes them at the next stage, so nothing to refresh in the queue.
        return False
