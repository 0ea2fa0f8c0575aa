"""Predictions a ranking policy reads: remaining output length and API duration.

A ``Predictor`` answers from what is known at decision time; ``oracle`` reads
the request's declared segments (replay) and explicit ``predictions``.
"""

from __future__ import annotations

from typing import ClassVar

from scheduler.request import Request

_REGISTRY: dict[str, type["Predictor"]] = {}


def register_predictor(name: str):
    def deco(cls: type[Predictor]) -> type[Predictor]:
        _REGISTRY[name] = cls
        cls.name = name
        return cls
    return deco


def available_predictors() -> list[str]:
    return sorted(_REGISTRY)


def make_predictor(spec: str, seed: int = 0) -> "Predictor":
    """Build a predictor from ``"name"`` or ``"name:arg"`` (e.g. ``"noisy:0.3"``)."""
    name, _, arg = spec.partition(":")
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown predictor {spec!r}; available: {', '.join(available_predictors())}") from None
    return cls(arg, seed=seed) if arg else cls(seed=seed)


class Predictor:
    name: ClassVar[str] = "base"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def segment_output_len(self, request: Request) -> int:
        """Tokens still to generate before the next API call (or the end)."""
        raise NotImplementedError

    def total_output_len(self, request: Request) -> int:
        """Tokens still to generate over the rest of the request."""
        raise NotImplementedError

    def api_duration(self, request: Request, now: float, call_time: float | None) -> float | None:
        """Seconds the next (or current) API call takes; ``None`` when unknown."""
        raise NotImplementedError

    def observe_api(self, api_type: str, duration_s: float) -> None:
        """Hook: a call of ``api_type`` took ``duration_s``."""


@register_predictor("oracle")
class OraclePredictor(Predictor):
    """Exact values from the declared segments; ``predictions`` override when given."""

    def segment_output_len(self, request: Request) -> int:
        seg = request.current_segment
        if seg is not None:
            return max(0, seg.num_tokens - request.segment_generated)
        if "output_len" in request.predictions:
            return max(0, int(request.predictions["output_len"]) - request.num_generated)
        return max(0, request.max_tokens - request.num_generated)

    def total_output_len(self, request: Request) -> int:
        if request.segments:
            rest = sum(s.num_tokens for s in request.segments[request.segment_index:])
            return max(0, rest - request.segment_generated)
        return self.segment_output_len(request)

    def api_duration(self, request: Request, now: float, call_time: float | None) -> float | None:
        seg = request.current_segment
        if seg is not None and seg.has_api_call:
            return seg.api_duration_s
        return request.predictions.get("api_duration_s")
