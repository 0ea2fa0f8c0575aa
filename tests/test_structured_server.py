"""Structured output through the HTTP server (a real ``uvicorn`` subprocess
serving the demo model, random weights: only the constraint can make the JSON
valid): ``response_format`` json_schema, ``tool_choice`` named and
``"required"``, streamed and not, greedy and sampled, ``n > 1``, bad input."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest_server import ServerProcess
from test_server import assert_error, stream

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
    req = body("Wake me up", tools=TOOLS, tool_choice=tool_choice)
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
    args = "".join(d["function"].get("arguments", "") for d in deltas)
    assert len(deltas) > 2 and json.loads(args) == json.loads(call["function"]["arguments"])
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


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
