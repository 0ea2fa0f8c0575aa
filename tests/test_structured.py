"""Structured output in the engine, on the demo model (random weights: only the
constraint can make its text valid). JSON Schema features, greedy and sampled,
forced tool calls, API pauses mid-answer, unsatisfiable constraints, bad input,
the masked sampler itself, and that unconstrained rows in the same batch are
untouched."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, ApiCall, SamplingParams, StructuredOutput, Tool
from jaxserve.sampling import SamplingArrays, apply_token_bitmask, sample_masked

SIZES = dict(num_pages=256, max_num_batched_tokens=128, max_num_seqs=16, max_model_len=512, warmup=False,
             check_invariants=True)

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 8},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
    "address": {"type": "object", "properties": {"zip": {"type": "integer", "minimum": 1000, "maximum": 9999}},
                "required": ["zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "active", "tags", "address"], "additionalProperties": False}
SCORES = {"type": "array", "items": {"type": "integer", "minimum": -3, "maximum": 3}, "minItems": 2, "maxItems": 4}
CHOICE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
          "required": ["ok"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "lookup", "parameters": CHOICE}}]


ADD = Tool("add", lambda a, b: str(a + b), api_type="math", parameters={
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False})


@pytest.fixture(scope="module")
def llm():
    engine = LLM("demo", tools=[ADD], **SIZES)
    yield engine
    engine.engine.shutdown()


def test_a_grammar_ends_on_the_chat_templates_end_of_turn_when_it_is_an_eos(llm):
    """A forced parallel turn ends with EOS; with several EOS ids (Llama 3: end of text,
    end of message, end of turn) only the one the template writes after an assistant
    message lets a client's follow-up re-render the context and resume it."""
    engine = llm.engine
    end_of_turn = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn not in engine.eos_token_ids       # the demo's only EOS is another id
    assert engine._turn_end_ids() == engine.eos_token_ids
    saved = set(engine.eos_token_ids)
    try:
        engine.eos_token_ids |= {end_of_turn}
        assert engine._turn_end_ids() == {end_of_turn}
    finally:
        engine.eos_token_ids = saved


def valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_json_schema_answers_validate_greedy_and_sampled_in_one_batch(llm):
    prompts = ["Tell me about Ada.", "Scores please", "Yes or no?", "Another person", "x", "JSON!"]
    specs = [PERSON, SCORES, CHOICE, PERSON, SCORES, CHOICE]
    params = [SamplingParams(max_tokens=120, temperature=0.0 if i % 2 == 0 else 1.0, seed=i,
                             structured=StructuredOutput.json(s)) for i, s in enumerate(specs)]
    outs = llm.generate(prompts, params)
    for out, schema in zip(outs, specs):
        assert out.finish_reason == "stop", out.text
        valid(out.text, schema)
    # Sampling under the mask still varies with the seed: two seeds, same prompt, different answers.
    a, b = llm.generate(["Tell me"] * 2, [SamplingParams(max_tokens=120, temperature=1.0, seed=s,
                                                         structured=StructuredOutput.json(PERSON)) for s in (1, 2)])
    assert valid(a.text, PERSON) != valid(b.text, PERSON)


def test_both_mask_paths_give_the_same_tokens(llm):
    """The mask filled before one step program (the CPU path) and filled while the forward
    runs, sampled by a second program (the accelerator path): same tokens, greedy and seeded,
    and the same logprobs, which are the model's own, before the mask."""
    executor = llm.engine.executor
    params = [SamplingParams(max_tokens=60, temperature=t, seed=3, structured=StructuredOutput.json(PERSON),
                             logprobs=2 if t else None) for t in (0.0, 1.0)]
    default = executor.overlap_mask_fill
    answers, logprobs = {}, {}
    try:
        for overlap in (False, True):
            executor.overlap_mask_fill = overlap
            outs = llm.generate(["Who?", "Who?"], params)
            answers[overlap] = [o.token_ids for o in outs]
            logprobs[overlap] = outs[1].logprobs
            assert outs[0].logprobs is None
    finally:
        executor.overlap_mask_fill = default
    assert answers[False] == answers[True]
    assert [r.token_id for r in logprobs[True]] == answers[True][1]
    for a, b in zip(logprobs[False], logprobs[True]):
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-5)
    # Unmasked: the likeliest tokens may be ones the grammar forbids, so some sampled token is not among them.
    assert any(r.token_id not in [t for t, _ in r.top] for r in logprobs[False])


def test_unconstrained_neighbours_are_untouched(llm):
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    alone = llm.generate(["Hello there"], plain)[0]
    outs = llm.generate(["Hello there", "Give JSON", "Hello there"],
                        [plain, SamplingParams(max_tokens=60, temperature=0.0, structured=StructuredOutput.json(CHOICE)),
                         SamplingParams(max_tokens=24, temperature=0.7, seed=5)])
    assert outs[0].token_ids == alone.token_ids          # same greedy tokens beside a constrained row
    valid(outs[1].text, CHOICE)
    # Without a constraint the random model writes no JSON (so the constraint is what made it valid).
    with pytest.raises(ValueError):
        json.loads(alone.text)


def test_json_object_on_a_model_that_writes_json(tool_checkpoint):
    # json_object leaves strings unbounded, so a random model may never close one; the
    # tool model, trained to write a call's JSON, does. Its markup is banned: only the object remains.
    path, convs = tool_checkpoint
    llm = LLM(str(path), **{**SIZES, "max_model_len": 640})
    spec = StructuredOutput.json_object()
    outs = llm.generate(prompt_token_ids=[c.prompt_ids for c in convs],
                        sampling_params=SamplingParams(max_tokens=80, temperature=0.0, structured=spec))
    for out in outs:
        assert out.finish_reason == "stop" and not out.api_calls, out.text
        assert isinstance(json.loads(out.text), dict)
    llm.engine.shutdown()


@pytest.mark.parametrize("handling", ["preserve", "discard", "swap"])
def test_grammar_state_survives_an_api_pause_mid_answer(handling):
    llm = LLM("demo", handling=handling, **SIZES)
    calls = [ApiCall(after_tokens=6, duration_s=0.02, returned_token_ids=[40, 41, 42, 43])]
    out = llm.generate(["Who?"], SamplingParams(max_tokens=120, temperature=0.0, structured=StructuredOutput.json(PERSON)),
                       api_calls=[calls])[0]
    assert [c.handling for c in out.api_calls] == [handling]
    assert out.finish_reason == "stop"
    valid(out.text, PERSON)          # the returned tokens are context, not part of the JSON
    llm.engine.shutdown()


def test_forced_tool_calls_named_and_required(llm):
    named = StructuredOutput.tool_call(TOOLS, "get_weather")
    required = StructuredOutput.tool_call(TOOLS)
    outs = llm.generate(["Weather?", "Anything", "Call something"],
                        [SamplingParams(max_tokens=80, temperature=0.0, structured=named),
                         SamplingParams(max_tokens=80, temperature=1.0, seed=7, structured=required),
                         SamplingParams(max_tokens=80, temperature=0.0, structured=required)])
    for out in outs:
        assert out.finish_reason == "tool_calls", out.text
        schema = {"get_weather": WEATHER, "lookup": CHOICE}[out.tool_call["name"]]
        valid(out.tool_call["arguments"], schema)
    assert outs[0].tool_call["name"] == "get_weather"


def test_forced_server_side_call_runs_then_generation_continues_free(llm):
    spec = StructuredOutput.tool_call([ADD.openai_schema()], "add")
    out = llm.generate(["Compute"], SamplingParams(max_tokens=60, temperature=0.0, structured=spec))[0]
    [call] = out.api_calls
    assert call.name == "add" and call.error is None
    args = valid(call.arguments, ADD.parameters)
    assert out.text.startswith(f'<tool_call>{{"name": "add", "arguments": {json.dumps(args)}}}</tool_call>')
    assert out.finish_reason in ("stop", "length")
    after = out.text.split("</tool_call>", 1)[1]
    assert after          # it went on writing after the tool's result, no longer constrained


def test_forced_parallel_server_side_calls_all_run_and_return_in_call_order(llm):
    """Sampled (seed 6), the demo model writes several ``add`` calls in its forced turn: every one
    runs (the first sleeps longest), and their results enter the context together, in
    call order, before decoding goes on unconstrained."""
    import time
    ran, contexts = [], []

    def add(a: int, b: int) -> str:
        time.sleep(0.2 if not ran else 0.0)
        ran.append((a, b))
        return f"sum {a}+{b}={a + b}"

    engine = llm.engine
    tool = Tool("add", add, api_type="math", parameters=ADD.parameters)
    engine.tools["add"], wrap = tool, engine.result_token_ids
    engine.result_token_ids = lambda request, result: contexts.append(wrap(request, result)) or contexts[-1]
    try:
        spec = StructuredOutput.tool_call([tool.openai_schema()], "add")
        out = llm.generate(["Compute"], SamplingParams(max_tokens=120, temperature=1.0, seed=6, structured=spec))[0]
    finally:
        engine.tools["add"] = ADD
        del engine.result_token_ids
    [pause] = out.api_calls
    args = [valid(c["arguments"], ADD.parameters) for c in pause.tool_calls]
    assert len(args) >= 2 and [c["name"] for c in pause.tool_calls] == ["add"] * len(args)
    assert sorted(ran) == sorted((a["a"], a["b"]) for a in args) and pause.error is None
    [context] = contexts
    text = llm.tokenizer.decode(context, skip_special_tokens=False)
    positions = [text.index(f"sum {a['a']}+{a['b']}={a['a'] + a['b']}") for a in args]
    assert positions == sorted(positions) and text.count("<|im_start|>tool") == len(args)
    assert pause.returned_tokens == len(context) and out.finish_reason in ("stop", "length")
    assert out.text.count("</tool_call>") >= len(args)


def test_client_side_parallel_turn_is_resumed_with_one_result_per_call(llm):
    """A forced turn of several client-side calls pauses once with all of them; resuming
    with one text per call appends one tool turn each, in order, and decoding goes on."""
    engine = llm.engine
    spec = StructuredOutput.tool_call(TOOLS, "get_weather")   # the request's own tool: client-side
    rid = engine.add_request(prompt="Weather?", sampling_params=SamplingParams(
        max_tokens=160, temperature=1.0, seed=7, structured=spec))   # seed 7: two calls
    paused = None
    while paused is None:
        paused = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
    assert paused.finish_reason == "tool_calls" and len(paused.tool_calls) >= 2, paused.text
    for call in paused.tool_calls:
        valid(call["arguments"], WEATHER)
    results = [f"weather #{i}" for i in range(len(paused.tool_calls))]
    engine.resume(rid, text=results)
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
    [pause] = final.api_calls
    expected = engine.tokenizer.encode(engine.tool_format.wrap_results(results, engine.tokenizer.chat_template),
                                       add_special_tokens=False)
    assert pause.returned_tokens == len(expected) and final.finish_reason in ("stop", "length", "tool_calls")
    engine.abort(rid)   # it may have paused on a free-text call after the results


def test_a_forced_parallel_turn_ends_with_its_calls_at_any_budget(llm):
    """The turn is closed for the model before a call that would not fit, leaving the close
    a token that is not the last allowed: where the forced close (Hermes: EOS) was the last
    token, the request ended "length" and every complete call was lost."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}
    def run(max_tokens: int):
        spec = StructuredOutput.tool_call([weather], parallel=True)
        return llm.generate(["Weather in Paris?"], SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=2,
                                                                  structured=spec))[0]

    whole = run(400)
    assert whole.finish_reason == "tool_calls" and len(whole.tool_calls) >= 3   # (this seed keeps calling)
    n = len(whole.token_ids)
    for budget in range(n - 40, n + 2):
        out = run(budget)
        assert out.finish_reason == "tool_calls" and out.tool_calls, (budget, n, out.finish_reason)


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_forced_parallel_turn_in_list_formats_runs_every_call(parser):
    """With the Llama 3 JSON or Mistral format, the forced turn is a list of calls: the
    engine parses every call of it, runs them all (server-side) and goes on. The demo
    model keeps adding calls; the list is closed for it (``]`` forced) before a call that
    would not fit in ``max_tokens``, so the turn ends with complete calls, not "length"."""
    ran = []

    def add(a: int, b: int) -> str:
        ran.append((a, b))
        return str(a + b)

    tool = Tool("add", add, api_type="math", parameters=ADD.parameters)
    llm = LLM("demo", tools=[tool], tool_call_parser=parser, **SIZES)
    try:
        spec = StructuredOutput.tool_call([tool.openai_schema()], "add")
        outs = llm.generate(["Compute", "Sum"], [SamplingParams(max_tokens=120, temperature=1.0, seed=s,
                                                                structured=spec) for s in (1, 2)])
    finally:
        llm.engine.shutdown()
    calls = [c for out in outs for c in out.api_calls[0].tool_calls]
    assert all(c["name"] == "add" for c in calls) and len(calls) >= 2
    assert sorted(ran) == sorted((a["a"], a["b"]) for a in (valid(c["arguments"], ADD.parameters) for c in calls))
    opener = "[" if parser == "llama3_json" else "[TOOL_CALLS]["
    assert all(out.text.startswith(opener) or out.text.startswith("{") for out in outs)


PARALLEL_TOOLS = {"a": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                        "additionalProperties": False},
                  "b": {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"],
                        "additionalProperties": False}}
PARALLEL_TURN = {
    "hermes": ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>',
               '\n<tool_call>{"name": "b", "arguments": {"s": "]}"}}</tool_call>', ""),
    "llama3_json": ('[{"name": "a", "parameters": {"x": 1}}', ', {"name": "b", "parameters": {"s": "]}"}}', "]"),
    "mistral": ('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}', ', {"name": "b", "arguments": {"s": "]}"}}',
                "]"),
}


@pytest.mark.parametrize("name", sorted(PARALLEL_TURN))
def test_forced_call_grammar_of_each_format_allows_several_calls_only_when_parallel(llm, name):
    """Per format, on the demo tokenizer: the parallel grammar takes a turn of two calls
    (and the format's parser reads both back); the one-call grammar refuses the second."""
    from jaxserve.structured import StructuredDecoding
    from jaxserve.tool_format import get_format
    fmt, tok = get_format(name), llm.tokenizer
    decoding = StructuredDecoding(tok, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids, fmt)
    first, second, close = PARALLEL_TURN[name]
    ids = tok.encode(first + second + close, add_special_tokens=False)
    grammar = decoding.start(StructuredOutput.tool_call(PARALLEL_TOOLS, parallel=True))
    assert all(grammar.accept(t) is None for t in ids) and grammar.matcher.is_accepting()
    if grammar.ends_with_eos:   # Hermes: another block could follow; the model's EOS completes the turn
        assert grammar.active and grammar.accept(min(llm.engine.eos_token_ids)) is None
    assert grammar.turn_complete and not grammar.active
    calls = get_format(name).parser().feed(tok.decode(ids))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {"s": "]}"})]

    one = StructuredOutput.tool_call(PARALLEL_TOOLS, parallel=False)
    single = decoding.start(one)
    one_call = {"hermes": first, "llama3_json": first[1:], "mistral": first + "]"}[name]
    assert all(single.accept(t) is None for t in tok.encode(one_call, add_special_tokens=False))
    assert single.turn_complete          # one call completes the turn, no EOS needed
    if name != "hermes":                 # the list form is refused (Llama 3), or its second item (Mistral)
        refused = tok.encode("[" if name == "llama3_json" else first + second, add_special_tokens=False)
        other = decoding.start(one)
        assert "length" in [other.accept(t) for t in refused]


@pytest.mark.parametrize("name", sorted(PARALLEL_TURN))
def test_forced_call_grammar_takes_exactly_what_render_calls_writes(llm, name):
    """A forced turn is written as ``render_calls`` re-renders it for a client's follow-up:
    one and two calls are taken to the character, and spellings it never writes are refused
    (Hermes blocks not one line apart; Mistral's list with other separators). A Llama 3
    list of one call stays allowed: refusing it would force a model that opened one to
    invent a second call."""
    from jaxserve.structured import StructuredDecoding
    from jaxserve.tool_format import get_format
    fmt, tok = get_format(name), llm.tokenizer
    decoding = StructuredDecoding(tok, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids, fmt)
    a, b = ("a", '{"x": 1}'), ("b", '{"s": "]}"}')

    def takes(text: str, parallel: bool) -> bool:
        grammar = decoding.start(StructuredOutput.tool_call(PARALLEL_TOOLS, parallel=parallel))
        if any(grammar.accept(t) is not None for t in tok.encode(text, add_special_tokens=False)):
            return False
        if grammar.ends_with_eos and grammar.active:
            grammar.accept(min(llm.engine.eos_token_ids))
        return grammar.turn_complete

    assert takes(fmt.render_calls([a]), parallel=False) and takes(fmt.render_calls([b]), parallel=False)
    assert takes(fmt.render_calls([a]), parallel=True) and takes(fmt.render_calls([a, b]), parallel=True)
    other = {"hermes": fmt.render_calls([a]) + fmt.render_calls([b]),
             "llama3_json": "[" + fmt.render_calls([a]) + ",  " + fmt.render_calls([b]) + "]",
             "mistral": fmt.render_calls([a])[:-1] + ",  " + fmt.render_calls([b])[len("[TOOL_CALLS]["):]}[name]
    assert not takes(other, parallel=True)
    if name == "llama3_json":
        assert takes("[" + fmt.render_calls([a]) + "]", parallel=True)


@pytest.mark.parametrize("name", sorted(PARALLEL_TURN))
def test_forced_call_grammar_follows_refs_to_the_tools_own_defs(llm, name):
    """Parameters as pydantic (and ``openai.pydantic_function_tool``) write them, a nested
    model in ``$defs`` behind a ``$ref``: the call grammar nests them in a wrapper schema,
    where "#/$defs/..." named nothing and every forced call was a 400."""
    import pydantic

    from jaxserve.structured import StructuredDecoding
    from jaxserve.tool_format import get_format

    class Location(pydantic.BaseModel):
        city: str

    class Trip(pydantic.BaseModel):
        start: Location
        stops: list[Location]

    parameters = Trip.model_json_schema()
    assert "$defs" in parameters and parameters["properties"]["start"] == {"$ref": "#/$defs/Location"}
    fmt, tok = get_format(name), llm.tokenizer
    decoding = StructuredDecoding(tok, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids, fmt)
    spec = StructuredOutput.tool_call([{"type": "function", "function": {"name": "plan", "parameters": parameters}}],
                                      "plan")

    def takes(arguments: str) -> bool:
        grammar = decoding.start(spec)
        if any(grammar.accept(t) is not None for t in tok.encode(fmt.render_calls([("plan", arguments)]),
                                                                  add_special_tokens=False)):
            return False
        if grammar.ends_with_eos and grammar.active:
            grammar.accept(min(llm.engine.eos_token_ids))
        return grammar.turn_complete

    assert takes('{"start": {"city": "Paris"}, "stops": [{"city": "Lyon"}]}')
    assert not takes('{"start": {"town": "Paris"}, "stops": []}')   # the $defs schema holds
    # Refs that are not pointers to the parameters' root stay as they are: an anchor, and
    # anything inside a subschema with its own $id (it resolves against itself)
    for parameters in ({"type": "object", "properties": {"a": {"$ref": "#city"}},
                        "$defs": {"C": {"$anchor": "city", "type": "string"}}},
                       {"$id": "https://example.com/trip", "type": "object", "properties": {"a": {"$ref": "#/$defs/C"}},
                        "$defs": {"C": {"type": "string"}}}):
        grammar = decoding.start(StructuredOutput.tool_call(
            [{"type": "function", "function": {"name": "plan", "parameters": parameters}}], "plan"))
        written = tok.encode(fmt.render_calls([("plan", '{"a": "Lyon"}')]), add_special_tokens=False)
        assert all(grammar.accept(t) is None for t in written)


@pytest.mark.parametrize("name", sorted(PARALLEL_TURN))
def test_optional_call_grammar_takes_text_or_calls_to_the_allowed_tools_only(llm, name):
    """``allowed_tools`` in mode ``auto`` (``StructuredOutput.tool_call(..., optional=True)``),
    per format, on the demo tokenizer (Hermes tags are special tokens there, Mistral's marker
    is text: both ways of ending the text before a call): plain text is taken whole and the
    request may end; text before a call where the format has calls follow text; a call, or a
    turn of calls, to an allowed tool; not a call to a tool outside the allowed ones, not the
    format's call markup inside text, not text after the calls. Calls end the constraint
    (the engine pauses on them)."""
    from jaxserve.structured import StructuredDecoding
    from jaxserve.tool_format import get_format
    fmt, tok = get_format(name), llm.tokenizer
    decoding = StructuredDecoding(tok, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids, fmt)
    allowed = StructuredOutput.tool_call({"a": PARALLEL_TOOLS["a"]}, parallel=True, optional=True)
    a, b = fmt.render_calls([("a", '{"x": 1}')]), fmt.render_calls([("b", '{"s": "q"}')])

    def feed(text: str):
        grammar = decoding.start(allowed)
        for t in tok.encode(text, add_special_tokens=False):
            if grammar.accept(t) is not None:
                return None     # refused
        return grammar

    prose = feed("It is sunny, I think: no call needed here.")
    assert prose.active and prose.matcher.validate_tokens([min(llm.engine.eos_token_ids)]) == 1   # it may end
    assert feed(a) is not None and feed(b) is None
    assert feed(fmt.render_calls([("a", '{"x": 1}'), ("a", '{"x": 2}')])) is not None   # a turn of calls
    assert feed(fmt.render_calls([("a", '{"x": 1}'), ("b", '{"s": "q"}')])) is None
    if fmt.call_opener is not None:
        assert feed("Let me check. " + a) is not None and feed("Let me check. " + b) is None
        assert feed(f"I could write {fmt.call_opener} here") is None
    else:   # Llama 3: a turn that opens with JSON (after any space ``str.isspace`` skips) is a call to the parser
        assert feed('{"a": 1}') is None and feed("Mention <|python_tag|> here") is None
        for space in ("\x0c", "\u00a0", "\u2028", "\x1e", " \n"):   # (a call itself opens the turn, as forced)
            assert feed(space + b) is None and feed(space + "Hi") is not None
    if fmt.turn_ends_with_eos(True):   # Hermes: after a block, only another block (or the turn's end)
        assert feed(a + " and more text") is None and feed(a).active
    else:                              # a list or a call object: nothing may follow; the constraint ends
        assert not feed(a).active
    one = decoding.start(StructuredOutput.tool_call({"a": PARALLEL_TOOLS["a"]}, parallel=False, optional=True))
    assert all(one.accept(t) is None for t in tok.encode(a, add_special_tokens=False))
    assert not one.active    # one call completes the turn: the constraint ends (no "stop")


def test_optional_calls_may_follow_a_reasoning_block_that_mentions_the_markup(llm):
    """A thinking model (a turn that may open with its reasoning, Qwen3's) reasons as it
    would before an optional turn of calls: the reasoning may name the call markup (Mistral's
    marker is text on the demo tokenizer), which the answer's text may not."""
    from jaxserve.reasoning import ReasoningFormat
    from jaxserve.structured import StructuredDecoding
    from jaxserve.tool_format import get_format
    fmt, tok = get_format("mistral"), llm.tokenizer
    decoding = StructuredDecoding(tok, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids, fmt)
    spec = StructuredOutput.tool_call({"a": PARALLEL_TOOLS["a"]}, optional=True)
    thinking = ReasoningFormat("t", start="<think>", end="</think>")
    call = fmt.render_calls([("a", '{"x": 1}')])

    def takes(text: str, reasoning) -> bool:
        grammar = decoding.start(spec, reasoning)
        return all(grammar.accept(t) is None for t in tok.encode(text, add_special_tokens=False))

    thought = "<think>A [TOOL_CALLS] list would do.</think>\n"
    assert takes(thought + call, thinking) and takes(thought + "No call.", thinking)
    assert not takes(thought + call, None)                       # without it, the marker in text is refused
    assert not takes(thought + fmt.render_calls([("b", '{"s": "q"}')]), thinking)


def test_a_thinking_first_answer_starts_after_newlines_only_as_the_reasoning_split_reads_it(llm):
    """The thinking-first grammar let up to 4 spaces follow the end tag, where the reasoning
    split skips only newlines: a ``choice`` of "yes"/"no" answered " no" (Qwen3 few-shot)."""
    from jaxserve.reasoning import ReasoningFormat, ReasoningSplit
    from jaxserve.structured import StructuredDecoding
    from jaxserve.tool_format import get_format
    tok = llm.tokenizer
    decoding = StructuredDecoding(tok, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids, get_format("hermes"))
    thinking = ReasoningFormat("t", start="<think>", end="</think>")

    def takes(text: str, spec: StructuredOutput) -> bool:
        grammar = decoding.start(spec, thinking)
        return all(grammar.accept(t) != "length" for t in tok.encode(text, add_special_tokens=False))

    for spec in (StructuredOutput.choice(["yes", "no"]), StructuredOutput.regex("(yes|no)")):
        assert takes("<think>hm</think>\n\nno", spec) and takes("<think>hm</think>no", spec)
        assert not takes("<think>hm</think> no", spec) and not takes("<think>hm</think>\n no", spec)
    split = ReasoningSplit(thinking)
    text = "<think>hm</think>\n\nno"
    split.finish(text)
    assert split.content(text, len(text), final=True) == "no"


def test_allowed_tools_auto_calls_only_the_allowed_tool_and_otherwise_writes_text(llm):
    """Through the engine: with ``<tool_call>`` favoured, the greedy turn calls, the call
    (server-side ``add``) runs, and the grammar starts over after its result, so the next
    turn calls ``add`` again (unconstrained, the favoured tag would open calls it never
    closes). With ``</tool_call>`` favoured and ``<tool_call>`` disfavoured, the turn is
    text, and the grammar keeps the tag out of it, where the free turn is full of it."""
    tools = [ADD.openai_schema(), *TOOLS]
    spec = StructuredOutput.tool_call(tools, optional=True)
    only_add = StructuredOutput.tool_call([ADD.openai_schema()], optional=True)
    opener, closer = (llm.tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
    away = {opener: -100.0, closer: 20.0}
    calls, text, free = llm.generate(["Compute", "Compute", "Compute"], [
        SamplingParams(max_tokens=90, temperature=0.0, structured=only_add, logit_bias={opener: 50.0}),
        SamplingParams(max_tokens=30, temperature=0.0, structured=spec, logit_bias=away),
        SamplingParams(max_tokens=30, temperature=0.0, logit_bias=away)])
    assert len(calls.api_calls) >= 2, calls.text
    for call in calls.api_calls:
        assert call.name == "add" and call.error is None
        valid(call.arguments, ADD.parameters)
    assert calls.text.startswith('<tool_call>{"name": "add", "arguments": ')
    assert "</tool_call>" in free.text
    assert not text.api_calls and text.text and "tool_call>" not in text.text
    assert text.finish_reason in ("stop", "length")


def test_unsatisfiable_within_max_tokens_ends_with_length(llm):
    long_string = {"type": "string", "minLength": 200}
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=8, temperature=0.0, structured=StructuredOutput.json(s))
                                     for s in (long_string, PERSON)])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert all(len(o.token_ids) == 8 for o in outs)


def test_bad_constraints_are_value_errors_naming_the_field_and_queue_nothing(llm):
    with pytest.raises(ValueError, match=r"^response_format: .*not a valid JSON Schema"):
        SamplingParams(structured=StructuredOutput.json({"type": "strng"}))
    with pytest.raises(ValueError, match=r"^tool_choice: function 'nope'"):
        StructuredOutput.tool_call(TOOLS, "nope")
    with pytest.raises(ValueError, match=r"^tools: .*parameters of 'f'"):
        SamplingParams(structured=StructuredOutput.tool_call({"f": {"type": 3}}))
    unsatisfiable = SamplingParams(structured=StructuredOutput.json({"type": "string", "minLength": 5, "maxLength": 2}))
    with pytest.raises(ValueError, match=r"^response_format: the schema cannot be compiled"):
        llm.generate(["x"], unsatisfiable)
    assert not llm.engine.has_unfinished()


def test_a_language_without_text_or_an_integer_bound_past_64_bits_is_refused_naming_the_field(llm):
    """A schema that compiles but admits no text at all (``$ref`` to itself) erred only at the
    first mask and ended "stop" with empty content; integer bounds past 64 bits were clamped
    (``minimum: 1e19`` wrote 2**63 - 1) or refused naming no field."""
    for schema, message in (({"$ref": "#"}, "no text satisfies the schema"),
                            ({"type": "integer", "minimum": 1e19, "maximum": 1e19 + 1}, "beyond 64 bits at minimum: 1e"),
                            ({"type": "object", "properties": {"n": {"type": ["integer", "null"], "maximum": -1e19}}},
                             "beyond 64 bits at properties/n/maximum: -1e"),
                            ({"const": 10 ** 30}, "the schema cannot be compiled: Value is not JSON serializable")):
        with pytest.raises(ValueError, match=f"^response_format: .*{message}"):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured=StructuredOutput.json(schema)))
    assert not llm.engine.has_unfinished()
    from jaxserve.reasoning import ReasoningFormat
    decoding = llm.engine.structured   # (a turn that may think first: its answer's language is what is checked)
    with pytest.raises(ValueError, match="^response_format: no text satisfies the schema \\(NoExtensionBias\\)$"):
        decoding.start(StructuredOutput.json({"$ref": "#"}), ReasoningFormat("t", start="<think>", end="</think>"))
    data = {"type": "integer", "maximum": 3, "examples": [{"type": "integer", "minimum": -1e20}]}   # data, not a schema
    assert llm.generate(["x"], SamplingParams(max_tokens=4, structured=StructuredOutput.json(data)))[0].finish_reason


def test_a_grammar_at_a_dead_end_ends_with_length_not_stop(llm):
    """A schema whose property can never be written (a ``$ref`` cycle): llguidance then allows
    only EOS, and the request ended "stop" with ``{"a": `` as its answer."""
    cycle = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
             "$defs": {"x": {"$ref": "#/$defs/x"}}}
    stats = llm.engine.core.stats.finished
    before = dict(stats)
    outs = llm.generate(["x", "y"], [SamplingParams(max_tokens=30, temperature=0.0, structured=s) for s in (
        StructuredOutput.json(cycle), StructuredOutput.lark('start: "a" /[^\\s\\S]/'))])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[0].text.startswith('{"a":') and outs[1].text == "a" and len(outs[0].token_ids) < 30
    assert stats.get("length", 0) == before.get("length", 0) + 2 and stats.get("stop", 0) == before.get("stop", 0)


def test_masked_sampler_only_picks_allowed_tokens():
    rng = np.random.default_rng(0)
    rows, vocab = 4, 70
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    allowed = rng.random((rows, vocab)) < 0.1
    allowed[:, 3] = True
    allowed[3] = True                                   # an unconstrained row
    padded = np.zeros((rows, 96), bool)
    padded[:, :vocab] = allowed
    bitmask = np.packbits(padded, axis=1, bitorder="little").view(np.int32)
    masked = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    assert np.array_equal(np.isfinite(masked), allowed)
    assert np.array_equal(masked[allowed], logits[allowed])
    sample = jax.jit(sample_masked)
    for temp in (0.0, 1.0):
        params = SamplingArrays(temperature=jnp.full(rows, temp, jnp.float32), top_k=jnp.zeros(rows, jnp.int32),
                                top_p=jnp.ones(rows, jnp.float32), min_p=jnp.zeros(rows, jnp.float32),
                                seed=jnp.arange(rows, dtype=jnp.uint32),
                                step=jnp.zeros(rows, jnp.int32))
        for step in range(5):
            params = SamplingArrays(**{**params.__dict__, "step": jnp.full(rows, step, jnp.int32)})
            tokens = np.asarray(sample(jnp.asarray(logits), jnp.asarray(bitmask), params))
            assert allowed[np.arange(rows), tokens].all()
        if temp == 0.0:
            assert np.array_equal(tokens, np.where(allowed, logits, -np.inf).argmax(1))


def test_grammar_cache_keys_are_digests_of_the_whole_constraint():
    big = {"type": "object", "description": "x" * 1_000_000}
    key = StructuredOutput.json(big).key()
    assert len(key) == 64 and key == StructuredOutput.json(dict(big)).key()
    assert key != StructuredOutput.json({**big, "title": "t"}).key()
    assert StructuredOutput.json(PERSON).key() != StructuredOutput.tool_call(TOOLS).key()


def test_schema_checks_are_remembered_by_digest_and_bounded():
    """A server checks every request's schema: the answers are remembered by the
    schema's SHA-256 (a body may carry megabytes of schema; the texts themselves
    were kept, 1,024 of them), and an error quoting a huge part of it is cut."""
    from jaxserve import constraints

    constraints.check_schema({"type": "object", "description": "x" * 1_000_000}, "response_format")
    for i in range(constraints.SCHEMA_CHECKS_KEPT + 10):
        constraints.check_schema({"type": "object", "title": f"s{i}"}, "response_format")
    assert len(constraints._schema_checks) == constraints.SCHEMA_CHECKS_KEPT
    assert all(isinstance(k, bytes) and len(k) == 32 for k in constraints._schema_checks)
    for _ in range(2):   # the second answer comes from the table
        with pytest.raises(ValueError, match=r"^response_format: .*not a valid JSON Schema at properties") as e:
            constraints.check_schema({"properties": "y" * 100_000}, "response_format")
        assert len(str(e.value)) < 500


def test_regex_choice_and_grammar_constraints_are_checked_at_the_edge():
    """The vLLM kinds: bad values are ``ValueError`` naming the field (``structured_outputs``
    unless another is given); distinct constraints have distinct cache keys."""
    from jaxserve.constraints import StructuredOutput
    for bad in (StructuredOutput.regex(""), StructuredOutput.choice("yes"), StructuredOutput.choice([]),
                StructuredOutput.choice(["a", ""]), StructuredOutput.lark("x" * 20_000),
                StructuredOutput.regex("\ud800")):
        with pytest.raises(ValueError, match="^structured_outputs: "):
            SamplingParams(structured=bad)
    with pytest.raises(ValueError, match="^guided_regex: "):
        StructuredOutput.regex("", field="guided_regex").validate()
    keys = {StructuredOutput.regex("a").key(), StructuredOutput.regex("b").key(), StructuredOutput.lark("a").key(),
            StructuredOutput.choice(["a"]).key(), StructuredOutput.choice(["a", "b"]).key()}
    assert len(keys) == 5
