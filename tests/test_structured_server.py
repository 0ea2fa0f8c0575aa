"""Structured output through the HTTP server (a real ``uvicorn`` subprocess
serving the demo model, random weights: only the constraint can make the JSON
valid): ``response_format`` json_schema, ``tool_choice`` named and
``"required"``, one call or several in a turn (``parallel_tool_calls``, also
through the official ``openai`` client), streamed and not, greedy and sampled,
``n > 1``, bad input."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest_server import ServerProcess
from test_server import assert_error, metrics, stream

PROFILE = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 10},
    "level": {"type": "integer", "minimum": 1, "maximum": 5},
    "plan": {"enum": ["free", "pro"]},
    "verified": {"type": "boolean"},
    "langs": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "level", "plan", "verified", "langs"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "repeat": {"type": "boolean"}},
         "required": ["hour", "repeat"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured-server")
    server = ServerProcess("demo", ["--max-num-batched-tokens", "64", "--num-pages", "128", "--max-model-len", "1024",
                                    "--max-num-seqs", "16"], log_path=tmp / "server.log").start()
    try:
        server.wait_ready()
        with httpx.Client(base_url=server.url, timeout=120) as c:
            yield c
    finally:
        server.stop()


def body(content: str, **kw) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 100, **kw}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_answers_validate_greedy_sampled_n2_and_streamed(client):
    fmt = json_schema_format(PROFILE)
    r = client.post("/v1/chat/completions", json=body("Profile of Ada?", response_format=fmt))
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "stop"
    greedy = json.loads(choice["message"]["content"])
    jsonschema.validate(greedy, PROFILE)

    r = client.post("/v1/chat/completions", json=body("Profile of Ada?", response_format=fmt, n=2,
                                                      temperature=1.0, seed=11))
    assert r.status_code == 200, r.text
    answers = [json.loads(c["message"]["content"]) for c in r.json()["choices"]]
    for a in answers:
        jsonschema.validate(a, PROFILE)
    assert answers[0] != answers[1]          # each choice has its own matcher and seed

    events = stream(client, "/v1/chat/completions", body("Profile of Ada?", response_format=fmt))
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert json.loads(text) == greedy        # streamed deltas join into the same answer
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "set_alarm"}}, "required"])
def test_forced_tool_calls_streamed_and_not(client, tool_choice):
    req = body("Wake me up", tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    r = client.post("/v1/chat/completions", json=req)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert "<tool_call>" not in choice["message"].get("content", "")
    if isinstance(tool_choice, dict):
        assert call["function"]["name"] == "set_alarm"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])

    sampled = client.post("/v1/chat/completions", json={**req, "temperature": 1.0, "seed": 3, "n": 2}).json()
    for c in sampled["choices"]:
        [sc] = c["message"]["tool_calls"]
        jsonschema.validate(json.loads(sc["function"]["arguments"]), SCHEMAS[sc["function"]["name"]])

    events = stream(client, "/v1/chat/completions", req)
    deltas = [d for e in events[:-1] if e["choices"] for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == call["function"]["name"] and deltas[0]["id"].startswith("call_")
    pieces = [d["function"]["arguments"] for d in deltas[1:]]
    assert "".join(pieces) == call["function"]["arguments"]   # the very text the response without stream has
    # sent piece by piece as the model wrote them (not cut from the whole at the end, 16 characters a piece)
    assert len(pieces) > -(-len(call["function"]["arguments"]) // 16) + 2 and "" not in pieces
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def openai_client(client):
    import openai
    return openai.OpenAI(base_url=str(client.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls: list, names: set[str]) -> None:
    """Each call has its own id, names one of ``names``, and its arguments validate."""
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    for c in calls:
        assert c.type == "function" and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "set_alarm"}}, "required"])
def test_parallel_tool_calls_several_in_one_turn_streamed_and_not_with_the_openai_client(client, tool_choice):
    """Greedy, the demo model keeps opening ``<tool_call>`` blocks: several calls in one
    turn, each valid, each with its own id; streamed as tool_call deltas 0, 1, … whose
    argument fragments join into the same calls."""
    api = openai_client(client)
    names = {"set_alarm"} if isinstance(tool_choice, dict) else set(SCHEMAS)
    req = dict(model="demo", messages=[{"role": "user", "content": "Wake me up twice"}], tools=TOOLS,
               tool_choice=tool_choice, temperature=0, max_tokens=160)
    reply = api.chat.completions.create(**req)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls
    assert len(calls) >= 2, calls
    check_calls(calls, names)

    chunks = list(api.chat.completions.create(**req, stream=True))
    by_index: dict[int, dict] = {}
    for chunk in chunks:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = by_index.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
    assert sorted(by_index) == list(range(len(calls)))
    assert [(e["name"], e["arguments"]) for _, e in sorted(by_index.items())] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert len({e["id"] for e in by_index.values()}) == len(calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)   # no markup leaks


def test_a_turn_of_calls_streams_through_the_responses_api_call_by_call(client):
    """The Responses stream of a forced parallel turn: each call's item is added, its
    arguments arrive piece by piece as written and the item is done before the next call's
    is added; the pieces join into the ``done`` arguments and into the final response's,
    at the ``output_index`` each has there; the same calls as without ``stream``."""
    api = openai_client(client)
    req = dict(model="demo", input="Wake me up twice", temperature=0, max_output_tokens=160,
               tools=[{"type": "function", **t["function"]} for t in TOOLS], tool_choice="required")
    whole = api.responses.create(**req)
    events = list(api.responses.create(**req, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) >= 2 and [(c.name, c.arguments) for c in calls] == \
        [(item.name, item.arguments) for item in whole.output if item.type == "function_call"]
    open_index, pieces, order = None, {}, []
    for event in events:
        if event.type == "response.output_item.added" and event.item.type == "function_call":
            assert open_index is None   # the previous call is done
            open_index = event.output_index
            pieces[open_index] = []
            order.append(open_index)
        elif event.type == "response.function_call_arguments.delta":
            assert event.output_index == open_index
            pieces[open_index].append(event.delta)
        elif event.type == "response.function_call_arguments.done":
            assert event.output_index == open_index and event.arguments == "".join(pieces[open_index])
        elif event.type == "response.output_item.done" and event.item.type == "function_call":
            assert event.output_index == open_index
            item = final.output[open_index]
            assert (event.item.call_id, event.item.arguments) == (item.call_id, item.arguments)
            open_index = None
    assert open_index is None and order == [final.output.index(c) for c in calls]
    assert all(len(pieces[i]) > -(-len(final.output[i].arguments) // 16) + 2 for i in order)


def test_a_call_cut_by_the_token_budget_is_an_unfinished_call_not_markup(client):
    """A turn of calls that ``max_tokens`` ends inside a call whose name is written: the
    response lists the calls as calls (chat: ``tool_calls``, the last one's arguments
    unfinished, ``finish_reason: "length"``, as OpenAI's; Responses: the last item
    ``incomplete``), streamed or not, and shows none of their markup. The official client's
    Responses stream reader, which refuses an index used twice or an item never done,
    reads every budget's stream."""
    api = openai_client(client)
    req = dict(model="demo", input="Wake me up twice", temperature=0,
               tools=[{"type": "function", **t["function"]} for t in TOOLS], tool_choice="required")
    cut = partial = 0
    for budget in range(10, 50, 6):
        with api.responses.stream(**req, max_output_tokens=budget) as reader:
            events = list(reader)
        added = {e.output_index for e in events if e.type == "response.output_item.added"}
        done = [e for e in events if e.type == "response.output_item.done"]
        assert added == {e.output_index for e in done} == set(range(len(added))), budget
        final = events[-1].response
        assert [(d.item.type, d.item.status) for d in sorted(done, key=lambda d: d.output_index)] == \
            [(o.type, o.status) for o in final.output], budget
        if final.status == "incomplete" and final.output[-1].type == "function_call":
            cut += 1
            partial += final.output[-1].status == "incomplete"   # (else cut after a call, before the next)
            assert "message" not in {o.type for o in final.output}
            assert all(o.status == "completed" for o in final.output[:-1])
            whole = api.responses.create(**req, max_output_tokens=budget)
            assert [(o.type, o.status, getattr(o, "arguments", None)) for o in whole.output] == \
                [(o.type, o.status, getattr(o, "arguments", None)) for o in final.output]

            chat = dict(model="demo", messages=[{"role": "user", "content": "Wake me up twice"}], temperature=0,
                        tools=TOOLS, tool_choice="required", max_tokens=budget)
            [choice] = api.chat.completions.create(**chat).choices
            assert choice.finish_reason == "length" and not choice.message.content
            calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
            assert calls == [(o.name, o.arguments) for o in final.output]
            streamed: dict[int, list] = {}
            text = ""
            for chunk in api.chat.completions.create(**chat, stream=True):
                for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    entry = streamed.setdefault(d.index, [d.function.name, ""])
                    entry[1] += d.function.arguments or ""
                text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            assert [tuple(e) for _, e in sorted(streamed.items())] == calls and "tool_call" not in text
    assert cut and partial, "no budget cut a call after its name"


def test_a_call_the_last_allowed_token_completes_is_a_call_and_a_cut_server_call_shows_nothing(client):
    """A forced client-side call whose closing token is the last one ``max_tokens`` allows ends
    ``"tool_calls"`` and is parked, as with room to spare (it ended ``"length"``, a cut call,
    never parked); a call to the server's own tool (``calculator``) cut by ``max_tokens`` is
    neither run nor shown (its markup was the message text), streamed or not."""
    api = openai_client(client)
    req = dict(model="demo", messages=[{"role": "user", "content": "weather?"}], tools=TOOLS[:1], temperature=0,
               tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    roomy = api.chat.completions.create(**req, max_tokens=200)
    assert roomy.choices[0].finish_reason == "tool_calls"
    parked = metrics(client)["jaxserve:num_parked_tool_contexts"]
    exact = api.chat.completions.create(**req, max_tokens=roomy.usage.completion_tokens)
    assert exact.choices[0].finish_reason == "tool_calls"
    assert [c.function.arguments for c in exact.choices[0].message.tool_calls] == \
        [c.function.arguments for c in roomy.choices[0].message.tool_calls]
    assert metrics(client)["jaxserve:num_parked_tool_contexts"] == parked + 1

    server_call = dict(model="demo", messages=[{"role": "user", "content": "go"}], max_tokens=24, temperature=0,
                       tool_choice={"type": "function", "function": {"name": "calculator"}})
    [choice] = api.chat.completions.create(**server_call).choices
    assert choice.finish_reason == "length" and not choice.message.content and not choice.message.tool_calls
    text = "".join(chunk.choices[0].delta.content or "" for chunk in api.chat.completions.create(**server_call,
                                                                                                   stream=True)
                   if chunk.choices)
    assert text == ""


def test_parallel_tool_calls_false_gives_exactly_one_call_sampled_n8(client):
    """The same request that gives several calls greedily gives exactly one per choice
    with ``parallel_tool_calls: false``; sampled with true, choices differ in how many
    calls they make, and every call is valid."""
    api = openai_client(client)
    req = dict(model="demo", messages=[{"role": "user", "content": "Wake me up twice"}], tools=TOOLS,
               tool_choice="required", max_tokens=160, temperature=1.0, seed=5, n=8)
    one = api.chat.completions.create(**req, parallel_tool_calls=False)
    assert [len(c.message.tool_calls) for c in one.choices] == [1] * 8
    for c in one.choices:
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls, set(SCHEMAS))
    several = api.chat.completions.create(**req, parallel_tool_calls=True)
    counts = [len(c.message.tool_calls or []) for c in several.choices]
    for c in several.choices:
        if c.finish_reason == "tool_calls":
            check_calls(c.message.tool_calls, set(SCHEMAS))
    assert max(counts) >= 2, counts


def test_forced_parallel_server_side_calls_all_run_then_the_answer_continues(client):
    """``calculator`` is the server's: a forced turn of several calls to it runs them all
    in the server, and the response is the text written after their results: no call's
    markup (the random model may open another call it never closes before ``max_tokens``:
    that is no call, and is shown as written)."""
    r = client.post("/v1/chat/completions", json=body("Add things", tool_choice={
        "type": "function", "function": {"name": "calculator"}}, max_tokens=120))
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] in ("stop", "length") and "tool_calls" not in choice["message"]
    content = choice["message"]["content"]
    assert "</tool_call>" not in content
    if "<tool_call>" in content:
        assert choice["finish_reason"] == "length" and content.count("<tool_call>") == 1


def test_unsatisfiable_within_max_tokens_is_length_not_an_error(client):
    r = client.post("/v1/chat/completions", json=body("x", max_tokens=4, response_format=json_schema_format(PROFILE)))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/chat/completions", json=body("x", tools=TOOLS, tool_choice="required", max_tokens=3))
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_bad_schemas_and_unknown_functions_are_400_naming_the_field(client):
    bad = client.post("/v1/chat/completions", json=body("x", response_format=json_schema_format({"type": "strng"})))
    assert_error(bad, 400, param="response_format")
    unsat = {"type": "string", "minLength": 5, "maxLength": 2}
    assert_error(client.post("/v1/chat/completions", json=body("x", response_format=json_schema_format(unsat))),
                 400, param="response_format")
    unknown = {"type": "function", "function": {"name": "nope"}}
    assert_error(client.post("/v1/chat/completions", json=body("x", tools=TOOLS, tool_choice=unknown)),
                 400, param="tool_choice")
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]
    assert_error(client.post("/v1/chat/completions", json=body("x", tools=bad_tool, tool_choice="required")),
                 400, param="tools")
    missing = client.post("/v1/chat/completions", json=body("x", response_format={"type": "json_schema"}))
    assert_error(missing, 400)
    # The engine kept serving: a plain request still works.
    assert client.post("/v1/chat/completions", json=body("hi", max_tokens=4)).status_code == 200


def test_vllm_structured_outputs_regex_choice_grammar_and_json(client):
    """vLLM's ``structured_outputs`` (and its older ``guided_*`` fields) through chat and
    completions, greedy, sampled (n=4) and via the official client's ``extra_body``:
    each answer is one of the choices, matches the regex, is in the grammar's language,
    or validates against the schema (random weights: only the constraint can do that)."""
    import re

    import openai
    choices = ["red", "green", "blue sky"]
    cases = [({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
             ({"guided_choice": choices}, lambda t: t in choices),
             ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}},
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
             ({"guided_regex": r"(yes|no)/[A-Z]"}, lambda t: re.fullmatch(r"(yes|no)/[A-Z]", t)),
             ({"structured_outputs": {"grammar": 'start: "A" item* "!"\nitem: " x" | " y"'}},
              lambda t: re.fullmatch(r"A( x| y)*!", t)),
             ({"structured_outputs": {"json": WEATHER}}, lambda t: jsonschema.validate(json.loads(t), WEATHER) is None),
             ({"guided_json": json.dumps(ALARM)}, lambda t: jsonschema.validate(json.loads(t), ALARM) is None)]
    for fields, ok in cases:
        greedy = client.post("/v1/chat/completions", json=body("Say something.", max_tokens=60, **fields))
        assert greedy.status_code == 200, greedy.text
        [choice] = greedy.json()["choices"]
        assert choice["finish_reason"] == "stop" and ok(choice["message"]["content"]), (fields, choice)
        sampled = client.post("/v1/completions", json={"model": "demo", "prompt": "Say", "max_tokens": 60,
                                                        "temperature": 1.0, "n": 4, "seed": 3, **fields}).json()
        assert all(c["finish_reason"] == "stop" and ok(c["text"]) for c in sampled["choices"]), (fields, sampled)
    sdk = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="x", max_retries=0)
    answer = sdk.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Pick"}], max_tokens=20,
                                         temperature=0, extra_body={"structured_outputs": {"choice": choices}})
    assert answer.choices[0].message.content in choices


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": 'root ::= "a"'}, "guided_grammar"),              # GBNF: not this server's grammar syntax
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "strng"}}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_bad_structured_outputs_are_400_naming_the_field(client, fields, param):
    assert_error(client.post("/v1/chat/completions", json=body("x", **fields)), 400, param=param)


ONLY_WEATHER = {"type": "allowed_tools", "allowed_tools": {
    "mode": "required", "tools": [{"type": "function", "function": {"name": "get_weather"}}]}}


def test_allowed_tools_limit_calls_to_a_subset_of_the_listed_tools(client):
    """``tool_choice: {"type": "allowed_tools"}`` (every tool stays in the prompt): mode
    ``required`` gives calls to the allowed tool only, sampled n=8, where ``"required"``
    over the same tools calls the other one too; mode ``auto`` calls only the allowed
    tool when the model opens a call (``<tool_call>`` favoured by ``logit_bias``) and
    answers in text when it does not, through the official client and the Responses API."""
    api = openai_client(client)
    req = dict(model="demo", messages=[{"role": "user", "content": "Wake me up twice"}], tools=TOOLS,
               max_tokens=160, temperature=1.0, seed=5, n=8)
    limited = api.chat.completions.create(**req, tool_choice=ONLY_WEATHER)
    free = api.chat.completions.create(**req, tool_choice="required")
    for c in limited.choices:
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls, {"get_weather"})
    assert "set_alarm" in {t.function.name for c in free.choices for t in c.message.tool_calls or []}

    opener = client.post("/tokenize", json={"model": "demo", "prompt": "<tool_call>"}).json()["tokens"][-1]
    auto = {"type": "allowed_tools", "allowed_tools": {**ONLY_WEATHER["allowed_tools"], "mode": "auto"}}
    called = api.chat.completions.create(**{**req, "n": 4}, tool_choice=auto, logit_bias={str(opener): 40})
    for c in called.choices:
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls, {"get_weather"})
    closer = client.post("/tokenize", json={"model": "demo", "prompt": "</tool_call>"}).json()["tokens"][-1]
    away = {str(opener): -100, str(closer): 20}   # (free, the model would write the closing tag over and over)
    text = api.chat.completions.create(**{**req, "n": 4, "max_tokens": 24}, tool_choice=auto, logit_bias=away)
    free_text = api.chat.completions.create(**{**req, "n": 1, "max_tokens": 24}, tool_choice="auto", logit_bias=away)
    assert "</tool_call>" in free_text.choices[0].message.content
    for c in text.choices:
        assert c.finish_reason in ("stop", "length") and not c.message.tool_calls
        assert c.message.content and "tool_call>" not in c.message.content

    response = api.responses.create(model="demo", input="Wake me up", max_output_tokens=80, temperature=0,
                                    tools=[{"type": "function", **t["function"]} for t in TOOLS],
                                    tool_choice={"type": "allowed_tools", "mode": "required",
                                                 "tools": [{"type": "function", "name": "get_weather"}]})
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and {c.name for c in calls} == {"get_weather"}
    assert response.tool_choice.type == "allowed_tools" and response.tool_choice.mode == "required"


@pytest.mark.parametrize("tool_choice", [
    {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "nope"}}]}},
    {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
    {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": ONLY_WEATHER["allowed_tools"]["tools"]}},
])
def test_bad_allowed_tools_are_400_naming_tool_choice(client, tool_choice):
    err = assert_error(client.post("/v1/chat/completions", json=body("x", tools=TOOLS, tool_choice=tool_choice)), 400)
    assert err["param"].startswith("tool_choice"), err
