"""Replay fidelity (issue 19): the step cost model's context term, InferCept's
seed-faithful swap budget, and how the replay counts requests."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.core import SimClock
from jaxserve.executor.sim import SimExecutor
from jaxserve.replay.experiment import ReplayConfig, simulate
from jaxserve.replay.simulate import SimConfig
from jaxserve.replay.trace import load_trace, scale_entries
from scheduler import (BUILTIN_PROFILES, EventKind, Handling, PageAllocator, Request, RequestState, Scheduler,
                       SchedulerConfig, ScheduledChunk, Segment, StepPlan, StepResult, make_policy)
from scheduler.cost_model import waste_discard, waste_discard_chunked
from scheduler.policies.prophet import in_prefill

COST = BUILTIN_PROFILES["gptj-6b-a100-40g"]


# ------------------------------------------------------------- cost model
def test_shipped_profiles_carry_the_derived_context_term():
    # 28 layers x (K, V) x 4096 x 2 bytes, read at 60 % of the A100-40GB's 1.555 TB/s
    assert COST.bytes_per_token == 458_752
    assert COST.fwd_per_context_token_s == pytest.approx(458_752 / (1.555e12 * 0.6))
    mars = BUILTIN_PROFILES["gptj-6b-a100-40g-mars"]
    assert (mars.fwd_base_s, mars.fwd_per_token_s) == (0.0169, 0.041e-3)
    assert mars.fwd_per_context_token_s == COST.fwd_per_context_token_s
    assert COST.t_step(0, 10_000) == 0.0
    overhead = dataclasses.replace(COST, step_overhead_s=0.007)
    assert overhead.t_step(10, 1000) == pytest.approx(COST.t_fwd(10, 1000) + 0.007)


def test_simulated_step_pays_for_every_chunk_s_context():
    ex = SimExecutor(COST, 16, SimClock())
    short = [Request(f"s{i}", 0.0, prompt_len=10, max_tokens=5) for i in range(4)]
    long = [Request(f"l{i}", 0.0, prompt_len=10, max_tokens=5) for i in range(4)]
    # four decode tokens each: contexts 100 (short) and 2000 (long) tokens so far
    plan_short = StepPlan(chunks=[ScheduledChunk(r, 99, 1, True) for r in short])
    plan_long = StepPlan(chunks=[ScheduledChunk(r, 1999, 1, True) for r in long])
    assert plan_short.num_context_tokens == 400 and plan_long.num_context_tokens == 8000
    dt_short, _, _ = ex.step_time(plan_short)
    dt_long, _, _ = ex.step_time(plan_long)
    assert dt_short == pytest.approx(COST.t_fwd(4, 400))
    assert dt_long - dt_short == pytest.approx(7600 * COST.fwd_per_context_token_s)
    ex.execute(plan_long)
    assert ex.clock.now() == pytest.approx(dt_long)


def test_waste_equations_use_the_same_step_cost():
    no_context = dataclasses.replace(COST, fwd_per_context_token_s=0.0)
    assert waste_discard(COST, 2000, 5000) > waste_discard(no_context, 2000, 5000)
    assert waste_discard(COST, 2000, 5000) == pytest.approx(
        COST.t_step(2000, 2000) * 7000 * COST.bytes_per_token)
    assert waste_discard_chunked(COST, 2000, 5000, 10) > waste_discard_chunked(no_context, 2000, 5000, 10)


# ------------------------------------------------------------ InferCept
def _scheduler(policy: str, swap_tokens: int) -> Scheduler:
    # The seeds' InferCept has no prefix cache: with one, a discarded context stays cached and
    # Discard's expected recompute (hence its waste) drops, which is another policy's behaviour.
    return Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16, swap_budget_tokens=swap_tokens,
                                     enable_prefix_caching=False),
                     make_policy(policy), PageAllocator(512, 16), PageAllocator(512, 16, "host"), COST)


def _call_together(sched: Scheduler, prompts: list[int], duration_s: float) -> list[Request]:
    """Requests that each prefill ``prompt`` tokens then call an API of ``duration_s``, all in one step."""
    reqs = [Request(f"r{i}", 0.0, prompt_len=p, max_tokens=3,
                    segments=[Segment(1, "tool", duration_s, 4), Segment(2)]) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r, 0.0)
    plan = sched.schedule(0.0)
    events = sched.update(plan, StepResult(), 0.1)
    assert [e.kind for e in events] == [EventKind.API_CALL] * len(reqs)
    sched.check_invariants()
    return reqs


def test_infercept_gives_the_swap_budget_to_the_largest_wastes_only():
    sched = _scheduler("infercept", swap_tokens=64)
    reqs = _call_together(sched, [64, 48, 160, 96], duration_s=30.0)
    # At the call (in the order the calls happen): r0's 64 tokens fill the swap-out
    # queue to a step's budget; the others keep eq. 5's choice (a 30 s call: Discard).
    swapped = [r for r in reqs if r.handling == Handling.SWAP]
    assert len(swapped) == 1 and swapped[0].state == RequestState.SWAPPING_OUT
    assert all(r.handling == Handling.DISCARD for r in reqs if r not in swapped)
    assert sum(len(r.device_pages) for r in sched.swapping_out) * 16 >= 64


def test_infercept_preserved_calls_compete_for_the_budget_by_waste():
    sched = _scheduler("infercept", swap_tokens=32)
    # 5 ms calls: Preserve wastes less than Discard for each; the first call takes the budget
    reqs = _call_together(sched, [32, 48, 96], duration_s=0.005)
    assert reqs[0].handling == Handling.SWAP
    assert [r.handling for r in reqs[1:]] == [Handling.PRESERVE, Handling.PRESERVE]
    waste = [r.policy_state["waste"] for r in reqs]
    assert waste[2] > waste[1] > 0
    # the next step copies r0 out (32 tokens = the budget); the step after, the largest
    # preserved waste (r2, 96 tokens) gets the budget before r1
    sched.update(sched.schedule(0.11), StepResult(), 0.11)
    assert reqs[0].state == RequestState.SWAPPED
    sched.update(sched.schedule(0.12), StepResult(), 0.12)
    assert reqs[2].handling == Handling.SWAP and reqs[1].handling == Handling.PRESERVE
    sched.check_invariants()


def test_infercept_minwaste_variant_swaps_every_long_call_at_the_call():
    sched = _scheduler("infercept-minwaste", swap_tokens=64)
    reqs = _call_together(sched, [64, 48, 160, 96], duration_s=30.0)
    assert all(r.handling == Handling.SWAP for r in reqs)     # no budget on the swap queue


# ------------------------------------------------------------- counting
def test_replay_counts_in_window_by_default_and_reports_both():
    entries = scale_entries(load_trace(), 0.2)
    base = dict(policies=["infercept"], rates=[6.0], duration_s=20.0, seed=3,
                sim=SimConfig(page_size=16, num_device_pages=200))
    with pytest.raises(ValueError, match="count"):
        ReplayConfig(count="some", **base)
    (windowed,) = simulate(entries, COST, ReplayConfig(**base), progress=False)
    (everything,) = simulate(entries, COST, ReplayConfig(count="all", **base), progress=False)
    w, a = windowed.row, everything.row
    assert w["count"] == "in-window" and a["count"] == "all"
    assert w["by_count"] == a["by_count"]
    assert w["completed"] == w["by_count"]["in-window"]["completed"] == w["completed_in_window"]
    assert a["completed"] == a["by_count"]["all"]["completed"] == a["requests"]
    assert w["completed"] < a["completed"]       # requests still running when the window closed
    assert w["mean_e2e_s"] < a["mean_e2e_s"]      # ... are the long ones
    assert sum(w["handling_mix"].values()) == pytest.approx(1.0)
    assert w["handling_counts"] == a["handling_counts"]


# ------------------------------------------------------------- AugServe
def _one_call(policy: str, handling: Handling, duration_s: float = 0.05):
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, swap_budget_tokens=64,
                                      handling=handling),
                      make_policy(policy), PageAllocator(256, 16), PageAllocator(256, 16, "host"), COST)
    r = Request("r", 0.0, prompt_len=40, max_tokens=8, segments=[Segment(1, "tool", duration_s, 3), Segment(4)])
    sched.add_request(r, 0.0)
    sched.update(sched.schedule(0.0), StepResult(), 0.01)
    for i in range(3):                    # let a swap-out finish
        sched.update(sched.schedule(0.02 + 0.01 * i), StepResult(), 0.02 + 0.01 * i)
    # a new request arrives while the call is out
    new = Request("new", 0.05, prompt_len=8, max_tokens=2)
    sched.add_request(new, 0.05)
    sched.api_return(r, 3, 0.06)
    sched.check_invariants()
    return sched, r, new


def test_augserve_resumes_a_preserved_call_straight_into_the_batch():
    sched, r, _ = _one_call("augserve", Handling.PRESERVE)
    assert r.state == RequestState.RUNNING and r in sched.running and r not in sched.waiting
    plan = sched.schedule(0.07)
    assert any(c.request is r and c.num_tokens == 4 for c in plan.chunks)   # the 3 returned tokens + 1
    # lamps re-enters ranking as a new segment (seed 000), pages still held
    sched, r, _ = _one_call("lamps", Handling.PRESERVE)
    assert r in sched.waiting and r.device_pages


def test_augserve_serves_the_swapped_queue_before_waiting_work():
    sched, r, new = _one_call("augserve", Handling.SWAP)
    assert r.state == RequestState.SWAPPED
    assert sched.admission_order() == [r, new]
    sched, r, new = _one_call("augserve", Handling.DISCARD)
    assert r.state == RequestState.WAITING and set(sched.admission_order()) == {r, new}


def test_dynamic_budget_above_max_batched_tokens_sizes_the_executor():
    from jaxserve import LLM
    llm = LLM("demo", policy="augserve", page_size=8, num_pages=64, max_num_batched_tokens=16,
              max_model_len=64, warmup=False, policy_options={"budget_beta_high": 4.0})
    engine = llm.engine
    assert engine.scheduler.max_step_tokens == 64
    assert engine.executor.config.token_buckets[-1] == 64
    from jaxserve.sampling_params import SamplingParams
    out = llm.generate(prompt_token_ids=[[5] * 40, [6] * 30],
                       sampling_params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [3, 3]
    # the prompts (70 tokens) took a step of 64 tokens, four times max_num_batched_tokens
    buckets = engine.core.stats.steps_by_bucket.as_row()
    assert "64" in buckets and max(int(b) for b in buckets) == 64


# --------------------------------------------------------------- Prophet
def test_prophet_caps_the_decode_batch_so_the_mlfq_demotes_and_rotates():
    policy = make_policy("prophet", quanta=(5, 10), starvation_limit=50)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64, swap_budget_tokens=64),
                      policy, PageAllocator(1024, 16), PageAllocator(64, 16, "host"), COST)
    reqs = [Request(f"r{i}", 0.0, prompt_len=4, max_tokens=100) for i in range(20)]
    for r in reqs:
        sched.add_request(r, 0.0)
    decode, prefill = [], []
    for i in range(40):
        plan = sched.schedule(0.01 * i)
        decode.append(sum(not in_prefill(c.request) for c in plan.chunks))
        prefill.append(sum(in_prefill(c.request) for c in plan.chunks))
        sched.update(plan, StepResult(), 0.01 * i)
    assert max(decode) == 16                         # the seed's decoder batch size
    assert max(prefill) == 4 and prefill[:5] == [4] * 5   # its prefiller's: 20 prompts in 5 steps
    assert {policy.level(r) for r in reqs} == {1}     # everyone ran its 5-step quantum and was demoted
    assert min(r.num_generated for r in reqs) > 5     # ... and the four left out rotated in
    sched.check_invariants()


# ----------------------------------------------------- Continuum, Autellix
def test_continuum_pins_kv_for_the_ttl_then_drops_it():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, swap_budget_tokens=64),
                      make_policy("continuum", ttl_max_s=0.5), PageAllocator(256, 16),
                      PageAllocator(256, 16, "host"), COST)
    short = Request("short", 0.0, prompt_len=20, max_tokens=4, segments=[Segment(1, "t", 0.2, 2), Segment(2)])
    long = Request("long", 0.0, prompt_len=20, max_tokens=4, segments=[Segment(1, "t", 3.0, 2), Segment(2)])
    late = Request("late", 0.05, prompt_len=4, max_tokens=1)
    for r in (short, long):
        sched.add_request(r, 0.0)
    sched.update(sched.schedule(0.0), StepResult(), 0.01)
    assert short.handling == long.handling == Handling.PRESERVE and short.device_pages and long.device_pages
    sched.add_request(late, 0.05)
    sched.api_return(short, 2, 0.2)                 # back inside its TTL: KV reused
    sched.update(sched.schedule(0.3), StepResult(), 0.3)
    assert short.api_calls[-1].handling == Handling.PRESERVE and short.num_computed_tokens > 20
    sched.update(sched.schedule(0.6), StepResult(), 0.6)   # long's TTL (0.5 s) ran out
    assert long.api_calls[-1].handling == Handling.DISCARD and not long.device_pages
    sched.api_return(long, 2, 3.0)
    assert long.num_computed_tokens == 0            # recomputed on return
    # program-level FCFS: keyed by its first arrival, ahead of later programs
    assert sched.admission_key(long) == (0, 0.0) and sched.policy.priority(late, 3.0, None) == (0.05,)
    sched.check_invariants()


def test_autellix_ranks_by_least_attained_service():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, swap_budget_tokens=64),
                      make_policy("autellix"), PageAllocator(256, 16), PageAllocator(256, 16, "host"), COST)
    veteran = Request("veteran", 0.0, prompt_len=100, max_tokens=8, segments=[Segment(1, "t", 0.1, 2), Segment(4)])
    sched.add_request(veteran, 0.0)
    sched.update(sched.schedule(0.0), StepResult(), 0.01)   # 100 prompt tokens of service, then its call
    newcomer = Request("newcomer", 0.05, prompt_len=30, max_tokens=2)
    sched.add_request(newcomer, 0.05)
    sched.api_return(veteran, 2, 0.11)
    # the newcomer arrived later but has had no service: it goes first
    assert sched.admission_order()[0] is newcomer
    assert veteran.attained_tokens == 100
    sched.check_invariants()


def test_attained_service_counts_every_chunk_through_discard_and_relink():
    """``Request.attained_tokens`` (autellix's rank) is the sum of the request's
    planned chunks: recomputed tokens count again, tokens linked from the prefix
    cache do not, also when its context was dropped at a call and re-linked."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8, handling=Handling.DISCARD),
                      make_policy("autellix"), PageAllocator(64, 16), PageAllocator(64, 16, "host"), COST)
    r = Request("r", 0.0, prompt_len=70, max_tokens=8, token_ids=list(range(100, 170)),
                segments=[Segment(1, "t", 0.1, 2, (7, 8)), Segment(3)])
    sched.add_request(r, 0.0)
    planned, now = 0, 0.0
    while not r.is_finished:
        if r.request_id in sched.paused and r.api_calls[-1].return_time is None:
            assert r.handling == Handling.DISCARD and r.num_computed_tokens == 0
            sched.api_return(r, 2, now, [7, 8])
        plan = sched.schedule(now)
        planned += sum(c.num_tokens for c in plan.chunks if c.request is r)
        samples = [c for c in plan.chunks if c.samples]
        now += 0.01
        sched.update(plan, StepResult(token_ids=[5] * len(plan.chunks)) if samples else StepResult(), now)
        assert r.attained_tokens == planned
    # 70 prompt tokens; after the call the context is 73, of which 4 full pages (64 tokens) are
    # re-linked and 9 recomputed; then 2 decode tokens
    assert planned == 70 + 9 + 2 and r.num_preemptions == 0


def test_prefill_decode_split_runs_the_two_phases_side_by_side():
    joint, split = SimExecutor(COST, 16, SimClock()), SimExecutor(COST, 16, SimClock(), prefill_decode_split=True)
    prompt = Request("p", 0.0, prompt_len=200, max_tokens=4)
    decoders = [Request(f"d{i}", 0.0, prompt_len=10, max_tokens=50) for i in range(8)]
    for d in decoders:
        d.num_generated = 3
    plan = StepPlan(chunks=[ScheduledChunk(prompt, 0, 200, True)]
                    + [ScheduledChunk(d, 500, 1, True) for d in decoders])
    assert joint.step_time(plan)[0] == pytest.approx(COST.t_fwd(208, 200 + 8 * 501))
    prefill, decode = COST.t_fwd(200, 200), COST.t_fwd(8, 8 * 501)
    # the first token ends the prefill: its 200 tokens of KV go to the decoder
    assert split.step_time(plan)[0] == pytest.approx(max(prefill, decode) + COST.t_swap(200))
    from jaxserve.replay import cli as replay_cli
    import argparse
    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    _, config = replay_cli.build_config(parser.parse_args(["--simulate", "--prefill-decode-split", "--rate", "2"]))
    assert config.sim.prefill_decode_split is True


def test_in_run_profile_takes_the_engines_own_step_times():
    """tools/replay_fidelity.py's in-run profile: buckets the engine ran often enough
    cost what they cost in the run; the others scale the profile by the observed
    ratio; swap-only steps (bucket 0) are left out."""
    import dataclasses
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "replay_fidelity.py"
    spec = importlib.util.spec_from_file_location("replay_fidelity", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    before = dataclasses.replace(COST, step_overhead_s=0.001, max_num_batched_tokens=512,
                                 meta={"step_times_s": {"8": 0.002, "64": 0.01, "512": 0.1}})
    rows = [{"steps_by_bucket": {"0": {"steps": 3, "mean_s": 0.5}, "1": {"steps": 10, "mean_s": 0.004},
                                 "512": {"steps": 6, "mean_s": 0.2}, "64": {"steps": 2, "mean_s": 9.0}}}]
    cal = tool.in_run_profile(before, rows)
    assert cal.resolved_step_model == "buckets" and cal.step_overhead_s == 0.0
    assert cal.t_step(1) == pytest.approx(0.004)
    # the buckets are whole steps at the run's own contexts: no context term on top
    assert cal.fwd_per_context_token_s == 0.0 and cal.t_step(1, 5000) == pytest.approx(0.004)
    assert cal.t_step(300) == pytest.approx(0.2)
    ratio = (10 * 0.004 + 6 * 0.2) / (10 * before.t_step(1) + 6 * before.t_step(512))
    assert cal.t_step(64) == pytest.approx(ratio * before.t_step(64))   # 2 steps: too few to trust
    assert cal.meta["in_run"]["buckets_seen"] == [1, 512]
