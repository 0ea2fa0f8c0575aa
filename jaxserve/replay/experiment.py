"""Replay a workload under several policies and rates; collect and write results.

``simulate`` runs the simulator (``jaxserve.replay.simulate``); ``jaxserve.replay.engine_replay``
runs the real engine (imported lazily: it needs JAX). Both produce
``RunCurves`` whose ``row`` is one ``results.json`` object, and
``write_outputs`` writes ``results.json``, ``summary.md`` and the plots.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from jaxserve.replay.metrics import Slo, aggregate, e2e_values, request_metrics, summary_table
from jaxserve.replay.page_keys import PageNamer
from jaxserve.replay.plots import PLOT_FILES, RunCurves, write_plots
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation
from jaxserve.replay.trace import TraceEntry
from jaxserve.replay.workload import WorkloadSpec, make_workload
from scheduler import CostModel, Handling, Request, make_policy, make_predictor


COUNT_MODES = ("in-window", "all")
MODES = ("requests", "resend")
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

    ``mode``: ``"requests"`` (each trace request is one request that pauses for
    its API calls) or ``"resend"`` (each segment is a new request carrying the
    whole conversation, ``jaxserve.replay.cluster``). ``prefix_cache``: one run
    per value (cache off/on side by side). ``replicas`` and ``routers``
    (re-send mode): one run per router over that many simulated replicas.
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
    mode: str = "requests"
    prefix_cache: Sequence[bool] = (False,)
    replicas: int = 1
    routers: Sequence[str] = ("round_robin",)
    batch_share: float = 0.0   # fraction of arrivals in priority class 1 (``WorkloadSpec.batch_share``)

    def __post_init__(self) -> None:
        from jaxserve.replay.cluster import ROUTERS

        if self.count not in COUNT_MODES:
            raise ValueError(f"count must be one of {', '.join(COUNT_MODES)}, got {self.count!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.prefix_cache:
            raise ValueError("prefix_cache needs at least one setting (False, True)")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        if self.replicas > 1 and self.mode != "resend":
            raise ValueError("several replicas are simulated in re-send mode only (--mode resend)")
        unknown = [r for r in self.routers if r not in ROUTERS]
        if unknown or not self.routers:
            raise ValueError(f"unknown router {', '.join(unknown) or '(none)'}; available: {', '.join(ROUTERS)}")

    def spec(self, rate: float | None) -> WorkloadSpec:
        return WorkloadSpec(self.arrival, rate, self.cv, self.num_requests, self.duration_s, self.seed,
                            self.batch_share)

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
    row["prompt_tokens"] = sum(r.prompt_len for r in requests)
    row["cached_prompt_tokens"] = sum(r.num_cached_tokens for r in requests)
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

    def page_names(self, page_size: int) -> Callable[[Request], list]:
        """Prefix-cache page names for this run's requests (``jaxserve.replay.page_keys``):
        a Mooncake entry's from its ``block_ids``, any other request's of its own."""
        namer = PageNamer(page_size)
        blocks = {w.request_id: w.entry for w in self.workload if w.entry.block_ids is not None}

        def name(request: Request) -> list:
            entry = blocks.get(request.request_id)
            if entry is None:
                return namer.fresh(request)
            return namer.blocks(entry.block_ids, entry.prompt_len, request.prompt_len + request.max_tokens)
        return name


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
        for cache in config.prefix_cache:
            for router in (config.routers if config.mode == "resend" else (None,)):
                runs.append(_simulate_one(run, cache, router, cost, config, sim, slo, progress))
                if progress:
                    tqdm.write(one_line_summary(runs[-1].row))
    return runs


def _simulate_one(run: GridRun, cache: bool, router: str | None, cost: CostModel, config: ReplayConfig,
                  sim: SimConfig, slo: Slo, progress: bool) -> RunCurves:
    """One simulated run (prefix cache ``cache``; ``router`` in re-send mode)."""
    from tqdm import tqdm

    from jaxserve.replay.cluster import run_resend

    sim = dataclasses.replace(sim, enable_prefix_caching=cache)

    def scheduler():
        predictor = make_predictor(config.predictor, seed=config.seed)
        return build_scheduler(cost, make_policy(run.policy, predictor=predictor, **config.policy_options), sim)

    label = run.label + (" cache" if cache else "") + (f" {router}" if router and config.replicas > 1 else "")
    total = len(run.workload) if config.mode == "requests" else sum(len(w.entry.segments) for w in run.workload)
    with tqdm(total=total, desc=label, unit="req", disable=not progress, leave=False, dynamic_ncols=True) as bar:
        def tick(n: int, now: float) -> None:
            bar.update(n)
            bar.set_postfix_str(f"t={now:.0f}s", refresh=False)
        if config.mode == "resend":
            schedulers = [scheduler() for _ in range(config.replicas)]
            result = run_resend(schedulers, run.workload, router, horizon_s=config.horizon_s,
                                check_invariants=sim.check_invariants, progress=tick)
            kinds = {r.request_id: run.kinds.get(r.request_id.rpartition("/")[0]) for r in result.requests}
        else:
            names = run.page_names(sim.page_size) if cache else None
            schedulers = [scheduler()]
            result = run_simulation(schedulers[0], [w.to_request() for w in run.workload],
                                    horizon_s=config.horizon_s, progress=tick,
                                    sample_interval_s=sim.sample_interval_s,
                                    check_invariants=sim.check_invariants,
                                    prefill_decode_split=sim.prefill_decode_split, page_names=names)
            kinds = run.kinds
    makespan = result.end_time_s
    window = measurement_window(run.spec, makespan)
    if config.horizon_s is not None:
        window = min(window, config.horizon_s)
    row, per_request = summarize_run(run.policy, run.rate, config, result.requests, kinds, window, makespan, slo)
    row.update({
        "executor": "sim", "profile": cost.name, "step_model": schedulers[0].cost.resolved_step_model,
        "step_time_scale": sim.step_time_scale, "prefill_decode_split": sim.prefill_decode_split,
        "mode": config.mode, "prefix_cache": cache, "replicas": config.replicas, "router": router,
        "steps": result.num_steps, "batched_tokens": result.batched_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "mean_step_s": result.busy_time_s / result.num_steps if result.num_steps else 0.0,
        "page_size": sim.page_size, "max_num_batched_tokens": sim.max_num_batched_tokens,
        "swap_budget_tokens": sim.swap_budget_tokens,
    })
    if any(w.entry.block_ids is not None for w in run.workload):
        row.update(_block_trace_totals(run, row, sim.num_device_pages * sim.page_size))
    if config.mode == "resend":
        row.update({"affinity_hit_rate": result.affinity_hit_rate, "follow_ups": result.follow_ups,
                    "follow_ups_same_replica": result.follow_ups_same_replica,
                    "requests_by_replica": result.requests_by_replica,
                    "busy_fraction": result.busy_time_s / (makespan * config.replicas) if makespan > 0 else 0.0})
        return RunCurves(run.policy, run.rate, row, e2e_values(per_request), [], [], [])
    row.update({
        "steps_by_bucket": result.steps_by_bucket.as_row(),
        "busy_fraction": result.busy_time_s / makespan if makespan > 0 else 0.0,
        "swap_stall_s": result.swap_stall_s, "swapped_tokens": result.swapped_tokens,
        "device_pages": result.total_device_pages, "host_pages": result.total_host_pages,
    })
    occ = result.occupancy
    return RunCurves(run.policy, run.rate, row, e2e_values(per_request), occ.time_s,
                     [u / result.total_device_pages for u in occ.device_used],
                     [u / result.total_host_pages if result.total_host_pages else 0.0 for u in occ.host_used])


def _block_trace_totals(run: GridRun, row: dict, capacity_tokens: int) -> dict:
    """A Mooncake run's cached share of input tokens next to the trace's bounds
    (``jaxserve.replay.mooncake.cache_bounds`` at the device pool's capacity), and
    its recomputed tokens counting the input an earlier request had computed
    (the unbounded cache's hits) but this run did not serve from the cache."""
    from jaxserve.replay.mooncake import cache_bounds

    bounds = cache_bounds([w.entry for w in run.workload], capacity_tokens)
    cached = row["cached_prompt_tokens"]
    return {"cached_share": cached / bounds.input_tokens if bounds.input_tokens else 0.0,
            "bound_infinite_share": bounds.infinite_share, "bound_lru_share": bounds.lru_share,
            "bound_lru_capacity_tokens": bounds.capacity_tokens,
            "recomputed_tokens": row["recomputed_tokens"] + max(0, bounds.infinite_tokens - cached)}


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


OUTPUT_FILES = ("results.json", "summary.md", *PLOT_FILES)


def write_outputs(runs: Sequence[RunCurves], out_dir: str | Path, title: str = "",
                  plots: bool = True) -> dict[str, Path]:
    """``results.json`` (one object per run), ``summary.md`` (the side-by-side
    table) and the PNG plots; returns the paths written by name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [_clean(r.row) for r in runs]
    paths = {"results": out / OUTPUT_FILES[0], "summary": out / OUTPUT_FILES[1]}
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
