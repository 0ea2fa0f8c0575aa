"""API-augmented requests: pausing under Preserve / Discard / Swap is exact,
swap really moves KV to host memory, tight pools never deadlock."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from jaxserve import LLM, ApiCall, SamplingParams, StructuredOutput
from scheduler import RequestState

GREEDY = dict(temperature=0.0, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


ONE_CALL = [ApiCall(after_tokens=8, duration_s=0.02, returned_token_ids=[5, 6, 7], api_type="math")]
THREE_CALLS = [ApiCall(5, 0.01, ids(4, 11), "math"), ApiCall(12, 0.03, ids(19, 12), "qa"),
               ApiCall(20, 0.0, [9], "ve")]


def spliced_reference(llm: LLM, prompt: list[int], generated: list[int], calls: list[ApiCall],
                      max_tokens: int) -> list[int]:
    """What an uninterrupted greedy run produces after each call, given the context with
    the returned tokens spliced in at the same places; returns the full generated list."""
    out: list[int] = []
    context = list(prompt)
    bounds = [c.after_tokens for c in calls] + [max_tokens]
    for i, end in enumerate(bounds):
        if i > 0:
            context += list(calls[i - 1].returned_token_ids)
        if i == 0:
            piece = llm.generate(prompt_token_ids=[context], sampling_params=SamplingParams(max_tokens=end, **GREEDY))
        else:
            piece = llm.generate(prompt_token_ids=[context], sampling_params=SamplingParams(
                max_tokens=end - bounds[i - 1], **GREEDY))
        seg = piece[0].token_ids
        # feed the paused run's own tokens forward so each segment is checked independently
        own = generated[len(out):len(out) + len(seg)]
        assert seg == own, f"segment {i} differs"
        out += own
        context += own
    return out


@pytest.mark.parametrize("pool", ["roomy", "tight"])
@pytest.mark.parametrize("handling", ["preserve", "discard", "swap"])
def test_paused_output_equals_spliced_uninterrupted_run(handling, pool):
    num_pages = 128 if pool == "roomy" else 16
    llm = LLM("demo", handling=handling, page_size=8, num_pages=num_pages, num_host_pages=64,
              max_num_batched_tokens=32, max_model_len=256, check_invariants=True, warmup=False,
              swap_budget_tokens=16)
    prompts = [ids(13, 1), ids(30, 2)] + [ids(5 + 7 * k, 20 + k) for k in range(4)]
    calls = [ONE_CALL, THREE_CALLS] + [[ApiCall(3 + k, 0.01, [4] * k, "x")] for k in range(4)]
    params = SamplingParams(max_tokens=28, **GREEDY)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, api_calls=calls)
    for prompt, call_list, out in zip(prompts, calls, outs):
        assert len(out.token_ids) == 28 and out.finish_reason == "length"
        assert [c.handling for c in out.api_calls] and len(out.api_calls) == len(call_list)
        spliced_reference(llm, prompt, out.token_ids, call_list, 28)
    used = {c.handling for o in outs for c in o.api_calls}
    if pool == "roomy":
        assert used == {handling}
    else:
        assert llm.engine.scheduler.num_preemptions > 0 or used != {handling}
    if handling == "swap":
        assert llm.engine.stats.swapped_out_pages > 0 and llm.engine.stats.swapped_in_pages > 0
    sched = llm.engine.scheduler
    assert sched.kv.num_free_device == sched.device_pool.num_pages   # free or cached-unreferenced
    assert sched.kv.num_free_host == sched.host_pool.num_pages   # free or host-tier cached


def test_swap_moves_kv_to_pinned_host_and_frees_device_pages():
    llm = LLM("demo", handling="swap", page_size=8, num_pages=12, num_host_pages=16,
              max_num_batched_tokens=64, max_model_len=96, check_invariants=True, warmup=False)
    engine = llm.engine
    engine.add_request("a", prompt_token_ids=ids(40, 3), sampling_params=SamplingParams(max_tokens=8, **GREEDY),
                       api_calls=[ApiCall(2, 3.0, [5, 6], "slow")])  # long enough to outlast a loaded machine
    req = engine.scheduler.requests["a"]
    while req.state not in (RequestState.SWAPPED,):
        engine.step()
    assert not req.device_pages and len(req.host_pages) == 6
    assert engine.scheduler.kv.num_free_device == 12   # its device copies: free or cached
    kinds = {engine.executor.host_memory_kind(req.request_id, p) for p in req.host_pages}
    assert kinds == {"pinned_host"}
    # another request now uses the freed device pages (it needs 11 of the 12)
    engine.add_request("b", prompt_token_ids=ids(80, 4), sampling_params=SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    engine.step()  # 80 prompt tokens take two steps of 64
    assert req.state == RequestState.SWAPPED and len(engine.scheduler.requests["b"].device_pages) == 10
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.kv.num_free_device == 12 and engine.scheduler.kv.num_free_host == 16   # or cached
    assert engine.usage()["api_calls"] == {"preserve": 0, "discard": 0, "swap": 1}   # (/metrics' api_calls_total)


def test_many_paused_requests_in_a_tight_pool_all_finish(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        llm = LLM("demo", policy="infercept", page_size=8, num_pages=10, num_host_pages=6,
                  max_num_batched_tokens=32, max_model_len=128, check_invariants=True, warmup=False)
    # a pool smaller than the context window is said at start, for the Python API as for the server
    assert "the KV pool holds 80 tokens, less than max_model_len=128" in caplog.text
    assert llm.engine.context_limit == 80
    prompts = [ids(4 + 3 * k, 50 + k) for k in range(12)]
    calls = [[ApiCall(2, 0.05 * (k % 3), [7] * (k % 4), "t"), ApiCall(6, 0.0, [8], "u")] for k in range(12)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=10, **GREEDY),
                        api_calls=calls)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outs)
    sched = llm.engine.scheduler
    assert sched.kv.num_free_device == 10 and sched.kv.num_free_host == 6   # free or host-tier cached


def test_resume_errors_and_bad_api_calls_leave_engine_serving():
    llm = LLM("demo", page_size=8, num_pages=32, max_num_batched_tokens=32, max_model_len=128, warmup=False)
    engine = llm.engine
    with pytest.raises(KeyError):
        engine.resume("nope", token_ids=[1])
    with pytest.raises(ValueError, match="priority"):
        engine.resume("nope", token_ids=[1], priority=0.5)
    with pytest.raises(ValueError, match="after_tokens"):
        ApiCall(after_tokens=0)
    for duration in (-1.0, float("nan"), float("inf")):   # (a NaN or endless call used to hang generate)
        with pytest.raises(ValueError, match="duration_s"):
            ApiCall(after_tokens=2, duration_s=duration)
    with pytest.raises(ValueError, match="after_tokens"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=4),
                     api_calls=[[ApiCall(after_tokens=5)]])
    done = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(KeyError):
        engine.resume(done[0].request_id, text="late")
    assert llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(max_tokens=3, **GREEDY))[0].token_ids \
        == done[0].token_ids


def test_a_refused_resume_leaves_the_paused_request_as_it_was():
    """A resume that fails its checks changes nothing: a ``max_tokens`` past the limit
    once left the new budget on the request, so the next valid resume ran to the
    context limit; results for more calls than the turn made went into the context."""
    llm = LLM("demo", page_size=8, num_pages=64, max_num_batched_tokens=32, max_model_len=256, warmup=False)
    engine = llm.engine
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured=StructuredOutput.tool_call({"ext": empty}, name="ext", parallel=False))

    def until_done(rid: str):
        while True:
            for out in engine.step():
                if out.request_id == rid and out.finish_reason:
                    return out

    engine.add_request("r", "call ext", params, parse_tool_calls=True)
    paused = until_done("r")
    assert paused.finish_reason == "tool_calls" and len(paused.tool_calls) == 1
    request = engine.scheduler.requests["r"]
    before = (request.max_tokens, request.sampling_params, len(request.token_ids))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.resume("r", text="ok", max_tokens=2**31 - 10)
    with pytest.raises(ValueError, match="3 results for the 1 call"):
        engine.resume("r", text=["one", "two", "three"])
    assert (request.max_tokens, request.sampling_params, len(request.token_ids)) == before
    assert engine.api.is_waiting_external("r")
    engine.resume("r", text=["the result"])   # one per call: accepted, and the request's own budget holds
    done = until_done("r")
    assert done.finish_reason in ("stop", "length", "tool_calls")
    assert request.num_generated <= params.max_tokens


def test_swapping_compiles_each_shape_once():
    """Warm-up covers every swap program, and each step shape compiles once, at its
    first use: a pool whose sharding changed after the swap-in scatter once recompiled
    every step bucket mid-run."""
    llm = LLM("demo", handling="swap", page_size=8, num_pages=12, num_host_pages=16,
              max_num_batched_tokens=32, max_model_len=64, swap_budget_tokens=64)
    executor = llm.engine.executor
    swap_programs = {f: f._cache_size() for f in (executor._gather, executor._scatter)}
    outs = llm.generate(prompt_token_ids=[ids(20, 5), ids(9, 6)],
                        sampling_params=SamplingParams(max_tokens=6, **GREEDY),
                        api_calls=[[ApiCall(2, 0.05, [5, 6, 7], "slow")], [ApiCall(3, 0.02, [8], "fast")]])
    assert all(len(o.token_ids) == 6 for o in outs)
    assert llm.engine.stats.swapped_in_pages > 0
    assert {f: f._cache_size() for f in swap_programs} == swap_programs
    assert len(executor.step_shapes) >= 2   # a prefill and a decode shape at least
    assert executor._step._cache_size() == len(executor.step_shapes)


def test_a_call_due_at_the_token_a_stop_string_ends_on_is_never_made():
    """A declared call due at the token that completes a stop string: the request ends
    "stop" and the call never runs, but it was listed in ``api_calls`` (a call made under a
    handling that never returned), where a stop token on that step lists none."""
    llm = LLM("demo", page_size=8, num_pages=32, max_num_batched_tokens=32, max_model_len=128, warmup=False)
    params = dict(GREEDY, max_tokens=4)
    free = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(**params))[0]
    texts = [llm.tokenizer.decode(free.token_ids[:k]) for k in range(1, 5)]
    # a character the k-th token writes first (k >= 2): a stop string completed by that token
    k, stop = next((k, c) for k in range(2, 4) for c in texts[k - 1][len(texts[k - 2]):]
                   if c not in texts[k - 2] and c.strip() and c != "\ufffd")
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(**params, stop=[stop]),
                       api_calls=[[ApiCall(after_tokens=k - 1, duration_s=0.001), ApiCall(after_tokens=k, duration_s=0.001)]])[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:k]
    assert len(out.api_calls) == 1 and out.api_calls[0].return_time is not None
    assert llm.engine.stats.finished.get("stop") == 1 and not llm.engine.has_unfinished()


def test_a_tool_result_the_tokenizer_cannot_take_fails_no_other_request(monkeypatch):
    """A result holding a lone surrogate (text read with ``errors="surrogateescape"``) made
    the tokenizer raise inside the step, and every request in flight failed with it. Lone
    surrogates now become U+FFFD; and a result that still cannot be turned into tokens
    fails its own request only (finish "error"), the others run on."""
    llm = LLM("demo", page_size=8, num_pages=64, max_num_batched_tokens=32, max_model_len=256, warmup=False)
    engine = llm.engine
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    call = SamplingParams(max_tokens=40, temperature=0.0,
                          structured=StructuredOutput.tool_call({"ext": empty}, name="ext", parallel=False))

    def run(until: set[str]) -> dict:
        ended = {}
        while not until <= set(ended):
            ended.update({out.request_id: out for out in engine.step() if out.finish_reason})
        return ended

    for rid in ("r", "s"):
        engine.add_request(rid, "call ext", call, parse_tool_calls=True)
    assert {o.finish_reason for o in run({"r", "s"}).values()} == {"tool_calls"}
    engine.add_request("bystander", prompt_token_ids=[5, 6], sampling_params=SamplingParams(max_tokens=24, **GREEDY))
    engine.resume("r", text="read \ud800 as bytes")
    request = engine.scheduler.requests["r"]
    ended = run({"r"})
    assert ended["r"].finish_reason != "error"
    assert "read \ufffd as bytes" in engine.tokenizer.decode(request.token_ids)
    real = engine.result_token_ids

    def failing(req, result):
        if req.request_id == "s":
            raise TypeError("a tokenizer defect")
        return real(req, result)
    monkeypatch.setattr(engine, "result_token_ids", failing)
    engine.resume("s", text="fine")
    ended = run({"s", "bystander"})
    assert ended["s"].finish_reason == "error" and "a tokenizer defect" in ended["s"].error
    assert ended["bystander"].finish_reason == "length" and len(ended["bystander"].token_ids) == 24


def test_a_server_side_turn_with_no_room_for_its_results_turn_is_not_run():
    """With less room in the context than the results' tool turn takes, a tool still ran:
    its result was cut with the wrapper (``<|im_end|>\\n<|im_start|>to``), or dropped, and
    the model sampled a token after the broken turn. Now the tools are not run and the
    request ends "length" at the call (as at the last allowed token); with room for the
    wrapper, the model always sees a closed tool turn, the result cut inside it."""
    window = 128
    llm = LLM("demo", page_size=8, num_pages=64, max_model_len=window, warmup=False,
              tools={"big": lambda: "abcdefghij " * 200})
    engine = llm.engine
    tok, sched = engine.tokenizer, engine.scheduler
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    seen = {}
    api_return = sched.api_return

    def spy(request, n, now, token_ids=None):
        seen["at"] = request.num_tokens
        done = api_return(request, n, now, token_ids)
        seen["kept"] = request.token_ids[seen["at"]:]
        return done
    sched.api_return = spy

    def run(prompt_len: int):
        seen.clear()
        params = SamplingParams(max_tokens=window - prompt_len, temperature=0.0, ignore_eos=True,
                                structured=StructuredOutput.tool_call({"big": empty}, name="big", parallel=False))
        return llm.generate(prompt_token_ids=[[(7 * i + 3) % 200 + 10 for i in range(prompt_len)]],
                            sampling_params=params, parse_tool_calls=True)[0]

    run(20)
    call = seen["at"] - 20   # tokens the forced call takes
    wrapper = len(tok.encode(engine.tool_format.wrap_results([""], tok.chat_template), add_special_tokens=False))
    for room in (1, 2, 6, wrapper - 1, wrapper, wrapper + 3, wrapper + 30):
        out = run(window - call - room)
        if room - 1 < wrapper:   # (a token to sample after the turn is kept)
            assert not out.api_calls and out.finish_reason == "length" and len(out.token_ids) == call, room
        else:
            closed = tok.decode(seen["kept"], skip_special_tokens=False)
            assert len(out.api_calls) == 1 and closed.endswith("<|im_end|>\n<|im_start|>assistant\n"), (room, closed)
    # A client-side call pauses at any room (the caller answers it, or sends a follow-up of its own);
    # a result given back with no room for its tool turn is refused and leaves the request paused.
    ext = SamplingParams(max_tokens=window, temperature=0.0, ignore_eos=True,
                         structured=StructuredOutput.tool_call({"ext": empty}, name="ext", parallel=False))
    engine.add_request("x", prompt_token_ids=[(7 * i + 3) % 200 + 10 for i in range(window - call - 3)],
                       sampling_params=dataclasses.replace(ext, max_tokens=call + 3), parse_tool_calls=True)
    while engine.is_live("x") and not engine.api.is_waiting_external("x"):
        engine.step()
    with pytest.raises(ValueError, match=r"the context window has \d token\(s\) left, fewer than the \d+ of"):
        engine.resume("x", text="a result")
    assert engine.api.is_waiting_external("x")
    engine.abort("x")
