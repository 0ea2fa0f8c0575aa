"""Workloads: which trace entries arrive, and when.

Arrivals are Poisson at a rate, Gamma with a coefficient of variation (bursty
when ``cv > 1``; ``cv = 1`` is Poisson), or the trace's own ``arrival_time``s.
Entries are sampled with replacement, as the original InferCept driver did
(it drew ``4 · qps · window`` keys and sent them with Poisson gaps for a
``window``-second run; here the draw stops at the window or at a fixed count,
which is the same distribution).

A fixed seed gives an identical workload: the entry sample and the arrival
gaps come from two ``numpy.random.Generator`` streams derived from the seed,
so the same seed also gives the same entry sequence at every rate.

``batch_share``: that fraction of the arrivals (drawn from a third stream) is
batch work, in priority class 1 (``Request.priority``); the others keep their
entry's class (0 unless the trace gives one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from jaxserve.replay.trace import TraceEntry
from scheduler import Request

ARRIVALS = ("poisson", "gamma", "trace")


BATCH_PRIORITY = 1   # the class of the arrivals ``batch_share`` marks as batch work


@dataclass(frozen=True, slots=True)
class WorkloadItem:
    """One arrival: a fresh ``request_id`` for ``entry`` arriving at ``arrival_time`` (s),
    in priority class ``priority``."""

    request_id: str
    arrival_time: float
    entry: TraceEntry
    priority: int = 0

    def to_request(self) -> Request:
        return self.entry.to_request(self.request_id, self.arrival_time, self.priority)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How to draw a workload. Exactly one of ``num_requests``/``duration_s``
    bounds it, except for ``arrival="trace"`` where both are optional caps."""

    arrival: str = "poisson"
    rate: float | None = None          # requests per second (poisson, gamma)
    cv: float = 1.0                    # gamma: coefficient of variation of the gaps
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    batch_share: float = 0.0           # fraction of arrivals in class ``BATCH_PRIORITY``

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {self.arrival!r}")
        if self.arrival != "trace":
            if self.rate is None or not self.rate > 0:
                raise ValueError(f"{self.arrival} arrivals need a rate > 0, got {self.rate!r}")
            if (self.num_requests is None) == (self.duration_s is None):
                raise ValueError("give exactly one of num_requests or duration_s")
        if self.arrival == "gamma" and not self.cv > 0:
            raise ValueError(f"gamma arrivals need cv > 0, got {self.cv!r}")
        if self.num_requests is not None and self.num_requests <= 0:
            raise ValueError(f"num_requests must be > 0, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration_s}")
        if not 0.0 <= self.batch_share <= 1.0:
            raise ValueError(f"batch share must be in [0, 1], got {self.batch_share!r}")


def _streams(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    """(entry sampling, arrival gaps) — independent streams of one seed."""
    return np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])


def _gaps(rng: np.random.Generator, spec: WorkloadSpec, n: int) -> np.ndarray:
    mean = 1.0 / spec.rate
    if spec.arrival == "poisson":
        return rng.exponential(mean, n)
    shape = 1.0 / (spec.cv ** 2)          # Gamma(k, θ): mean kθ, CV 1/sqrt(k)
    return rng.gamma(shape, mean / shape, n)


def arrival_times(spec: WorkloadSpec) -> np.ndarray:
    """Arrival times in seconds (first at its gap after 0), for poisson/gamma."""
    _, rng = _streams(spec.seed)
    if spec.num_requests is not None:
        return np.cumsum(_gaps(rng, spec, spec.num_requests))
    out: list[np.ndarray] = []
    t = 0.0
    block = max(64, int(spec.rate * spec.duration_s * 1.2) + 16)
    while True:
        times = t + np.cumsum(_gaps(rng, spec, block))
        keep = times[times < spec.duration_s]
        out.append(keep)
        if len(keep) < block:
            return np.concatenate(out)
        t = float(times[-1])


def make_workload(entries: Sequence[TraceEntry], spec: WorkloadSpec) -> list[WorkloadItem]:
    """The arrivals of ``spec`` over ``entries``, sorted by time."""
    if not entries:
        raise ValueError("the trace has no requests")
    if spec.arrival == "trace":
        items = _trace_workload(entries, spec)
    else:
        times = arrival_times(spec)
        pick_rng, _ = _streams(spec.seed)
        picks = pick_rng.integers(0, len(entries), size=len(times))
        width = max(5, len(str(len(times))))
        items = [WorkloadItem(f"{i:0{width}d}-{entries[k].request_id}", float(t), entries[k], entries[k].priority)
                 for i, (t, k) in enumerate(zip(times.tolist(), picks.tolist()))]
    if not items:
        window = "in its first --num-requests" if spec.duration_s is None else f"within {spec.duration_s:g} s"
        raise ValueError(f"no request arrives {window}: lengthen --duration or raise the rate")
    if spec.batch_share > 0:
        batch = np.random.default_rng([spec.seed, 2]).random(len(items)) < spec.batch_share
        items = [replace(w, priority=BATCH_PRIORITY) if b else w for w, b in zip(items, batch.tolist())]
    return items


def _trace_workload(entries: Sequence[TraceEntry], spec: WorkloadSpec) -> list[WorkloadItem]:
    missing = [e.request_id for e in entries if e.arrival_time is None]
    if missing:
        raise ValueError(f"--arrival trace needs an arrival_time on every request; "
                         f"{len(missing)} have none (first: {missing[0]!r})")
    items = sorted(entries, key=lambda e: e.arrival_time)
    if spec.duration_s is not None:
        items = [e for e in items if e.arrival_time < spec.duration_s]
    if spec.num_requests is not None:
        items = items[:spec.num_requests]
    return [WorkloadItem(e.request_id, float(e.arrival_time), e, e.priority) for e in items]
