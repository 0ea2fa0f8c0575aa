"""Decode-only steps run in bulk (``DecodeRun``) give exactly what running them one by one gives."""

from __future__ import annotations

import gc

import pytest

from jaxserve.profiles import load_profile
from jaxserve.replay.cluster import run_resend
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation
from jaxserve.replay.trace import load_trace
from jaxserve.replay.workload import WorkloadSpec, make_workload
from scheduler import make_policy, make_predictor
from scheduler.fast_forward import DecodeRun

COST = load_profile("gptj-6b-a100-40g")
MARKS = ("first_scheduled_time", "first_token_time", "finish_time", "last_scheduled_time", "num_generated",
         "num_computed_tokens", "num_cached_tokens", "max_computed_tokens", "num_preemptions", "finish_reason")


def _marks(requests):
    return [tuple(getattr(r, f) for f in MARKS)
            + tuple((c.call_time, c.return_time, c.resume_time, c.handling) for c in r.api_calls)
            for r in requests]


def _count_decode_run_steps(monkeypatch) -> list[int]:
    counted = [0]
    step = DecodeRun.step

    def counting(self, t):
        dt = step(self, t)
        counted[0] += dt is not None
        return dt
    monkeypatch.setattr(DecodeRun, "step", counting)
    return counted


def _simulate(policy: str, fast_forward: bool, cache: bool, pages: int | None):
    workload = make_workload(load_trace(), WorkloadSpec("poisson", rate=6.0, duration_s=6.0, seed=3))
    sched = build_scheduler(COST, make_policy(policy, make_predictor("oracle", 0)),
                            SimConfig(enable_prefix_caching=cache, num_device_pages=pages, num_host_pages=400))
    result = run_simulation(sched, [w.to_request() for w in workload], fast_forward=fast_forward,
                            check_invariants=True)
    totals = (result.end_time_s, result.num_steps, result.busy_time_s, result.forward_time_s, result.swap_stall_s,
              result.batched_tokens, result.swapped_tokens, result.num_preemptions, result.recomputed_tokens,
              result.cached_tokens, result.occupancy.time_s, result.occupancy.device_used,
              result.occupancy.host_used, result.steps_by_bucket.as_row())
    return _marks(result.requests), totals, sched.iteration


@pytest.mark.parametrize("policy,cache,pages", [("fcfs", False, 1500), ("infercept", True, 1500),
                                                ("lamps", True, 300), ("infercept", False, 300)])
def test_simulation_is_the_same_step_for_step(policy, cache, pages, monkeypatch):
    """Every request's marks, every total, the occupancy samples and the policy's
    iteration count agree, with the prefix cache (and its host tier) on and off and
    under a pool tight enough to preempt; invariants are checked after every step."""
    stepped = _simulate(policy, False, cache, pages)
    counted = _count_decode_run_steps(monkeypatch)
    forwarded = _simulate(policy, True, cache, pages)
    assert forwarded == stepped
    assert counted[0] > stepped[1][1] // 2   # most steps ran as decode-run steps


@pytest.mark.parametrize("horizon_s", [None, 4.0])
def test_replicas_are_the_same_step_for_step(monkeypatch, horizon_s):
    """Re-send mode on 3 replicas behind the affinity router: routing reads every
    replica's cache at each arrival, so decode runs must keep time order exactly.
    Their quiet steps run late (``DecodeRun.plan_quiet``): many of them, and some
    planned steps dropped because an arrival made them admitting steps; with a
    horizon, those before it run and the others do not."""
    def run(fast_forward: bool):
        workload = make_workload(load_trace(), WorkloadSpec("poisson", rate=6.0, duration_s=6.0, seed=1))
        schedulers = [build_scheduler(COST, make_policy("infercept", make_predictor("oracle", 0)),
                                      SimConfig(enable_prefix_caching=True, num_device_pages=300,
                                                num_host_pages=400))
                      for _ in range(3)]
        result = run_resend(schedulers, workload, "affinity", horizon_s=horizon_s, check_invariants=True,
                            fast_forward=fast_forward)
        quiet.append((result.quiet_steps, result.quiet_steps_dropped))
        return _marks(result.requests), (result.end_time_s, result.num_steps, result.busy_time_s,
                                         result.batched_tokens, result.num_preemptions, result.recomputed_tokens,
                                         result.follow_up_hits, result.follow_ups_same_replica,
                                         result.requests_by_replica), [s.iteration for s in schedulers]
    quiet: list[tuple[int, int]] = []
    stepped = run(False)
    counted = _count_decode_run_steps(monkeypatch)
    forwarded = run(True)
    (_, _), (ran, dropped) = quiet
    assert forwarded == stepped and stepped[1][6] > 0
    assert counted[0] + ran > stepped[1][1] // 2
    assert ran > stepped[1][1] // 5 and dropped > 0
    assert gc.isenabled()   # the collector paused for the run is back on


def test_runs_admit_refuse_and_end_exactly(monkeypatch):
    """Re-send on 2 replicas with conversations built to hit every branch of a
    run's admission step: admitted prompts that finish in the step and join the
    run, prompts longer than the step's budget (still computing: the run plans
    their next chunks as fillers), and one-token segments (their stop rule fires
    on the first token: the run refuses the step). Step for step the same as
    without decode runs."""
    import random

    from jaxserve.replay.trace import TraceEntry
    from jaxserve.replay.workload import WorkloadItem
    from scheduler import Segment

    rng = random.Random(7)
    items = []
    for i in range(60):
        segments = tuple(Segment(rng.choice([1, 1, 3, 20, 60]), api_type="t", api_duration_s=rng.choice([0.0, 0.05, 0.4]),
                                 num_returned_tokens=rng.choice([5, 40, 700]))
                         for _ in range(rng.randint(2, 5)))
        entry = TraceEntry(f"c{i}", prompt_len=rng.choice([30, 200, 900]), segments=segments)
        items.append(WorkloadItem(f"c{i}", 0.05 * i + rng.random() * 0.02, entry))
    counts = {"admitted": 0, "still computing": 0, "refused": 0, "filler steps": 0}
    can_admit, join, mixed_step = DecodeRun._can_admit, DecodeRun._join_computed, DecodeRun._mixed_step

    def counting_can_admit(self):
        ok = can_admit(self)
        counts["refused"] += not ok
        return ok

    def counting_join(self, plan):
        for chunk in plan.chunks:
            counts["admitted" if chunk.request in self.scheduler._decoding else "still computing"] += 1
        return join(self, plan)

    def counting_mixed_step(self, t, n, due, fillers):
        counts["filler steps"] += bool(fillers)
        return mixed_step(self, t, n, due, fillers)

    def run(fast_forward: bool):
        schedulers = [build_scheduler(COST, make_policy("lamps", make_predictor("oracle", 0)),
                                      SimConfig(enable_prefix_caching=True, num_device_pages=400, num_host_pages=200,
                                                max_num_batched_tokens=256))
                      for _ in range(2)]
        result = run_resend(schedulers, items, "least_loaded", check_invariants=True, fast_forward=fast_forward)
        return _marks(result.requests), (result.end_time_s, result.num_steps, result.busy_time_s,
                                         result.batched_tokens, result.num_preemptions, result.recomputed_tokens,
                                         result.follow_up_hits, result.requests_by_replica)
    stepped = run(False)
    monkeypatch.setattr(DecodeRun, "_can_admit", counting_can_admit)
    monkeypatch.setattr(DecodeRun, "_join_computed", counting_join)
    monkeypatch.setattr(DecodeRun, "_mixed_step", counting_mixed_step)
    forwarded = run(True)
    assert forwarded == stepped
    assert all(n > 0 for n in counts.values()), counts


def test_a_paused_collector_comes_back_without_walking_the_run():
    """``cyclic_gc_paused``: the collector is off inside and on after; what the run
    made is moved to the oldest generation as it is, so the first collection
    after the run does not walk it (it walked every result object)."""
    from jaxserve.replay.simulate import cyclic_gc_paused

    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]
    assert gc.isenabled()
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(o) in oldest for o in made)
