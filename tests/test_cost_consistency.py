"""One cost model: the policies' waste and ranking values price every step with
the same ``CostModel.t_step(n, c)`` as the simulated clock, so a different
profile moves the ranking the way it moves the clock."""

import dataclasses

import pytest

from jaxserve.core import SimClock
from jaxserve.executor.sim import SimExecutor
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation
from scheduler import BUILTIN_PROFILES, Request, Segment, StepResult, make_policy
from scheduler.cost_model import decode_cost, fill_cost, recompute_time

GPTJ = BUILTIN_PROFILES["gptj-6b-a100-40g"]
NO_CONTEXT = dataclasses.replace(GPTJ, fwd_per_context_token_s=0.0, name="no-context")
CONTEXT_HEAVY = dataclasses.replace(GPTJ, fwd_per_context_token_s=1e-3, name="context-heavy")
MEASURED = dataclasses.replace(GPTJ, step_overhead_s=0.002, fwd_per_context_token_s=2e-6, name="measured",
                               meta={"step_times_s": {"16": 0.004, "64": 0.009, "256": 0.02, "512": 0.05}})


@pytest.mark.parametrize("cost", [NO_CONTEXT, GPTJ, CONTEXT_HEAVY, MEASURED, MEASURED.timed(step_time_scale=1.7)],
                         ids=lambda c: f"{c.name}x{c.step_time_scale:g}")
def test_value_terms_are_sums_of_the_clock_step_time(cost):
    """decode_cost / fill_cost (closed forms) equal the step-by-step sums of t_step."""
    c0, out = 700, 93
    steps = [cost.t_step(cost.saturation_tokens, c0 + k) for k in range(out)]
    seconds, area = decode_cost(cost, c0, out)
    assert seconds == pytest.approx(sum(steps), rel=1e-9)
    assert area == pytest.approx(sum(t * (c0 + k + 0.5) for k, t in enumerate(steps)), rel=1e-9)

    start, fill, chunk = 130, 1100, 256
    want_s = want_a = 0.0
    done = 0
    while done < fill:
        n = min(chunk, fill - done)
        end = start + done + n
        t = cost.t_step(n, end)
        want_s += t
        want_a += t * (end - n / 2)
        done += n
    seconds, area = fill_cost(cost, start, fill, chunk)
    assert seconds == pytest.approx(want_s, rel=1e-9)
    assert area == pytest.approx(want_a, rel=1e-9)
    assert recompute_time(cost, 300) == cost.t_step(300, 300)


def _two_requests() -> tuple[Request, Request]:
    """A: a long prompt and a short answer; B: a short prompt and a long answer."""
    return (Request("A", 0.0, prompt_len=4000, max_tokens=2, segments=[Segment(2)]),
            Request("B", 0.0, prompt_len=10, max_tokens=400, segments=[Segment(400)]))


def _first_admitted(cost, policy_name: str) -> str:
    sched = build_scheduler(cost, make_policy(policy_name), SimConfig(page_size=16, num_device_pages=4096,
                                                                      num_host_pages=64, max_num_seqs=1))
    for r in _two_requests():
        sched.add_request(r, 0.0)
    plan = sched.schedule(0.0)
    return plan.chunks[0].request.request_id


def _served_area_alone(cost, request: Request) -> float:
    """Token-seconds of KV ``request`` holds from admission to its end when served
    alone, on the simulated clock (the quantity LAMPS ranks by)."""
    sched = build_scheduler(cost, make_policy("fcfs"), SimConfig(page_size=16, num_device_pages=4096,
                                                                 num_host_pages=64))
    executor = SimExecutor(sched.cost, sched.page_size, SimClock())
    sched.add_request(request, 0.0)
    now = area = 0.0
    while sched.has_unfinished():
        plan = sched.schedule(now)
        dt = executor.forward_time(plan)
        area += dt * sum(c.start + c.num_tokens for c in plan.chunks)
        sched.update(plan, StepResult(elapsed_s=dt), now)
        now += dt
    return area


@pytest.mark.parametrize("policy_name", ["lamps", "augserve"])
def test_a_context_heavy_profile_reverses_the_ranking_as_it_reverses_the_clock(policy_name):
    """Without a context term the long prompt with the short answer (A) costs less
    memory-time than the long answer (B); with a heavy one, A's every step reads
    4,000 tokens and costs more. The clock says so (each served alone), and the
    policy ranks accordingly under each profile."""
    for cost, cheaper in ((NO_CONTEXT, "A"), (CONTEXT_HEAVY, "B")):
        a, b = (_served_area_alone(cost, r) for r in _two_requests())
        assert ("A" if a < b else "B") == cheaper, (cost.name, a, b)
        assert _first_admitted(cost, policy_name) == cheaper, cost.name


def test_the_simulated_scale_reaches_the_policies_and_the_clock():
    """``SimConfig.step_time_scale`` makes one timed cost model: the scheduler's,
    its policy's and the simulated clock's."""
    results = {}
    for scale in (1.0, 2.0):
        config = SimConfig(page_size=16, num_device_pages=512, num_host_pages=64, step_time_scale=scale)
        policy = make_policy("lamps")
        sched = build_scheduler(GPTJ, policy, config)
        assert policy.context.cost is sched.cost
        assert sched.cost.t_step(100, 500) == pytest.approx(scale * GPTJ.t_step(100, 500))
        request = Request("r", 0.0, prompt_len=300, max_tokens=20, segments=[Segment(20)])
        sched.add_request(request, 0.0)
        fresh = Request("r", 0.0, prompt_len=300, max_tokens=20, segments=[Segment(20)])
        busy = run_simulation(build_scheduler(GPTJ, make_policy("lamps"), config), [fresh],
                              check_invariants=True).busy_time_s
        results[scale] = (policy.score(request, 0.0), busy)
    assert results[2.0][0] == pytest.approx(2 * results[1.0][0])    # the value doubles with the clock
    assert results[2.0][1] == pytest.approx(2 * results[1.0][1])
