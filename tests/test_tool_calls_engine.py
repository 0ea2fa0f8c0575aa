"""Parsed tool calls inside the engine, on a tiny model trained to call tools:
server-side tools under every handling, failing and timing-out tools, and
calls to tools nobody registered."""

from __future__ import annotations

import dataclasses

import json
import time

import pytest

from jaxserve import LLM, SamplingParams, Tool

SIZES = dict(max_num_batched_tokens=64, num_pages=128, max_model_len=640, warmup=False, check_invariants=True)
GREEDY = SamplingParams(max_tokens=48, temperature=0.0)


def conversation(convs, tool_name):
    return next(c for c in convs if c.call["name"] == tool_name)


def expected_generated(conv) -> list[int]:
    return [t for t, m in zip(conv.full_ids, conv.generated_mask) if m]


def test_chat_renders_each_conversation_as_the_server_does(tool_checkpoint, tmp_path, monkeypatch):
    """``LLM.chat`` on the model trained on the server's renderings: every first turn is the
    very ids the server renders (the request's tools, then the engine's, calculator first),
    the registered tools run inside the reply, and a call to a tool given to ``chat`` ends
    its request with the call. Bad conversations and tools are ``ValueError``s naming them."""
    from conftest_server import NOTE_LOG_ENV, WEATHER_TOOL, record_note

    path, convs = tool_checkpoint
    monkeypatch.setenv(NOTE_LOG_ENV, str(tmp_path / "notes.txt"))
    llm = LLM(str(path), tools={"record_note": record_note}, **SIZES)
    served = [c for c in convs if not c.client_tools]
    outs = llm.chat([[{"role": "user", "content": c.user}] for c in served], GREEDY)
    for conv, out in zip(served, outs):
        assert out.prompt_token_ids == conv.prompt_ids
        assert out.token_ids == expected_generated(conv) and out.finish_reason == "stop"
    assert (tmp_path / "notes.txt").read_text() == "the sky is blue\n"
    weather = conversation(convs, "get_weather")
    [out] = llm.chat([{"role": "user", "content": weather.user}], GREEDY,
                     tools=[{**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": True}}])
    assert out.prompt_token_ids == weather.prompt_ids   # (a field templates are not given is left out)
    assert out.finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    # The follow-up turn, its call and result given back as a client sends them (text parts,
    # dict arguments): the very ids the server renders, and the trained answer after them.
    answer_len = len(weather.full_ids) - max(i for i, m in enumerate(weather.generated_mask) if not m) - 1
    parts = [{"type": "text", "text": "weather in "}, {"type": "text", "text": "Paris?"}]
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    follow = [{"role": "user", "content": parts}, {"role": "assistant", "content": None, "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "call_0", "content": weather.result}]
    [out] = llm.chat(follow, GREEDY, tools=[WEATHER_TOOL])
    assert out.prompt_token_ids == weather.full_ids[:-answer_len]
    assert out.token_ids == weather.full_ids[-answer_len:] and out.finish_reason == "stop"
    user = {"role": "user", "content": "hi"}
    for bad, match in [([], r"^messages"), ([{"content": "no role"}], r"^messages\[0\]\.role"),
                       ([user, {"role": "robot", "content": "x"}], r"^messages\[1\]\.role"),
                       ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                        r"^messages\[0\]\.content"),
                       ([{"role": "assistant", "tool_calls": "oops"}], r"^messages\[0\]\.tool_calls"),
                       ([[user], [{"role": "user", "content": 7}]], r"^messages\[1\]\[0\]\.content"),
                       ({"role": "user", "content": "a dict"}, r"^messages")]:
        with pytest.raises(ValueError, match=match):
            llm.chat(bad)
    for kwargs, match in [(dict(tools=[WEATHER_TOOL, {"type": "function"}]), r"^tools\[1\]"),
                          (dict(tools=[WEATHER_TOOL, WEATHER_TOOL]), r"^tools\[1\]: a second tool"),
                          (dict(tools=WEATHER_TOOL), r"^tools: a list"),
                          # a schema the server refuses (400) is refused here too, not put in the prompt
                          (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
                              "type": "object", "properties": {"a": {"type": "strin"}}}}}]),
                           r"^tools\[0\]\.function\.parameters: parameters is not a valid JSON Schema at properties/a"),
                          (dict(chat_template_kwargs={"tools": []}), r"^chat_template_kwargs: tools"),
                          (dict(tool_choice="required"), r"^tool_choice"),
                          (dict(continue_final_message=True), r"^continue_final_message")]:
        with pytest.raises(ValueError, match=match):
            llm.chat([user], **kwargs)
    assert not llm.engine.scheduler.requests   # nothing was queued by the refused calls
    # tool_choice "none": no tool advertised, no call parsed (the prompt is the bare chat's).
    [bare] = llm.chat([user], SamplingParams(max_tokens=2, temperature=0.0), tool_choice="none")
    assert bare.prompt_token_ids == llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [user], add_generation_prompt=True, tokenize=False), add_special_tokens=False)


@pytest.mark.parametrize("handling", ["preserve", "discard", "swap"])
def test_calculator_call_pauses_runs_and_continues_exactly(handling, tool_checkpoint):
    path, convs = tool_checkpoint
    calc = conversation(convs, "calculator")
    llm = LLM(str(path), handling=handling, **SIZES)
    out = llm.generate(prompt_token_ids=[calc.prompt_ids], sampling_params=GREEDY)[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == expected_generated(calc)
    [call] = out.api_calls
    assert (call.name, call.handling, call.error) == ("calculator", handling, None)
    assert call.returned_tokens == len(calc.tool_turn_ids)
    pool = llm.engine.scheduler.device_pool
    assert llm.engine.scheduler.kv.num_free_device == pool.num_pages   # free or cached-unreferenced


def test_failing_and_timing_out_tools_resume_with_an_error_and_engine_keeps_serving(tool_checkpoint):
    path, convs = tool_checkpoint
    note, calc = conversation(convs, "record_note"), conversation(convs, "calculator")

    def failing(text):
        raise RuntimeError("disk full")

    def slow(text):
        time.sleep(2)
        return "saved"

    # The model sees a generic error for a tool's own exception (its text goes to the log only).
    for tools, expect in (({"record_note": failing}, "tool 'record_note' failed (internal error)"),
                          ([Tool("record_note", slow, timeout_s=0.2)], "timed out")):
        llm = LLM(str(path), tools=tools, **SIZES)
        start = time.monotonic()
        out, ok = llm.generate(prompt_token_ids=[note.prompt_ids, calc.prompt_ids], sampling_params=GREEDY)
        assert time.monotonic() - start < 30
        assert out.api_calls[0].name == "record_note" and expect in out.api_calls[0].error
        assert "disk full" not in out.api_calls[0].error
        assert out.finish_reason in ("stop", "length")       # it continued after the error text
        assert ok.token_ids == expected_generated(calc)      # the other request was unaffected
        llm.engine.shutdown()


def test_unregistered_tool_ends_offline_generate_with_the_call(tool_checkpoint):
    path, convs = tool_checkpoint
    weather = conversation(convs, "get_weather")
    llm = LLM(str(path), **SIZES)
    out = llm.generate(prompt_token_ids=[weather.prompt_ids], sampling_params=GREEDY)[0]
    assert out.finish_reason == "tool_calls"
    assert out.tool_call["name"] == "get_weather" and '"Paris"' in out.tool_call["arguments"]
    assert not llm.engine.has_unfinished()
    pool = llm.engine.scheduler.device_pool
    assert llm.engine.scheduler.kv.num_free_device == pool.num_pages   # free or cached-unreferenced


def test_engine_resume_continues_a_client_side_call(tool_checkpoint):
    path, convs = tool_checkpoint
    weather = conversation(convs, "get_weather")
    llm = LLM(str(path), handling="swap", **SIZES)
    engine = llm.engine
    engine.add_request("w", prompt_token_ids=weather.prompt_ids, sampling_params=GREEDY)
    paused = None
    while paused is None:
        paused = next((o for o in engine.step() if o.finish_reason == "tool_calls"), None)
    recomputed = engine.stats.recomputed_tokens
    engine.resume("w", token_ids=weather.tool_turn_ids)
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.finished), None)
        if not engine.scheduler.has_work():
            time.sleep(0.001)
    assert final.finish_reason == "stop" and final.token_ids == expected_generated(weather)
    assert engine.stats.recomputed_tokens == recomputed   # swapped out and back in, not recomputed
    assert engine.stats.swapped_in_pages > 0


def test_a_call_written_with_the_last_allowed_token_pauses_and_needs_a_new_budget(tool_checkpoint):
    """A client-side call completed by the token that reaches ``max_tokens`` pauses the request as
    with room to spare (it ended "length"); its continuation must bring a budget of its own (a
    resume keeping "the rest" would sample past ``max_tokens``), and then goes on as before."""
    path, convs = tool_checkpoint
    weather = conversation(convs, "get_weather")
    llm = LLM(str(path), **SIZES)
    engine = llm.engine
    engine.add_request("roomy", prompt_token_ids=weather.prompt_ids, sampling_params=GREEDY)
    roomy = None
    while roomy is None:
        roomy = next((o for o in engine.step() if o.finish_reason == "tool_calls"), None)
    engine.abort("roomy")
    exact = dataclasses.replace(GREEDY, max_tokens=len(roomy.token_ids))
    engine.add_request("w", prompt_token_ids=weather.prompt_ids, sampling_params=exact)
    paused = None
    while paused is None:
        paused = next((o for o in engine.step() if o.finished), None)
    assert paused.finish_reason == "tool_calls" and paused.token_ids == roomy.token_ids
    assert paused.tool_calls == roomy.tool_calls
    with pytest.raises(ValueError, match="max_tokens"):
        engine.resume("w", token_ids=weather.tool_turn_ids)
    engine.resume("w", token_ids=weather.tool_turn_ids, max_tokens=GREEDY.max_tokens)
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.finished), None)
    assert final.finish_reason == "stop" and final.token_ids == expected_generated(weather)


def test_resume_is_validated_and_cannot_outgrow_the_page_pool(tool_checkpoint):
    path, convs = tool_checkpoint
    weather = conversation(convs, "get_weather")
    pages = -(-len(weather.prompt_ids) // 16) + 3      # prompt + call fit; little room after
    llm = LLM(str(path), page_size=16, num_pages=pages, max_num_batched_tokens=64, max_model_len=640,
              warmup=False, check_invariants=True)
    engine = llm.engine
    assert engine.context_limit == pages * 16
    engine.add_request("w", prompt_token_ids=weather.prompt_ids, sampling_params=GREEDY)
    while not any(o.finish_reason == "tool_calls" for o in engine.step()):
        pass
    with pytest.raises(ValueError, match="token_ids"):
        engine.resume("w", token_ids=["oops"])
    with pytest.raises(ValueError, match="token_ids"):
        engine.resume("w", token_ids=[10**6])
    engine.resume("w", token_ids=weather.tool_turn_ids * 10, max_tokens=500)   # far more than the pool holds
    final = None
    for _ in range(500):
        final = next((o for o in engine.step() if o.finished), None)
        if final is not None:
            break
    assert final is not None and final.finish_reason in ("length", "stop")
    assert engine.scheduler.num_preemptions == 0
    assert engine.scheduler.kv.num_free_device == pages


def test_a_resumed_turn_counts_min_tokens_penalties_and_seeded_steps_as_a_new_request_would(tool_checkpoint):
    """``resume(max_tokens=...)`` starts a new turn: its tokens are those of a fresh request
    whose prompt is the whole context so far, under the same ``min_tokens`` (which holds the
    answer's end-of-turn back longer than the answer is) and presence/frequency penalties
    (which count only this turn's tokens), and with the same seed, the same samples (the
    random stream's step counts this turn's tokens); its ``max_tool_calls`` counts its own
    calls. Before, the first turn's tokens already counted towards ``min_tokens``, were
    penalised as generated, and moved the seeded stream (4 of these 5 seeds then sampled
    otherwise than the fresh request: the trained model is peaked, hence the temperature)."""
    path, convs = tool_checkpoint
    weather = conversation(convs, "get_weather")
    llm = LLM(str(path), **SIZES)
    engine = llm.engine
    rules = SamplingParams(max_tokens=48, temperature=0.0, min_tokens=40, presence_penalty=0.4, frequency_penalty=0.2)
    runs = {"rules": rules, **{f"seed{k}": SamplingParams(max_tokens=48, temperature=1.6, seed=k) for k in (0, 3, 6, 7, 8)}}
    for name, params in runs.items():
        engine.add_request(name, prompt_token_ids=weather.prompt_ids, sampling_params=params)
    first_turns = {}
    while len(first_turns) < len(runs):
        for out in engine.step():
            if out.finished:
                first_turns[out.request_id] = out
    called = {name: list(out.token_ids) for name, out in first_turns.items() if out.finish_reason == "tool_calls"}
    assert "rules" in called and len(called) >= 3, {n: o.finish_reason for n, o in first_turns.items()}
    for name in called:
        request = engine.scheduler.requests[name]
        request.tool_calls_run = 2   # (as if the first turn had run server-side calls: max_tool_calls is per response)
        engine.resume(name, token_ids=weather.tool_turn_ids, max_tokens=48)
        assert request.tool_calls_run == 0 and request.turn_start == len(called[name])
    finals = {}
    while len(finals) < len(called):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.scheduler.has_work():
            time.sleep(0.001)
    names = sorted(called)
    fresh = llm.generate(prompt_token_ids=[weather.prompt_ids + called[n] + weather.tool_turn_ids for n in names],
                         sampling_params=[runs[n] for n in names])
    for name, out in zip(names, fresh):
        assert finals[name].token_ids[len(called[name]):] == out.token_ids, name
    assert len(fresh[names.index("rules")].token_ids) >= 40   # the end of the answer held back for this turn's 40 tokens


def test_a_call_inside_the_reasoning_is_not_parsed(tool_checkpoint):
    """With a reasoning parser the tool-call parser reads the answer only: a turn that
    does not think (qwen3: no <think> first) calls its tool as before; a turn that
    opens inside the reasoning and never closes it (deepseek_r1) keeps the call
    markup as reasoning, and nothing is called."""
    from jaxserve.reasoning import get_reasoning_format
    path, convs = tool_checkpoint
    calc = conversation(convs, "calculator")
    llm = LLM(str(path), reasoning_parser="qwen3", **SIZES)
    answer = llm.generate(prompt_token_ids=[calc.prompt_ids], sampling_params=GREEDY)[0]
    assert answer.token_ids == expected_generated(calc) and answer.reasoning == ""
    assert [c.name for c in answer.api_calls] == ["calculator"]
    llm.engine.reasoning_format = get_reasoning_format("deepseek_r1")
    thought = llm.generate(prompt_token_ids=[calc.prompt_ids], sampling_params=GREEDY)[0]
    assert thought.api_calls == [] and thought.finish_reason in ("stop", "length")
    assert thought.reasoning.startswith("<tool_call>") and "calculator" in thought.reasoning and thought.text == ""


def test_max_tool_calls_caps_the_server_side_calls_a_request_runs(tool_checkpoint):
    """``SamplingParams.max_tool_calls``: within the limit a call runs as ever (the same
    tokens); past it the tool is not run, the model gets an error result saying why and
    goes on; a bad limit is refused naming the field."""
    path, convs = tool_checkpoint
    calc = conversation(convs, "calculator")
    ran = []

    def calculator(expression):
        ran.append(expression)
        return "42"

    llm = LLM(str(path), tools={"calculator": calculator}, **SIZES)
    free, capped = llm.generate(prompt_token_ids=[calc.prompt_ids, calc.prompt_ids], sampling_params=[
        SamplingParams(max_tokens=48, temperature=0.0, max_tool_calls=1),
        SamplingParams(max_tokens=48, temperature=0.0, max_tool_calls=0)])
    assert len(ran) == 1 and free.api_calls[0].error is None
    [call] = capped.api_calls
    assert call.name == "calculator" and "max_tool_calls" in call.error
    assert capped.finish_reason in ("stop", "length") and capped.token_ids != free.token_ids
    with pytest.raises(ValueError, match="max_tool_calls"):
        SamplingParams(max_tool_calls=-1)
    llm.engine.shutdown()



def test_max_tool_calls_counts_the_calls_run_across_turns():
    """The limit counts calls run over every turn of the request: a malformed call does
    not use it up, a call in a later turn past it is refused (not run)."""
    from jaxserve.engine import LLMEngine
    from jaxserve.tool_format.base import ParsedToolCall
    ran = []

    def echo(text):
        ran.append(text)
        return text

    engine = LLMEngine("demo", page_size=8, num_pages=64, max_num_batched_tokens=64, max_model_len=256,
                       warmup=False, tools={"echo": echo})
    try:
        rid = engine.add_request(prompt_token_ids=[5, 6, 7, 8], sampling_params=SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True, max_tool_calls=1))
        request = engine.scheduler.requests[rid]

        def turn(calls):
            while request.num_generated < 2 + 4 * len(request.api_calls):
                engine.step()
            engine._pause_for_tools(request, calls, engine.clock.now())
            deadline = time.monotonic() + 20
            while request.request_id in engine.scheduler.paused:
                assert time.monotonic() < deadline
                engine.step()
            return request.api_calls[-1]

        first = turn([ParsedToolCall("", "{bad", ""), ParsedToolCall("echo", '{"text": "a"}', "")])
        assert ran == ["a"] and "malformed" in first.error
        second = turn([ParsedToolCall("echo", '{"text": "b"}', "")])
        assert ran == ["a"] and "max_tool_calls" in second.error
    finally:
        engine.shutdown()
