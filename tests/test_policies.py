"""Each policy's order on hand-built situations, the predictors, and every policy
running random multi-API workloads to completion on a tight page pool."""

import random
import statistics

import pytest

from scheduler import (BUILTIN_PROFILES, EventKind, Handling, MemoryView, PageAllocator, Request, RequestState,
                       Scheduler, SchedulerConfig, Segment, StepResult, available_policies, make_policy,
                       make_predictor)
from scheduler.policies.lamps import memory_time_integral
from scheduler.queues import RankedQueue
from scheduler.token_budget import dynamic_token_budget

COST = BUILTIN_PROFILES["gptj-6b-a100-40g"]


def make_scheduler(policy, num_pages=256, host_pages=256, page_size=4, budget=64, seqs=16, handling=None,
                   swap_tokens=16, **config):
    if isinstance(policy, str):
        policy = make_policy(policy)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs,
                                     swap_budget_tokens=swap_tokens, handling=handling, **config),
                     policy, PageAllocator(num_pages, page_size), PageAllocator(host_pages, page_size, "host"),
                     COST)


def view(free=100, paused=0, running_tokens=0, num_running=0, host_free=100, page_size=4):
    return MemoryView(free_device_pages=free, total_device_pages=1000, free_host_pages=host_free,
                      total_host_pages=1000, page_size=page_size, running_tokens=running_tokens,
                      num_running=num_running, paused_device_pages=paused, cost=COST)


def step(sched, now, pending=None):
    """One engine step with declared API calls; returns the plan."""
    plan = sched.schedule(now)
    for event in sched.update(plan, StepResult(), now):
        if event.kind is EventKind.API_CALL:   # paused by update(); its segment is behind it now
            r = event.request
            seg = r.segments[r.segment_index - 1]
            if pending is not None:
                pending.append((now + seg.api_duration_s, r, seg.num_returned_tokens))
    sched.check_invariants()
    return plan


def drive(sched, now=0.0, max_steps=20000, dt=0.01):
    pending, steps = [], 0
    while sched.has_unfinished():
        steps += 1
        assert steps < max_steps, "no progress"
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            sched.api_return(item[1], item[2], now)
        step(sched, now, pending)
        now += dt
    assert sched.device_pool.num_free == sched.device_pool.num_pages
    assert sched.kv.num_free_host == sched.host_pool.num_pages
    return steps


def random_requests(n, seed, spread=0.0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        segs = [Segment(rng.randint(1, 6), rng.choice(["math", "qa"]), rng.choice([0.0, 0.02, 0.2]),
                        rng.randint(0, 5)) for _ in range(rng.randint(0, 3))]
        segs.append(Segment(rng.randint(1, 6)))
        out.append(Request(f"r{i}", arrival_time=rng.uniform(0, spread), prompt_len=rng.randint(1, 20),
                           max_tokens=sum(s.num_tokens for s in segs), segments=segs))
    return out


# ------------------------------------------------------------------ completion
ALL = [p for p in available_policies() if p != "mars"]


@pytest.mark.parametrize("handling", [Handling.PRESERVE, Handling.DISCARD, Handling.SWAP, None])
@pytest.mark.parametrize("policy", ALL)
def test_every_policy_finishes_random_multi_api_workload_on_tight_pool(policy, handling):
    for seed in (1, 2):
        sched = make_scheduler(policy, num_pages=20, host_pages=6, budget=32, handling=handling, swap_tokens=8)
        for r in random_requests(24, seed):
            sched.add_request(r, 0.0)
        drive(sched)


@pytest.mark.parametrize("options", [dict(predictor="noisy:0.5"), dict(predictor="api-type-mean"),
                                     dict(predictor="elapsed"), dict(refresh_interval=3),
                                     dict(token_budget="dynamic")])
@pytest.mark.parametrize("policy", ["lamps", "augserve", "sjf-total", "prophet", "infercept"])
def test_policies_finish_with_other_predictors_and_options(policy, options):
    if "refresh_interval" in options and policy in ("infercept",):
        options = {}
    sched = make_scheduler(make_policy(policy, **options), num_pages=24, host_pages=8, budget=32,
                           swap_tokens=8)
    for r in random_requests(30, 7):
        sched.add_request(r, 0.0)
    drive(sched)


def test_staggered_arrivals_and_dynamic_budget_from_config():
    sched = make_scheduler("fcfs", num_pages=20, host_pages=6, budget=32, token_budget="dynamic")
    reqs = sorted(random_requests(30, 3, spread=0.5), key=lambda r: r.arrival_time)
    now, pending = 0.0, []
    while reqs or sched.has_unfinished():
        while reqs and reqs[0].arrival_time <= now:
            sched.add_request(reqs.pop(0), now)
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            sched.api_return(item[1], item[2], now)
        plan = step(sched, now, pending)
        assert 8 <= plan.token_budget <= 32
        now += 0.01
    assert sched.device_pool.num_free == sched.device_pool.num_pages


# ----------------------------------------------------------------------- fcfs
def test_fcfs_improved_resumes_returning_request_ahead_of_later_arrivals():
    for policy, first in (("fcfs", "late"), ("fcfs-improved", "early")):
        sched = make_scheduler(policy, budget=4, seqs=1)
        early = Request("early", 0.0, prompt_len=4, max_tokens=3, segments=[Segment(1, "x", 0.5, 0), Segment(2)])
        sched.add_request(early, 0.0)
        step(sched, 0.0)
        assert early.state == RequestState.PAUSED
        sched.add_request(Request("late", 0.2, prompt_len=4, max_tokens=2), 0.2)
        sched.api_return(early, 0, 0.5)
        plan = sched.schedule(0.6)
        assert [c.request.request_id for c in plan.chunks] == [first], policy


# ----------------------------------------------------------------------- lamps
def test_lamps_preserve_handled_request_ranks_behind_discard_handled_one_of_equal_length():
    sched = make_scheduler("lamps", host_pages=0)      # no host room: Swap is not a candidate
    pol = sched.policy
    busy = view(running_tokens=5000, num_running=10, host_free=0)
    short_api = Request("preserve", 0.0, prompt_len=80, max_tokens=40, segments=[Segment(20, "x", 0.5), Segment(20)])
    long_api = Request("discard", 0.0, prompt_len=80, max_tokens=40, segments=[Segment(20, "x", 10.0), Segment(20)])
    pol.on_arrival(short_api, 0.0, busy)
    pol.on_arrival(long_api, 0.0, busy)
    assert short_api.policy_state["lamps_handling"] == Handling.PRESERVE
    assert long_api.policy_state["lamps_handling"] == Handling.DISCARD
    assert pol.priority(short_api, 0.0, None) > pol.priority(long_api, 0.0, None)
    # Same total length, same handling: the ranking is by size.
    small = Request("small", 0.0, prompt_len=10, max_tokens=5)
    big = Request("big", 0.0, prompt_len=100, max_tokens=50)
    for r in (big, small):
        sched.add_request(r, 0.0)
    assert [r.request_id for r in sched.admission_order()] == ["small", "big"]


def test_memory_time_integral_shapes():
    args = dict(context_tokens=100, uncomputed_tokens=0, output_tokens=50, chunk_tokens=64)
    none = memory_time_integral(COST, handling=None, api_duration_s=0.0, **args)
    preserve = memory_time_integral(COST, handling=Handling.PRESERVE, api_duration_s=2.0, **args)
    discard = memory_time_integral(COST, handling=Handling.DISCARD, api_duration_s=2.0, **args)
    swap = memory_time_integral(COST, handling=Handling.SWAP, api_duration_s=2.0, **args)
    assert preserve - none == pytest.approx(2.0 * 150 * COST.bytes_per_token)   # flat through the API
    assert none < swap < discard < preserve
    longer = memory_time_integral(COST, handling=None, api_duration_s=0.0, **{**args, "output_tokens": 60})
    assert longer > none


def test_lamps_applies_the_handling_it_predicted_and_reclassifies_after_each_return():
    sched = make_scheduler("lamps", budget=64)
    r = Request("a", 0.0, prompt_len=8, max_tokens=6,
                segments=[Segment(2, "slow", 30.0, 2), Segment(2, "fast", 0.0, 2), Segment(2)])
    sched.add_request(r, 0.0)
    predicted = [r.policy_state["lamps_handling"]]
    pending, now = [], 0.0
    while sched.has_unfinished():
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            sched.api_return(item[1], item[2], now)
            if r.current_segment is not None and r.current_segment.has_api_call:
                predicted.append(r.policy_state["lamps_handling"])
        step(sched, now, pending)
        now += 0.01
    applied = [c.fell_back_from or c.handling for c in r.api_calls]
    assert applied == predicted
    assert predicted == [Handling.SWAP, Handling.PRESERVE]   # a 30 s call is not preserved; a 0 s call is


def test_lamps_refresh_interval_rescores_only_every_k_plus_one_steps():
    pred = make_predictor("api-type-mean")
    sched = make_scheduler(make_policy("lamps", predictor=pred, refresh_interval=2), seqs=1, budget=8)
    blocker = Request("blocker", 0.0, prompt_len=4, max_tokens=50)
    sched.add_request(blocker, 0.0)
    step(sched, 0.0)
    a = Request("a", 0.0, prompt_len=4, max_tokens=2, segments=[Segment(1, "img", None), Segment(1)])
    sched.add_request(a, 0.0)
    before = sched.admission_key(a)
    pred.observe_api("img", 100.0)   # a preserve-worthy call becomes long: its score changes
    keys = []
    for i in range(3):
        step(sched, 0.01 * (i + 1))
        keys.append(sched.admission_key(a))
    assert keys[0] == before and keys[-1] != before


# --------------------------------------------------------------------- sjf
def test_sjf_picks_shortest_predicted_and_sjf_total_adds_api_time():
    a = lambda: Request("api", 0.0, prompt_len=4, max_tokens=10, segments=[Segment(5, "x", 5.0), Segment(5)])
    b = lambda: Request("plain", 0.1, prompt_len=4, max_tokens=30)
    for policy, first in (("sjf", "api"), ("sjf-total", "plain")):
        sched = make_scheduler(policy, seqs=1)
        sched.add_request(b(), 0.0)
        sched.add_request(a(), 0.0)
        plan = sched.schedule(0.0)
        assert [c.request.request_id for c in plan.chunks] == [first], policy


# ------------------------------------------------------------------ prophet
def test_prophet_srpt_for_prefill_and_starved_prefill_goes_first():
    sched = make_scheduler(make_policy("prophet", prefill_starvation_limit=3), seqs=1, budget=8)
    blocker = Request("blocker", 0.0, prompt_len=4, max_tokens=100)
    sched.add_request(blocker, 0.0)
    step(sched, 0.0)
    sched.add_request(Request("long", 0.0, prompt_len=50, max_tokens=1), 0.0)
    sched.add_request(Request("short", 0.1, prompt_len=5, max_tokens=1), 0.1)
    order = lambda: [r.request_id for r in sched.admission_order()]
    assert order() == ["short", "long"]
    for i in range(4):
        step(sched, 0.01 * (i + 1))
    assert order() == ["long", "short"]   # its estimate became 0 after 3 waiting steps


def test_prophet_mlfq_demotes_after_quantum_and_promotes_after_starvation():
    pol = make_policy("prophet", quanta=(2, 3, 5), starvation_limit=4)
    sched = make_scheduler(pol, budget=64, seqs=1)
    r = Request("a", 0.0, prompt_len=4, max_tokens=12, segments=[Segment(8, "x", 0.0, 0), Segment(4)])
    sched.add_request(r, 0.0)
    levels = []
    for i in range(8):
        step(sched, 0.01 * i)
        levels.append(pol.level(r))
    # step 1 is the prefill (samples the first token), then every decode step counts
    assert levels == [0, 0, 1, 1, 1, 2, 2, 2]
    assert r.state == RequestState.PAUSED           # its 8th token triggered the call
    hog = Request("hog", 0.1, prompt_len=4, max_tokens=100)
    sched.add_request(hog, 0.1)
    step(sched, 0.1)                                 # the hog takes the only seat
    sched.api_return(r, 0, 0.1)
    waiting_levels = []
    for i in range(6):
        step(sched, 0.2 + 0.01 * i)
        waiting_levels.append(pol.level(r))
    assert r in sched.waiting
    assert waiting_levels[:4] == [2, 2, 2, 2] and waiting_levels[-1] == 0   # promoted after 4 idle steps


def test_prophet_budget_goes_to_lower_levels_first_when_short():
    pol = make_policy("prophet", quanta=(2, 100))
    sched = make_scheduler(pol, budget=64)
    old = Request("old", 0.0, prompt_len=4, max_tokens=50)
    sched.add_request(old, 0.0)
    for i in range(4):
        step(sched, 0.01 * i)
    assert pol.level(old) == 1
    new = Request("new", 0.1, prompt_len=4, max_tokens=50)
    sched.add_request(new, 0.1)
    step(sched, 0.1)
    ordered = pol.order_running(sched.running, 0.2, sched.view(), budget=1, iteration=sched.iteration)
    assert [r.request_id for r in ordered] == ["new", "old"]
    capped = make_policy("prophet", decode_batch_size=1)
    Scheduler(sched.config, capped, PageAllocator(8, 4), PageAllocator(8, 4, "host"), COST)   # binds it
    assert len(capped.order_running([old, new], 0.2, sched.view(), budget=64, iteration=sched.iteration)) == 1


def test_prophet_prefiller_batches_at_most_four_prompts_per_step_in_srpt_order():
    sched = make_scheduler(make_policy("prophet"), budget=256, seqs=16)
    for i in range(6):   # six prompts, longest first; each fits the budget alone
        sched.add_request(Request(f"p{i}", 0.0, prompt_len=40 - 4 * i, max_tokens=4), 0.0)
    plan = sched.schedule(0.0)
    assert sorted(c.request.request_id for c in plan.chunks) == ["p2", "p3", "p4", "p5"]   # the 4 shortest
    sched.update(plan, StepResult(), 0.0)
    plan = sched.schedule(0.01)   # the first four decode now; the other two prompts join them
    assert sorted(c.request.request_id for c in plan.chunks) == ["p0", "p1", "p2", "p3", "p4", "p5"]
    chunked = make_scheduler(make_policy("prophet", prefill_batch_size=2), budget=6, seqs=16)
    for i in range(3):   # prompts longer than the budget: chunked over steps, two in progress at a time
        chunked.add_request(Request(f"c{i}", 0.0, prompt_len=8 + i, max_tokens=2), 0.0)
    seen = []
    for k in range(4):
        plan = chunked.schedule(0.01 * k)
        seen.append({c.request.request_id for c in plan.chunks})
        chunked.update(plan, StepResult(), 0.01 * k)
    assert all(len({r for r in s if r.startswith("c")}) <= 2 for s in seen)
    assert make_policy("prophet", prefill_batch_size=None).prefill_batch_size is None
    with pytest.raises(ValueError, match="prefill_batch_size"):
        make_policy("prophet", prefill_batch_size=0)


# ----------------------------------------------------------------- augserve
def test_dynamic_budget_stays_inside_bounds_as_free_memory_swings():
    target, low, high = 512, 0.25, 1.0
    rng = random.Random(0)
    for _ in range(500):
        free, paused = rng.randint(0, 400), rng.randint(0, 200)
        v = view(free=free, paused=paused, page_size=4)
        b = dynamic_token_budget(v, target, gamma=0.5, beta_low=low, beta_high=high)
        assert low * target <= b <= high * target
        raw = int((free + 0.5 * paused) * 4)
        if low * target <= raw <= high * target:
            assert b == raw
    assert dynamic_token_budget(view(free=0, paused=0), target) == 128
    assert dynamic_token_budget(view(free=10_000), target) == 512
    assert dynamic_token_budget(view(free=10_000), target, beta_high=2.0) == 1024


def test_augserve_budget_follows_free_memory_in_a_run():
    sched = make_scheduler("augserve", num_pages=40, host_pages=8, budget=64, swap_tokens=8)
    for r in random_requests(30, 5):
        sched.add_request(r, 0.0)
    budgets = []
    pending, now = [], 0.0
    while sched.has_unfinished():
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            sched.api_return(item[1], item[2], now)
        budgets.append(step(sched, now, pending).token_budget)
        now += 0.01
    # augserve's beta_high is 2: the budget expands above max_num_batched_tokens when memory is free
    assert all(16 <= b <= 128 for b in budgets)
    assert min(budgets) < 64 and max(budgets) > 64   # it moved, both ways


def test_augserve_stage_two_uses_observed_return_length_and_aging_reorders():
    sched = make_scheduler(make_policy("augserve", alpha=1000.0, token_budget="static"), seqs=1, budget=64)
    pol = sched.policy
    a = Request("a", 0.0, prompt_len=8, max_tokens=4, segments=[Segment(1, "x", 0.0, 0), Segment(3)])
    sched.add_request(a, 0.0)
    v1 = a.policy_state["aug_value"]
    step(sched, 0.0)
    assert a.state != RequestState.RUNNING   # paused at its call
    sched.api_return(a, 30, 0.01)
    assert a.policy_state["aug_stage"] == 2
    v_small = pol.stage2_value(a.api_calls[-1].handling, 9, 0, 3, None, 0.0)
    assert a.policy_state["aug_value"] > v_small > 0
    assert a.policy_state["aug_value"] != v1
    # Aging: an older, costlier request overtakes a cheap newcomer once it has waited long enough.
    big_old = Request("big", 0.0, prompt_len=200, max_tokens=100)
    cheap_new = Request("cheap", 5.0, prompt_len=4, max_tokens=2)
    for r, t in ((big_old, 0.0), (cheap_new, 5.0)):
        pol.on_arrival(r, t, sched.view())
    gap = big_old.policy_state["aug_value"] - cheap_new.policy_state["aug_value"]
    assert gap > 0
    assert (pol.priority(big_old, 5.0, None) < pol.priority(cheap_new, 5.0, None)) == (gap < 1000.0 * 5.0)


# ------------------------------------------------------------------ infercept
def test_infercept_elapsed_estimate_switches_a_long_call_off_preserve():
    pol = make_policy("infercept", predictor="elapsed")
    sched = make_scheduler(pol, host_pages=0, budget=64)
    a = Request("a", 0.0, prompt_len=40, max_tokens=3, segments=[Segment(1, "x"), Segment(2)])
    b = Request("b", 0.0, prompt_len=40, max_tokens=50)
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    events = sched.update(sched.schedule(0.0), StepResult(), 0.0)   # a's call (duration unknown) pauses it
    assert [(e.request.request_id, e.kind) for e in events] == [("a", EventKind.API_CALL)]   # b still prefills
    assert a.handling == Handling.PRESERVE and a.device_pages
    now = 0.0
    while a.handling == Handling.PRESERVE:
        now += 0.01
        assert now < 5, "never switched"
        step(sched, now)
    assert a.handling == Handling.DISCARD and not a.device_pages
    assert a.api_calls[-1].handling == Handling.DISCARD


def test_infercept_elapsed_switch_to_swap_is_recorded_on_the_call():
    sched = make_scheduler(make_policy("infercept", predictor="elapsed"), host_pages=256, budget=64)
    a = Request("a", 0.0, prompt_len=40, max_tokens=3, segments=[Segment(1, "x"), Segment(2)])
    sched.add_request(a, 0.0)
    step(sched, 0.0)
    assert a.handling == Handling.PRESERVE and a.device_pages
    now = 0.0
    while a.handling == Handling.PRESERVE:
        now += 0.01
        assert now < 5, "never switched"
        step(sched, now)
    assert a.handling == Handling.SWAP and a.api_calls[-1].handling == Handling.SWAP
    assert a.api_calls[-1].fell_back_from is None and a.host_pages


def test_infercept_swap_budget_goes_to_largest_waste_first():
    pol = make_policy("infercept")
    r1, r2 = Request("r1", 0, 4, 1), Request("r2", 0, 4, 1)
    r1.policy_state["waste"], r2.policy_state["waste"] = 1.0, 5.0
    assert pol.order_swap_out([r1, r2], view()) == [r2, r1]


# ----------------------------------------------------------------- predictors
def test_noisy_predictor_is_deterministic_per_seed_with_the_right_spread():
    reqs = [Request(f"q{i}", 0.0, prompt_len=4, max_tokens=100, segments=[Segment(100, "x", 2.0), Segment(1)])
            for i in range(3000)]
    p1, p1b, p2 = make_predictor("noisy:0.3", seed=1), make_predictor("noisy:0.3", seed=1), make_predictor("noisy:0.3", seed=2)
    lens1 = [p1.segment_output_len(r) for r in reqs]
    assert lens1 == [p1b.segment_output_len(r) for r in reqs]
    assert lens1 == [p1.segment_output_len(r) for r in reqs]          # same question, same answer
    assert lens1 != [p2.segment_output_len(r) for r in reqs]
    assert statistics.fmean(lens1) == pytest.approx(100, abs=2)
    assert statistics.pstdev(lens1) == pytest.approx(30, rel=0.08)
    durs = [p1.api_duration(r, 0.0, None) for r in reqs]
    assert statistics.pstdev(durs) == pytest.approx(0.6, rel=0.08)
    assert make_predictor("noisy:0").segment_output_len(reqs[0]) == 100


def test_api_type_mean_learns_from_the_scheduler():
    pred = make_predictor("api-type-mean")
    r = Request("a", 0.0, prompt_len=4, max_tokens=4, segments=[Segment(1, "calc", 99.0), Segment(1, "calc", 99.0), Segment(2)])
    assert pred.api_duration(r, 0.0, None) == 0.0    # nothing observed yet
    pred.observe_api("calc", 1.0)
    pred.observe_api("calc", 3.0)
    pred.observe_api("tts", 10.0)
    assert pred.api_duration(r, 0.0, None) == 2.0 and pred.version == 3
    assert pred.total_api_duration(r, 0.0) == 4.0
    sched = make_scheduler(make_policy("fcfs", predictor=pred))
    sched.add_request(r, 0.0)
    step(sched, 0.0)
    sched.api_return(r, 0, 6.0)                       # a 6 s call observed
    assert pred.mean("calc") == pytest.approx(10.0 / 3)


def test_elapsed_predictor_grows_with_time():
    pred = make_predictor("elapsed")
    r = Request("a", 0.0, prompt_len=4, max_tokens=2, segments=[Segment(1, "x", 9.0), Segment(1)])
    assert pred.api_duration(r, 5.0, None) == 0.0
    assert pred.api_duration(r, 5.0, 2.0) == 3.0
    with pytest.raises(ValueError):
        make_predictor("nope")


# ----------------------------------------------------------------- structures
def test_ranked_queue_orders_keeps_ties_and_allows_removal_while_iterating():
    q = RankedQueue()
    reqs = [Request(f"x{i}", 0.0, 1, 1) for i in range(6)]
    for r, k in zip(reqs, [(3,), (1,), (2,), (1,), (0,), (5,)]):
        q.add(r, k)
    assert [r.request_id for r in q] == ["x4", "x1", "x3", "x2", "x0", "x5"]
    seen = []
    for r in q:
        seen.append(r.request_id)
        if r.request_id in ("x4", "x3"):
            q.remove(r)
    assert seen == ["x4", "x1", "x3", "x2", "x0", "x5"]
    q.add(reqs[1], (9,))
    assert [r.request_id for r in q] == ["x2", "x0", "x5", "x1"] and len(q) == 4


def test_make_policy_rejects_unknown_names_and_options():
    with pytest.raises(ValueError, match="available"):
        make_policy("nope")
    with pytest.raises(ValueError, match="unknown options"):
        make_policy("lamps", bogus=1)
    with pytest.raises(ValueError):
        make_policy("fcfs", token_budget="huge")
    assert type(make_policy("mars")) is type(make_policy("lamps"))


def test_running_means_keep_a_bounded_number_of_api_types():
    """A caller naming a fresh API type (or request class) per request must not
    grow the predictors' tables for as long as the engine runs: beyond
    ``MAX_MEAN_KEYS`` a new key drops the one seen least often, and the types
    seen often keep their means."""
    from scheduler.predictors import MAX_MEAN_KEYS

    pred = make_predictor("api-type-mean")
    learned = make_predictor("learned")
    for _ in range(5):
        pred.observe_api("search", 2.0)
    for i in range(3 * MAX_MEAN_KEYS):
        pred.observe_api(f"tool-{i}", 1.0)
        r = Request(f"r{i}", 0.0, prompt_len=4, max_tokens=2, predictions={"class": f"class-{i}"})
        r.num_generated = 3
        learned.observe_output(r)
    assert len(pred._sum) == len(pred._count) == MAX_MEAN_KEYS
    assert len(learned._len_sum) == len(learned._len_count) == MAX_MEAN_KEYS
    assert pred.mean("search") == 2.0 and pred.mean(f"tool-{3 * MAX_MEAN_KEYS - 1}") == 1.0
    assert pred.mean("tool-0") == pred.default_s   # dropped: seen once, long ago


# ------------------------------------------------------------ priority classes
@pytest.mark.parametrize("name", ["fcfs", "lamps", "sjf", "prophet"])
def test_a_priority_class_is_admitted_before_the_policys_order(name):
    """Lower ``priority`` is admitted first whatever the policy ranks; within a class the
    policy's order stands (each policy here would admit ``early`` before ``urgent``)."""
    sched = make_scheduler(name, seqs=1)
    blocker = Request("blocker", 0.0, prompt_len=4, max_tokens=3)
    sched.add_request(blocker, 0.0)
    step(sched, 0.0)
    early = Request("early", 0.01, prompt_len=4, max_tokens=4)
    flex = Request("flex", 0.02, prompt_len=4, max_tokens=2, priority=1)
    later = Request("later", 0.03, prompt_len=4, max_tokens=8)
    urgent = Request("urgent", 0.04, prompt_len=4, max_tokens=16, priority=-1)
    for r in (early, flex, later, urgent):
        sched.add_request(r, r.arrival_time)
    assert [r.request_id for r in sched.admission_order()] == ["urgent", "early", "later", "flex"]
    assert sched.admission_key(urgent)[0] == -1
    admitted, now = [], 0.05
    while sched.has_unfinished():
        plan = step(sched, now)
        admitted += [c.request.request_id for c in plan.chunks
                     if c.request.request_id not in admitted and c.request is not blocker]
        now += 0.01
    assert admitted == ["urgent", "early", "later", "flex"]


@pytest.mark.parametrize("aging_s", [None, 0.5])
def test_aging_moves_starved_classes_lower_until_they_run(aging_s):
    """One seat, a new class-0 request every step (each needs a few): strict classes never
    admit the class-1 and class-2 requests waiting since 0; with ``priority_aging_s`` the
    class-1 one reaches class 0 at 0.5 s and, first by arrival there (fcfs), runs next; the
    class-2 one a step of 0.5 s later. The replay's metrics keep the class each arrived in."""
    from jaxserve.replay.metrics import request_metrics

    sched = make_scheduler("fcfs", seqs=1, priority_aging_s=aging_s)
    batch = Request("batch", 0.0, prompt_len=4, max_tokens=2, priority=1)
    bulk = Request("bulk", 0.0, prompt_len=4, max_tokens=2, priority=2)
    sched.add_request(batch, 0.0)
    sched.add_request(bulk, 0.0)
    started, now = {}, 0.0
    for i in range(200):   # 2 s
        sched.add_request(Request(f"i{i}", now, prompt_len=4, max_tokens=3), now)
        plan = step(sched, now)
        for chunk in plan.chunks:
            started.setdefault(chunk.request.request_id, now)
        now += 0.01
    if aging_s is None:
        assert "batch" not in started and "bulk" not in started
        assert (batch.priority, bulk.priority, batch.priority_aged) == (1, 2, 0)
        return
    assert 0.5 <= started["batch"] < 0.6 and 1.0 <= started["bulk"] < 1.1
    assert (batch.priority, batch.priority_aged, bulk.priority, bulk.priority_aged) == (0, 1, 0, 2)
    assert not sched.classes_in_use   # (all in class 0 now: the simulator's decode runs may resume)
    sched.check_invariants()
    assert request_metrics(bulk).priority == 2
    sched.set_priority(bulk, 1)   # (a caller's own choice, as a resume's ``priority``: the class it asks for now)
    assert (bulk.priority, bulk.priority_aged, request_metrics(bulk).priority) == (1, 0, 1)


def test_a_request_moved_up_by_aging_is_a_member_of_its_new_class():
    """A class-1 request aged to class 0 takes the only seat from the class-1 request
    holding it, as a request arriving in class 0 would, in the step it moves."""
    sched = make_scheduler("fcfs", seqs=1, priority_aging_s=0.2)
    holder = Request("holder", 0.0, prompt_len=4, max_tokens=100, priority=1)
    aged = Request("aged", 0.0, prompt_len=4, max_tokens=2, priority=1)
    sched.add_request(holder, 0.0)
    sched.add_request(aged, 0.0)
    now, plan = 0.0, None
    while not (plan and plan.preempted):
        plan = step(sched, now)
        now += 0.01
    assert 0.2 <= now - 0.01 < 0.21 and plan.preempted == [holder]
    assert [c.request for c in plan.chunks] == [aged] and (aged.priority, aged.priority_aged) == (0, 1)


def test_priority_aging_is_validated_and_reaches_the_engines_scheduler():
    import argparse

    from jaxserve import LLMEngine
    from jaxserve.config import EngineConfig
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    assert EngineConfig.from_cli(parser.parse_args(["--priority-aging-s", "60"])).priority_aging_s == 60.0
    assert EngineConfig().priority_aging_s is None   # (off: strict classes)
    engine = LLMEngine("demo", warmup=False, num_pages=32, max_model_len=512, priority_aging_s=30)
    assert engine.scheduler.config.priority_aging_s == 30.0
    for bad in (0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="priority_aging_s"):
            EngineConfig(priority_aging_s=bad)
        with pytest.raises(ValueError, match="priority_aging_s"):
            SchedulerConfig(priority_aging_s=bad)


def test_preemption_takes_the_lowest_priority_class_first():
    """Out of pages, the victim is the running request in the lowest class (``low``,
    ranked ahead of ``late`` by fcfs), not fcfs's own choice (the latest arrival)."""
    sched = make_scheduler("fcfs", num_pages=5, page_size=4, budget=64, seqs=8)
    first = Request("first", 0.0, prompt_len=4, max_tokens=12)
    low = Request("low", 0.0, prompt_len=4, max_tokens=12, priority=1)
    sched.add_request(first, 0.0)
    sched.add_request(low, 0.0)
    step(sched, 0.0)
    late = Request("late", 0.01, prompt_len=1, max_tokens=12)   # its pages come due after the others'
    sched.add_request(late, 0.01)
    preempted, now = [], 0.01
    while not preempted and sched.has_unfinished():
        preempted = [r.request_id for r in step(sched, now).preempted]
        now += 0.01
    assert preempted == ["low"]


def test_a_waiting_higher_class_preempts_lower_classes_for_a_seat_or_pages():
    """A class-0 arrival finds the batch full of class-1 requests: the policy's
    lowest-ranked of them is preempted and the arrival runs in the same step. It
    takes pages the same way, and never preempts when even every lower-class request's
    pages would not make it fit; an arrival of the same class waits its turn."""
    sched = make_scheduler("fcfs", seqs=2)
    batch = [Request(f"b{i}", 0.01 * i, prompt_len=4, max_tokens=50, priority=1) for i in range(2)]
    for r in batch:
        sched.add_request(r, r.arrival_time)
    step(sched, 0.0)
    peer = Request("peer", 0.02, prompt_len=4, max_tokens=4, priority=1)
    sched.add_request(peer, 0.02)
    assert not step(sched, 0.02).preempted and peer in sched.waiting
    urgent = Request("urgent", 0.03, prompt_len=4, max_tokens=4)
    sched.add_request(urgent, 0.03)
    plan = step(sched, 0.03)
    assert [r.request_id for r in plan.preempted] == ["b1"] and urgent in sched.running
    assert any(c.request is urgent for c in plan.chunks) and batch[1] in sched.waiting

    pages = make_scheduler("fcfs", num_pages=8, page_size=4, seqs=8)
    held = [Request(f"h{i}", 0.0, prompt_len=12, max_tokens=50, priority=1) for i in range(2)]
    for r in held:
        pages.add_request(r, 0.0)
    step(pages, 0.0)   # 6 of 8 pages held
    huge = Request("huge", 0.01, prompt_len=40, max_tokens=1)   # 10 pages: more than the pool frees
    pages.add_request(huge, 0.01)
    assert not step(pages, 0.01).preempted
    pages.abort("huge", 0.02)
    fits = Request("fits", 0.02, prompt_len=16, max_tokens=4)   # 4 pages: one of them must go
    pages.add_request(fits, 0.02)
    plan = step(pages, 0.02)
    assert [r.request_id for r in plan.preempted] == ["h1"] and fits in pages.running


@pytest.mark.parametrize("cache", [False, True])
def test_a_running_higher_class_is_served_first_and_never_preempts_itself_for_lower_ones(cache):
    """Six class-1 decoders fill most of the pool; a 64-token class-0 prompt is admitted
    behind them. Served in class order, it takes its pages from them as it grows (they
    are the victims), not from itself, and ends in a few steps."""
    sched = make_scheduler("fcfs", num_pages=26, page_size=4, budget=16, seqs=8, enable_prefix_caching=cache)
    batch = [Request(f"v{i}", 0.0, prompt_len=15, max_tokens=400, priority=1,
                     token_ids=list(range(100 * i, 100 * i + 15))) for i in range(6)]
    for r in batch:
        sched.add_request(r, 0.0)
    now = 0.0
    for _ in range(3):
        step(sched, now)
        now += 0.01
    urgent = Request("urgent", now, prompt_len=64, max_tokens=2, token_ids=list(range(900, 964)))
    sched.add_request(urgent, now)
    preempted, steps = [], 0
    while urgent.finish_time is None and steps < 50:
        preempted += step(sched, now).preempted
        now += 0.01
        steps += 1
    assert steps <= 8 and preempted and urgent not in preempted


def test_a_waiting_higher_class_takes_idle_holders_pages_and_the_budget_first():
    """Room for a class-0 arrival comes from a call's held KV before any running request,
    and nothing it freed goes to a higher class number in that step; a running class-1
    prompt leaves the budget to a waiting class-0 request."""
    sched = make_scheduler("fcfs", num_pages=12, page_size=4, budget=64, seqs=8, handling=Handling.PRESERVE)
    agent = Request("agent", 0.0, prompt_len=20, max_tokens=6, segments=[Segment(1, "tool", 100.0, 2), Segment(5)],
                    priority=1)
    decoder = Request("decoder", 0.0, prompt_len=12, max_tokens=40, priority=1)
    sched.add_request(agent, 0.0)
    sched.add_request(decoder, 0.0)
    step(sched, 0.0, [])
    step(sched, 0.01, [])   # the agent is in its call, its 5 pages held under Preserve
    assert agent.request_id in sched.paused and len(agent.device_pages) == 5
    urgent = Request("urgent", 0.02, prompt_len=16, max_tokens=2)
    sched.add_request(urgent, 0.02)
    plan = step(sched, 0.02, [])
    assert not plan.preempted and urgent in sched.running and decoder in sched.running
    assert not agent.device_pages and agent.api_calls[-1].fell_back_from == Handling.PRESERVE

    budget = make_scheduler("fcfs", num_pages=256, page_size=4, budget=16, seqs=3)
    d1, big = (Request("d1", 0.0, prompt_len=4, max_tokens=200, priority=1),
               Request("big", 0.0, prompt_len=400, max_tokens=4, priority=1))
    budget.add_request(d1, 0.0)
    step(budget, 0.0)
    budget.add_request(big, 0.01)
    step(budget, 0.01)
    interactive = Request("interactive", 0.02, prompt_len=4, max_tokens=2)
    budget.add_request(interactive, 0.02)
    plan = step(budget, 0.02)
    assert any(c.request is interactive for c in plan.chunks) and not plan.preempted


def test_no_preemption_for_a_class_when_the_pages_it_would_free_stay_held():
    """A class-1 request's system-prompt pages are shared with a running class-0 request:
    preempting it would free only its own page, too few for the class-0 arrival, so it
    keeps running (counting the shared pages as freed would preempt it in vain)."""
    sched = make_scheduler("fcfs", num_pages=12, page_size=4, budget=64, seqs=8, enable_prefix_caching=True)
    system = list(range(16))
    mine = Request("mine", 0.0, prompt_len=20, max_tokens=30, token_ids=system + [100, 101, 102, 103])
    sched.add_request(mine, 0.0)
    step(sched, 0.0)
    batch = Request("batch", 0.01, prompt_len=20, max_tokens=30, priority=1, token_ids=system + [200, 201, 202, 203])
    sched.add_request(batch, 0.01)
    step(sched, 0.01)
    assert batch.device_pages[:4] == mine.device_pages[:4] and sched.kv.num_free_device == 5
    big = Request("big", 0.02, prompt_len=36, max_tokens=2, token_ids=list(range(500, 536)))   # 9 pages
    sched.add_request(big, 0.02)
    assert not step(sched, 0.02).preempted and batch in sched.running


def test_set_priority_refiles_a_waiting_request_and_applies_when_a_paused_one_returns():
    """``Scheduler.set_priority`` (a client-side tool follow-up's class): a waiting request
    moves in the queue at once (one moved to its own class keeps its place); one paused
    in a call is filed in its new class when the call returns."""
    sched = make_scheduler("fcfs", seqs=1)
    blocker = Request("blocker", 0.0, prompt_len=4, max_tokens=20)
    sched.add_request(blocker, 0.0)
    step(sched, 0.0)
    first, second = Request("first", 0.01, prompt_len=4, max_tokens=2), Request("second", 0.01, prompt_len=4,
                                                                                  max_tokens=2)
    for r in (first, second):
        sched.add_request(r, r.arrival_time)
    sched.set_priority(first, 0)   # (a tie with second: re-filing would put it behind)
    assert [r.request_id for r in sched.admission_order()] == ["first", "second"] and not sched.classes_in_use
    sched.set_priority(first, 1)
    assert [r.request_id for r in sched.admission_order()] == ["second", "first"] and sched.classes_in_use

    calls = make_scheduler("fcfs", seqs=4)
    agent = Request("agent", 0.0, prompt_len=4, max_tokens=6, segments=[Segment(1, "tool", None, 2), Segment(5)])
    calls.add_request(agent, 0.0)
    step(calls, 0.0)
    step(calls, 0.01)
    assert agent.request_id in calls.paused
    later = Request("later", 0.02, prompt_len=4, max_tokens=2)
    calls.add_request(later, 0.02)
    calls.set_priority(agent, -1)
    calls.api_return(agent, 2, 0.03)
    assert calls.admission_order()[0] is agent and calls.admission_key(agent)[0] == -1


def test_a_waiting_class_never_starves_the_running_request_computing_its_next_page():
    """A class-1 request computes a long system prompt; a class-0 one with the same prefix
    waits for those pages (they reach it through the prefix cache). The step's tokens
    are not held back for the waiting one then, or neither would ever advance."""
    sched = make_scheduler("fcfs", num_pages=256, page_size=4, budget=16, seqs=8, enable_prefix_caching=True)
    system = list(range(1000, 1064))
    batch = Request("batch", 0.0, prompt_len=68, max_tokens=4, priority=1, token_ids=system + [1, 2, 3, 4])
    sched.add_request(batch, 0.0)
    step(sched, 0.0)
    interactive = Request("interactive", 0.01, prompt_len=68, max_tokens=4, token_ids=system + [5, 6, 7, 8])
    sched.add_request(interactive, 0.01)
    now, steps = 0.01, 0
    while interactive.finish_time is None and steps < 50:
        step(sched, now)
        now += 0.01
        steps += 1
    assert interactive.finish_time is not None and interactive.num_cached_tokens == 64


def test_pages_a_waiting_class_would_link_are_not_counted_as_freed_by_preempting_their_holder():
    """A class-1 request alone holds the system-prompt pages a class-0 arrival would link:
    preempting it frees none of the pages the arrival lacks, so it is not preempted."""
    sched = make_scheduler("fcfs", num_pages=16, page_size=4, budget=64, seqs=8, enable_prefix_caching=True)
    system = list(range(16))
    mine = Request("mine", 0.0, prompt_len=24, max_tokens=300, token_ids=list(range(300, 324)))
    sched.add_request(mine, 0.0)
    step(sched, 0.0)
    batch = Request("batch", 0.0, prompt_len=24, max_tokens=300, priority=1, token_ids=system + list(range(200, 208)))
    sched.add_request(batch, 0.0)
    step(sched, 0.01)
    head = Request("head", 0.02, prompt_len=49, max_tokens=2, token_ids=system + list(range(500, 533)))
    sched.add_request(head, 0.02)
    assert len(sched.kv.lookup(head)) == 4 and not step(sched, 0.02).preempted and batch in sched.running


def test_classes_are_in_use_only_while_a_request_of_another_class_lives():
    """Once the last request outside class 0 ends (or is aborted), scheduling is class
    0's again (the fast on-hand pass, decode runs)."""
    sched = make_scheduler("fcfs", seqs=1)
    for r in (Request("blocker", 0.0, prompt_len=4, max_tokens=3),
              Request("batch", 0.0, prompt_len=4, max_tokens=2, priority=1)):
        sched.add_request(r, 0.0)
    assert sched.classes_in_use
    now = 0.0
    while sched.has_unfinished():
        step(sched, now)
        now += 0.01
    assert not sched.classes_in_use
    sched.add_request(Request("late", now, prompt_len=4, max_tokens=2, priority=2), now)
    sched.abort("late", now)
    assert not sched.classes_in_use


def test_continuum_ttl_of_a_finished_request_does_not_touch_a_later_one_with_its_id():
    """Continuum's TTL entries name their request: an entry left by a request that ended (ids
    may be reused once a request is gone) must not move a later request given that id from
    Preserve to Discard (its pages then left the paused-holder index while on the device)."""
    from scheduler.request import ApiCallRecord
    policy = make_policy("continuum", ttl_max_s=1.0)
    view = None   # (Continuum's handling reads the predicted call duration only)
    old = Request("r", arrival_time=0.0, prompt_len=4, max_tokens=8)
    assert policy.handling(old, view, 0.0, 0.5) is Handling.PRESERVE
    old.api_calls.append(ApiCallRecord("x", Handling.PRESERVE, call_time=0.0))
    new = Request("r", arrival_time=1.0, prompt_len=4, max_tokens=8)   # (the old one ended; its id reused)
    assert policy.handling(new, view, 2.0, 0.5) is Handling.PRESERVE      # (a TTL to 2.5)
    new.api_calls.append(ApiCallRecord("x", Handling.PRESERVE, call_time=2.0))   # (as ``Scheduler.pause`` records it)
    assert list(policy.redecide(2.0, {"r": new}, lambda: view)) == []     # the old entry (0.5) is due: not its
    assert [(r.request_id, h) for r, h in policy.redecide(3.0, {"r": new}, lambda: view)] == [("r", Handling.DISCARD)]
