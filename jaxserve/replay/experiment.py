"""Replay a workload under several policies and rates; collect and write results.

``simulate`` runs the simulator (``jaxserve.replay.simulate``); ``jaxserve.replay.engine_replay``
runs the real engine (imported lazily: it needs JAX). Both produce
``RunCurves`` whose ``row`` is one ``results.json`` object, and
``write_outputs`` writes ``results.json``, ``summary.md`` and the plots.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from jaxserve.replay.metrics import Slo, aggregate, e2e_values, request_metrics, summary_table
from jaxserve.replay.plots import RunCurves, write_plots
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation
from jaxserve.replay.trace import TraceEntry
from jaxserve.replay.workload import WorkloadSpec, make_workload
from scheduler import CostModel, Handling, make_policy, make_predictor


COUNT_MODES = ("in-window", "all")
BY_COUNT_KEYS = ("completed", "mean_e2e_s", "p99_e2e_s", "mean_ttft_s", "p99_ttft_s", "mean_norm_latency_s",
                 "slo_attainment")


@dataclass(frozen=True)
class ReplayConfig:
    """One replay: the cross product ``policies × rates`` over one trace.

    ``rates`` holds ``None`` for ``arrival="trace"``. ``count`` picks the
    requests the latency statistics cover: ``"in-window"`` (default, as the
    papers count: those completed inside the measurement window, see
    ``measurement_window``) or ``"all"`` (every request, the run going on until
    the queue drains); ``results.json`` carries both under ``by_count``. SLOs: TTFT < ``slo_ttft_s``
    and normalized latency < ``slo_norm_latency_s`` (default: ``slo_step_factor``
    × the reference step time, the simulated time of a full step of
    ``max_num_batched_tokens``).
    """

    policies: Sequence[str]
    rates: Sequence[float | None]
    arrival: str = "poisson"
    cv: float = 1.0
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    predictor: str = "oracle"
    handling: Handling | None = None
    policy_options: dict = field(default_factory=dict)
    sim: SimConfig = SimConfig()
    horizon_s: float | None = None
    slo_ttft_s: float = 1.0
    slo_norm_latency_s: float | None = None
    slo_step_factor: float = 10.0
    count: str = "in-window"

    def __post_init__(self) -> None:
        if self.count not in COUNT_MODES:
            raise ValueError(f"count must be one of {', '.join(COUNT_MODES)}, got {self.count!r}")

    def spec(self, rate: float | None) -> WorkloadSpec:
        return WorkloadSpec(self.arrival, rate, self.cv, self.num_requests, self.duration_s, self.seed)

    def slo(self, reference_step_s: float) -> Slo:
        if self.slo_norm_latency_s is not None:
            return Slo(self.slo_ttft_s, self.slo_norm_latency_s)
        return Slo.from_step_time(reference_step_s, self.slo_ttft_s, self.slo_step_factor)


def measurement_window(spec: WorkloadSpec, makespan_s: float) -> float:
    """Seconds over which throughput and goodput count completions: the arrival
    window ``duration_s`` when the workload has one (LAMPS and AugServe count
    the requests completed within their 30-minute runs), else the makespan —
    the time to serve a fixed number of requests (AugServe's 2k-request runs)."""
    if spec.duration_s is not None:
        return spec.duration_s
    return makespan_s


def summarize_run(policy: str, rate: float | None, config: ReplayConfig, requests, kinds: dict[str, str],
                  window_s: float, makespan_s: float, slo: Slo) -> tuple[dict, list]:
    """The results.json row of one run and its per-request metrics."""
    per_request = [request_metrics(r, kinds.get(r.request_id)) for r in requests]
    in_window = [m for m in per_request if m.completed and m.arrival_s + m.e2e_s <= window_s + 1e-9]
    row: dict = {"policy": policy, "rate": rate, "arrival": config.arrival,
                 "cv": config.cv if config.arrival == "gamma" else None,
                 "seed": config.seed, "predictor": config.predictor,
                 "handling": config.handling.value if config.handling else "policy", "count": config.count}
    everything = aggregate(per_request, window_s, slo)
    # Throughput and goodput count only completions inside the measurement window.
    windowed = aggregate(in_window, window_s, slo)
    row.update(windowed if config.count == "in-window" else everything)
    row["requests"] = len(per_request)
    for key in ("throughput_req_s", "throughput_tok_s", "goodput_req_s"):
        row[key] = windowed[key]
    # The handling mix covers every call made, whichever requests the latencies count.
    row["handling_counts"] = everything["handling_counts"]
    row["handling_fallbacks"] = everything["handling_fallbacks"]
    row["api_calls"] = everything["api_calls"]
    calls = max(1, everything["api_calls"])
    row["handling_mix"] = {h: n / calls for h, n in everything["handling_counts"].items()}
    row["by_count"] = {"in-window": {k: windowed[k] for k in BY_COUNT_KEYS},
                       "all": {k: everything[k] for k in BY_COUNT_KEYS}}
    row["completed_in_window"] = windowed["completed"]
    row["window_s"] = window_s
    row["makespan_s"] = makespan_s
    by_kind: dict[str, list[float]] = defaultdict(list)
    for m in per_request:
        if m.completed and m.kind:
            by_kind[m.kind].append(m.e2e_s)
    row["mean_e2e_s_by_kind"] = {k: sum(v) / len(v) for k, v in sorted(by_kind.items())}
    return row, per_request


@dataclass(frozen=True)
class GridRun:
    """One (rate, policy) run of a replay: the rate's workload is shared by every policy."""

    rate: float | None
    policy: str
    spec: WorkloadSpec
    workload: list
    kinds: dict[str, str]
    label: str          # "[i/n] policy @ rate", for the progress bar


def grid(entries: Sequence[TraceEntry], config: ReplayConfig, suffix: str = "") -> Iterator[GridRun]:
    """Every (rate, policy) pair of ``config`` in order, one workload per rate."""
    total = len(config.rates) * len(config.policies)
    index = 0
    for rate in config.rates:
        spec = config.spec(rate)
        workload = make_workload(entries, spec)
        kinds = {w.request_id: w.entry.kind for w in workload}
        for policy_name in config.policies:
            index += 1
            label = f"[{index}/{total}] {policy_name} @ {'trace' if rate is None else format(rate, 'g')}{suffix}"
            yield GridRun(rate, policy_name, spec, workload, kinds, label)


def simulate(entries: Sequence[TraceEntry], cost: CostModel, config: ReplayConfig,
             progress: bool = True) -> list[RunCurves]:
    """Every (rate, policy) run on the simulator; the same workload per rate for every policy."""
    from tqdm import tqdm

    sim = config.sim.resolve(cost)
    reference_step = cost.timed(sim.step_model, sim.step_time_scale).t_step(sim.max_num_batched_tokens)
    slo = config.slo(reference_step)
    runs: list[RunCurves] = []
    for run in grid(entries, config):
        requests = [w.to_request() for w in run.workload]
        predictor = make_predictor(config.predictor, seed=config.seed)
        policy = make_policy(run.policy, predictor=predictor, **config.policy_options)
        sched = build_scheduler(cost, policy, sim)
        with tqdm(total=len(requests), desc=run.label, unit="req", disable=not progress,
                  leave=False, dynamic_ncols=True) as bar:
            def tick(n: int, now: float, bar=bar) -> None:
                bar.update(n)
                bar.set_postfix_str(f"t={now:.0f}s", refresh=False)
            result = run_simulation(sched, requests, horizon_s=config.horizon_s, progress=tick,
                                    sample_interval_s=sim.sample_interval_s,
                                    check_invariants=sim.check_invariants,
                                    prefill_decode_split=sim.prefill_decode_split)
        makespan = result.end_time_s
        window = measurement_window(run.spec, makespan)
        if config.horizon_s is not None:
            window = min(window, config.horizon_s)
        row, per_request = summarize_run(run.policy, run.rate, config, result.requests, run.kinds,
                                         window, makespan, slo)
        row.update({
            "executor": "sim", "profile": cost.name, "step_model": sched.cost.resolved_step_model,
            "step_time_scale": sim.step_time_scale, "prefill_decode_split": sim.prefill_decode_split,
            "steps": result.num_steps, "batched_tokens": result.batched_tokens,
            "mean_step_s": result.mean_step_s, "steps_by_bucket": result.steps_by_bucket.as_row(),
            "busy_fraction": result.busy_time_s / makespan if makespan > 0 else 0.0,
            "swap_stall_s": result.swap_stall_s, "swapped_tokens": result.swapped_tokens,
            "device_pages": result.total_device_pages, "host_pages": result.total_host_pages,
            "page_size": sim.page_size, "max_num_batched_tokens": sim.max_num_batched_tokens,
            "swap_budget_tokens": sim.swap_budget_tokens,
        })
        occ = result.occupancy
        runs.append(RunCurves(
            run.policy, run.rate, row, e2e_values(per_request), occ.time_s,
            [u / result.total_device_pages for u in occ.device_used],
            [u / result.total_host_pages if result.total_host_pages else 0.0 for u in occ.host_used]))
        if progress:
            tqdm.write(one_line_summary(row))
    return runs


def one_line_summary(row: dict) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    rate = "trace" if row["rate"] is None else f"{row['rate']:g}"
    return (f"{row['policy']:>14} @ {rate:>5}: done {row['completed']}/{row['requests']}  "
            f"E2E mean {f(row['mean_e2e_s'], '.2f')} s  TTFT mean {f(row['mean_ttft_s'], '.3f')} s  "
            f"goodput {f(row['goodput_req_s'], '.3f')} req/s")


def _clean(value):
    """JSON-safe: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_outputs(runs: Sequence[RunCurves], out_dir: str | Path, title: str = "",
                  plots: bool = True) -> dict[str, Path]:
    """``results.json`` (one object per run), ``summary.md`` (the side-by-side
    table) and the PNG plots; returns the paths written by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [_clean(r.row) for r in runs]
    paths = {"results": out / "results.json", "summary": out / "summary.md"}
    paths["results"].write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n")
    table = summary_table(rows)
    head = f"# Replay summary{': ' + title if title else ''}\n\n"
    notes = ("\nE2E/TTFT/normalized latency over completed requests; throughput and goodput count "
             "completions inside the arrival window (--duration; else the makespan). "
             "P/D/S: API calls handled by Preserve/Discard/Swap.\n")
    paths["summary"].write_text(head + table + "\n" + notes)
    if plots:
        for p in write_plots(runs, out):
            paths[p.stem] = p
    return paths
