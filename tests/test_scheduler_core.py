"""Scheduler core driven by a tiny in-test loop (no JAX): pages, pauses, swaps, preemption."""

import random

import pytest

from scheduler import (BUILTIN_PROFILES, EventKind, Handling, PageAllocator, Request,
                       RequestState, Scheduler, SchedulerConfig, Segment, StepResult, make_policy)

COST = BUILTIN_PROFILES["gptj-6b-a100-40g"]


def make_scheduler(num_pages=64, host_pages=64, page_size=4, policy="fcfs", handling=None, budget=32):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16,
                                     swap_budget_tokens=8, handling=handling),
                     make_policy(policy), PageAllocator(num_pages, page_size),
                     PageAllocator(host_pages, page_size, "host"), COST)


def drive(sched, now=0.0, max_steps=5000):
    """Run until every request finishes; API calls return after their duration."""
    pending = []  # (return_time, request)
    steps = 0
    while sched.has_unfinished():
        steps += 1
        assert steps < max_steps, "no progress"
        for t, r in list(pending):
            if t <= now:
                pending.remove((t, r))
                sched.api_return(r, r.api_calls[-1].num_returned_tokens or r.policy_state["ret"], now)
        plan = sched.schedule(now)
        now += 0.01
        for event in sched.update(plan, StepResult(), now):
            r = event.request
            if event.kind is EventKind.API_CALL:   # paused by update(); its segment is behind it now
                seg = r.segments[r.segment_index - 1]
                assert r.state in (RequestState.PAUSED, RequestState.SWAPPING_OUT)
                r.policy_state["ret"] = seg.num_returned_tokens
                pending.append((now + seg.api_duration_s, r))
            elif r.num_generated >= r.max_tokens:
                assert event.kind is EventKind.FINISHED and r.finish_reason == "length"
        sched.check_invariants()
    assert sched.device_pool.num_free == sched.device_pool.num_pages
    assert sched.kv.num_free_host == sched.host_pool.num_pages
    return steps


def random_requests(n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        segs = [Segment(rng.randint(1, 6), "math", rng.choice([0.0, 0.02, 0.2]), rng.randint(0, 5))
                for _ in range(rng.randint(0, 3))]
        segs.append(Segment(rng.randint(1, 6)))
        out.append(Request(f"r{i}", arrival_time=0.0, prompt_len=rng.randint(1, 20),
                           max_tokens=sum(s.num_tokens for s in segs), segments=segs))
    return out


def test_ended_requests_are_not_kept_by_the_decoder_index():
    """A long-running engine: thousands of requests decode and end while a few
    run at a time. The index of decoders' places (``_decoder_places``) dropped
    stale entries only from its top, the newest decoder, so it kept every
    request that ever decoded (and its token lists) alive."""
    sched = make_scheduler(num_pages=256, budget=64)
    now = 0.0
    for wave in range(40):
        for r in random_requests(50, seed=wave):
            r.request_id = f"w{wave}-{r.request_id}"
            r.segments = [r.segments[-1]]
            r.max_tokens = r.segments[0].num_tokens
            sched.add_request(r, now)
        while sched.has_unfinished():
            plan = sched.schedule(now)
            now += 0.01
            sched.update(plan, StepResult(), now)
    assert len(sched._decoding) == 0
    assert len(sched._decoder_places) <= 2 * 16 + 64 + 1   # max_num_seqs 16: never more than that many decode


@pytest.mark.parametrize("handling", [Handling.PRESERVE, Handling.DISCARD, Handling.SWAP, None])
@pytest.mark.parametrize("policy", ["fcfs", "fcfs-improved", "infercept"])
def test_all_finish_with_tight_pool(handling, policy):
    sched = make_scheduler(num_pages=20, host_pages=6, policy=policy, handling=handling)
    for r in random_requests(24, seed=1):
        sched.add_request(r, 0.0)
    drive(sched)


def test_swap_frees_device_pages_and_falls_back_to_discard_when_host_full():
    sched = make_scheduler(num_pages=32, host_pages=2, handling=Handling.SWAP)
    a = Request("a", 0.0, prompt_len=12, max_tokens=4, segments=[Segment(1, "x", 1.0, 0), Segment(3)])
    b = Request("b", 0.0, prompt_len=12, max_tokens=4, segments=[Segment(1, "x", 1.0, 0), Segment(3)])
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    events = sched.update(sched.schedule(0.0), StepResult(), 0.0)
    assert [(e.request.request_id, e.kind) for e in events] == [("a", EventKind.API_CALL), ("b", EventKind.API_CALL)]
    # a (3 pages of 4 tokens) does not fit 2 host pages -> both fall back to discard
    assert a.handling == Handling.DISCARD and a.api_calls[-1].fell_back_from == Handling.SWAP
    assert not a.device_pages and a.num_computed_tokens == 0


def test_swap_out_is_chunked_by_swap_budget():
    sched = make_scheduler(num_pages=32, host_pages=32, handling=Handling.SWAP)
    a = Request("a", 0.0, prompt_len=16, max_tokens=4, segments=[Segment(1, "x", 1.0, 2), Segment(3)])
    sched.add_request(a, 0.0)
    events = sched.update(sched.schedule(0.0), StepResult(), 0.0)
    assert [e.kind for e in events] == [EventKind.API_CALL]
    assert a.state == RequestState.SWAPPING_OUT and len(a.device_pages) == 4
    copied = []
    while a.state == RequestState.SWAPPING_OUT:
        plan = sched.schedule(0.1)
        copied += [len(op.device_pages) for op in plan.swap_out]
        sched.check_invariants()
    assert copied == [2, 2]  # 8 tokens per step at page size 4
    assert a.state == RequestState.SWAPPED and not a.device_pages and len(a.host_pages) == 4
    assert sched.device_pool.num_free == 32


def test_preemption_takes_newest_running_first():
    sched = make_scheduler(num_pages=10, page_size=4, budget=64)
    old = Request("old", 0.0, prompt_len=8, max_tokens=20)
    new = Request("new", 1.0, prompt_len=8, max_tokens=20)
    sched.add_request(old, 0.0)
    sched.add_request(new, 1.0)
    preempted = []
    for step in range(40):
        plan = sched.schedule(step)
        preempted += [r.request_id for r in plan.preempted]
        sched.update(plan, StepResult(), step)
        sched.check_invariants()
        if not sched.has_unfinished():
            break
    assert preempted and preempted[0] == "new"
    assert not sched.has_unfinished()


def test_fcfs_returning_request_goes_to_tail_but_improved_keeps_arrival():
    for policy, first in (("fcfs", "late"), ("fcfs-improved", "early")):
        sched = make_scheduler(policy=policy)
        early = Request("early", 0.0, prompt_len=4, max_tokens=4, segments=[Segment(1, "x", 0.5, 1), Segment(3)])
        sched.add_request(early, 0.0)
        events = sched.update(sched.schedule(0.0), StepResult(), 0.0)
        assert [e.kind for e in events] == [EventKind.API_CALL] and early.state == RequestState.PAUSED
        late = Request("late", 0.2, prompt_len=4, max_tokens=4)
        sched.add_request(late, 0.2)
        sched.api_return(early, 1, 0.5)
        order = sched.admission_order()
        assert order[0].request_id == first, policy


def test_duplicate_id_and_abort_free_pages():
    sched = make_scheduler()
    r = Request("x", 0.0, prompt_len=9, max_tokens=3)
    sched.add_request(r, 0.0)
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(Request("x", 0.0, prompt_len=1, max_tokens=1), 0.0)
    sched.update(sched.schedule(0.0), StepResult(), 0.0)
    assert r.device_pages
    assert sched.abort("x", 0.1) is r and r.state == RequestState.ABORTED
    assert sched.abort("x", 0.1) is None
    assert sched.device_pool.num_free == sched.device_pool.num_pages
    sched.check_invariants()


def test_policy_binds_to_one_scheduler_and_with_kv_uses_the_given_manager():
    from scheduler.kv_manager import KVManager
    policy = make_policy("lamps")
    kv = KVManager(PageAllocator(8, 4), PageAllocator(8, 4, "host"))
    sched = Scheduler.with_kv(SchedulerConfig(max_num_batched_tokens=16), policy, kv, COST)
    assert sched.kv is kv and sched.device_pool is kv.device_pool and policy.context.page_size == 4
    with pytest.raises(ValueError, match="already bound"):
        Scheduler(SchedulerConfig(), policy, PageAllocator(8, 4), PageAllocator(8, 4, "host"), COST)
    r = Request("a", 0.0, prompt_len=6, max_tokens=1)
    sched.add_request(r, 0.0)
    sched.update(sched.schedule(0.0), StepResult(), 0.0)
    assert r.state == RequestState.FINISHED and kv.device_pool.num_free == 8


@pytest.mark.parametrize("policy,handling", [("augserve", Handling.PRESERVE), ("fcfs", Handling.SWAP),
                                             ("fcfs", Handling.DISCARD), ("fcfs", Handling.PRESERVE)])
def test_a_returned_call_is_marked_resumed_by_the_first_step_that_runs_it_again(policy, handling):
    """Whichever way a request re-enters the batch (straight from Preserve, a swap-in
    over several steps, re-admission), its call's ``resume_time`` is the clock of the
    first step that gives it a chunk after the return."""
    sched = make_scheduler(policy=policy, handling=handling, budget=64)
    r = Request("a", 0.0, prompt_len=40, max_tokens=8, segments=[Segment(2, "t", 0.05, 3), Segment(6)])
    sched.add_request(r, 0.0)
    now, returned, ran_after_return = 0.0, False, None
    while sched.has_unfinished():
        if r.state is RequestState.PAUSED or r.state is RequestState.SWAPPED or r.state is RequestState.SWAPPING_OUT:
            if not returned and not r.api_returned:
                sched.api_return(r, 3, now)
                returned = True
        plan = sched.schedule(now)
        if returned and ran_after_return is None and any(c.request is r for c in plan.chunks):
            ran_after_return = now
        now += 0.01
        sched.update(plan, StepResult(), now)
        sched.check_invariants()
    [call] = r.api_calls
    assert ran_after_return is not None and call.resume_time == ran_after_return


def test_decoders_keep_their_chunk_and_a_long_prompt_gets_what_they_leave():
    """A prompt admitted after the decoders, chunked over several steps, takes
    what the budget leaves after their tokens; each decoder's chunk object is
    reused from step to step, its ``start`` the request's computed tokens, and
    a decoder crossing into a new page gets the page."""
    sched = make_scheduler(num_pages=256, page_size=4, budget=16)
    decoders = [Request(f"d{i}", 0.0, prompt_len=3, max_tokens=40) for i in range(4)]
    for r in decoders:
        sched.add_request(r, 0.0)
    plan = sched.schedule(0.0)
    sched.update(plan, StepResult(), 0.01)                       # the four prompts: decoding from now on
    long = Request("long", 0.02, prompt_len=200, max_tokens=2)
    sched.add_request(long, 0.02)
    previous = None
    for step in range(12):
        plan = sched.schedule(0.02 + 0.01 * step)
        by_id = {c.request.request_id: c for c in plan.chunks}
        assert all(f"d{i}" in by_id for i in range(4)), f"step {step}: a decoder was stalled"
        assert plan.num_batched_tokens <= 16
        if long.num_computed_tokens < long.num_tokens:
            assert by_id["long"].num_tokens == 16 - 4               # the prompt gets what the decoders leave
        for r in decoders:
            chunk = by_id[r.request_id]
            assert (chunk.start, chunk.num_tokens, chunk.samples) == (r.num_computed_tokens, 1, True)
            assert len(r.device_pages) * 4 > r.num_computed_tokens   # the page its token writes is held
            if previous is not None:
                assert chunk is previous[r.request_id]              # the same record, not a new one per step
        previous = by_id
        sched.update(plan, StepResult(), 0.03 + 0.01 * step)
        sched.check_invariants()


def test_pages_short_takes_the_ordered_pass_and_preempts_like_before():
    """When a step's pages are not all on hand the ordered pass runs: the
    lowest-priority request is preempted, and the rest finish exactly."""
    sched = make_scheduler(num_pages=12, page_size=4, budget=32)
    reqs = [Request(f"r{i}", float(i) * 1e-3, prompt_len=6, max_tokens=14) for i in range(4)]
    for r in reqs:
        sched.add_request(r, r.arrival_time)
    drive(sched, now=0.01)
    assert sched.num_preemptions > 0
    assert all(r.finish_reason == "length" and r.num_generated == 14 for r in reqs)




def _swap_mix(seed: int) -> list[Request]:
    """Short requests, half of them calling an API that returns 10-40 tokens,
    arriving over 50 ms: with Swap and a small pool, a swapped request's
    swap-in can finish during admission without pages for its returned tokens,
    so requests admitted after it decode while it still has them to compute."""
    rng = random.Random(seed)
    out = []
    for i in range(rng.randint(4, 10)):
        segs = [Segment(rng.randint(1, 4), "math", 0.0, rng.randint(10, 40))] if rng.random() < 0.5 else []
        segs.append(Segment(rng.randint(1, 8)))
        out.append(Request(f"r{i}", arrival_time=rng.choice([0.0, 0.02, 0.05]), prompt_len=rng.randint(1, 12),
                           max_tokens=sum(s.num_tokens for s in segs), segments=segs))
    return sorted(out, key=lambda r: r.arrival_time)


@pytest.mark.parametrize("handling,requests,pages,budget", [
    (Handling.PRESERVE, random_requests(30, seed=11), 48, 12),
    (Handling.SWAP, random_requests(30, seed=11), 48, 12),
    (Handling.SWAP, _swap_mix(483), 16, 12),
])
def test_the_decode_set_plans_what_the_ordered_pass_plans(handling, requests, pages, budget):
    """Whenever the decode-set step applies, it plans the same chunks, preempts
    the same requests and leaves the same pages free as walking the batch in
    order: checked at every step, against a copy of the scheduler that takes
    the ordered pass. The last case has a request still computing returned
    tokens ahead of decoders that entered the batch after it."""
    import copy
    from types import MappingProxyType

    sched = make_scheduler(num_pages=pages, host_pages=64, page_size=4, handling=handling, budget=budget)
    todo = list(requests)
    now, pending, compared = 0.0, [], 0
    while todo or sched.has_unfinished():
        while todo and todo[0].arrival_time <= now:
            sched.add_request(todo.pop(0), now)
        for t, r in list(pending):
            if t <= now:
                pending.remove((t, r))
                sched.api_return(r, r.policy_state["ret"], now)
        preserved, sched._preserved = sched._preserved, None   # a read-only view: rebuilt for the copy
        ordered = copy.deepcopy(sched)
        sched._preserved, ordered._preserved = preserved, MappingProxyType(ordered.kv.paused_holders)
        ordered._schedule_on_hand = lambda *args: None
        plan, expected = sched.schedule(now), ordered.schedule(now)
        assert sorted((c.request.request_id, c.start, c.num_tokens) for c in plan.chunks) == \
            sorted((c.request.request_id, c.start, c.num_tokens) for c in expected.chunks), f"t={now:.2f}"
        assert [r.request_id for r in plan.preempted] == [r.request_id for r in expected.preempted]
        assert sched.device_pool.num_free == ordered.device_pool.num_free
        compared += bool(plan.chunks)
        now += 0.01
        for event in sched.update(plan, StepResult(), now):
            if event.kind is EventKind.API_CALL:
                r = event.request
                seg = r.segments[r.segment_index - 1]
                r.policy_state["ret"] = seg.num_returned_tokens
                pending.append((now + seg.api_duration_s, r))
        sched.check_invariants()
        assert compared < 5000, "no progress"
    assert compared > 10


def test_a_step_ends_and_pauses_requests_in_the_batch_order():
    """Two requests call an API in the same step: the one that entered the batch
    first pauses first (its handling is decided before the other's frees memory),
    although the decode-set step puts the chunk of the one still computing its
    prompt first."""
    sched = make_scheduler(num_pages=64, page_size=4, budget=16)
    early = Request("early", 0.0, prompt_len=2, max_tokens=5, segments=[Segment(3, "math", 0.1, 0), Segment(2)])
    late = Request("late", 0.01, prompt_len=20, max_tokens=3, segments=[Segment(1, "math", 0.1, 0), Segment(2)])
    sched.add_request(early, 0.0)
    sched.update(sched.schedule(0.0), StepResult(), 0.01)       # early's prompt: its first token
    sched.add_request(late, 0.01)
    sched.update(sched.schedule(0.01), StepResult(), 0.02)      # early's 2nd token; 15 of late's 20
    plan = sched.schedule(0.02)
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("late", 5), ("early", 1)]
    events = sched.update(plan, StepResult(), 0.03)
    assert [(e.request.request_id, e.kind) for e in events] == [("early", EventKind.API_CALL),
                                                                 ("late", EventKind.API_CALL)]


def test_a_preserved_call_returning_during_a_swap_in_waits_for_a_seat():
    """augserve resumes a Preserve call straight into the batch; it did so while another
    request swapping in held the last seat, and once that swap-in completed the batch held
    more than ``max_num_seqs`` requests (more rows than the engine's batch shapes allow)."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, swap_budget_tokens=4)   # a page a step
    policy = make_policy("augserve")
    choice = {"A": Handling.SWAP, "B": Handling.PRESERVE}
    policy.handling = lambda request, view, now, duration: choice[request.request_id]
    sched = Scheduler(config, policy, PageAllocator(32, 4), PageAllocator(32, 4, "host"), COST)
    a = Request("A", 0.0, prompt_len=12, max_tokens=2, segments=[Segment(1, "tool", 1.0, 0), Segment(1)])
    b = Request("B", 0.0, prompt_len=12, max_tokens=9, segments=[Segment(1, "tool", 1.0, 0), Segment(8)])
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    now, seen = 0.0, set()

    def step():
        nonlocal now
        plan = sched.schedule(now)
        assert len(sched.running) + len(sched.swapping_in) <= 1 and len(plan.chunks) <= 1
        now += 0.01
        sched.update(plan, StepResult(), now)
        sched.check_invariants()
        seen.add((a.state, b.state))

    step()
    while a.state is not RequestState.SWAPPED:
        step()
    assert b.state is RequestState.PAUSED and b.handling == Handling.PRESERVE
    sched.api_return(a, 0, now)
    step()
    assert a.state is RequestState.SWAPPING_IN
    sched.api_return(b, 0, now)   # the seat is the swap-in's: B waits
    assert b.state is RequestState.WAITING
    for _ in range(40):
        if not sched.has_unfinished():
            break
        step()
    assert not sched.has_unfinished() and a.is_finished and b.is_finished


def test_preemption_takes_the_latest_admitted_of_equal_rank_and_never_readmits_it_in_its_step():
    """Two requests of equal rank (fcfs, one arrival time) in a pool too small for both: the
    victim was the oldest (``max`` keeps the first of equal keys), so A, ahead and needing one
    page, preempted itself and the two ping-ponged; and a request preempted in a step was
    admitted again by that step, recomputing what it had just dropped, step after step."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False),
                      make_policy("fcfs"), PageAllocator(5, 4), PageAllocator(0, 4, "host"), COST)
    a = Request("A", 0.0, prompt_len=8, max_tokens=11)
    b = Request("B", 0.0, prompt_len=11, max_tokens=4)
    sched.add_request(a, 0.0)
    sched.add_request(b, 0.0)
    now, computed = 0.0, {"A": 0, "B": 0}
    while sched.has_unfinished():
        plan = sched.schedule(now)
        assert not {r.request_id for r in plan.preempted} & {c.request.request_id for c in plan.chunks}
        assert a not in plan.preempted
        for c in plan.chunks:
            computed[c.request.request_id] += c.num_tokens
        now += 0.01
        sched.update(plan, StepResult(), now)
        sched.check_invariants()
        assert now < 1.0, "no progress"
    # A computes its context once; B its context twice at most (preempted once)
    assert computed["A"] == 8 + 10 and computed["B"] <= 2 * (11 + 3)


def test_a_declared_call_at_max_tokens_with_segments_after_it_is_never_made():
    """A declared call (more segments after it) that falls on ``max_tokens`` (replay's token
    cap on a middle call): the request paused for it, and after the return sampled a token
    past its budget. It ends "length" at that token, its call never made (as the engine ends
    a turn of server-side calls at the last token); a call that is the last step is made."""
    for segments, made in (([Segment(2, "tool", 0.0, 1), Segment(5)], False), ([Segment(2, "tool", 0.0, 1)], True)):
        sched = make_scheduler()
        r = Request("r", 0.0, prompt_len=4, max_tokens=2, segments=segments)
        sched.add_request(r, 0.0)
        now, events = 0.0, []
        while sched.has_unfinished():
            plan = sched.schedule(now)
            now += 0.01
            for event in sched.update(plan, StepResult(), now):
                events.append(event.kind)
                if event.kind is EventKind.API_CALL:
                    assert sched.api_return(r, 1, now)   # (it ended the request: its last step)
            assert now < 1.0, "no progress"
        assert (EventKind.API_CALL in events) is made and r.num_generated == 2 and len(r.api_calls) == made
        assert r.finish_reason == ("stop" if made else "length")
        sched.check_invariants()
        assert sched.device_pool.num_free == sched.device_pool.num_pages


@pytest.mark.parametrize("more", [False, True])
def test_a_result_that_ends_the_request_may_fill_the_context_to_its_last_token(more):
    """A call's result is cut to leave room for the token sampled after it, and a call that
    ends the request (its last declared step) was cut by that one token too, though nothing
    is sampled after it. A call the request goes on from keeps it."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=32),
                      make_policy("fcfs"), PageAllocator(16, 4), PageAllocator(16, 4, "host"), COST)
    segments = [Segment(2, "tool", 0.0, 9)] + ([Segment(3)] if more else [])
    r = Request("r", 0.0, prompt_len=21, max_tokens=5 if more else 2, segments=segments)
    sched.add_request(r, 0.0)
    now = 0.0
    while r.num_generated < 2:
        plan = sched.schedule(now)
        now += 0.01
        sched.update(plan, StepResult(), now)
    assert sched.api_return(r, 9, now) is not more
    # 21 + 2 generated: 9 fit exactly when the request ends there, 8 leave a token's room otherwise
    assert r.api_calls[-1].num_returned_tokens == (8 if more else 9)
    sched.check_invariants()


def test_a_request_ended_by_an_error_teaches_the_predictor_nothing():
    """A failed step now ends every live request "error" (it was "abort"); as an abort, such
    an ending says nothing of how long outputs run, so the learned predictor's running means
    must not take it (waiting requests would pull them toward 0 tokens)."""
    sched = make_scheduler()
    seen = []
    sched.policy.predictor.observe_output = lambda request: seen.append(request.request_id)
    for rid in ("err", "abort", "stop"):
        sched.add_request(Request(rid, 0.0, prompt_len=4, max_tokens=4), 0.0)
    sched.finish(sched.requests["err"], "error", 0.0)
    sched.finish(sched.requests["abort"], "abort", 0.0)
    sched.finish(sched.requests["stop"], "stop", 0.0)
    assert seen == ["stop"]
