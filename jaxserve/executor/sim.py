"""The simulated executor: the engine step of DESIGN section 3 with a cost
model and a simulated clock in place of the model.

``SimExecutor.execute(plan)`` advances a ``SimClock`` by the plan's cost and
returns no token ids; the same ``EngineCore`` and scheduler drive it as drive
the model executor, so the simulator cannot drift from the engine's logic.

The cost model (see ``docs/replay.md``):

* A step over ``n`` batched query tokens whose attention reads ``c`` cached
  tokens (``StepPlan.num_context_tokens``) takes ``cost.t_step(n, c)``: the
  profile's forward for ``n`` tokens (linear, or the measured time of the
  padded bucket: ``CostModel.step_model``), its context term, its per-step
  host overhead, times its ``step_time_scale``. The scheduler's policies price
  their waste and ranking values with the same ``CostModel`` object (the
  scheduler's ``cost``), so the simulated clock and the policies cannot
  disagree about the machine.
* Swaps run on the host link. With a profile whose ``swap_overlaps_forward``
  is true (the GPT-J/A100 constants: InferCept's layer-pipelined swap, §4.1) a
  step that copies ``k`` tokens' KV (out and in together) takes
  ``max(T_fwd(n), T_swap(k))`` — only the part of the copy that the forward
  cannot hide is added. A measured profile of jaxserve's engine, which copies
  before the forward, says false: the step takes ``T_fwd(n) + T_swap(k)``.
  A step with swaps and no forward takes ``T_swap(k)``.
* ``prefill_decode_split`` (Prophet's disaggregation, seed 002, simulated):
  the step's prefill and recompute chunks run on a prefill executor and its
  decode tokens on a decode executor at the same time, so the forward takes
  ``max(T_fwd(prefill part), T_fwd(decode part))``; a chunk that ends a
  prefill (it samples the first token after it) then ships its context's KV
  to the decoder over the host link, ``T_swap(context)``, added to the step.
  One KV pool is still shared (the decoder's memory is not modelled apart).
"""

from __future__ import annotations

from typing import Callable

from jaxserve.core import SimClock
from scheduler import CostModel, Request, StepPlan, StepResult

class SimExecutor:
    """Executes plans by advancing ``clock`` by their simulated cost.

    Totals since construction: ``forward_time_s`` and ``swap_stall_s`` (the
    parts of the simulated step time) and ``swapped_tokens``.
    """

    def __init__(self, cost: CostModel, page_size: int, clock: SimClock, *,
                 prefill_decode_split: bool = False) -> None:
        self.cost = cost
        self.prefill_decode_split = prefill_decode_split
        self.page_size = page_size
        self.clock = clock
        self.forward_time_s = 0.0
        self.swap_stall_s = 0.0
        self.swapped_tokens = 0

    def forward_time(self, plan: StepPlan) -> float:
        """Seconds of the plan's forward (and, split, the prefill-to-decoder KV transfers)."""
        if not self.prefill_decode_split:
            return self.cost.t_step(plan.num_batched_tokens, plan.num_context_tokens)
        p_tokens = p_context = d_tokens = d_context = transfer = 0
        for c in plan.chunks:
            context = c.start + c.num_tokens
            if c.num_tokens == 1 and c.request.num_generated > 0:
                d_tokens += 1
                d_context += context
            else:
                p_tokens += c.num_tokens
                p_context += context
                if c.samples:
                    transfer += context
        fwd = max(self.cost.t_step(p_tokens, p_context), self.cost.t_step(d_tokens, d_context))
        return fwd + (self.cost.t_swap(transfer) if transfer else 0.0)

    def step_time(self, plan: StepPlan) -> tuple[float, float, int]:
        """(step seconds, un-hidden swap seconds, tokens swapped) for ``plan``."""
        pages = 0
        if plan.swap_out or plan.swap_in:
            pages = sum(len(op.device_pages) for op in plan.swap_out)
            pages += sum(len(op.device_pages) for op in plan.swap_in)
        return self._with_copies(self.forward_time(plan), pages)

    def _with_copies(self, fwd: float, pages: int) -> tuple[float, float, int]:
        """(step seconds, un-hidden swap seconds, tokens swapped) of a forward of
        ``fwd`` seconds in a step that copies ``pages`` KV pages."""
        swapped = pages * self.page_size
        if not swapped:
            return fwd, 0.0, 0
        cost = self.cost
        copy = cost.t_swap(swapped)
        if not cost.swap_overlaps_forward:
            return fwd + copy, copy, swapped
        return max(fwd, copy), max(0.0, copy - fwd), swapped

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.swap_out or plan.swap_in:
            dt = self._advance(*self.step_time(plan))
        else:
            dt = self._advance(self.forward_time(plan), 0.0, 0)
        return StepResult(elapsed_s=dt)

    def execute_with_decoders(self, plan: StepPlan, num_decoders: int, decoder_context: int) -> float:
        """``execute`` of ``plan`` plus ``num_decoders`` one-token chunks whose
        attention reads ``decoder_context`` tokens (a ``DecodeRun``'s admission
        step): the same time and totals; returns its seconds."""
        assert not self.prefill_decode_split, "decode runs need a colocated executor"
        pages = sum(len(op.device_pages) for op in plan.swap_out) + sum(len(op.device_pages) for op in plan.swap_in)
        fwd = self.cost.t_step(plan.num_batched_tokens + num_decoders, plan.num_context_tokens + decoder_context)
        return self._advance(*self._with_copies(fwd, pages))

    def decode_stepper(self, num_tokens: int) -> Callable[[int, int], float]:
        """Decode-only steps of ``num_tokens`` one-token chunks without a plan
        (``DecodeRun``): ``(context_tokens, copied_pages) -> seconds``, the same
        time and totals as ``execute`` gives such a plan (the attention reads
        ``context_tokens``; ``copied_pages`` go to the host tier). Its attribute
        ``seconds`` (``context_tokens -> seconds``) is the time of such a step
        without copies, without running it."""
        assert not self.prefill_decode_split, "decode runs need a colocated executor"
        t_step, clock = self.cost.t_step_of_context(num_tokens), self.clock

        def step(context_tokens: int, copied_pages: int) -> float:
            if copied_pages:
                return self._advance(*self._with_copies(t_step(context_tokens), copied_pages))
            dt = t_step(context_tokens)   # ``_advance(dt, 0.0, 0)``, inlined: most simulated steps come here
            self.forward_time_s += dt - 0.0
            clock.t += dt   # ``clock.advance(dt)``
            return dt
        step.seconds = t_step   # (the step's time alone: ``DecodeRun.plan_quiet``)
        return step

    def _advance(self, dt: float, stall: float, swapped: int) -> float:
        """Count a step of ``dt`` seconds (``stall`` of them un-hidden copying ``swapped``
        tokens) and move the clock on; returns ``dt``."""
        if swapped:
            self.swap_stall_s += stall
            self.swapped_tokens += swapped
        self.forward_time_s += dt - stall
        self.clock.advance(dt)
        return dt

    def release(self, request: Request) -> None:
        """Nothing is held outside the scheduler's page accounting."""
