"""Sampling parameters of a request, validated at the edge (no JAX here, so
``import jaxserve`` and the simulator stay light)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.constraints import StructuredOutput


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``seed`` makes sampling reproducible per request: the same
    seed gives the same tokens whether the request runs alone or in a batch.
    ``max_tokens`` counts generated tokens only (not API-returned ones).
    ``structured`` constrains the output (JSON Schema, JSON object, forced tool
    call; see ``jaxserve.constraints``); a constraint that cannot be completed
    within ``max_tokens`` ends with ``finish_reason == "length"``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError("structured must be a jaxserve.StructuredOutput")
            self.structured.validate()
