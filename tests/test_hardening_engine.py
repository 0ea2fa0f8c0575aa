"""Hostile and careless callers of the in-process engine (issue 13): cancellation at
every point of a request's life, values the step's arrays cannot hold.

One ``AsyncEngine`` over the demo model for the module, with a pool small enough
that requests wait, and ``--handling swap`` so paused requests move their pages.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from jaxserve.async_engine import AsyncEngine
from jaxserve.outputs import ApiCall
from jaxserve.sampling_params import INT32_MAX, SamplingParams


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine("demo", max_num_batched_tokens=32, max_num_seqs=2, num_pages=32, max_model_len=256,
                      handling="swap", policy="fcfs")
    yield eng
    eng.shutdown()


def _idle(engine: AsyncEngine) -> bool:
    u = engine.engine.usage()
    return (u["running"] == u["waiting"] == u["swapping"] == 0 and not any(u["paused"].values())
            and u["device_pages_used"] == 0 and u["host_pages_used"] == 0 and not engine.engine.scheduler.requests
            and not engine._streams)


async def _wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not _idle(engine):
        assert time.monotonic() < deadline, (engine.engine.usage(), list(engine.engine.scheduler.requests), list(engine._streams))
        await asyncio.sleep(0.02)


async def _consume(engine: AsyncEngine, request_id: str, params: SamplingParams, api_calls=None,
                   parse_tool_calls: bool | None = None) -> list:
    outs = []
    async for out in engine.generate(prompt="hello there", sampling_params=params, request_id=request_id,
                                      api_calls=api_calls, parse_tool_calls=parse_tool_calls):
        outs.append(out)
    return outs


async def _fresh_request_completes(engine: AsyncEngine) -> None:
    outs = await asyncio.wait_for(_consume(engine, f"fresh-{random.random()}",
                                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)), 30)
    assert outs[-1].finished and len(outs[-1].token_ids) == 4


def test_cancel_while_the_add_command_is_queued_keeps_the_engine_alive(engine):
    """Defect 1: a client that hangs up while its ``add_request`` waits in the inbox
    made the engine thread call ``set_result`` on a cancelled future and die."""
    async def scenario():
        busy = asyncio.ensure_future(engine._call(lambda: time.sleep(0.3)))   # hold the engine thread
        await asyncio.sleep(0.05)
        tasks = [asyncio.ensure_future(_consume(engine, f"q-{i}", SamplingParams(max_tokens=50, ignore_eos=True)))
                 for i in range(8)]
        await asyncio.sleep(0.05)   # every add_request is queued behind the sleep
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await busy
        await asyncio.sleep(0.2)
        assert engine.is_alive
        await _wait_idle(engine)
        await _fresh_request_completes(engine)
    asyncio.run(scenario())


def test_cancel_after_the_add_command_ran_leaves_no_orphan(engine):
    """A generate() cancelled between its command running and its first await: the
    request was added, nobody will read it, so it must be aborted, not left running."""
    async def scenario():
        for delay in (0.0, 0.001, 0.003, 0.01):
            task = asyncio.ensure_future(_consume(engine, f"o-{delay}",
                                                  SamplingParams(max_tokens=200, ignore_eos=True)))
            await asyncio.sleep(delay)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await _wait_idle(engine)
        assert engine.is_alive
    asyncio.run(scenario())


@pytest.mark.parametrize("hops", [0, 1, 2, 3])
def test_a_cancel_that_lands_as_an_output_arrives_still_aborts(engine, hops):
    """A consumer cancelled ``hops`` event-loop turns after an output was put on its stream
    (the server's non-streamed path cancels its reader at a moment unrelated to the outputs:
    a client gone mid-generation). ``asyncio.wait_for`` on Python 3.11 returned that output
    and dropped the cancel: the request ran to ``max_tokens``, the handler waiting for it."""
    async def scenario():
        rid = f"landing-{hops}"
        outs = []

        async def consume():
            async for out in engine.generate(prompt="hello there", request_id=rid,
                                             sampling_params=SamplingParams(max_tokens=200, ignore_eos=True)):
                outs.append(out)
        task = asyncio.ensure_future(consume())
        while len(outs) < 3:
            await asyncio.sleep(0.001)
        loop = asyncio.get_running_loop()
        queue = engine._streams[rid].queue
        put = queue.put_nowait

        def after(n, fn):
            loop.call_soon(fn) if n == 0 else loop.call_soon(after, n - 1, fn)

        def put_then_cancel(item):   # the engine thread's delivery of the next output
            put(item)
            queue.put_nowait = put
            after(hops, task.cancel)
        queue.put_nowait = put_then_cancel
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled(), f"the cancel was lost: {len(outs[-1].token_ids)} tokens, {outs[-1].finish_reason}"
        assert not outs[-1].finished
        await _wait_idle(engine)
        assert engine.is_alive
    asyncio.run(scenario())


@pytest.mark.parametrize("point", ["waiting", "running", "paused", "swapping"])
def test_cancellation_is_safe_at_every_point_of_a_request_life(engine, point):
    """Cancel requests while they wait for a slot, run, sit paused in an API call
    (swap handling: pages on the host) or move their pages; everything is freed."""
    async def scenario():
        rng = random.Random(point)
        long = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        calls = [ApiCall(after_tokens=3, duration_s=0.4, returned_token_ids=[5, 6, 7])]
        tasks = {}
        for i in range(6):   # max_num_seqs=2: four of these wait
            rid = f"{point}-{i}"
            api = calls if point in ("paused", "swapping") else None
            tasks[rid] = asyncio.ensure_future(_consume(engine, rid, long, api))
        deadline = time.monotonic() + 10
        seen = False
        while time.monotonic() < deadline and not seen:
            u = engine.engine.usage()
            seen = {"waiting": u["waiting"] > 0, "running": u["running"] > 0,
                    "paused": u["paused"].get("swap", 0) > 0, "swapping": u["swapping"] > 0 or
                    u["host_pages_used"] > 0}[point]
            await asyncio.sleep(0.001)
        assert seen, f"never saw a request {point}"
        for rid, task in tasks.items():
            await asyncio.sleep(rng.random() * 0.01)
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await _wait_idle(engine)
        assert engine.is_alive
        await _fresh_request_completes(engine)
    asyncio.run(scenario())


@pytest.mark.parametrize("field,value", [("top_k", 2**31), ("top_k", 2**63), ("max_tokens", 2**31),
                                         ("temperature", float("nan")), ("temperature", float("inf")),
                                         ("temperature", 1e39), ("top_p", float("nan")), ("seed", 2**32),
                                         ("stop_token_ids", [2**31])])
def test_values_the_step_cannot_hold_are_refused_before_the_step(engine, field, value):
    """Defect 2: ``top_k >= 2**31`` overflowed the int32 sampling array inside the step
    and aborted every request in the batch. The engine refuses it at add_request."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)   # bypass the constructor: add_request validates again

    async def scenario():
        bystander = asyncio.ensure_future(_consume(engine, f"by-{field}-{value}",
                                                   SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match=field):
            async for _ in engine.generate(prompt="x", sampling_params=params):
                pass
        outs = await bystander
        assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 30
        assert engine.is_alive
    asyncio.run(scenario())


def test_largest_representable_top_k_samples_fine(engine):
    async def scenario():
        outs = await _consume(engine, "topk-max", SamplingParams(max_tokens=3, top_k=INT32_MAX, seed=1,
                                                                 ignore_eos=True))
        assert len(outs[-1].token_ids) == 3
    asyncio.run(scenario())


def test_a_front_end_error_fails_only_its_own_request(engine, monkeypatch):
    """The front end (detokenizer, grammar, tool parser) raising on one request's
    token used to fail the whole step: every request in flight got "engine step
    failed", and one that had finished earlier in that step was never delivered
    (its stream hung). Now only that request fails, with its error raised to its
    caller; its batch-mate finishes normally and the engine keeps serving."""
    frontend = engine.engine.core.frontend
    on_event = frontend.on_event

    def failing(event, now):
        if event.request.request_id == "bad" and event.request.num_generated == 2:
            raise KeyError("broken parser state")
        return on_event(event, now)
    monkeypatch.setattr(frontend, "on_event", failing)

    async def scenario():
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        bad = asyncio.ensure_future(_consume(engine, "bad", params))
        good = asyncio.ensure_future(_consume(engine, "good", params))
        with pytest.raises(RuntimeError, match="request failed: KeyError: 'broken parser state'"):
            await asyncio.wait_for(bad, 30)
        outs = await asyncio.wait_for(good, 30)
        assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 6
        assert engine.is_alive
        await _wait_idle(engine)
        await _fresh_request_completes(engine)
    asyncio.run(scenario())
    assert engine.engine.stats.finished.get("error") == 1


def test_a_request_that_ended_in_a_failed_step_gets_an_error_not_silence(engine, monkeypatch):
    """A step that fails after the scheduler ended a request (here: ``update()``
    raising once it has finished "short") used to leave that request's stream
    waiting forever: the request was no longer live, so the failure handling
    (which fails live requests) never reached it, and its final output was lost
    with the step. Every stream owed an output now gets the step's error."""
    scheduler = engine.engine.scheduler
    update, raised = scheduler.update, []

    def failing_update(plan, result, now):
        events = update(plan, result, now)
        if not raised and any(e.request.request_id == "short" and e.request.is_finished for e in events):
            raised.append(True)
            raise RuntimeError("a scheduler defect")
        return events
    monkeypatch.setattr(scheduler, "update", failing_update)

    before = dict(engine.engine.stats.finished)

    async def scenario():
        # (not parsing calls: such a request reaching max_tokens is ended by the scheduler itself, in update())
        short = asyncio.ensure_future(_consume(engine, "short", SamplingParams(max_tokens=2, ignore_eos=True),
                                               parse_tool_calls=False))
        long = asyncio.ensure_future(_consume(engine, "long", SamplingParams(max_tokens=40, ignore_eos=True)))
        for task in (short, long):
            with pytest.raises(RuntimeError, match="engine step failed: a scheduler defect"):
                await asyncio.wait_for(task, 15)
        assert raised and engine.is_alive
        # The request the failed step left live ended as an error (was counted an "abort"), and the
        # metrics' gauges say so at once (they kept it running until the next request came).
        finished = engine.stats_snapshot.finished
        assert finished.get("error", 0) - before.get("error", 0) == 1
        assert finished.get("abort", 0) == before.get("abort", 0)
        assert engine.usage_snapshot["running"] == 0 and engine.usage_snapshot["waiting"] == 0
        await _wait_idle(engine)
        await _fresh_request_completes(engine)
    asyncio.run(scenario())


def test_a_refused_resumption_ends_the_paused_request_it_took():
    """Found by reading the code in the soak: a resumption the engine refused with anything but
    ``KeyError`` (here a token id outside the vocabulary) left the paused request in
    the engine, holding its pages, after its parked context was taken: no TTL was
    left to free it. It is aborted now, and the refusal reaches the caller. The same for a
    resumption whose task was cancelled before it ran."""
    from jaxserve.constraints import StructuredOutput
    from server.generation import ChoiceMerger, Job, job_outputs, sampling_key
    from server.parked import ParkedContext

    eng = AsyncEngine("demo", max_num_batched_tokens=32, num_pages=32, max_model_len=256, warmup=False)
    try:
        empty = {"type": "object", "properties": {}, "additionalProperties": False}
        params = SamplingParams(max_tokens=40, temperature=0.0,
                                structured=StructuredOutput.tool_call({"ext": empty}, name="ext", parallel=False))

        async def scenario() -> None:
            outs = await _consume(eng, "r", params, parse_tool_calls=True)
            assert outs[-1].finish_reason == "tool_calls" and eng.engine.is_live("r")
            context = outs[-1].prompt_token_ids + outs[-1].token_ids
            parked = ParkedContext("r", context, sampling_key(params), calls_seen=0, expires_at=time.monotonic() + 60)
            job = Job("r", context + [eng.engine.model_config.vocab_size + 7], params, parse_tool_calls=True,
                      resume_from=parked, resume_at=len(context))
            with pytest.raises(ValueError, match="token_ids must be integers"):
                async for _ in job_outputs(eng, job):
                    pass
            assert not eng.engine.is_live("r")
            # The same for a resumption whose task was cancelled before it ran (a response that
            # ended at once): nothing resumed or aborted the paused request.
            outs = await _consume(eng, "s", params, parse_tool_calls=True)
            context = outs[-1].prompt_token_ids + outs[-1].token_ids
            parked = ParkedContext("s", context, sampling_key(params), calls_seen=0, expires_at=time.monotonic() + 60)
            merger = ChoiceMerger(eng, [Job("s", context + [1, 2], params, parse_tool_calls=True, resume_from=parked,
                                            resume_at=len(context))])
            await merger.aclose()
            assert not eng.engine.is_live("s")
            await _wait_idle(eng)
        asyncio.run(scenario())
    finally:
        eng.shutdown()
