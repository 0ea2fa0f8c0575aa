"""AugServe's dynamic token budget (seed 004, eqs 27–32), usable by any policy.

``budget = ⌊(G_free + γ·G_paused) / M⌋`` tokens, clamped to
``[β_low · target_max, β_high · target_max]``. ``G_free`` is the free device
KV memory and ``G_paused`` the KV memory held by requests paused under
Preserve (which active requests may take over), both in bytes; divided by
``M`` (bytes per token) they are simply token counts, so this works on pages:
``(free_pages + γ · paused_pages) · page_size``. ``target_max`` is the
engine's ``max_num_batched_tokens`` (the seed's offline-profiled reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.plan import MemoryView

TOKEN_BUDGET_MODES = ("policy", "static", "dynamic")


@dataclass(frozen=True, slots=True)
class DynamicBudget:
    """Parameters of eq. 31–32 and the clamp. ``β_high > 1`` lets the budget
    expand above ``max_num_batched_tokens`` under light load (§4.4); the engine
    sizes its executor's token buckets for ``max_tokens`` (the simulator takes
    any step size)."""

    gamma: float = 1.0
    beta_low: float = 0.25
    beta_high: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 < self.beta_low <= self.beta_high:
            raise ValueError(f"need 0 < beta_low <= beta_high, got {self.beta_low}, {self.beta_high}")

    def max_tokens(self, target_max: int) -> int:
        """The largest budget this can return for ``target_max``."""
        low = max(1, math.ceil(self.beta_low * target_max))
        return max(low, math.floor(self.beta_high * target_max))

    def __call__(self, target_max: int, view: MemoryView) -> int:
        return dynamic_token_budget(view, target_max, self.gamma, self.beta_low, self.beta_high)


def dynamic_token_budget(view: MemoryView, target_max: int, gamma: float = 1.0,
                         beta_low: float = 0.25, beta_high: float = 1.0) -> int:
    """Tokens the next step may batch under eqs. 27–32 (at least 1)."""
    avail_tokens = (view.free_device_pages + gamma * view.paused_device_pages) * view.page_size
    budget = math.floor(avail_tokens)
    low = max(1, math.ceil(beta_low * target_max))
    high = max(low, math.floor(beta_high * target_max))
    return min(max(budget, low), high)
