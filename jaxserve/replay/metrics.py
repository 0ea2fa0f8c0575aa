"""Per-request and aggregate serving metrics (DESIGN section 9).

Everything is computed from the timing marks a ``scheduler.Request`` carries
(``arrival_time``, ``first_scheduled_time``, ``first_token_time``,
``finish_time``, ``api_calls``, ``num_preemptions``, ``num_generated``), so the
simulator and the real engine share this code. Times are seconds.

* E2E latency = finish − arrival.
* TTFT = first token − arrival (includes queueing).
* Queueing time = first scheduled − arrival.
* API time = Σ (return − call) over the request's calls.
* Normalized latency = (E2E − API time) / generated tokens (the original
  driver's definition: the system is not charged for the API itself).
* TPOT = (E2E − TTFT − API time) / (generated tokens − 1).
* Goodput = completed requests meeting the SLOs (TTFT < ``ttft_s`` and
  normalized latency < ``norm_latency_s``) per second of the run.

When requests of several priority classes ran (``Request.priority``), the
aggregates also give each class's TTFT and E2E mean and p99
(``mean_ttft_s_class<N>``, ...), and its completed requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from scheduler import Handling, Request

DEFAULT_SLO_TTFT_S = 1.0
DEFAULT_SLO_STEP_FACTOR = 10.0


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    request_id: str
    kind: str | None
    completed: bool
    arrival_s: float
    e2e_s: float | None
    ttft_s: float | None
    queueing_s: float | None
    api_s: float
    norm_latency_s: float | None
    tpot_s: float | None
    generated_tokens: int
    num_api_calls: int
    preemptions: int
    handlings: tuple[str, ...]
    fallbacks: int
    priority: int = 0   # the class it arrived in (aging may have moved it lower since)


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives for goodput: TTFT and normalized latency, seconds."""

    ttft_s: float = DEFAULT_SLO_TTFT_S
    norm_latency_s: float = math.inf

    @classmethod
    def from_step_time(cls, step_s: float, ttft_s: float = DEFAULT_SLO_TTFT_S,
                       factor: float = DEFAULT_SLO_STEP_FACTOR) -> "Slo":
        """AugServe's default: TTFT < 1 s and normalized latency < ``factor`` × step time."""
        return cls(ttft_s=ttft_s, norm_latency_s=factor * step_s)

    def met(self, m: RequestMetrics) -> bool:
        return (m.completed and m.ttft_s is not None and m.ttft_s < self.ttft_s
                and m.norm_latency_s is not None and m.norm_latency_s < self.norm_latency_s)


def request_metrics(r: Request, kind: str | None = None) -> RequestMetrics:
    """Metrics of one request (``completed`` only when it finished normally)."""
    completed = r.finish_time is not None and r.finish_reason != "abort"
    api_s = sum(c.return_time - c.call_time for c in r.api_calls if c.return_time is not None)
    e2e = r.finish_time - r.arrival_time if completed else None
    ttft = r.first_token_time - r.arrival_time if r.first_token_time is not None else None
    queueing = r.first_scheduled_time - r.arrival_time if r.first_scheduled_time is not None else None
    gen = r.num_generated
    norm = (e2e - api_s) / gen if e2e is not None and gen > 0 else None
    tpot = (e2e - ttft - api_s) / (gen - 1) if e2e is not None and ttft is not None and gen > 1 else None
    handlings = tuple(c.handling.value for c in r.api_calls)
    fallbacks = sum(1 for c in r.api_calls if c.fell_back_from is not None)
    return RequestMetrics(r.request_id, kind, completed, r.arrival_time, e2e, ttft, queueing, api_s,
                          norm, tpot, gen, len(r.api_calls), r.num_preemptions, handlings, fallbacks,
                          r.priority + r.priority_aged)


def _stats(values: Sequence[float], prefix: str, out: dict, p50: bool = True) -> None:
    if values:
        a = np.asarray(values, dtype=np.float64)
        out[f"mean_{prefix}"] = float(a.mean())
        if p50:
            out[f"p50_{prefix}"] = float(np.percentile(a, 50))
        out[f"p99_{prefix}"] = float(np.percentile(a, 99))
    else:
        out[f"mean_{prefix}"] = None
        if p50:
            out[f"p50_{prefix}"] = None
        out[f"p99_{prefix}"] = None


def aggregate(metrics: Iterable[RequestMetrics], duration_s: float, slo: Slo) -> dict:
    """Aggregates over a run lasting ``duration_s`` (throughput denominators).

    Latency statistics are over completed requests; ``requests`` counts every
    request of the workload.
    """
    ms = list(metrics)
    done = [m for m in ms if m.completed]
    out: dict = {"requests": len(ms), "completed": len(done)}
    _stats([m.e2e_s for m in done], "e2e_s", out)
    _stats([m.ttft_s for m in done], "ttft_s", out)
    _stats([m.norm_latency_s for m in done if m.norm_latency_s is not None], "norm_latency_s", out)
    _stats([m.tpot_s for m in done if m.tpot_s is not None], "tpot_s", out)
    _stats([m.queueing_s for m in done if m.queueing_s is not None], "queueing_s", out)
    good = sum(1 for m in done if slo.met(m))
    tokens = sum(m.generated_tokens for m in done)
    out["throughput_req_s"] = len(done) / duration_s if duration_s > 0 else None
    out["throughput_tok_s"] = tokens / duration_s if duration_s > 0 else None
    out["goodput_req_s"] = good / duration_s if duration_s > 0 else None
    out["slo_attainment"] = good / len(done) if done else None
    out["slo_ttft_s"] = slo.ttft_s
    out["slo_norm_latency_s"] = None if math.isinf(slo.norm_latency_s) else slo.norm_latency_s
    out["preemptions"] = sum(m.preemptions for m in ms)
    counts = {h.value: 0 for h in Handling}
    for m in ms:
        for h in m.handlings:
            counts[h] = counts.get(h, 0) + 1
    out["handling_counts"] = counts
    out["handling_fallbacks"] = sum(m.fallbacks for m in ms)
    out["api_calls"] = sum(m.num_api_calls for m in ms)
    out["duration_s"] = duration_s
    classes = sorted({m.priority for m in ms})
    if classes != [0] and classes:
        for c in classes:
            mine = [m for m in done if m.priority == c]
            out[f"completed_class{c}"] = len(mine)
            _stats([m.ttft_s for m in mine], f"ttft_s_class{c}", out, p50=False)
            _stats([m.e2e_s for m in mine], f"e2e_s_class{c}", out, p50=False)
    return out


def e2e_values(metrics: Iterable[RequestMetrics]) -> list[float]:
    return [m.e2e_s for m in metrics if m.completed]


# ------------------------------------------------------------------ tables
SUMMARY_COLUMNS = (
    ("policy", "policy", "{}"),
    ("rate", "rate", "{}"),
    ("cache", "prefix_cache", "{}"),
    ("router", "router", "{}"),
    ("done", "completed", "{}"),
    ("E2E mean s", "mean_e2e_s", "{:.2f}"),
    ("E2E p99 s", "p99_e2e_s", "{:.2f}"),
    ("TTFT mean s", "mean_ttft_s", "{:.3f}"),
    ("TTFT p99 s", "p99_ttft_s", "{:.2f}"),
    ("norm lat s/tok", "mean_norm_latency_s", "{:.4f}"),
    ("TPOT ms", "mean_tpot_s", "{:.1f}"),
    ("thru req/s", "throughput_req_s", "{:.3f}"),
    ("goodput req/s", "goodput_req_s", "{:.3f}"),
    ("preempt", "preemptions", "{}"),
    ("recomputed tok", "recomputed_tokens", "{}"),
    ("cached prompt tok", "cached_prompt_tokens", "{}"),
    ("P/D/S", "handling_counts", "{}"),
)


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return "-"
    if key == "handling_counts":
        return f"{v.get('preserve', 0)}/{v.get('discard', 0)}/{v.get('swap', 0)}"
    if key == "prefix_cache":
        return "on" if v else "off"
    if key == "mean_tpot_s":
        return fmt.format(v * 1e3)
    if key == "rate" and isinstance(v, float):
        return f"{v:g}"
    return fmt.format(v)


def _class_columns(rows: Sequence[dict]) -> list[tuple[str, str, str]]:
    """Columns of each priority class's TTFT and E2E means, for the classes the rows have."""
    classes = sorted({int(k.removeprefix("completed_class")) for r in rows for k in r if k.startswith("completed_class")})
    return [col for c in classes for col in ((f"TTFT mean s, class {c}", f"mean_ttft_s_class{c}", "{:.3f}"),
                                             (f"E2E mean s, class {c}", f"mean_e2e_s_class{c}", "{:.2f}"))]


def summary_table(rows: Sequence[dict]) -> str:
    """A Markdown table of ``results.json`` rows, grouped by rate then policy."""
    columns = list(SUMMARY_COLUMNS) + _class_columns(rows)
    header = [c[0] for c in columns]
    body = [[_cell(r, key, fmt) for _, key, fmt in columns] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.rjust(w) if i > 0 else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))) + " |"
              for b in body]
    return "\n".join(lines)


