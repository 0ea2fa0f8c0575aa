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

Re-send mode (``ReplayConfig.mode == "resend"``, as ``jaxserve.replay.cluster``
simulates it): each segment arrives as a new request carrying the whole
conversation so far — the first prompt, every earlier segment's generated
tokens and every earlier API return — and generates that segment's tokens; the
next segment arrives when this one finished plus the call's duration. The
follow-ups are real token ids, so the engine's prefix cache finds the earlier
turns by hashing them, as it would for an OpenAI client re-sending its history.

Importing this module imports JAX (through the engine).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.replay.plots import RunCurves
from jaxserve.replay.experiment import ReplayConfig, grid, measurement_window, one_line_summary, summarize_run
from jaxserve.replay.metrics import e2e_values
from jaxserve.replay.page_keys import MOONCAKE_BLOCK_TOKENS
from jaxserve.replay.trace import TraceEntry
from jaxserve.replay.workload import WorkloadItem
from scheduler import CostModel


@dataclass(frozen=True)
class EngineOptions:
    """Engine construction for a replay: the engine settings (pools, limits and
    policy are replaced per run from the ``ReplayConfig``)."""

    engine: EngineConfig = EngineConfig()   # model, dtype, max_model_len, warm-up (pools and policy come per run)
    sample_interval_s: float = 0.25     # occupancy sampling period, wall seconds


class _SyntheticTokens:
    """Seeded token ids for one workload item: its prompt first, then each API return in turn.
    A Mooncake request's prompt is its 512-token blocks, each drawn from a seed of the chain
    of block ids up to it, so equal chains are equal tokens (the pages the simulator names
    alike, ``PageNamer.blocks``, hash alike in the engine's prefix cache)."""

    def __init__(self, item: WorkloadItem, vocab: int, seed: int) -> None:
        self.item, self.seed = item, seed
        self.rng = np.random.default_rng([seed, zlib.crc32(item.request_id.encode())])
        self.low, self.vocab = min(4, vocab - 1), vocab   # clear of small vocabularies' special ids

    def draw(self, n: int) -> list[int]:
        return self.rng.integers(self.low, self.vocab, size=n).tolist()

    def prompt(self) -> list[int]:
        entry = self.item.entry
        ids: list[int] = []
        chain = hashlib.blake2b(digest_size=8)   # (of the block ids so far: any integers, negative too)
        for block_id in entry.block_ids or ():
            if len(ids) >= entry.prompt_len:
                break
            chain.update(f"{block_id},".encode())
            block = np.random.default_rng([self.seed, int.from_bytes(chain.digest(), "little")])
            ids += block.integers(self.low, self.vocab, size=MOONCAKE_BLOCK_TOKENS).tolist()
        return ids[:entry.prompt_len] + self.draw(max(0, entry.prompt_len - len(ids)))


def _engine_request(item: WorkloadItem, vocab: int, seed: int):
    """(prompt ids, SamplingParams, ApiCalls) for one workload item."""
    from jaxserve import ApiCall, SamplingParams

    tokens = _SyntheticTokens(item, vocab, seed)
    ids = tokens.prompt()
    calls, done = [], 0
    for seg in item.entry.segments:
        done += seg.num_tokens
        if seg.has_api_call:
            returned = tuple(tokens.draw(seg.num_returned_tokens))
            calls.append(ApiCall(after_tokens=done, duration_s=float(seg.api_duration_s),
                                 returned_token_ids=returned, api_type=seg.api_type))
    # (the simulator's cap too, ``TraceEntry.max_tokens``: the original driver's; calls past it never come)
    max_tokens = min(done, item.entry.max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return ids, params, [call for call in calls if call.after_tokens <= max_tokens]


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
                drive = _drive_resend if config.mode == "resend" else _drive
                requests, t0, end, occupancy, follow_ups = drive(engine, run.workload, config.seed, options, bar)
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
        kinds = run.kinds if config.mode != "resend" else \
            {r.request_id: run.kinds.get(r.request_id.rpartition("/")[0]) for r in requests}
        row, per_request = summarize_run(run.policy, run.rate, config, requests, kinds, window, makespan,
                                         config.slo(reference))
        # A re-sent turn recomputes the context its predecessor computed, less what it found cached.
        resent_uncached = sum(max(0, prev.max_computed_tokens - r.num_cached_tokens)
                              for r, prev in follow_ups if r.first_scheduled_time is not None)
        row.update({"executor": "engine", "model": engine.config.model, "mode": config.mode, "prefix_cache": cache,
                    "steps": stats.steps, "mean_step_s": step_s, "batched_tokens": stats.batched_tokens,
                    "recomputed_tokens": stats.recomputed_tokens + resent_uncached,
                    "steps_by_bucket": stats.steps_by_bucket.as_row(),
                    "busy_fraction": stats.busy_time_s / makespan if makespan > 0 else 0.0,
                    "device_pages": engine.scheduler.device_pool.num_pages,
                    "host_pages": engine.scheduler.host_pool.num_pages, "page_size": sim.page_size,
                    "max_num_batched_tokens": engine.scheduler.config.max_num_batched_tokens,
                    "swap_budget_tokens": engine.scheduler.config.swap_budget_tokens})
        if config.mode == "resend":
            row.update({"follow_ups": len(follow_ups),
                        "affinity_hit_rate": (sum(r.num_cached_tokens > 0 for r, _ in follow_ups) / len(follow_ups)
                                              if follow_ups else None)})
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


def _check_fits(engine, item: WorkloadItem, total: int) -> None:
    if total > engine.max_model_len:
        raise ValueError(f"request {item.entry.request_id!r} needs {total} tokens of context but the model "
                         f"allows {engine.max_model_len}; scale the trace down with --token-scale")


class _Occupancy:
    """Pages in use, sampled every ``interval_s`` of the run (wall seconds)."""

    def __init__(self, engine, interval_s: float) -> None:
        self.sched, self.interval_s = engine.scheduler, interval_s
        self.times: list[float] = []
        self.device: list[int] = []
        self.host: list[int] = []
        self.next_at = engine.clock.now()

    def observe(self, now: float) -> None:
        if now >= self.next_at:
            self.times.append(now)
            self.device.append(self.sched.device_pool.num_used)
            self.host.append(self.sched.host_pool.num_used)
            self.next_at = now + self.interval_s

    @property
    def curves(self) -> tuple[list[float], list[int], list[int]]:
        return self.times, self.device, self.host


def _finished(touched) -> list:
    """The requests a pass finished, each once."""
    return [r for r in {id(r): r for r in touched}.values() if r.is_finished]


def _drive(engine, workload: Sequence[WorkloadItem], seed: int, options: EngineOptions, bar):
    """Feed arrivals in wall-clock time through the engine loop until every request ends."""
    vocab = engine.model_config.vocab_size
    t0 = engine.clock.now()
    requests = []
    for w in workload:
        ids, params, calls = _engine_request(w, vocab, seed)
        _check_fits(engine, w, len(ids) + params.max_tokens + sum(len(c.returned_token_ids) for c in calls))
        requests.append(engine.make_request(w.request_id, prompt_token_ids=ids, sampling_params=params,
                                            api_calls=calls, parse_tool_calls=False, parse_reasoning=False,
                                            arrival_time=t0 + w.arrival_time,
                                            predictions=dict(w.entry.predictions) or None, priority=w.priority))
    occupancy = _Occupancy(engine, options.sample_interval_s)
    total_requests = len(requests)
    engine.core.run(done=lambda: engine.stats.requests == total_requests and not engine.has_unfinished(),
                    arrivals=requests, observe=occupancy.observe,
                    on_outputs=lambda touched: bar.update(len(_finished(touched))),
                    idle=lambda until: engine.idle(min(until, occupancy.next_at) if until is not None
                                                   else occupancy.next_at))
    end = max((r.finish_time for r in requests if r.finish_time is not None), default=engine.clock.now())
    return requests, t0, end, occupancy.curves, []


def _drive_resend(engine, workload: Sequence[WorkloadItem], seed: int, options: EngineOptions, bar):
    """Re-send mode (module doc): segment ``k`` of a conversation arrives as request
    ``"<id>/<k>"`` whose prompt is the conversation so far; a trailing API call
    (after the last segment) has nothing left to generate and is dropped. Returns
    also the (follow-up, predecessor) pairs."""
    from jaxserve import SamplingParams

    vocab = engine.model_config.vocab_size
    t0 = engine.clock.now()
    requests, follow_ups = [], []
    pending: list[tuple[float, int, object]] = []   # (arrival time, tie-break, request) of follow-ups
    turn_of: dict[str, tuple[WorkloadItem, int, _SyntheticTokens]] = {}
    total = sum(len(w.entry.segments) for w in workload)

    def segment_request(item: WorkloadItem, k: int, ids: list[int], at: float, synthetic: _SyntheticTokens):
        tokens = item.entry.segments[k].num_tokens
        _check_fits(engine, item, len(ids) + tokens)
        request = engine.make_request(f"{item.request_id}/{k}", prompt_token_ids=ids, parse_tool_calls=False,
                                      parse_reasoning=False,
                                      sampling_params=SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                     ignore_eos=True),
                                      arrival_time=at, predictions=dict(item.entry.predictions) or None,
                                      priority=item.priority)
        turn_of[request.request_id] = (item, k, synthetic)
        requests.append(request)
        return request

    first = []
    for w in workload:
        synthetic = _SyntheticTokens(w, vocab, seed)
        first.append(segment_request(w, 0, synthetic.prompt(), t0 + w.arrival_time, synthetic))
    order = itertools.count()

    def on_outputs(touched) -> None:
        done = _finished(touched)
        bar.update(len(done))
        for r in done:
            item, k, synthetic = turn_of.pop(r.request_id)
            if k + 1 >= len(item.entry.segments):
                continue
            seg = item.entry.segments[k]
            returned = synthetic.draw(seg.num_returned_tokens) if seg.has_api_call else []
            nxt = segment_request(item, k + 1, list(r.token_ids) + returned,
                                  r.finish_time + (seg.api_duration_s or 0.0), synthetic)
            follow_ups.append((nxt, r))
            heapq.heappush(pending, (nxt.arrival_time, next(order), nxt))

    occupancy = _Occupancy(engine, options.sample_interval_s)

    def observe(now: float) -> None:
        while pending and pending[0][0] <= now:
            request = heapq.heappop(pending)[2]
            engine.core.add(request, request.arrival_time)
        occupancy.observe(now)

    def idle(until: float | None) -> None:
        wake = min(t for t in (until, occupancy.next_at, pending[0][0] if pending else None) if t is not None)
        engine.idle(wake)

    engine.core.run(done=lambda: len(requests) == total and engine.stats.requests == total
                    and not engine.has_unfinished() and not pending,
                    arrivals=first, observe=observe, on_outputs=on_outputs, idle=idle)
    end = max((r.finish_time for r in requests if r.finish_time is not None), default=engine.clock.now())
    return requests, t0, end, occupancy.curves, follow_ups
