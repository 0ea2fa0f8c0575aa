"""The simulated executor: the engine step of DESIGN section 3 with a cost
model and a simulated clock in place of the model.

``SimExecutor.execute(plan)`` advances a ``SimClock`` by the plan's cost and
returns no token ids; the same ``EngineCore`` and scheduler drive it as drive
the model executor, so the simulator cannot drift from the engine's logic.

The cost model (see ``docs/replay.md``):

* A step over ``n`` batched query tokens whose attention reads ``c`` cached
  tokens (``StepPlan.num_context_tokens``) takes ``T_fwd(n, c)`` from the
  profile (prefill chunks, recompute chunks and decode tokens cost the same per
  query token; every chunk pays ``fwd_per_context_token_s`` per token of its
  request's context so far) — the ``linear`` step model. A profile measured by ``jaxserve profile``
  also carries the time of each padded token bucket (``meta.step_times_s``);
  with the ``buckets`` step model a step costs the measured time of the
  power-of-two bucket its ``n`` tokens are padded to, as the engine pads them,
  plus the same context term.
  ``auto`` (the default) uses buckets when the profile has them. Every step
  that runs the model also pays the profile's ``step_overhead_s`` (the
  engine's host-side work), and all step times are multiplied by
  ``step_time_scale`` (1 unless asked: a what-if, or a sensitivity check).
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

from jaxserve.core import SimClock
from scheduler import CostModel, Request, StepPlan, StepResult

STEP_MODELS = ("linear", "buckets", "auto")


def bucket_step_times(cost: CostModel) -> list[tuple[int, float]] | None:
    """``[(bucket tokens, step seconds), ...]`` ascending, from a measured
    profile's ``meta["step_times_s"]``; ``None`` when the profile has none."""
    table = (cost.meta or {}).get("step_times_s")
    if not table:
        return None
    return sorted((int(k), float(v)) for k, v in table.items())


class StepTimer:
    """Seconds of a step over ``n`` batched tokens reading ``c`` context tokens:
    ``scale · (forward(n) + fwd_per_context_token_s · c + cost.step_overhead_s)``,
    0 for ``n == 0`` (the ``n`` part memoised per ``n``).

    forward — ``linear``: ``T_fwd(n)``. ``buckets``: the measured time of the
    smallest bucket ``>= n`` (beyond the largest, that bucket's time plus
    ``fwd_per_token_s`` per extra token). ``auto``: buckets when the profile
    has them, else linear.
    """

    def __init__(self, cost: CostModel, model: str = "auto", scale: float = 1.0) -> None:
        if model not in STEP_MODELS:
            raise ValueError(f"step model must be one of {', '.join(STEP_MODELS)}, got {model!r}")
        if not scale > 0:
            raise ValueError(f"step time scale must be > 0, got {scale}")
        table = bucket_step_times(cost)
        if model == "buckets" and table is None:
            raise ValueError(f"profile {cost.name!r} has no measured step times (meta.step_times_s); "
                             "use the linear step model")
        self.model = "buckets" if (model == "auto" and table) or model == "buckets" else "linear"
        self.cost = cost
        self.scale = scale
        self._table = table if self.model == "buckets" else None
        self._cache: dict[int, float] = {}

    def __call__(self, n: int, context_tokens: int = 0) -> float:
        t = self._cache.get(n)
        if t is None:
            t = self._cache[n] = self._compute(n)
        if context_tokens and n > 0:
            t += self.scale * self.cost.fwd_per_context_token_s * context_tokens
        return t

    def _compute(self, n: int) -> float:
        if n <= 0:
            return 0.0
        return self.scale * (self._forward(n) + self.cost.step_overhead_s)

    def _forward(self, n: int) -> float:
        if self._table is None:
            return self.cost.t_fwd(n)
        for bucket, seconds in self._table:
            if bucket >= n:
                return seconds
        bucket, seconds = self._table[-1]
        return seconds + self.cost.fwd_per_token_s * (n - bucket)


class SimExecutor:
    """Executes plans by advancing ``clock`` by their simulated cost.

    Totals since construction: ``forward_time_s`` and ``swap_stall_s`` (the
    parts of the simulated step time) and ``swapped_tokens``.
    """

    def __init__(self, cost: CostModel, page_size: int, clock: SimClock, *, step_model: str = "auto",
                 step_time_scale: float = 1.0, prefill_decode_split: bool = False) -> None:
        self.cost = cost
        self.prefill_decode_split = prefill_decode_split
        self.page_size = page_size
        self.clock = clock
        self.t_fwd = StepTimer(cost, step_model, step_time_scale)
        self.forward_time_s = 0.0
        self.swap_stall_s = 0.0
        self.swapped_tokens = 0

    def forward_time(self, plan: StepPlan) -> float:
        """Seconds of the plan's forward (and, split, the prefill-to-decoder KV transfers)."""
        if not self.prefill_decode_split:
            return self.t_fwd(plan.num_batched_tokens, plan.num_context_tokens)
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
        fwd = max(self.t_fwd(p_tokens, p_context), self.t_fwd(d_tokens, d_context))
        return fwd + (self.cost.t_swap(transfer) * self.t_fwd.scale if transfer else 0.0)

    def step_time(self, plan: StepPlan) -> tuple[float, float, int]:
        """(step seconds, un-hidden swap seconds, tokens swapped) for ``plan``."""
        cost = self.cost
        fwd = self.forward_time(plan)
        swapped = 0
        if plan.swap_out or plan.swap_in:
            pages = sum(len(op.device_pages) for op in plan.swap_out)
            pages += sum(len(op.device_pages) for op in plan.swap_in)
            swapped = pages * self.page_size
        if not swapped:
            return fwd, 0.0, 0
        copy = cost.t_swap(swapped) * self.t_fwd.scale
        if not cost.swap_overlaps_forward:
            return fwd + copy, copy, swapped
        return max(fwd, copy), max(0.0, copy - fwd), swapped

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.swap_out or plan.swap_in:
            dt, stall, swapped = self.step_time(plan)
            self.swap_stall_s += stall
            self.swapped_tokens += swapped
            self.forward_time_s += dt - stall
        else:
            dt = self.forward_time(plan)
            self.forward_time_s += dt
        self.clock.advance(dt)
        return StepResult(elapsed_s=dt)

    def release(self, request: Request) -> None:
        """Nothing is held outside the scheduler's page accounting."""
