"""Predictions a ranking policy reads: remaining output length and API duration.

A ``Predictor`` answers from what is known at decision time:

- ``oracle``: the request's declared segments (replay) and explicit ``predictions``;
- ``noisy[:p]``: oracle + Gaussian error with σ = p · value (default p = 0.3),
  seeded and fixed per (request, segment), so the same question gets the same answer;
- ``api-type-mean``: output lengths from the oracle, API durations as the running
  mean of observed durations per API type (``observe_api``);
- ``elapsed``: InferCept's estimate for a call in progress, ``t_now − t_call``;
- ``learned[:DIR]``: output lengths from the engine's length probe (the
  prediction the engine writes on the request), API durations as
  ``api-type-mean``.

``version`` changes whenever a predictor's answers for an unchanged request may
change (``api-type-mean`` after an observation), so policies that cache scores
know when to re-score. Other predictors plug in by subclassing ``Predictor`` and overriding
``segment_output_len``/``total_output_len`` (and bumping ``version`` when
their answers change).
"""

from __future__ import annotations

import hashlib
import math
import random
from typing import ClassVar

from scheduler.request import Request

MAX_MEAN_KEYS = 1024   # API types (or request classes) a running-mean predictor keeps a mean for


def add_to_mean(sums: dict[str, float], counts: dict[str, int], key: str, value: float) -> None:
    """Add ``value`` to the running mean of ``key`` (``sums[key] / counts[key]``). A new key
    beyond ``MAX_MEAN_KEYS`` first drops the key with the fewest observations (the
    oldest of those): API types are callers' strings, and one named afresh per
    request must not grow the tables for as long as the engine runs."""
    if key not in counts and len(counts) >= MAX_MEAN_KEYS:
        rarest = min(counts, key=counts.__getitem__)
        del sums[rarest], counts[rarest]
    sums[key] = sums.get(key, 0.0) + value
    counts[key] = counts.get(key, 0) + 1

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
    grows_while_waiting: ClassVar[bool] = False   # api_duration() of a call in progress grows with t_now

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.version = 0   # bumped when answers for an unchanged request may change

    def segment_output_len(self, request: Request) -> int:
        """Tokens still to generate before the next API call (or the end)."""
        raise NotImplementedError

    def total_output_len(self, request: Request) -> int:
        """Tokens still to generate over the rest of the request."""
        raise NotImplementedError

    def api_duration(self, request: Request, now: float, call_time: float | None) -> float | None:
        """Seconds the next (or current) API call takes; ``None`` when unknown."""
        raise NotImplementedError

    def total_api_duration(self, request: Request, now: float) -> float:
        """Seconds of API calls still ahead of the request (the current segment's and later)."""
        return 0.0

    def observe_api(self, api_type: str, duration_s: float) -> None:
        """Hook: a call of ``api_type`` took ``duration_s``."""

    def observe_output(self, request: Request) -> None:
        """Hook: ``request`` ended a segment (it emitted an API call, or finished)."""


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

    def total_api_duration(self, request: Request, now: float) -> float:
        if request.segments:
            return sum(s.api_duration_s or 0.0 for s in request.segments[request.segment_index:]
                       if s.has_api_call)
        return float(request.predictions.get("api_duration_s") or 0.0)


def _unit_normal(seed: int, request_id: str, segment: int, what: str) -> float:
    """A standard-normal draw fixed by (seed, request, segment, quantity)."""
    digest = hashlib.blake2b(f"{seed}|{request_id}|{segment}|{what}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little")).gauss(0.0, 1.0)


@register_predictor("noisy")
class NoisyPredictor(OraclePredictor):
    """Oracle values times ``1 + p·z`` with ``z ~ N(0, 1)``: error σ = p · value.

    ``z`` is fixed per (seed, request, segment, quantity), so repeated questions
    get the same answer and runs are reproducible. Lengths are rounded and
    clipped at 0 tokens; durations clipped at 0 s. Built as ``"noisy:0.3"``.
    """

    def __init__(self, p: str | float = 0.3, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.p = float(p)
        if not (self.p >= 0 and math.isfinite(self.p)):
            raise ValueError(f"noisy predictor needs a relative error p >= 0, got {p!r}")

    def _noisy(self, value: float, request: Request, segment: int, what: str) -> float:
        if self.p == 0 or value == 0:
            return value
        return max(0.0, value * (1.0 + self.p * _unit_normal(self.seed, request.request_id, segment, what)))

    def segment_output_len(self, request: Request) -> int:
        # Noise on the whole segment length, then subtract progress: the estimate
        # of a segment does not jitter as it is generated.
        seg = request.current_segment
        if seg is not None:
            total = round(self._noisy(seg.num_tokens, request, request.segment_index, "len"))
            return max(0, total - request.segment_generated)
        base = super().segment_output_len(request) + request.num_generated
        return max(0, round(self._noisy(base, request, request.segment_index, "len")) - request.num_generated)

    def total_output_len(self, request: Request) -> int:
        if request.segments:
            rest = self.segment_output_len(request)
            for i in range(request.segment_index + 1, len(request.segments)):
                rest += round(self._noisy(request.segments[i].num_tokens, request, i, "len"))
            return rest
        return self.segment_output_len(request)

    def api_duration(self, request: Request, now: float, call_time: float | None) -> float | None:
        value = super().api_duration(request, now, call_time)
        if value is None:
            return None
        return self._noisy(value, request, request.segment_index, "api")

    def total_api_duration(self, request: Request, now: float) -> float:
        if request.segments:
            return sum(self._noisy(s.api_duration_s or 0.0, request, i, "api")
                       for i, s in enumerate(request.segments[request.segment_index:], request.segment_index)
                       if s.has_api_call)
        return self._noisy(super().total_api_duration(request, now), request, 0, "api")


@register_predictor("api-type-mean")
class ApiTypeMeanPredictor(OraclePredictor):
    """API duration = running mean of the durations observed for its API type
    (``observe_api``); ``default_s`` (0 s unless given as ``"api-type-mean:5"``)
    before the first observation of a type. Output lengths come from the oracle.
    """

    def __init__(self, default_s: str | float = 0.0, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.default_s = float(default_s)
        self._sum: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def mean(self, api_type: str | None) -> float:
        n = self._count.get(api_type, 0)
        return self._sum[api_type] / n if n else self.default_s

    def observe_api(self, api_type: str, duration_s: float) -> None:
        add_to_mean(self._sum, self._count, api_type, duration_s)
        self.version += 1

    def api_duration(self, request: Request, now: float, call_time: float | None) -> float | None:
        seg = request.current_segment
        if seg is not None and seg.has_api_call:
            return self.mean(seg.api_type)
        api_type = request.predictions.get("api_type")
        return self.mean(api_type) if api_type is not None else None

    def total_api_duration(self, request: Request, now: float) -> float:
        return sum(self.mean(s.api_type) for s in request.segments[request.segment_index:] if s.has_api_call)


@register_predictor("elapsed")
class ElapsedPredictor(OraclePredictor):
    """InferCept's estimate for unknown durations: a call in progress is predicted
    to last ``t_now − t_call`` (it grows while the call runs); a call not yet
    started is predicted to take 0 s. Output lengths come from the oracle."""

    grows_while_waiting = True

    def api_duration(self, request: Request, now: float, call_time: float | None) -> float | None:
        return max(0.0, now - call_time) if call_time is not None else 0.0

    def total_api_duration(self, request: Request, now: float) -> float:
        return 0.0


# Keys of ``Request.predictions`` the learned predictor reads.
LEARNED_LEN = "learned_len"            # engine: predicted tokens of the segment that started at ...
LEARNED_FROM = "learned_from"          # ... num_generated == this value
LEARNED_AT_CALL = "learned_at_call"    # ... after this many API calls (a prediction holds for that segment only)
LEARNED_SEGMENT_LENS = "learned_segment_lens"   # simulator: cached prediction per declared segment (or None)
PREDICTION_CLASS = "class"             # running-mean class of a request (e.g. the trace's "math")


@register_predictor("learned")
class LearnedPredictor(ApiTypeMeanPredictor):
    """Output lengths from the learned probe on the served model's hidden state.

    The probe itself runs in the engine (``jaxserve.predictor``; no JAX here):
    the engine writes ``predictions[LEARNED_LEN]`` (tokens) and
    ``predictions[LEARNED_FROM]`` (``num_generated`` then) when a row ends a
    prefill or the recompute after an API return; the simulator puts cached
    per-segment predictions in ``predictions[LEARNED_SEGMENT_LENS]``. The
    remaining length is the prediction minus what the segment generated since.
    Without a prediction (a request not yet prefilled; a token-form trace
    segment, which has no text) the answer is the running mean of observed
    segment lengths of the request's class (``predictions["class"]``, else its
    current API type, else ``"final"``), then of all classes, then
    ``default_len`` (the probe's training mean, set by whoever loads the probe).
    API durations: running mean per API type (``api-type-mean``). The current
    segment only is predicted: ``total_output_len`` equals
    ``segment_output_len`` (later segments' text does not exist yet live).
    Built as ``"learned:DIR"``; ``DIR`` is the probe checkpoint the engine loads.
    """

    def __init__(self, checkpoint: str = "", seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.checkpoint = checkpoint
        self.default_len = 0.0
        self._len_sum: dict[str, float] = {}
        self._len_count: dict[str, int] = {}

    @staticmethod
    def _class(request: Request) -> str:
        seg = request.current_segment
        return str(request.predictions.get(PREDICTION_CLASS)
                   or (seg.api_type if seg is not None and seg.api_type else "final"))

    def class_mean(self, request: Request) -> float:
        key = self._class(request)
        n = self._len_count.get(key, 0)
        if n:
            return self._len_sum[key] / n
        total = sum(self._len_count.values())
        return sum(self._len_sum.values()) / total if total else self.default_len

    def segment_output_len(self, request: Request) -> int:
        p = request.predictions
        cached = p.get(LEARNED_SEGMENT_LENS)
        if cached is not None and request.segment_index < len(cached) and cached[request.segment_index] is not None:
            return max(0, round(cached[request.segment_index]) - request.segment_generated)
        if LEARNED_LEN in p and p.get(LEARNED_AT_CALL, 0) == len(request.api_calls):
            return max(0, round(p[LEARNED_LEN]) - (request.num_generated - int(p.get(LEARNED_FROM, 0))))
        done = request.segment_generated if request.segments else request.num_generated
        return max(0, round(self.class_mean(request)) - done)

    def total_output_len(self, request: Request) -> int:
        return self.segment_output_len(request)

    def observe_output(self, request: Request) -> None:
        if request.segments:
            n = request.segment_generated
        else:
            n = request.num_generated - int(request.predictions.get(LEARNED_FROM, 0))
        add_to_mean(self._len_sum, self._len_count, self._class(request), n)
        self.version += 1
