"""Replay a workload on the real engine (``jaxserve.LLMEngine``), in wall-clock time.

Each workload item becomes an engine request at its arrival time: a prompt
of ``prompt_len`` synthetic token ids (seeded), ``ignore_eos``, and one
declared ``jaxserve.ApiCall`` per API segment (after the cumulative number
of generated tokens, taking the recorded duration and returning synthetic
tokens). The engine's ``Scheduler`` requests carry the same timing marks as
the simulator's, so the same metrics code reports both.

A trace request whose last segment ends in an API call ends when that call
returns, in the engine (an ``ApiCall`` at ``after_tokens == max_tokens``) as in
the simulator, so both replay the same entries.

Importing this module imports JAX (through the engine).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.replay.plots import RunCurves
from jaxserve.replay.experiment import ReplayConfig, grid, measurement_window, one_line_summary, summarize_run
from jaxserve.replay.metrics import e2e_values
from jaxserve.replay.trace import TraceEntry
from jaxserve.replay.workload import WorkloadItem
from scheduler import CostModel


@dataclass(frozen=True)
class EngineOptions:
    """Engine construction for a replay: the engine settings (pools, limits and
    policy are replaced per run from the ``ReplayConfig``)."""

    engine: EngineConfig = EngineConfig()   # model, dtype, max_model_len, warm-up (pools and policy come per run)
    sample_interval_s: float = 0.25     # occupancy sampling period, wall seconds


def _engine_request(item: WorkloadItem, vocab: int, seed: int):
    """(prompt ids, SamplingParams, ApiCalls) for one workload item."""
    from jaxserve import ApiCall, SamplingParams

    rng = np.random.default_rng([seed, zlib.crc32(item.request_id.encode())])
    low = min(4, vocab - 1)   # stay clear of the special ids at the start of small vocabularies
    ids = rng.integers(low, vocab, size=item.entry.prompt_len).tolist()
    calls, done = [], 0
    for seg in item.entry.segments:
        done += seg.num_tokens
        if seg.has_api_call:
            returned = tuple(rng.integers(low, vocab, size=seg.num_returned_tokens).tolist())
            calls.append(ApiCall(after_tokens=done, duration_s=float(seg.api_duration_s),
                                 returned_token_ids=returned, api_type=seg.api_type))
    params = SamplingParams(max_tokens=done, temperature=0.0, ignore_eos=True)
    return ids, params, calls


def run_engine(entries: Sequence[TraceEntry], config: ReplayConfig, options: EngineOptions,
               cost: CostModel | None = None, progress: bool = True) -> list[RunCurves]:
    """Every (rate, policy, prefix-cache setting) run on a fresh engine; arrivals in wall-clock time.

    The engine's prefix cache follows ``config.prefix_cache`` (one run per
    setting, as the simulator does), not the engine's own default, so a
    comparison with ``simulate`` on the same config recomputes the same tokens.

    ``cost`` (a profile) only sets the SLO's reference step time
    (``T_fwd(max_num_batched_tokens)``); without it the run's own mean step
    time is used.
    """
    from tqdm import tqdm

    from jaxserve import LLMEngine

    sim = config.sim
    runs: list[RunCurves] = []
    for run, cache in ((run, cache) for run in grid(entries, config, suffix=" (engine)")
                       for cache in config.prefix_cache):
        engine = LLMEngine(config=options.engine.replace(
            page_size=sim.page_size, num_pages=sim.num_device_pages, num_host_pages=sim.num_host_pages,
            max_num_batched_tokens=sim.max_num_batched_tokens, max_num_seqs=sim.max_num_seqs,
            policy=run.policy, handling=config.handling.value if config.handling else None,
            predictor=config.predictor, policy_options=dict(config.policy_options), seed=config.seed,
            swap_budget_tokens=sim.swap_budget_tokens, check_invariants=sim.check_invariants,
            enable_prefix_caching=cache))
        try:
            with tqdm(total=len(run.workload), desc=run.label, unit="req", disable=not progress, leave=False,
                      dynamic_ncols=True) as bar:
                requests, t0, end, occupancy = _drive(engine, run.workload, config.seed, options, bar)
        finally:
            engine.shutdown()
        stats = engine.stats
        makespan = end - t0
        # Metrics are relative to arrival; shift to the run's own zero for the window.
        for r in requests:
            _shift(r, -t0)
        window = measurement_window(run.spec, makespan)
        step_s = stats.busy_time_s / stats.steps if stats.steps else 0.0
        batched = engine.scheduler.config.max_num_batched_tokens
        reference = cost.t_fwd(batched) if cost else step_s
        row, per_request = summarize_run(run.policy, run.rate, config, requests, run.kinds, window, makespan,
                                         config.slo(reference))
        row.update({"executor": "engine", "model": engine.config.model, "prefix_cache": cache, "steps": stats.steps,
                    "mean_step_s": step_s, "batched_tokens": stats.batched_tokens,
                    "recomputed_tokens": stats.recomputed_tokens, "steps_by_bucket": stats.steps_by_bucket.as_row(),
                    "busy_fraction": stats.busy_time_s / makespan if makespan > 0 else 0.0,
                    "device_pages": engine.scheduler.device_pool.num_pages,
                    "host_pages": engine.scheduler.host_pool.num_pages, "page_size": sim.page_size,
                    "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
                    "swap_budget_tokens": engine.scheduler.config.swap_budget_tokens})
        times, dev, host = occupancy
        runs.append(RunCurves(run.policy, run.rate, row, e2e_values(per_request), [t - t0 for t in times],
                              [d / engine.scheduler.device_pool.num_pages for d in dev],
                              [h / max(1, engine.scheduler.host_pool.num_pages) for h in host]))
        if progress:
            tqdm.write(one_line_summary(row))
    return runs


def _shift(r, dt: float) -> None:
    r.arrival_time += dt
    for name in ("first_scheduled_time", "first_token_time", "finish_time", "last_scheduled_time"):
        v = getattr(r, name)
        if v is not None:
            setattr(r, name, v + dt)
    for c in r.api_calls:
        c.call_time += dt
        if c.return_time is not None:
            c.return_time += dt
        if c.resume_time is not None:
            c.resume_time += dt


def _drive(engine, workload: Sequence[WorkloadItem], seed: int, options: EngineOptions, bar):
    """Feed arrivals in wall-clock time through the engine loop until every request ends."""
    sched = engine.scheduler
    vocab = engine.model_config.vocab_size
    limit = engine.max_model_len
    t0 = engine.clock.now()
    requests = []
    for w in workload:
        ids, params, calls = _engine_request(w, vocab, seed)
        total = len(ids) + params.max_tokens + sum(len(c.returned_token_ids) for c in calls)
        if total > limit:
            raise ValueError(f"request {w.entry.request_id!r} needs {total} tokens of context but the model "
                             f"allows {limit}; scale the trace down with --token-scale")
        requests.append(engine.make_request(w.request_id, prompt_token_ids=ids, sampling_params=params,
                                            api_calls=calls, parse_tool_calls=False,
                                            arrival_time=t0 + w.arrival_time,
                                            predictions=dict(w.entry.predictions) or None))
    times, dev, host = [], [], []
    next_sample = [t0]

    def observe(now: float) -> None:
        if now >= next_sample[0]:
            times.append(now)
            dev.append(sched.device_pool.num_used)
            host.append(sched.host_pool.num_used)
            next_sample[0] = now + options.sample_interval_s

    def progress(touched) -> None:
        bar.update(sum(1 for r in {id(r): r for r in touched}.values() if r.is_finished))

    total_requests = len(requests)
    engine.core.run(done=lambda: engine.stats.requests == total_requests and not engine.has_unfinished(),
                    arrivals=requests, observe=observe, on_outputs=progress,
                    idle=lambda until: engine.idle(min(until, next_sample[0]) if until is not None else next_sample[0]))
    end = max((r.finish_time for r in requests if r.finish_time is not None), default=engine.clock.now())
    return requests, t0, end, (times, dev, host)
