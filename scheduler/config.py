"""The scheduler's settings (per-step limits, forced handling, token budget mode)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import Handling
from scheduler.token_budget import TOKEN_BUDGET_MODES, DynamicBudget


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Per-step limits. Tokens are query tokens batched into one forward.

    ``token_budget`` picks the per-step token limit for every policy:
    ``"policy"`` (default) lets the policy decide (``augserve`` and any policy
    built with ``token_budget="dynamic"`` use AugServe's dynamic budget, the
    others ``max_num_batched_tokens``), ``"static"`` always uses
    ``max_num_batched_tokens``, ``"dynamic"`` always uses the dynamic budget
    (``scheduler.token_budget``) with ``budget_gamma``/``budget_beta_low``/
    ``budget_beta_high`` and ``max_num_batched_tokens`` as ``target_max``.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    swap_budget_tokens: int = 512      # KV tokens copied host<->device per step (both ways together)
    handling: Handling | None = None   # force one handling for every call; None = the policy decides
    token_budget: str = "policy"       # "policy" | "static" | "dynamic"
    budget_gamma: float = 1.0
    budget_beta_low: float = 0.25
    budget_beta_high: float = 1.0
    max_model_len: int | None = None   # context limit in tokens (None: unlimited, as in the simulator)
    enable_prefix_caching: bool = True  # share full pages of equal token prefixes (scheduler.prefix_cache)
    prefix_cache_key: str = ""          # model and dtype: caches of different keys never mix
    prefix_retention_s: float = 30.0    # eviction bonus (s) of the context of a request inside an API call
    host_cache: bool = True             # cached pages evicted from the device go to the host pool (when it has
    #                                     pages; Swap's pages come first there): the prefix cache's host tier
    priority_aging_s: float | None = None   # a request waiting in the queue in a class above 0 moves one
    #                                         class lower each time it has waited this many seconds there
    #                                         (since it entered the queue or last moved; None: strict classes)

    def __post_init__(self) -> None:
        if self.token_budget not in TOKEN_BUDGET_MODES:
            raise ValueError(f"token_budget must be one of {TOKEN_BUDGET_MODES}, got {self.token_budget!r}")
        DynamicBudget(self.budget_gamma, self.budget_beta_low, self.budget_beta_high)  # validates
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be > 0")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be > 0")
        if self.swap_budget_tokens <= 0:
            raise ValueError("swap_budget_tokens must be > 0")
        if not self.prefix_retention_s >= 0:
            raise ValueError("prefix_retention_s must be >= 0")
        if self.priority_aging_s is not None and (isinstance(self.priority_aging_s, bool)
                                                  or not 0 < self.priority_aging_s < float("inf")):
            raise ValueError(f"priority_aging_s must be a finite number > 0 or None, got {self.priority_aging_s!r}")
