"""Server pieces that need no running server: tool-markup filtering, error
mapping, paused-context matching, CLI flags and environment variables."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest

from jaxserve.cli import apply_env_defaults
from server.cli import add_arguments, load_tools
from server.errors import from_value_error
from server.parked import ParkedContexts
from jaxserve.tool_format import get_format


def _feed_all(pieces: list[str]) -> str:
    f = get_format("hermes").markup_filter()
    return "".join(f.feed(p) for p in pieces) + f.flush()


@pytest.mark.parametrize("pieces, visible", [
    (["Hello ", "world"], "Hello world"),
    (["Sure.", "<tool_call>", '{"name": "x"}', "</tool_call>"], "Sure."),
    (["a <tool", "_call>{}</tool", "_call> b"], "a  b"),
    (["x <tool", "box"], "x <toolbox"),                       # a held-back partial tag that never completes
    (["1 < 2 and <", "b>"], "1 < 2 and <b>"),
    (["<tool_call>{unterminated"], "<tool_call>{unterminated"),   # never closed: no call, shown as written
    (["p<tool_call>1</tool_call>q<tool_call>2</tool_call>r"], "pqr"),
])
def test_tool_markup_filter(pieces, visible):
    assert _feed_all(pieces) == visible


def test_tool_markup_filter_holds_back_only_possible_tag_prefixes():
    f = get_format("hermes").markup_filter()
    assert f.feed("abc <to") == "abc "
    assert f.feed("day") == "<today"


@pytest.mark.parametrize("message, param", [
    ("prompt: prompt (600 tokens) + max_tokens (16) = 616 exceeds the context window", "messages"),
    ("max_tokens: prompt (10 tokens) + max_tokens (600) exceeds the context window", "max_tokens"),
    ("temperature must be >= 0, got -1", "temperature"),
    ("prompt_token_ids must be integers in [0, 512)", "messages"),
    ("something unexpected", None),
])
def test_engine_value_errors_map_to_400_with_param(message, param):
    err = from_value_error(ValueError(message), prompt_param="messages")
    assert err.status == 400 and err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error"


class _FakeEngine:
    def __init__(self):
        self.aborted = []

    async def abort(self, request_id):
        self.aborted.append(request_id)
        return True


def test_parked_contexts_match_longest_prefix_check_sampling_and_expire():
    async def run():
        now = [0.0]
        engine = _FakeEngine()
        parked = ParkedContexts(engine, ttl_s=10, clock=lambda: now[0])
        await parked.park("a", [1, 2, 3], ("greedy",), calls_seen=0)
        await parked.park("b", [1, 2, 3, 4, 5], ("greedy",), calls_seen=0)
        await parked.park("c", [9, 9], ("greedy",), calls_seen=0)
        assert await parked.take([1, 2, 3], ("greedy",)) is None          # must leave something to append
        taken, covered = await parked.take([1, 2, 3, 4, 5, 6], ("greedy",))
        assert taken.request_id == "b" and covered == 5
        assert await parked.take([1, 2, 3, 7], ("sampled",)) is None       # other sampling: aborted, not resumed
        assert engine.aborted == ["a"]
        now[0] = 11.0
        assert await parked.expire() == 1 and engine.aborted == ["a", "c"] and len(parked) == 0
        # Two conversations with the same tokens and other settings: each follow-up takes its own,
        # whichever was parked first, and leaves the other parked; a longer match with other settings
        # (this conversation, gone on with them) is aborted.
        await parked.park("plain", [1, 2, 3, 4], ("greedy",), calls_seen=0)
        await parked.park("scored", [1, 2, 3, 4], ("greedy", "logprobs"), calls_seen=0)
        assert (await parked.take([1, 2, 3, 4, 6], ("greedy", "logprobs")))[0].request_id == "scored"
        await parked.park("longer", [1, 2, 3, 4, 5], ("greedy", "logprobs"), calls_seen=0)
        assert (await parked.take([1, 2, 3, 4, 5, 6], ("greedy",)))[0].request_id == "plain"
        assert engine.aborted == ["a", "c", "longer"] and len(parked) == 0
    asyncio.run(run())


def test_a_follow_up_sent_twice_at_once_takes_a_parked_context_once():
    """Two identical follow-ups at once, the first aborting a longer context with other
    settings: while it awaited that abort, the second took the context the first was
    about to take, and the first's removal raised ``KeyError`` (an HTTP 500)."""
    class YieldingEngine(_FakeEngine):
        async def abort(self, request_id):
            await asyncio.sleep(0)   # (a real abort hands the loop over)
            return await super().abort(request_id)

    async def run():
        engine = YieldingEngine()
        parked = ParkedContexts(engine, ttl_s=10)
        await parked.park("turn", [1, 2, 3], ("greedy",), calls_seen=0)
        await parked.park("other", [1, 2, 3, 4, 5], ("top_k",), calls_seen=0)
        results = await asyncio.gather(*(parked.take([1, 2, 3, 4, 5, 6], ("greedy",)) for _ in range(3)))
        assert sorted(r[0].request_id if r else "" for r in results) == ["", "", "turn"]
        assert engine.aborted == ["other"] and len(parked) == 0
    asyncio.run(run())


def test_zero_ttl_aborts_at_once():
    async def run():
        engine = _FakeEngine()
        parked = ParkedContexts(engine, ttl_s=0)
        await parked.park("a", [1], (), calls_seen=0)
        assert len(parked) == 0 and engine.aborted == ["a"]
    asyncio.run(run())


def _parse(argv, environ):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    apply_env_defaults(parser, environ)
    return parser.parse_args(argv)


def test_cli_defaults_flags_and_env_vars():
    args = _parse(["demo"], {})
    assert (args.host, args.port, args.api_key, args.paused_context_ttl) == ("127.0.0.1", 8000, None, 60.0)
    env = {"JAXSERVE_PORT": "9001", "JAXSERVE_API_KEY": "k", "JAXSERVE_MAX_MODEL_LEN": "256",
           "JAXSERVE_HANDLING": "swap", "JAXSERVE_PAUSED_CONTEXT_TTL": "2.5", "JAXSERVE_MAX_CONCURRENT_REQUESTS": "3"}
    args = _parse(["demo"], env)
    assert (args.port, args.api_key, args.max_model_len, args.handling, args.paused_context_ttl,
            args.max_concurrent_requests) == (9001, "k", 256, "swap", 2.5, 3)
    assert _parse(["demo", "--port", "9002"], env).port == 9002        # the command line wins


def test_load_tools_spec():
    tools = load_tools("upper=builtins:str, mx=builtins:max")
    assert tools == {"upper": str, "mx": max}
    with pytest.raises(ValueError, match="name=module:function"):
        load_tools("nonsense")
    # A module or function that is not there was a traceback (not the one-line refusal); a
    # name no model could call was accepted.
    for spec, message in (("f=builtins:nope", "module 'builtins' has no 'nope'"),
                          ("f=no_such_module_here:f", "cannot import 'no_such_module_here' for 'f'"),
                          ("bad name=builtins:str", "tool name 'bad name' is not a function name")):
        with pytest.raises(ValueError, match=message):
            load_tools(spec)


class _ScriptedEngine:
    """Stands in for ``AsyncEngine``: yields one token then fails (or is dead)."""

    def __init__(self, alive=True):
        from jaxserve.core import EngineStats
        from transformers import AutoTokenizer

        from jaxserve.demo import demo_dir
        self.is_alive = alive
        self.tokenizer = AutoTokenizer.from_pretrained(str(demo_dir()))
        self.usage_snapshot = {"running": 0, "waiting": 0, "swapping": 0, "paused": {"preserve": 0},
                               "device_pages_used": 0, "device_pages_total": 8, "host_pages_used": 0,
                               "host_pages_total": 8, "preemptions": 0, "prefix_cache_queries": 0,
                               "prefix_cache_hits": 0, "prefix_cached_pages": 0}
        self.stats_snapshot = EngineStats()

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        from jaxserve.outputs import RequestOutput
        yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"], token_ids=[65],
                            text="b", delta_token_ids=[65], delta_text="b")
        raise RuntimeError("engine step failed: boom")

    async def abort(self, request_id):
        return False


def _client(engine, max_model_len: int = 64):
    from fastapi.testclient import TestClient

    from server import create_app
    return TestClient(create_app(engine, served_model_name="m", max_model_len=max_model_len))


def test_health_is_503_and_requests_refused_when_the_engine_is_dead():
    with _client(_ScriptedEngine(alive=False)) as client:
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_error_after_the_stream_started_is_an_error_event_then_done():
    with _client(_ScriptedEngine()) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "stream": True})
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert set(error) == {"message", "type", "param", "code"} and "boom" in error["message"]
        assert json.loads(events[0])["choices"][0]["text"] == "b"
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2]})
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]


def test_parked_contexts_belong_to_their_owner():
    """Issue 13: contexts were matched by prefix alone; another key or user could resume them."""
    async def run():
        engine = _FakeEngine()
        parked = ParkedContexts(engine, ttl_s=10)
        await parked.park("alice", [1, 2, 3], ("greedy",), calls_seen=0, owner="key-a/alice")
        assert await parked.take([1, 2, 3, 4], ("greedy",), owner="key-b/alice") is None
        assert await parked.take([1, 2, 3, 4], ("greedy",), owner="key-a/bob") is None
        assert engine.aborted == [] and len(parked) == 1        # untouched by the others
        assert (await parked.take([1, 2, 3, 4], ("greedy",), owner="key-a/alice"))[0].request_id == "alice"
    asyncio.run(run())


def test_owner_hash_depends_on_api_key_and_user():
    from types import SimpleNamespace

    from server.app import _owner

    from server.middleware import TRUSTED_OWNERS

    def req(key, scope=None):
        return SimpleNamespace(headers={"authorization": key} if key else {}, scope=scope or {})
    owners = {_owner(req(k), SimpleNamespace(user=u)) for k in ("Bearer a", "Bearer b", None) for u in ("x", None)}
    assert len(owners) == 6 and all("Bearer" not in o for o in owners)
    # a batch's line (in-process) is its creator, whatever header it carries
    creator = {"": _owner(req("Bearer a"), None), "x": _owner(req("Bearer a"), SimpleNamespace(user="x"))}
    line = req(None, {TRUSTED_OWNERS: creator})
    assert _owner(line, SimpleNamespace(user="x")) == creator["x"] and _owner(line, None) == creator[""]


def test_fan_out_counts_against_the_concurrency_limit():
    from server.app import ConcurrencyLimit
    from server.errors import APIError

    limit = ConcurrencyLimit(8)
    big = limit.acquire(6)
    with pytest.raises(APIError) as e:
        limit.acquire(3)
    assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
    small = limit.acquire(2)
    big.release()
    big.release()   # idempotent
    assert limit.in_flight == 2
    small.release()
    assert limit.in_flight == 0


def test_unhandled_exception_is_a_500_that_keeps_the_connection(caplog):
    """Starlette re-raises unhandled exceptions to the server, which drops the keep-alive
    connection; the catch-all answers them itself."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.errors import install_handlers
    from server.middleware import CatchAllMiddleware, RequestIdMiddleware

    app = FastAPI()
    install_handlers(app)
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/boom")
    async def boom():
        raise KeyError("secret-detail")

    with caplog.at_level("ERROR", logger="jaxserve.server"), \
            TestClient(app, raise_server_exceptions=True) as client:   # a re-raise would surface here
        r = client.get("/boom", headers={"x-request-id": "trace-42"})
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: KeyError"
    assert "secret-detail" not in r.text
    assert r.headers["x-request-id"] == "trace-42" and "(request trace-42)" in caplog.text   # the log names it


def test_every_response_carries_a_request_id_the_clients_own_or_a_new_one():
    """``x-request-id`` on every response (OpenAI clients' ``_request_id``): a new ``req_``
    id per request, the client's own when it is a plain token, a new one in place of any
    other value; the API key guard's 401 carries one too."""
    import re

    from fastapi.testclient import TestClient

    from server import create_app
    client = TestClient(create_app(_ScriptedEngine(), served_model_name="m", api_key="k", max_model_len=64))
    key = {"authorization": "Bearer k"}
    first, second = (client.get("/v1/models", headers=key).headers["x-request-id"] for _ in range(2))
    assert re.fullmatch(r"req_[0-9a-f]{32}", first) and re.fullmatch(r"req_[0-9a-f]{32}", second) and first != second
    assert client.get("/v1/models", headers={**key, "x-request-id": "job-7.step:3"}).headers["x-request-id"] \
        == "job-7.step:3"
    for bad in ("has space", "x" * 129, "quote\"d"):
        got = client.get("/v1/models", headers={**key, "x-request-id": bad}).headers["x-request-id"]
        assert got.startswith("req_") and got != bad
    denied = client.get("/v1/models")
    assert denied.status_code == 401 and denied.headers["x-request-id"].startswith("req_")


def test_cheap_prompt_bound_never_exceeds_the_real_token_count():
    from transformers import AutoTokenizer

    from jaxserve.demo import demo_dir
    from server.tokenizers import TokenizerPool

    tok = AutoTokenizer.from_pretrained(str(demo_dir()))
    pool = TokenizerPool(tok, size=2)
    for text in ["hello world", "ééé ü 日本語 🙂" * 50, "<|im_start|>" * 40, " " * 3000, "x" * 10_000]:
        assert pool.min_tokens(text) <= len(tok.encode(text, add_special_tokens=True)), text

    async def concurrent():   # two copies: two calls run at once
        import threading
        barrier = threading.Barrier(2, timeout=10)

        def meet(t):
            barrier.wait()
            return len(t.encode("hi"))
        return await asyncio.gather(pool.run(meet), pool.run(meet))
    assert asyncio.run(concurrent()) == [len(tok.encode("hi"))] * 2


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from jaxserve.gguf_checkpoint import load_tokenizer
    from jaxserve.model_source import smollm2_path
    return load_tokenizer(smollm2_path())


def test_spelling_matches_a_context_the_model_cut_into_other_tokens(smollm2_tokenizer):
    """SmolLM2 wrote its call ending ``"}`` ``}``; the re-rendered follow-up encodes it as
    ``"`` ``}}``: the same text, so the paused context covers the follow-up up to its tool
    turn. Other text, or a plain-text stretch standing for a special token, does not match."""
    from server.parked import Spelling
    tok = smollm2_tokenizer
    spelling = Spelling(tok)
    enc = lambda text: tok.encode(text, add_special_tokens=False)   # noqa: E731
    prompt = enc("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    model_wrote = enc('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}') + enc("}</tool_call>")
    follow_up = prompt + enc(call + "<|im_end|>\n<|im_start|>tool\nSunny<|im_end|>\n<|im_start|>assistant\n")
    context = prompt + model_wrote
    assert follow_up[:len(context)] != context                       # the tokens differ...
    covered = spelling.covered(context, follow_up)
    assert covered == len(prompt + enc(call))                        # ...the text does not
    assert tok.decode(follow_up[:covered]) == tok.decode(context)
    assert spelling.covered(context, prompt + enc(call.replace("Paris", "Lyon") + "<|im_end|>")) is None
    # "><" (end of one tag, start of the next) is not ">" followed by the special token <|im_end|>,
    # nor is <|im_end|> spelt in plain-text pieces the special token itself
    assert spelling.covered(prompt + enc(call[:-1]) + enc("><"), follow_up) is None
    plain = tok.encode("<|im_end|>", add_special_tokens=False, split_special_tokens=True)
    assert len(plain) > 1 and tok.decode(plain) == "<|im_end|>"
    assert spelling.covered(prompt + enc(call) + plain, follow_up) is None


def test_parked_context_is_taken_by_a_follow_up_that_spells_it_alike(smollm2_tokenizer):
    from server.parked import Spelling
    tok = smollm2_tokenizer
    enc = lambda text: tok.encode(text, add_special_tokens=False)   # noqa: E731
    prompt = enc("<|im_start|>assistant\n")
    wrote = enc('{"a": "b"') + enc("}")        # the model's own cut; the re-render encodes '{"a": "b"}'
    context = prompt + wrote
    follow_up = enc('<|im_start|>assistant\n{"a": "b"}<|im_end|>')
    spelling = Spelling(tok)
    longer = len(context) - (len(follow_up) - 1)   # how many more tokens the model's spelling took

    async def run():
        parked = ParkedContexts(_FakeEngine(), ttl_s=10)
        await parked.park("x", context, ("greedy",), calls_seen=0, written_from=len(prompt))
        assert await parked.take(follow_up, ("greedy",)) is None            # token for token: no
        if longer > 0:   # a window with no room for the longer spelling: not resumed (still parked)
            assert await parked.take(follow_up, ("greedy",), spelling=spelling, room=longer) is None
        taken, covered = await parked.take(follow_up, ("greedy",), spelling=spelling, room=longer + 1)
        assert taken.request_id == "x" and follow_up[covered:] == enc("<|im_end|>")
        # the rendered prompt must agree token for token: only what the model wrote may be spelt otherwise
        other_prompt = enc("<|im_start|>assist") + enc("ant\n")   # the same text, cut otherwise
        assert other_prompt != prompt and tok.decode(other_prompt) == tok.decode(prompt)
        await parked.park("y", other_prompt + wrote, ("greedy",), calls_seen=0, written_from=len(other_prompt))
        assert await parked.take(follow_up, ("greedy",), spelling=spelling) is None
    asyncio.run(run())


def _error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize("body, param, message", [
    # a rule over several fields names its field, not "the body is not an object"
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     "stream_options", "only allowed with stream"),
    # the request's tools are checked whether or not a call is forced
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools", "not a valid JSON Schema"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "tools", "same name"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["\ud800"]}}}},
     "response_format", "lone surrogates"),
])
def test_bad_chat_fields_are_400s_that_name_the_field(body, param, message):
    with _client(_ScriptedEngine()) as client:
        r = client.post("/v1/chat/completions", content=json.dumps({"model": "m", **body}),
                        headers={"content-type": "application/json"})
        error = _error(r, 400)
        assert error["param"] == param and message in error["message"], error


@pytest.mark.parametrize("content, detail", [(b'{"model": "m", "prompt": "\xff\xfe"}', None),
                                             (b'{"model": "m", "prompt": [' + b"9" * 5000 + b"]}", None),
                                             (b'{"model": "m", "prompt": ', "not valid JSON")])
def test_a_body_that_is_not_json_is_a_400_naming_the_body(content, detail):
    """Bytes that are not UTF-8 and an integer too long for Python reached FastAPI's own
    400 with ``param`` null; bad JSON text was already the body's."""
    with _client(_ScriptedEngine()) as client:
        error = _error(client.post("/v1/completions", content=content,
                                   headers={"content-type": "application/json"}), 400)
        assert error["param"] == "body" and (detail or "could not be read as JSON") in error["message"], error
        # an upload's multipart body that cannot be read is the body's 400 too, in its own words
        error = _error(client.post("/v1/files", content=b"x", headers={"content-type": "multipart/form-data"}), 400)
        assert error["param"] == "body" and "multipart" in error["message"] and "JSON" not in error["message"]


def _nested_schema(depth: int) -> dict:
    schema: dict = {}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("depth", [400, 2000])
@pytest.mark.parametrize("path, field, body", [
    ("/v1/chat/completions", "response_format", lambda s: {
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}),
    ("/v1/chat/completions", "tools", lambda s: {
        "messages": [{"role": "user", "content": "hi"}], "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                               "properties": {"a": s}}}}]}),
    ("/v1/completions", "guided_json", lambda s: {"prompt": "hi", "guided_json": s}),
    ("/v1/responses", "text", lambda s: {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                            "schema": s}}}),
])
def test_a_schema_nested_too_deeply_to_check_is_a_400_naming_its_field(path, field, body, depth):
    """Every route checks schemas against the metaschema, which recurses a few frames a
    level: past ~370 levels that was a ``RecursionError`` and a 500 (past ~1,000 already
    in writing the schema as JSON)."""
    with _client(_ScriptedEngine()) as client:
        error = _error(client.post(path, content=json.dumps({"model": "m", **body(_nested_schema(depth))}),
                                   headers={"content-type": "application/json"}), 400)
        assert error["param"].split(".")[0] == field and "nested too deeply" in error["message"], error


def test_a_schema_given_as_json_text_nested_too_deeply_is_a_400_naming_its_field():
    """``guided_json`` may be the schema's JSON text: reading text nested past Python's
    recursion limit was a ``RecursionError`` and a 500."""
    text = '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000
    with _client(_ScriptedEngine()) as client:
        error = _error(client.post("/v1/completions", json={"model": "m", "prompt": "hi", "guided_json": text}), 400)
        assert error["param"] == "guided_json" and "nested too deeply" in error["message"], error


@pytest.mark.parametrize("path, field, value", [("/v1/completions", "best_of", 2), ("/v1/completions", "suffix", "x")])
def test_fields_that_would_change_the_answer_are_refused_not_ignored(path, field, value):
    """Fields this server does not implement but that change what a client gets back
    (best_of, suffix) are 400s naming the field, never silently dropped."""
    body = {"model": "m", field: value, **({"prompt": "hi"} if "chat" not in path
                                           else {"messages": [{"role": "user", "content": "hi"}]})}
    with _client(_ScriptedEngine()) as client:
        error = _error(client.post(path, json=body), 400)
        assert error["param"] == field and "not supported" in error["message"]
        assert error["message"].count(field) == 1, error["message"]   # "logprobs: logprobs are..." read twice


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),   # 0 only scores a prompt, with echo
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": False}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs")])
def test_bad_logprobs_fields_are_400s_naming_the_field(path, body, field):
    """At most 20 alternatives (OpenAI's limit), top_logprobs only with logprobs: true, and
    chat's logprobs a boolean."""
    with _client(_ScriptedEngine()) as client:
        error = _error(client.post(path, json={"model": "m", **body}), 400)
        assert error["param"] == field, error


@pytest.mark.parametrize("body, field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"), ({"min_p": 2}, "min_p"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"logit_bias": {"50": 101}}, "logit_bias.50"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"fifty": 1}}, "logit_bias"),
    ({"logit_bias": {"5" * 11: 1}}, "logit_bias"), ({"logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"), ({"logit_bias": {"7": 1, "007": 2}}, "logit_bias")])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_penalties_and_logit_bias_are_400s_naming_the_field(path, body, field):
    """Penalties within OpenAI's [-2, 2], a repetition penalty within [0.01, 10],
    ``min_tokens`` within ``max_tokens``, ``logit_bias`` keys that are token ids of the
    vocabulary (the demo's is 512) and values within [-100, 100]."""
    prompt = {"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    with _client(_Recorder(), max_model_len=2048) as client:
        error = _error(client.post(path, json={"model": "m", **prompt, **body}), 400)
        assert error["param"] == field, error


class _Recorder(_ScriptedEngine):
    """Answers every request with one token and keeps its ``SamplingParams``; refuses, as the
    engine does, a ``logit_bias`` key outside the demo's 512-token vocabulary."""

    def __init__(self):
        super().__init__()
        self.params = []
        self.priorities = []

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        from jaxserve.outputs import RequestOutput
        if sampling_params.logit_bias and max(sampling_params.logit_bias) >= 512:
            raise ValueError("logit_bias: its keys must be token ids in [0, 512)")
        self.params.append(sampling_params)
        self.priorities.append(kw.get("priority", 0))
        yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"], token_ids=[65],
                            text="b", delta_token_ids=[65], delta_text="b", finish_reason="stop")


def test_penalties_and_logit_bias_reach_the_engine():
    """OpenAI's ``logit_bias`` (string keys), ``presence_penalty``, ``frequency_penalty``
    and vLLM's ``repetition_penalty``, ``min_tokens``, ``min_p``, ``stop_token_ids`` and
    ``include_stop_str_in_output`` become the engine's settings."""
    engine = _Recorder()
    with _client(engine, max_model_len=2048) as client:
        for path, prompt in [("/v1/completions", {"prompt": "hi"}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
            r = client.post(path, json={"model": "m", **prompt, "logit_bias": {"50": 5, "007": -100.0},
                                        "presence_penalty": 0.5, "frequency_penalty": -1.5, "repetition_penalty": 1.2,
                                        "min_tokens": 3, "max_tokens": 8, "min_p": 0.05, "stop_token_ids": [9, 40],
                                        "include_stop_str_in_output": True})
            assert r.status_code == 200, r.text
            p = engine.params[-1]
            assert (p.logit_bias, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens,
                    p.min_p, p.stop_token_ids, p.include_stop_str_in_output) == (
                {50: 5.0, 7: -100.0}, 0.5, -1.5, 1.2, 3, 0.05, [9, 40], True)
            for bad in ([-1], [1] * 65, ["1"], 5):
                assert _error(client.post(path, json={"model": "m", **prompt, "stop_token_ids": bad}),
                              400)["param"].startswith("stop_token_ids")


def test_tokenize_counts_what_generation_would_send_and_detokenize_spells_it():
    """``/tokenize`` gives a completions prompt's ids (with or without special tokens) and
    a chat's ids exactly as ``/v1/chat/completions`` sends them to the engine (template,
    tools and all); ``/detokenize`` spells ids back; bad input is a 400 naming the field."""
    engine = _Recorder()
    tok = engine.tokenizer
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    with _client(engine, max_model_len=2048) as client:
        r = client.post("/tokenize", json={"model": "m", "prompt": "Hello world"})
        assert r.status_code == 200, r.text
        assert r.json() == {"count": len(tok.encode("Hello world")), "max_model_len": 2048,
                            "tokens": tok.encode("Hello world")}
        plain = client.post("/tokenize", json={"model": "m", "prompt": "Hello world", "add_special_tokens": False})
        assert plain.json()["tokens"] == tok.encode("Hello world", add_special_tokens=False)
        # Past the window it counts too (a long text was a 400 by the cheap bound, a shorter one past the
        # window a 200), and an empty prompt is its special tokens (was a 400), as vLLM's /tokenize.
        long = "word " * 3000
        for text in (long, long * 40, ""):
            assert client.post("/tokenize", json={"model": "m", "prompt": text}).json()["tokens"] == tok.encode(text)
        assert client.post("/tokenize", json={"model": "m", "messages": [{"role": "user", "content": long * 40}]}
                           ).json()["count"] > 2048
        counted = client.post("/tokenize", json={"model": "m", **chat}).json()
        sent = []
        engine.generate = _keep_prompt(engine.generate, sent)
        assert client.post("/v1/chat/completions", json={"model": "m", **chat}).status_code == 200
        assert counted["tokens"] == sent[0] and counted["count"] == len(sent[0])
        assert client.post("/detokenize", json={"model": "m", "tokens": tok.encode("Hello world", add_special_tokens=False)}
                           ).json() == {"prompt": "Hello world"}
        for route, body, status, param in [
                ("/tokenize", {"prompt": "a", "messages": chat["messages"]}, 400, None),
                ("/tokenize", {}, 400, None),
                ("/detokenize", {"tokens": [len(tok)]}, 400, "tokens"), ("/detokenize", {"tokens": []}, 400, "tokens"),
                ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
                ("/tokenize", {"messages": chat["messages"], "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, 400, "tools")]:
            error = _error(client.post(route, json={"model": "m", **body}), status)
            assert param is None or error["param"] == param, (route, body, error)
        assert _error(client.post("/tokenize", json={"model": "x", "prompt": "a"}), 404)["code"] == "model_not_found"


def test_chat_rendering_options_reach_the_template():
    """vLLM's ``add_generation_prompt``, ``continue_final_message`` (an assistant prefill the
    model continues) and ``chat_template_kwargs`` render the messages as the template does
    with them, for generation and ``/tokenize`` alike; contradictory or reserved settings
    are 400s naming the field."""
    engine = _Recorder()
    tok = engine.tokenizer
    tok.chat_template += "{% if closing_words %}{{ closing_words }}{% endif %}"
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Sure, the answer is"}]

    def rendered(msgs, **options):
        return tok.encode(tok.apply_chat_template(msgs, tokenize=False, **options), add_special_tokens=False)

    sent = []
    engine.generate = _keep_prompt(engine.generate, sent)
    cases = [({"messages": messages[:1]}, rendered(messages[:1], add_generation_prompt=True)),
             ({"messages": messages[:1], "add_generation_prompt": False}, rendered(messages[:1])),
             ({"messages": messages, "continue_final_message": True},
              rendered(messages, continue_final_message=True)),
             ({"messages": messages[:1], "chat_template_kwargs": {"closing_words": "Bye"}},
              rendered(messages[:1], add_generation_prompt=True, closing_words="Bye"))]
    with _client(engine, max_model_len=2048) as client:
        for body, want in cases:
            body = {"model": "m", "tool_choice": "none", **body}   # (no tools advertised in the prompt)
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert sent[-1] == want, body
            assert client.post("/tokenize", json=body).json()["tokens"] == want, body
        assert tok.decode(cases[2][1]).endswith("Sure, the answer is")   # left open for the model to continue
        assert tok.decode(cases[3][1]).endswith("Bye") and cases[3][1] != cases[0][1]
        for route, body in [
                ("/v1/chat/completions", {"messages": messages, "continue_final_message": True,
                                          "add_generation_prompt": True}),
                ("/v1/chat/completions", {"messages": messages[:1], "chat_template_kwargs": {"tools": []}}),
                ("/v1/chat/completions", {"messages": messages[:1], "chat_template_kwargs": {"chat_template": "x"}}),
                ("/v1/chat/completions", {"messages": messages[:1], "chat_template_kwargs": ["x"]}),
                ("/tokenize", {"prompt": "a", "continue_final_message": True})]:
            error = _error(client.post(route, json={"model": "m", **body}), 400)
            assert "chat_template" in error["message"] or "continue_final_message" in error["message"], error
        assert len(sent) == len(cases)


def _keep_prompt(generate, sent: list):
    """``generate`` that first keeps each request's prompt token ids in ``sent``."""
    def wrapped(*args, **kw):
        sent.append(kw["prompt_token_ids"])
        return generate(*args, **kw)
    return wrapped


def test_a_model_is_retrieved_by_its_name():
    """``client.models.retrieve(name)``: ``GET /v1/models/{name}``."""
    with _client(_ScriptedEngine()) as client:
        card = client.get("/v1/models/m").json()
        assert card["id"] == "m" and card["object"] == "model"
        error = _error(client.get("/v1/models/other"), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"


class _OneAnswerEngine(_ScriptedEngine):
    """Answers every request with ``text`` in one final output."""

    text = "The tag <tool_call> starts a call."

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        from jaxserve.outputs import RequestOutput
        yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"], token_ids=[65, 66],
                            text=self.text, delta_token_ids=[65, 66], delta_text=self.text, finish_reason="stop")


@pytest.mark.parametrize("tool_choice", ["none", "auto"])
def test_chat_shows_tool_markup_the_model_quoted(tool_choice):
    """With ``tool_choice: "none"`` nothing is parsed, so nothing is hidden; and in any mode a
    ``<tool_call>`` never closed is text (the answer used to end at the tag)."""
    with _client(_OneAnswerEngine(), max_model_len=2048) as client:   # (room for the tools in the prompt)
        r = client.post("/v1/chat/completions", json={"model": "m", "tool_choice": tool_choice, "messages": [
            {"role": "user", "content": "Repeat: The tag <tool_call> starts a call."}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == _OneAnswerEngine.text


class _LogprobsEngine(_OneAnswerEngine):
    """Answers with two tokens and their log-probabilities when asked."""

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        from jaxserve.outputs import RequestOutput, TokenLogprob
        records = None if sampling_params.logprobs is None else [
            TokenLogprob(65, -0.25, ((65, -0.25), (66, -2.0))[:sampling_params.logprobs]),
            TokenLogprob(66, -0.5, ((66, -0.5), (65, -1.5))[:sampling_params.logprobs])]
        yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"], token_ids=[65, 66],
                            text="bc", delta_token_ids=[65, 66], delta_text="bc", finish_reason="stop",
                            logprobs=records)


def test_null_fields_take_their_defaults_and_logprobs_come_back():
    """Clients that serialize every field send ``null`` for the ones they leave alone (OpenAI
    types them "or null"): each takes its default, ``"logprobs": null`` included. A
    non-streamed answer with logprobs (built off the event loop) has OpenAI's shape."""
    nulls = {"logprobs": None, "top_logprobs": None, "temperature": None, "top_p": None, "n": None,
             "stream": None, "presence_penalty": None, "stop": None, "seed": None, "max_tokens": None}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi", "name": None}]}
    engine = _LogprobsEngine()
    b, c = (engine.tokenizer.decode([t]) for t in (65, 66))
    with _client(engine, max_model_len=2048) as client:
        r = client.post("/v1/chat/completions", json={**chat, **nulls})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "bc" and "logprobs" not in r.json()["choices"][0]
        r = client.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 1})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [(item["token"], item["logprob"]) for item in content] == [(b, -0.25), (c, -0.5)]
        assert [[t["token"] for t in item["top_logprobs"]] for item in content] == [[b], [c]]
        assert content[0]["bytes"] == list(b.encode())


def test_non_streamed_answers_are_built_off_the_event_loop(monkeypatch):
    """Every non-streamed answer, with logprobs or not, is built and serialized in a worker
    thread (no running event loop there): n=16 answers of 200 tokens took ~0.4 s on the loop,
    a stall for every other client's stream."""
    from server.wire import ChatWire
    built_on_loop = []
    real = ChatWire.full

    def spy(*args):
        try:
            asyncio.get_running_loop()
            built_on_loop.append(True)
        except RuntimeError:
            built_on_loop.append(False)
        return real(*args)
    monkeypatch.setattr(ChatWire, "full", spy)
    with _client(_OneAnswerEngine(), max_model_len=2048) as client:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = client.post(path, json={"model": "m", **body})
            assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
            assert r.json()["usage"]["completion_tokens"] == 2
    assert built_on_loop == [False, False]


@pytest.fixture(scope="module")
def smollm2_spellings():
    from jaxserve.model_source import load_tokenizer, smollm2_path
    from server.logprobs import TokenSpellings

    tokenizer = load_tokenizer(smollm2_path())
    spell = TokenSpellings(tokenizer)
    asyncio.run(spell.ready())
    return tokenizer, spell


@pytest.mark.parametrize("skip_special", [True, False])
def test_completion_logprobs_text_offsets_follow_the_text_through_split_characters(smollm2_spellings, skip_special):
    """SmolLM2 splits "😀" over two tokens (the first spelled " \\ufffd"): each token's offset is
    where its text starts in the completion's text, fed in two stream pieces; a special
    token counts nothing when the text leaves it out."""
    from jaxserve.outputs import TokenLogprob
    from server.logprobs import TextOffsets, completion_logprobs

    tokenizer, spell = smollm2_spellings
    ids = tokenizer.encode("héllo wörld 😀 ok<|im_end|> 日本", add_special_tokens=False)
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    records = [TokenLogprob(t, -1.0) for t in ids]
    offsets = TextOffsets(skip_special)
    pieces = [completion_logprobs(records[:5], spell, offsets), completion_logprobs(records[5:], spell, offsets)]
    tokens = [t for p in pieces for t in p["tokens"]]
    starts = [o for p in pieces for o in p["text_offset"]]
    assert "\ufffd" in "".join(tokens) and "<|im_end|>" in tokens
    assert starts == sorted(starts) and starts[-1] < len(text)
    for token, start in zip(tokens, starts):
        if "\ufffd" not in token and (token != "<|im_end|>" or not skip_special):
            assert text[start:start + len(token)] == token, (token, start)
    # A character the model never finished shows as U+FFFD before the next token's text.
    broken = [ids[tokens.index(" \ufffd")], tokenizer.encode("The", add_special_tokens=False)[0]]
    text = tokenizer.decode(broken)
    starts = completion_logprobs([TokenLogprob(t, -1.0) for t in broken], spell, TextOffsets(True))["text_offset"]
    assert text[starts[1]:] == "The" and starts[0] == 0


def test_completion_top_logprobs_keep_the_likeliest_of_alike_spellings_and_the_sampled_token(smollm2_spellings):
    """Two alternatives both spelled "\\ufffd" (parts of characters) keep the likelier value; the
    sampled token is always a key (OpenAI's up to logprobs + 1), also with no alternatives."""
    from jaxserve.outputs import TokenLogprob
    from server.logprobs import TextOffsets, completion_logprobs

    _, spell = smollm2_spellings
    partial = [t for t in range(49152) if spell(t)[0] == "\ufffd"][:2]
    the = next(t for t in range(49152) if spell(t)[0] == "The")
    record = TokenLogprob(the, -3.0, ((partial[0], -0.5), (partial[1], -1.0)))
    top = completion_logprobs([record], spell, TextOffsets(True))["top_logprobs"][0]
    assert top == {"\ufffd": -0.5, "The": -3.0}
    alone = completion_logprobs([TokenLogprob(the, -3.0)], spell, TextOffsets(True))["top_logprobs"][0]
    assert alone == {"The": -3.0}


# ------------------------------------------------------------- Responses API
FLAT_TOOL = {"type": "function", "name": "f", "description": "Does f.",
             "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in FLAT_TOOL.items() if k != "type"}}


def test_a_responses_request_renders_as_the_chat_request_it_amounts_to():
    """``instructions`` a system message, message items, a ``function_call`` item the assistant
    message that made it, a ``function_call_output`` item its tool message, flat function tools:
    the engine gets exactly the tokens of the equivalent chat completions request; after
    ``previous_response_id`` the stored conversation (its input and answer) comes first, without
    the earlier ``instructions``."""
    engine = _Recorder()
    sent = []
    engine.generate = _keep_prompt(engine.generate, sent)
    items = [{"role": "user", "content": "Hi"},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "3"},
             {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                      "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}, {"role": "user", "content": "thanks"}]
    with _client(engine, max_model_len=4096) as client:
        r = client.post("/v1/responses", json={"model": "m", "instructions": "Be brief.", "input": items,
                                               "tools": [FLAT_TOOL], "max_output_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "tools": [CHAT_TOOL],
                                                          "max_tokens": 8, "temperature": 0}).status_code == 200
        assert sent[0] == sent[1]
        first = r.json()
        assert first["object"] == "response" and first["status"] == "completed" and first["id"].startswith("resp_")
        [message] = first["output"]
        assert message["type"] == "message" and message["role"] == "assistant"
        assert message["content"] == [{"type": "output_text", "text": "b", "annotations": []}]
        assert first["usage"] == {"input_tokens": len(sent[0]),   # (a scripted engine: no prefix cache)
                                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                                  "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0},
                                  "total_tokens": len(sent[0]) + 1}
        assert first["tools"] == [FLAT_TOOL] and first["instructions"] == "Be brief." and first["max_output_tokens"] == 8
        assert engine.params[0].max_tokens == 8 and engine.params[0].temperature == 0

        r = client.post("/v1/responses", json={"model": "m", "previous_response_id": first["id"], "input": "more",
                                               "tools": [FLAT_TOOL], "max_output_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["previous_response_id"] == first["id"]
        follow = messages[1:] + [{"role": "assistant", "content": "b"}, {"role": "user", "content": "more"}]
        assert client.post("/v1/chat/completions", json={"model": "m", "messages": follow, "tools": [CHAT_TOOL],
                                                          "max_tokens": 8, "temperature": 0}).status_code == 200
        assert sent[2] == sent[3]


def test_stored_responses_are_retrieved_deleted_and_kept_per_api_key():
    engine = _OneAnswerEngine()
    mine, theirs = {"Authorization": "Bearer mine"}, {"Authorization": "Bearer theirs"}
    with _client(engine, max_model_len=4096) as client:
        first = client.post("/v1/responses", json={"model": "m", "input": "hi"}, headers=mine).json()
        assert client.get(f"/v1/responses/{first['id']}", headers=mine).json() == first
        assert _error(client.get(f"/v1/responses/{first['id']}", headers=theirs), 404)["param"] == "response_id"
        assert _error(client.post("/v1/responses", json={"model": "m", "input": "x", "previous_response_id": first["id"]},
                                  headers=theirs), 404)["param"] == "previous_response_id"
        second = client.post("/v1/responses", json={"model": "m", "input": "more", "previous_response_id": first["id"]},
                             headers=mine).json()
        assert second["status"] == "completed"
        unstored = client.post("/v1/responses", json={"model": "m", "input": "hi", "store": False}, headers=mine).json()
        assert unstored["store"] is False
        _error(client.get(f"/v1/responses/{unstored['id']}", headers=mine), 404)
        assert client.delete(f"/v1/responses/{first['id']}", headers=mine).json() == {
            "id": first["id"], "object": "response.deleted", "deleted": True}
        _error(client.get(f"/v1/responses/{first['id']}", headers=mine), 404)
        # the second turn is still stored, but its conversation lost its first turn
        error = _error(client.post("/v1/responses", json={"model": "m", "input": "x",
                                                           "previous_response_id": second["id"]}, headers=mine), 404)
        assert error["code"] == "previous_response_not_found" and first["id"] in error["message"]


def test_response_store_drops_the_least_recently_used_and_a_walk_refreshes_a_conversation():
    from server.response_store import ResponseStore, StoredResponse
    store = ResponseStore(capacity=3)
    store.put("a", StoredResponse("o", None, [{"role": "user", "content": "1"}], {}))
    store.put("b", StoredResponse("o", "a", [{"role": "user", "content": "2"}], {}))
    store.put("x", StoredResponse("o", None, [], {}))
    assert [m["content"] for e in store.chain("b", "o") for m in e.messages] == ["1", "2"]   # refreshes a and b
    store.put("y", StoredResponse("o", None, [], {}))                            # drops x, the oldest now
    assert store.get("x", "o") is None and store.get("a", "o") is not None and store.get("a", "other") is None
    # A byte budget too: large conversations push out the least recently used, one over it alone is not kept.
    store = ResponseStore(capacity=100, max_bytes=3000)
    for i in range(4):
        store.put(f"r{i}", StoredResponse("o", None, [{"role": "user", "content": "x" * 900}], {}))
    assert [store.get(f"r{i}", "o") is not None for i in range(4)] == [False, True, True, True]
    assert store.num_bytes <= 3000
    store.put("huge", StoredResponse("o", None, [{"role": "user", "content": "x" * 5000}], {}))
    assert store.get("huge", "o") is None and store.get("r3", "o") is not None
    assert store.delete("r3", "o") and store.num_bytes == sum(store.get(f"r{i}", "o").size for i in (1, 2))
    # Over a limit, the owner holding the most gives up its least recently used response.
    store = ResponseStore(capacity=4, max_bytes=3000)
    store.put("theirs", StoredResponse("b", None, [{"role": "user", "content": "y" * 300}], {}))
    for i in range(6):
        store.put(f"mine{i}", StoredResponse("a", None, [{"role": "user", "content": "x" * 900}], {}))
    assert store.get("theirs", "b") is not None and store.get("mine5", "a") is not None
    assert store.get("mine0", "a") is None and store.num_bytes <= 3000
    for i in range(3):
        store.put(f"small{i}", StoredResponse("c", None, [], {}))
    assert store.get("theirs", "b") is not None and len(store._entries) == 4   # "a" gave up its responses


@pytest.mark.parametrize("body, status, param", [
    ({"input": "hi", "reasoning": {"effort": "low"}}, 400, "reasoning"),   # (no reasoning parser here)
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, 400, "reasoning.effort"),
    ({"input": "hi", "background": True, "store": False}, 400, "background"),
    ({"input": "hi", "top_logprobs": 21}, 400, "top_logprobs"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input.0"),
    # (the paths as the client wrote them: no tag of the item's type between its index and its field)
    ({"input": [{"type": "reasoning", "content": [{"type": "summary_text", "text": "x"}]}]}, 400,
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input.0.call_id"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input.0.role"),
    ({"input": "hi", "tool_choice": {"type": "function"}}, 400, "tool_choice.name"),   # (no member class name)
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, 400, "input.0.output"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, 400, "input.0.content.0.text"),
    ({"input": []}, 400, "input"),
    # a result of no call, and a call with no result (OpenAI's 400s: the model would read either as it stands)
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                {"role": "user", "content": "never mind"}]}, 400, "input"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": "hi", "max_output_tokens": 100_000}, 400, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
])
def test_responses_bad_input_is_an_error_naming_the_field(body, status, param):
    with _client(_OneAnswerEngine(), max_model_len=4096) as client:
        error = _error(client.post("/v1/responses", json={"model": "m", **body}), status)
        assert error["param"] == param, error


def test_a_reasoning_object_that_asks_nothing_is_served_without_a_reasoning_parser():
    """Clients that serialize every field send ``reasoning: {}`` or all-null: nothing asked,
    nothing refused (an ``effort`` still needs ``--reasoning-parser``: the 400 above)."""
    with _client(_OneAnswerEngine(), max_model_len=4096) as client:
        for reasoning in ({}, {"effort": None, "summary": None}):
            r = client.post("/v1/responses", json={"model": "m", "input": "hi", "reasoning": reasoning})
            assert r.status_code == 200, r.text


def test_a_function_call_and_its_output_in_the_input_are_served():
    """The pair OpenAI's follow-ups send (a call, then its output) is accepted; the 400s above
    are only for an output of no call or a call left without one."""
    with _client(_OneAnswerEngine(), max_model_len=4096) as client:
        r = client.post("/v1/responses", json={"model": "m", "input": [
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"}]})
        assert r.status_code == 200, r.text
        message = _error(client.post("/v1/responses", json={"model": "m", "input": [
            {"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}), 400)["message"]
        assert "call_nope" in message, message


def test_a_streamed_response_sends_the_typed_events_in_order():
    with _client(_OneAnswerEngine(), max_model_len=4096) as client:
        with client.stream("POST", "/v1/responses", json={"model": "m", "input": "hi", "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = r.read().decode()
    blocks = [b for b in raw.split("\n\n") if b]
    events = []
    for block in blocks:
        kind, data = block.split("\n")
        event = json.loads(data[len("data: "):])
        assert kind == f"event: {event['type']}"
        events.append(event)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["output"] == [events[-2]["item"]]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == \
        done["output"][0]["content"][0]["text"] == _OneAnswerEngine.text


def test_responses_logprobs_match_chat_logprobs():
    """``include: ["message.output_text.logprobs"]`` / ``top_logprobs``: the ``output_text``
    part carries each token's record in chat's ``logprobs.content`` shape, whole and streamed
    (each delta with its tokens'); without them no ``logprobs`` are computed."""
    engine = _LogprobsEngine()
    with _client(engine, max_model_len=2048) as client:
        chat = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                          "logprobs": True, "top_logprobs": 2}).json()
        want = chat["choices"][0]["logprobs"]["content"]
        body = {"model": "m", "input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
        r = client.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["logprobs"] == want and r.json()["top_logprobs"] == 2
        with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
            events = [json.loads(line[len("data: "):]) for line in s.read().decode().splitlines()
                      if line.startswith("data: ")]
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert [item for e in deltas for item in e["logprobs"]] == want
        done = next(e for e in events if e["type"] == "response.output_text.done")
        assert done["logprobs"] == want
        plain = client.post("/v1/responses", json={"model": "m", "input": "hi"}).json()
        assert "logprobs" not in plain["output"][0]["content"][0]
        error = _error(client.post("/v1/responses", json={"model": "m", "input": "hi",
                                                          "include": ["file_search_call.results"]}), 400)
        assert error["param"].startswith("include")


class _EndsWithEosEngine(_OneAnswerEngine):
    """Two outputs: a token with text, then the end-of-sequence token (no text), each with its record."""

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        from jaxserve.outputs import RequestOutput, TokenLogprob
        first, eos = TokenLogprob(65, -0.25, ((65, -0.25),)), TokenLogprob(2, -0.125, ((2, -0.125),))
        yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"], token_ids=[65], text="b",
                            delta_token_ids=[65], delta_text="b", logprobs=[first])
        yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"], token_ids=[65, 2],
                            text="b", delta_token_ids=[2], delta_text="", finish_reason="stop", logprobs=[first, eos])


class _BrokenCallThenAnotherEngine(_OneAnswerEngine):
    """Text, a call the model breaks (answered with the server's error, the model goes on),
    more text, then a good client-side call the response pauses on."""

    steps = [("Let me call. ", 0, None), ('<tool_call>{"name": "f", "arguments": {"a": tru', 0, None),
             ('}}</tool_call>', 1, None), ("Sorry, again: ", 1, None),
             ('<tool_call>{"name": "g", "arguments": {"b": 1}}</tool_call>', 2, "tool_calls")]

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        from jaxserve.outputs import ApiCallOutput, RequestOutput
        record = ApiCallOutput(api_type="invalid", handling="preserve", call_time=0.0, return_time=0.0,
                               resume_time=0.0, context_tokens=1, returned_tokens=1)
        text = ""
        for i, (delta, calls, reason) in enumerate(self.steps):
            text += delta
            yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"],
                                token_ids=list(range(i + 1)), text=text, delta_token_ids=[i], delta_text=delta,
                                finish_reason=reason, api_calls=[record] * calls,
                                tool_calls=[{"name": "g", "arguments": '{"b": 1}'}] if reason else [])


def test_a_call_the_model_broke_leaves_the_responses_stream_well_formed():
    """The broken call went out as far as it was written (a stream cannot take it back): its
    item is done ``incomplete`` when the text after it opens a new message, every item has
    its own ``output_index`` and is done, no text goes to a message already done, and the
    good call is the response's; chat lists it under the next index."""
    tools = [{"type": "function", "name": n, "parameters": {"type": "object", "properties": {}}} for n in "fg"]
    with _client(_BrokenCallThenAnotherEngine(), max_model_len=4096) as client:
        with client.stream("POST", "/v1/responses", json={"model": "m", "input": "hi", "tools": tools,
                                                          "stream": True}) as s:
            events = [json.loads(line[len("data: "):]) for line in s.read().decode().splitlines()
                      if line.startswith("data: ")]
        chat = client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "tools": [{"type": "function", "function": t} for t in tools]}).text
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    assert added == [(0, "message"), (1, "function_call"), (2, "message"), (3, "function_call")]
    assert set(done) == {0, 1, 2, 3} and (done[1]["name"], done[1]["status"]) == ("f", "incomplete")
    assert (done[3]["name"], done[3]["status"], done[3]["arguments"]) == ("g", "completed", '{"b": 1}')
    closed: set[int] = set()
    for e in events:
        if e["type"] == "response.output_item.done":
            closed.add(e["output_index"])
        elif "delta" in e["type"]:
            assert e["output_index"] not in closed, e
    for index, item in done.items():   # each message's done text is its own deltas' (not the text before it)
        if item["type"] == "message":
            deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta"
                             and e["output_index"] == index)
            assert item["content"][0]["text"] == deltas, (index, item)
    assert [done[0]["content"][0]["text"], done[2]["content"][0]["text"]] == ["Let me call. ", "Sorry, again: "]
    final = events[-1]["response"]
    assert [(o["type"], o.get("name")) for o in final["output"]] == [("message", None), ("function_call", "g")]
    assert final["output"][0]["content"][0]["text"] == "Let me call. Sorry, again: "
    indices = {}
    for line in chat.splitlines():
        if line.startswith("data: {"):
            for d in json.loads(line[len("data: "):])["choices"][0]["delta"].get("tool_calls", []):
                if "id" in d:
                    indices[d["function"]["name"]] = d["index"]
    assert indices == {"f": 0, "g": 1}


class _EndsInCallTextEngine(_OneAnswerEngine):
    """Text that ends inside a call's markup, with a finish reason: set per test."""

    reason = "length"

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        from jaxserve.outputs import RequestOutput
        yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"], token_ids=[65, 66],
                            text=self.text, delta_token_ids=[65, 66], delta_text=self.text, finish_reason=self.reason)


@pytest.mark.parametrize("text, reason, calls", [
    # max_tokens inside a call the parser would take so far: a call, its arguments unfinished
    ('<tool_call>{"name": "f", "arguments": {"a": 1, "b": "x', "length", [("f", '{"a": 1, "b": "x')]),
    # ended by EOS (or a stop string) inside a tag never closed: no call, the text as written
    ('OK <tool_call>{"name": "f", "arguments": {"a": 1}}', "stop", []),
    # cut inside a call the parser would refuse (a key written twice): the text as written
    ('<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2, "b": "x', "length", []),
])
def test_a_turn_cut_inside_a_call_is_a_call_only_where_the_parser_would_take_one(text, reason, calls):
    engine = _EndsInCallTextEngine()
    engine.text, engine.reason = text, reason
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with _client(engine, max_model_len=4096) as client:
        message = client.post("/v1/chat/completions", json={"model": "m", "tools": tools, "messages": [
            {"role": "user", "content": "hi"}]}).json()["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert message.get("content") == (None if calls else text), message


class _JsonWithMarkupEngine(_OneAnswerEngine):
    text = '{"html": "<tool_call>{\\"name\\": \\"f\\", \\"arguments\\": {}}</tool_call>"}'


@pytest.mark.parametrize("stream", [False, True])
def test_a_constrained_answer_holding_call_markup_is_the_answer(stream):
    """A JSON answer whose text holds the tool-call markup is the answer: under a grammar
    that does not force calls the engine parses none, and the server now hides none (it cut
    ``<tool_call>...</tool_call>`` out of the JSON, or reported a call never made)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "html?"}], "tools": tools, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}
    with _client(_JsonWithMarkupEngine(), max_model_len=4096) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            deltas = [json.loads(line[len("data: "):])["choices"][0]["delta"] for line in r.text.splitlines()
                      if line.startswith("data: {") and '"choices":[{' in line]
            content = "".join(d.get("content", "") for d in deltas)
            assert not any("tool_calls" in d for d in deltas)
        else:
            message = r.json()["choices"][0]["message"]
            content = message["content"]
            assert "tool_calls" not in message
    assert content == _JsonWithMarkupEngine.text


def test_a_streamed_response_sends_the_last_tokens_logprobs_though_they_have_no_text():
    """The end-of-sequence token writes no text: its record, held for the next text, came
    only in ``output_text.done``; it goes in a last (empty) delta before it."""
    with _client(_EndsWithEosEngine(), max_model_len=2048) as client:
        body = {"model": "m", "input": "hi", "include": ["message.output_text.logprobs"], "stream": True}
        with client.stream("POST", "/v1/responses", json=body) as s:
            events = [json.loads(line[len("data: "):]) for line in s.read().decode().splitlines()
                      if line.startswith("data: ")]
    streamed = [record for e in events if e["type"] == "response.output_text.delta" for record in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert len(done["logprobs"]) == 2 and streamed == done["logprobs"]


def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits():
    """``truncation: "auto"``: a conversation over the context window loses its oldest turns,
    whole (the kept part starts at a user message, after ``instructions``), as few as make
    the prompt and ``max_output_tokens`` fit; the engine gets exactly that conversation's
    tokens. Without it the same request is a 400, as is one whose last turn alone is too long."""
    long = " ".join(["words to fill the context"] * 12)
    turns = [{"role": "user", "content": f"first {long}"}, {"role": "assistant", "content": "one"},
             {"role": "user", "content": f"second {long}"}, {"role": "assistant", "content": "two"},
             {"role": "user", "content": "third"}]
    system = [{"role": "system", "content": "Be brief."}]

    def count(messages):
        with _client(_Recorder(), max_model_len=4096) as client:
            return client.post("/tokenize", json={"model": "m", "messages": messages}).json()["tokens"]

    full, from_second, last = count(system + turns), count(system + turns[2:]), count(system + turns[4:])
    assert len(full) > len(from_second) + 8 > len(last) + 8
    engine = _Recorder()
    sent = []
    engine.generate = _keep_prompt(engine.generate, sent)
    body = {"model": "m", "instructions": "Be brief.", "input": turns, "max_output_tokens": 8}
    with _client(engine, max_model_len=len(from_second) + 8) as client:
        r = client.post("/v1/responses", json={**body, "truncation": "auto"})
        assert r.status_code == 200, r.text
        assert sent == [from_second] and r.json()["truncation"] == "auto"
        error = _error(client.post("/v1/responses", json=body), 400)
        assert error["code"] == "context_length_exceeded" and error["param"] == "input"
        assert error["message"].startswith("input: the prompt has ")   # the Responses API's name, not chat's
    with _client(engine, max_model_len=len(last) + 7) as client:   # the last turn fits, not with 8 more tokens:
        r = client.post("/v1/responses", json={**body, "truncation": "auto"})   # max_output_tokens is the fault
        error = _error(r, 400)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "max_output_tokens") and len(sent) == 1
        assert f"prompt ({len(last)} tokens)" in error["message"], error
    with _client(engine, max_model_len=len(last) - 1) as client:   # the last turn alone is past the window
        error = _error(client.post("/v1/responses", json={**body, "truncation": "auto"}), 400)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "input") and len(sent) == 1


@pytest.mark.parametrize("message, param, expected", [
    ("prompt: this request needs 9 KV pages", "input", ("input", "input: this request needs 9 KV pages")),
    ("messages.1.content: too long", "messages", ("input", "input: too long")),
    ("max_tokens: must be at least 1", "max_tokens", ("max_output_tokens", "max_output_tokens: must be at least 1")),
    ("temperature: must be in [0, 2]", "temperature", ("temperature", "temperature: must be in [0, 2]")),
    ("the engine said: no", None, (None, "the engine said: no")),
])
def test_a_responses_error_names_the_responses_fields(message, param, expected):
    """Errors raised for the chat request a response runs as (or by the engine, which
    calls a prompt a prompt) name the Responses API's fields, in the message as in
    ``param``; streamed ones too (``ResponsesWire.error``)."""
    from server.errors import APIError
    from server.responses import responses_error
    error = responses_error(APIError(400, message, param=param))
    assert (error.param, error.message) == expected


def test_a_responses_input_items_are_listed_in_pages():
    """``GET /v1/responses/{id}/input_items``: the response's input as items with ids, last
    first by default, in pages (``limit``, ``after``, ``has_more``); the owner's only."""
    items = [{"role": "user", "content": "Hi"},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "3"},
             {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}]
    mine = {"Authorization": "Bearer mine"}
    with _client(_Recorder(), max_model_len=4096) as client:
        created = client.post("/v1/responses", json={"model": "m", "input": items, "tools": [FLAT_TOOL]},
                              headers=mine).json()
        path = f"/v1/responses/{created['id']}/input_items"
        page = client.get(path, headers=mine).json()
        assert page["object"] == "list" and page["has_more"] is False
        assert [i["type"] for i in page["data"]] == ["message", "function_call_output", "function_call", "message"]
        assert page["data"][0]["content"] == [{"type": "input_text", "text": "thanks"}]
        assert page["data"][2]["call_id"] == "call_1" and page["data"][1]["output"] == "3"
        assert len({i["id"] for i in page["data"]}) == 4 and page["first_id"] == page["data"][0]["id"]
        first = client.get(path, params={"order": "asc", "limit": 2}, headers=mine).json()
        assert first["has_more"] is True and first["data"] == page["data"][::-1][:2]
        rest = client.get(path, params={"order": "asc", "after": first["last_id"]}, headers=mine).json()
        assert rest["has_more"] is False and rest["data"] == page["data"][::-1][2:]
        assert _error(client.get(path, params={"limit": 0}, headers=mine), 400)["param"] == "limit"
        assert _error(client.get(path, params={"after": "msg_x"}, headers=mine), 400)["param"] == "after"
        assert _error(client.get(path), 404)["param"] == "response_id"



def test_input_items_keep_the_client_ids_and_a_repeated_id_is_a_400():
    """Output items sent back as input keep their ids (``input_items`` lists them so); an id
    that repeats within the input, or names an item the conversation holds (a
    ``previous_response_id`` turn's input or output, a ``conversation``'s items), is OpenAI's
    400 "Duplicate item found", naming ``input`` (``items`` when adding to a conversation)."""
    with _client(_Recorder(), max_model_len=4096) as client:
        first = client.post("/v1/responses", json={"model": "m", "input": [
            {"type": "message", "id": "msg_mine", "role": "user", "content": "Hi"}]}).json()
        [listed] = client.get(f"/v1/responses/{first['id']}/input_items").json()["data"]
        assert listed["id"] == "msg_mine"
        [answer] = first["output"]
        twice = [{"role": "user", "content": "a", "id": "x"}, {"role": "user", "content": "b", "id": "x"}]
        error = _error(client.post("/v1/responses", json={"model": "m", "input": twice}), 400)
        assert error["param"] == "input" and "'x'" in error["message"]
        for again in ({"role": "assistant", "id": answer["id"], "content": "b"},
                      {"role": "user", "id": "msg_mine", "content": "Hi"}):
            error = _error(client.post("/v1/responses", json={"model": "m", "previous_response_id": first["id"],
                                                              "input": [again]}), 400)
            assert error["param"] == "input" and "Duplicate item" in error["message"]
        follow = client.post("/v1/responses", json={"model": "m", "previous_response_id": first["id"],
                                                     "input": [{"role": "user", "id": "msg_next", "content": "more"}]})
        assert follow.status_code == 200
        conversation = client.post("/v1/conversations", json={"items": [
            {"role": "user", "id": "msg_c", "content": "Hi"}]}).json()["id"]
        error = _error(client.post(f"/v1/conversations/{conversation}/items",
                                   json={"items": [{"role": "user", "id": "msg_c", "content": "again"}]}), 400)
        assert error["param"] == "items"
        error = _error(client.post("/v1/responses", json={"model": "m", "conversation": conversation,
                                                          "input": [{"role": "user", "id": "msg_c", "content": "x"}]}), 400)
        assert error["param"] == "input"
        assert _error(client.post("/v1/conversations", json={"items": twice}), 400)["param"] == "items"
        ok = client.post("/v1/responses", json={"model": "m", "conversation": conversation,
                                                "input": [{"role": "user", "id": "msg_d", "content": "x"}]})
        assert ok.status_code == 200
        items = client.get(f"/v1/conversations/{conversation}/items", params={"order": "asc"}).json()["data"]
        assert [i["id"] for i in items][:2] == ["msg_c", "msg_d"]


def test_only_background_responses_are_cancelled_or_streamed_again():
    with _client(_Recorder(), max_model_len=4096) as client:
        plain = client.post("/v1/responses", json={"model": "m", "input": "hi"}).json()
        assert plain["background"] is False
        error = _error(client.post(f"/v1/responses/{plain['id']}/cancel"), 400)
        assert error["param"] == "response_id" and "background" in error["message"]
        assert _error(client.get(f"/v1/responses/{plain['id']}", params={"stream": "true"}), 400)["param"] == "stream"
        assert _error(client.post("/v1/responses/resp_unknown/cancel"), 404)["param"] == "response_id"
        assert _error(client.get("/v1/responses/resp_unknown", params={"stream": "true"}), 404)


def test_background_runs_replay_follow_and_are_forgotten_after_retention():
    """``BackgroundRuns``: a follower gets the events after its ``starting_after``, those to
    come included, until the run ends; a run is its creator's only; an ended run is
    kept ``retention_s`` (and within ``max_event_bytes``), then forgotten; ``close``
    cancels live runs, whose bodies then end them."""
    from server.background import BackgroundRun, BackgroundRuns

    async def run():
        now = [0.0]
        runs = BackgroundRuns(retention_s=10, max_event_bytes=100, clock=lambda: now[0])
        release = asyncio.Event()

        def new(name: str) -> BackgroundRun:
            return BackgroundRun(name, "me", lambda status: {"status": status}, [])

        async def body(r: BackgroundRun, events: list[str]):
            try:
                r.started()
                for e in events:
                    r.add([e])
                    await release.wait()
                r.end({"status": "completed"})
            except asyncio.CancelledError:
                r.end({"status": "cancelled"})

        a = new("a")
        a.add(["e0"])
        await runs.start(a, body(a, ["e1", "e2"]))
        assert runs.get("a", "me").response() == {"status": "in_progress"} and runs.get("a", "other") is None
        follower = a.follow(starting_after=0)
        assert await follower.__anext__() == "e1"
        release.set()
        assert [e async for e in follower] == ["e2"]
        assert [e async for e in a.follow()] == ["e0", "e1", "e2"] and a.response() == {"status": "completed"}
        await asyncio.sleep(0)   # (the task's done callback)
        now[0] = 5.0
        assert runs.get("a", "me") is a and runs.num_live == 0
        now[0] = 11.0
        assert runs.get("a", "me") is None
        release.clear()
        b = new("b")
        await runs.start(b, body(b, ["x" * 60]))
        await runs.close()
        assert b.response() == {"status": "cancelled"}
        c = new("c")
        await runs.start(c, body(c, ["y" * 60]))
        assert (await runs.cancel(c)) == {"status": "cancelled"}
        await asyncio.sleep(0)
        assert runs.get("b", "me") is None and runs.get("c", "me") is c   # 120 bytes > 100: the oldest went
        broken = new("d")

        async def crash():
            raise RuntimeError("bug")
        await runs.start(broken, crash())
        await asyncio.sleep(0)
        assert broken.response()["status"] == "failed" and [e async for e in broken.follow()] == []
    asyncio.run(run())


@pytest.mark.parametrize("finish_reason, status, event", [("error", "failed", "response.failed"),
                                                          ("abort", "cancelled", "response.incomplete")])
def test_a_response_the_engine_failed_or_aborted_says_so(finish_reason, status, event):
    """A request the engine ended with "error" is a ``failed`` response carrying the engine's
    reason; one aborted in the engine is ``cancelled`` (whole and streamed; the API has no
    cancelled event, so its stream ends with ``response.incomplete``)."""
    class Ending(_ScriptedEngine):
        async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
            from jaxserve.outputs import RequestOutput
            yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"], token_ids=[65],
                                text="b", delta_token_ids=[65], delta_text="b", finish_reason=finish_reason,
                                error="out of pages" if finish_reason == "error" else None)

    with _client(Ending(), max_model_len=4096) as client:
        whole = client.post("/v1/responses", json={"model": "m", "input": "hi"}).json()
        assert whole["status"] == status and "incomplete_details" not in whole
        assert ("error" in whole) == (status == "failed")
        if status == "failed":
            assert "out of pages" in whole["error"]["message"] and whole["error"]["code"] == "server_error"
        with client.stream("POST", "/v1/responses", json={"model": "m", "input": "hi", "stream": True}) as r:
            events = [json.loads(line[len("data: "):]) for line in r.read().decode().splitlines()
                      if line.startswith("data: ")]
        assert events[-1]["type"] == event and events[-1]["response"]["status"] == status


def test_input_tokens_are_counted_as_the_response_would_send_them():
    """``POST /v1/responses/input_tokens``: the prompt tokens of the response the same body
    would create (instructions, tools, the stored conversation, truncation), nothing run;
    ``model`` may be left out, another model is a 404."""
    engine = _Recorder()
    sent = []
    engine.generate = _keep_prompt(engine.generate, sent)
    body = {"model": "m", "instructions": "Be brief.", "input": "Hi", "tools": [FLAT_TOOL]}
    with _client(engine, max_model_len=4096) as client:
        counted = client.post("/v1/responses/input_tokens", json=body).json()
        assert counted["object"] == "response.input_tokens" and sent == []   # (nothing ran)
        first = client.post("/v1/responses", json=body).json()
        assert counted["input_tokens"] == len(sent[0]) == first["usage"]["input_tokens"]
        follow = {"previous_response_id": first["id"], "input": "more"}
        counted = client.post("/v1/responses/input_tokens", json=follow).json()["input_tokens"]
        client.post("/v1/responses", json={"model": "m", **follow})
        assert counted == len(sent[1]) and len(sent) == 2
        assert _error(client.post("/v1/responses/input_tokens", json={**body, "model": "x"}), 404)["param"] == "model"
        error = _error(client.post("/v1/responses/input_tokens", json={"input": "hi", "tools": [{"type": "web"}]}), 400)
        assert error["param"] == "tools.0.type"


def test_max_tool_calls_reaches_the_engine_from_responses_and_chat():
    """``max_tool_calls`` (the Responses API's; an extension on chat) caps the server-side
    tool calls the request runs (``SamplingParams.max_tool_calls``) and is echoed."""
    engine = _Recorder()
    with _client(engine, max_model_len=4096) as client:
        r = client.post("/v1/responses", json={"model": "m", "input": "hi", "max_tool_calls": 2}).json()
        assert r["max_tool_calls"] == 2 and engine.params[-1].max_tool_calls == 2
        assert client.post("/v1/chat/completions", json={"model": "m", "max_tool_calls": 0, "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200 and engine.params[-1].max_tool_calls == 0
        client.post("/v1/responses", json={"model": "m", "input": "hi"})
        assert engine.params[-1].max_tool_calls is None
        error = _error(client.post("/v1/responses", json={"model": "m", "input": "hi", "max_tool_calls": -1}), 400)
        assert error["param"] == "max_tool_calls"


def test_priority_and_service_tier_reach_the_engine_and_the_tier_is_reported():
    """vLLM's ``priority`` is the engine request's class; OpenAI's ``service_tier`` maps to
    one when ``priority`` is not given ("flex" after the default, "priority" before it) and
    is reported back, in a streamed chunk too. Bad values are 400s naming the field."""
    engine = _Recorder()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with _client(engine, max_model_len=4096) as client:
        for path, prompt in [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat),
                             ("/v1/responses", {"input": "hi"})]:
            for fields, priority, tier in [({}, 0, None), ({"priority": -3}, -3, None),
                                           ({"service_tier": "flex"}, 1, "flex"),
                                           ({"service_tier": "priority"}, -1, "priority"),
                                           ({"service_tier": "auto"}, 0, "default"),
                                           ({"service_tier": "flex", "priority": 0}, 0, "flex")]:
                r = client.post(path, json={"model": "m", **prompt, **fields})
                assert r.status_code == 200, r.text
                assert engine.priorities[-1] == priority and r.json().get("service_tier") == tier, (path, fields)
            for bad, field in [({"priority": True}, "priority"), ({"priority": 1.5}, "priority"),
                               ({"priority": 2**31}, "priority"), ({"service_tier": "scale"}, "service_tier")]:
                assert _error(client.post(path, json={"model": "m", **prompt, **bad}), 400)["param"] == field
        streamed = client.post("/v1/chat/completions", json={"model": "m", **chat, "stream": True,
                                                              "service_tier": "flex"}).text
        chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
        assert chunks and all(c["service_tier"] == "flex" for c in chunks)


class _QueuedEngine(_ScriptedEngine):
    """Never produces a first output (a request still queued); counts the streams closed."""

    def __init__(self):
        super().__init__()
        self.closed = 0

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        try:
            await asyncio.Event().wait()
            yield None
        finally:
            self.closed += 1


class _CallsThenWaitsEngine(_QueuedEngine):
    """Text, a whole call, then half of a second one; then nothing more (until cancelled)."""

    steps = ["Checking. ", '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
             '<tool_call>{"name": "g", "arguments": {"b": "hal']

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        from jaxserve.outputs import RequestOutput
        text = ""
        try:
            for i, delta in enumerate(self.steps):
                text += delta
                yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"],
                                    token_ids=list(range(i + 1)), text=text, delta_token_ids=[i], delta_text=delta)
            await asyncio.Event().wait()
        finally:
            self.closed += 1


def test_a_cancelled_background_response_lists_the_calls_it_streamed():
    """Cancelled in a turn of calls: the stored response lists its text and the call its
    stream announced (``incomplete``, as the stream closed it: the turn never ended), not
    only its text. (The second call's start is still held back by the markup filter, which
    keeps a tail that could begin the closing tag: never announced, not listed.)"""
    tools = [{"type": "function", "name": n, "parameters": {"type": "object", "properties": {}}} for n in "fg"]
    engine = _CallsThenWaitsEngine()
    with _client(engine, max_model_len=4096) as client:
        response_id = client.post("/v1/responses", json={"model": "m", "input": "hi", "tools": tools,
                                                         "background": True}).json()["id"]
        for _ in range(500):   # (until the engine has written all it will: text, then the calls)
            if client.get(f"/v1/responses/{response_id}").json()["output"]:
                break
            time.sleep(0.01)
        time.sleep(0.2)
        cancelled = client.post(f"/v1/responses/{response_id}/cancel").json()
    assert cancelled["status"] == "cancelled" and engine.closed == 1
    assert [(o["type"], o.get("name"), o["status"]) for o in cancelled["output"]] == \
        [("message", None, "incomplete"), ("function_call", "f", "incomplete")]
    assert cancelled["output"][0]["content"][0]["text"] == "Checking. " and cancelled["output"][1]["arguments"] == '{"a": 1}'


def test_a_queued_background_response_is_polled_cancelled_and_deleted():
    """A background run whose engine request has produced nothing yet is ``queued``;
    cancelling it closes its engine stream (which aborts the request) and leaves it
    ``cancelled`` and stored; deleting a live run stops it first; a follow-up on a run
    still going is a 400."""
    engine = _QueuedEngine()
    with _client(engine, max_model_len=4096) as client:
        created = client.post("/v1/responses", json={"model": "m", "input": "hi", "background": True}).json()
        assert created["status"] == "queued" and created["background"] is True
        assert client.get(f"/v1/responses/{created['id']}").json()["status"] == "queued"
        error = _error(client.post("/v1/responses", json={"model": "m", "input": "more",
                                                           "previous_response_id": created["id"]}), 400)
        assert error["code"] == "previous_response_in_progress"
        theirs = {"Authorization": "Bearer theirs"}   # (another key sees none of it)
        for method, path, params in [("GET", "", None), ("GET", "", {"stream": "true"}), ("POST", "/cancel", None),
                                     ("GET", "/input_items", None), ("DELETE", "", None)]:
            r = client.request(method, f"/v1/responses/{created['id']}{path}", params=params, headers=theirs)
            assert _error(r, 404)["code"] == "response_not_found", (method, path)
        assert engine.closed == 0
        cancelled = client.post(f"/v1/responses/{created['id']}/cancel").json()
        assert cancelled["status"] == "cancelled" and cancelled["usage"]["output_tokens"] == 0
        assert engine.closed == 1 and client.get(f"/v1/responses/{created['id']}").json() == cancelled
        with client.stream("GET", f"/v1/responses/{created['id']}", params={"stream": "true"}) as r:
            events = [json.loads(line[len("data: "):]) for line in r.read().decode().splitlines()
                      if line.startswith("data: ")]
        assert [e["type"] for e in events] == ["response.created", "response.queued", "response.incomplete"]
        assert events[-1]["response"] == cancelled and [e["sequence_number"] for e in events] == [0, 1, 2]
        other = client.post("/v1/responses", json={"model": "m", "input": "hi", "background": True}).json()
        assert client.delete(f"/v1/responses/{other['id']}").json()["deleted"] is True
        assert engine.closed == 2
        _error(client.get(f"/v1/responses/{other['id']}"), 404)


def test_a_response_store_with_a_file_keeps_responses_and_their_order_across_reopening(tmp_path):
    """``ResponseStore(path=...)``: what is stored, dropped, deleted and refreshed is in the
    file; reopening gives the same conversations, owners and LRU order (a smaller limit
    then drops the least recently used, from the file too); a file that is not a store is
    a ``ValueError``."""
    import sqlite3

    from server.response_store import ResponseStore, StoredResponse
    path = tmp_path / "store" / "responses.sqlite3"
    store = ResponseStore(path=path)
    store.put("a", StoredResponse("o", None, [{"role": "user", "content": "1"}], {"id": "a"}, [{"id": "msg_1"}]))
    store.put("b", StoredResponse("o", "a", [{"role": "user", "content": "2"}], {"id": "b"}))
    store.put("x", StoredResponse("o", None, [], {"id": "x"}))
    store.put("gone", StoredResponse("o", None, [], {"id": "gone"}))
    assert store.delete("gone", "o")
    store.put("theirs", StoredResponse("p", None, [], {"id": "theirs"}))
    assert [m["content"] for e in store.chain("b", "o") for m in e.messages] == ["1", "2"]   # refreshes b, then a
    num_bytes = store.num_bytes
    store.close()
    again = ResponseStore(path=path)   # (o's order, least recent first: x, b, a)
    assert again.num_bytes == num_bytes
    assert [m["content"] for e in again.chain("b", "o") for m in e.messages] == ["1", "2"]
    assert again.get("a", "o").input_items == [{"id": "msg_1"}] and again.get("a", "o").response == {"id": "a"}
    assert again.get("gone", "o") is None and again.get("theirs", "o") is None and again.get("theirs", "p")
    again.close()
    small = ResponseStore(capacity=3, path=path)   # "o" holds the most: it gives up x, its least recently used
    assert small.get("x", "o") is None and small.get("a", "o") is not None
    small.close()
    assert ResponseStore(path=path).get("x", "o") is None   # (dropped from the file too)
    other = tmp_path / "other.sqlite3"
    sqlite3.connect(other).execute("CREATE TABLE t (a)").connection.commit()
    with pytest.raises(ValueError, match="not a jaxserve response store"):
        ResponseStore(path=other)
    (tmp_path / "garbage.sqlite3").write_bytes(b"not a database at all" * 100)
    with pytest.raises(ValueError, match="response store"):
        ResponseStore(path=tmp_path / "garbage.sqlite3")


def test_a_background_response_left_running_in_a_store_file_reads_back_failed(tmp_path, caplog):
    """A response stored ``queued`` or ``in_progress`` (a background run the server did not
    end: it crashed) reads back ``failed`` with a ``server_error`` when the file is opened,
    the rest of it as stored; the file is rewritten, so the next opening finds nothing to
    mend; ended responses are untouched."""
    from server.response_store import ResponseStore, StoredResponse
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path=path)
    for rid, status in [("q", "queued"), ("r", "in_progress"), ("c", "completed"), ("x", "cancelled")]:
        store.put(rid, StoredResponse("o", None, [{"role": "user", "content": rid}],
                                      {"id": rid, "status": status, "background": True}))
    store.close()
    with caplog.at_level("WARNING", logger="jaxserve.server"):
        again = ResponseStore(path=path)
    assert "2 background response(s) were running" in caplog.text
    for rid in ("q", "r"):
        response = again.get(rid, "o").response
        assert response["status"] == "failed" and response["error"]["code"] == "server_error"
        assert response["id"] == rid and response["background"] and again.get(rid, "o").messages[0]["content"] == rid
    assert [again.get(rid, "o").response["status"] for rid in ("c", "x")] == ["completed", "cancelled"]
    again.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxserve.server"):
        third = ResponseStore(path=path)
    assert "were running" not in caplog.text and third.get("q", "o").response["status"] == "failed"
    third.close()


def test_conversations_are_kept_per_key_beside_responses_and_across_reopening(tmp_path, caplog):
    """``server.conversations`` over a ``ResponseStore`` with a file: a conversation and its
    items read back after reopening; another key's lookups, and the response routes' lookups
    (a conversation is no response, a response no conversation), find nothing; bad pages are
    400s naming the parameter; items past the store's size are a 400 and leave it as it
    was; a response that ends after its conversation was deleted does not bring it back."""
    from pydantic import TypeAdapter

    from server.conversations import Conversations
    from server.errors import APIError
    from server.protocol import ResponseInputItem
    from server.response_store import ResponseStore, StoredResponse
    items = TypeAdapter(list[ResponseInputItem]).validate_python
    path = tmp_path / "responses.sqlite3"
    store = ResponseStore(path=path, max_bytes=4000)
    conversations = Conversations(store)
    conv = conversations.create("o", items([{"role": "user", "content": "Hi"}]), {"k": "v"})
    conversations.extend(conv["id"], "o", [{"type": "message", "id": "msg_a", "role": "assistant",
                                            "content": [{"type": "output_text", "text": "Hello!"}]}])
    store.put("resp_1", StoredResponse("o", None, [], {"id": "resp_1", "object": "response"}))
    store.close()
    store = ResponseStore(path=path, max_bytes=4000)
    conversations = Conversations(store)
    assert conversations.messages(conv["id"], "o") == [{"role": "user", "content": "Hi"},
                                                       {"role": "assistant", "content": "Hello!"}]
    assert conversations.get(conv["id"], "o").response == conv
    with pytest.raises(APIError) as other:
        conversations.get(conv["id"], "p")
    assert other.value.status == 404 and other.value.code == "conversation_not_found"
    assert store.get(conv["id"], "o") is None and not store.delete(conv["id"], "o")
    with pytest.raises(APIError) as walk:
        store.chain(conv["id"], "o")
    assert walk.value.status == 404
    with pytest.raises(APIError):
        conversations.get("resp_1", "o")
    page = conversations.items(conv["id"], "o", 1, "asc", None)
    assert [i["content"][0]["text"] for i in page["data"]] == ["Hi"] and page["has_more"]
    for args, param in [((0, "asc", None), "limit"), ((5, "up", None), "order"), ((5, "asc", "msg_x"), "after")]:
        with pytest.raises(APIError) as bad:
            conversations.items(conv["id"], "o", *args)
        assert bad.value.status == 400 and bad.value.param == param
    with pytest.raises(APIError) as big:
        conversations.add_items(conv["id"], "o", items([{"role": "user", "content": "x" * 5000}]))
    assert big.value.status == 400 and big.value.param == "items"
    assert len(conversations.get(conv["id"], "o").input_items) == 2
    conversations.delete(conv["id"], "o")
    with caplog.at_level("WARNING", logger="jaxserve.server"):
        conversations.extend(conv["id"], "o", [{"type": "message", "id": "msg_b", "role": "user", "content": []}])
    assert "gone before" in caplog.text and store.get(conv["id"], "o", "conversation") is None
    store.close()


def test_responses_allowed_tools_become_chat_allowed_tools_in_either_mode():
    """The Responses API's flat ``allowed_tools`` is chat's, mode and names kept."""
    from server.protocol import AllowedToolsChoice, ResponsesRequest
    from server.responses import chat_request
    for mode in ("auto", "required"):
        body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [
            {"type": "function", "name": "f", "parameters": {"type": "object"}},
            {"type": "function", "name": "g", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "allowed_tools", "mode": mode, "tools": [{"type": "function", "name": "g"}]}})
        choice = chat_request(body, [], [{"role": "user", "content": "hi"}]).tool_choice
        assert isinstance(choice, AllowedToolsChoice) and choice.allowed_tools.mode == mode
        assert [t.function.name for t in choice.allowed_tools.tools] == ["g"]


def test_a_conversation_is_held_by_one_response_at_a_time():
    """``Conversations.lock``: a second hold is a 400 ``conversation_locked`` (param
    ``conversation``); a release frees it once, and a second call of the same release does
    not free a later response's hold."""
    from server.conversations import Conversations
    from server.errors import APIError
    from server.response_store import ResponseStore
    conversations = Conversations(ResponseStore())
    one, two = (conversations.create("o", [], None)["id"] for _ in range(2))
    with pytest.raises(APIError) as theirs:
        conversations.lock(one, "p")   # (another key's: not found, not "locked")
    assert theirs.value.status == 404 and theirs.value.param == "conversation"
    release = conversations.lock(one, "o")
    other = conversations.lock(two, "o")   # (others are free)
    with pytest.raises(APIError) as locked:
        conversations.lock(one, "o")
    assert locked.value.status == 400 and locked.value.code == "conversation_locked"
    assert locked.value.param == "conversation"
    release()
    later = conversations.lock(one, "o")
    release()   # (the first response's release, again)
    with pytest.raises(APIError):
        conversations.lock(one, "o")
    later()
    other()
    conversations.lock(one, "o")


def test_items_are_not_added_or_deleted_while_a_response_runs_on_the_conversation():
    """An item added while a response ran was stored before that response's turn, which
    never saw it (later turns were rendered from a history that did not happen); deleting
    one took away what the running response was built on. Both are 400s
    ``conversation_locked`` until it ends; other conversations are free."""
    from server.conversations import Conversations
    from server.errors import APIError
    from pydantic import TypeAdapter

    from server.protocol import ResponseInputItem
    from server.response_store import ResponseStore
    conversations = Conversations(ResponseStore())

    def items():
        return TypeAdapter(list[ResponseInputItem]).validate_python([{"role": "user", "content": "hi"}])
    one, two = (conversations.create("o", items(), None)["id"] for _ in range(2))
    first = conversations.items(one, "o", 20, "asc", None)["data"][0]["id"]
    release = conversations.lock(one, "o")
    for change in (lambda: conversations.add_items(one, "o", items()),
                   lambda: conversations.delete_item(one, "o", first)):
        with pytest.raises(APIError) as locked:
            change()
        assert locked.value.status == 400 and locked.value.code == "conversation_locked"
    conversations.add_items(two, "o", items())
    release()
    conversations.add_items(one, "o", items())
    conversations.delete_item(one, "o", first)
    assert len(conversations.items(one, "o", 20, "asc", None)["data"]) == 1


class _GatedAnswerEngine(_OneAnswerEngine):
    """Answers as ``_OneAnswerEngine`` after ``gate`` is set (each request's prompt ids in ``prompts``)."""

    text = "A-ANSWER"

    def __init__(self):
        import threading
        super().__init__()
        self.gate, self.entered, self.prompts = threading.Event(), threading.Event(), []

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        self.prompts.append(kw["prompt_token_ids"])
        self.entered.set()
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        async for out in super().generate(prompt, sampling_params, request_id, **kw):
            yield out


def test_a_response_on_a_held_conversation_is_refused_before_it_reads_it(monkeypatch):
    """While one response runs on a conversation, another (here with ``truncation: "auto"``,
    whose rendering waits on the tokenizer pool) is a 400 ``conversation_locked`` at once,
    before it reads the conversation (read after, the first could end meanwhile and the
    second run without its turn); the next one, after the first ended, sees its turn."""
    import threading

    from server.conversations import Conversations
    reads = []
    read = Conversations.messages
    monkeypatch.setattr(Conversations, "messages", lambda self, *a: reads.append(a) or read(self, *a))
    engine = _GatedAnswerEngine()
    with _client(engine, max_model_len=2048) as client:
        conversation = client.post("/v1/conversations", json={}).json()["id"]
        first = {}
        running = threading.Thread(target=lambda: first.setdefault("r", client.post("/v1/responses", json={
            "model": "m", "conversation": conversation, "input": "A-TURN"})))
        running.start()
        try:
            assert engine.entered.wait(10)
            second = client.post("/v1/responses", json={"model": "m", "conversation": conversation,
                                                        "input": "B-TURN", "truncation": "auto"})
        finally:
            engine.gate.set()   # (whatever happened: the first response ends, the client can close)
            running.join(10)
        assert _error(second, 400)["code"] == "conversation_locked" and len(engine.prompts) == 1 and len(reads) == 1
        assert first["r"].status_code == 200
        third = client.post("/v1/responses", json={"model": "m", "conversation": conversation, "input": "B-TURN",
                                                   "truncation": "auto"})
        assert third.status_code == 200, third.text
        assert "A-ANSWER" in engine.tokenizer.decode(engine.prompts[-1])


def test_a_failed_store_of_a_conversation_leaves_it_as_it_was():
    """A key whose only entry is a conversation that grows past what the store can hold
    beside another key's: the addition is refused (400 naming ``items``) and the
    conversation stays as it was, in memory and in what it returns."""
    from pydantic import TypeAdapter

    from server.conversations import Conversations
    from server.errors import APIError
    from server.protocol import ResponseInputItem
    from server.response_store import ResponseStore, StoredResponse
    items = TypeAdapter(list[ResponseInputItem]).validate_python
    store = ResponseStore(max_bytes=1000)
    store.put("resp_other", StoredResponse("p", None, [], {"id": "resp_other", "pad": "x" * 300}))
    conversations = Conversations(store)
    conv = conversations.create("o", items([{"role": "user", "content": "Hi"}]), None)
    with pytest.raises(APIError) as big:
        conversations.add_items(conv["id"], "o", items([{"role": "user", "content": "y" * 400}]))
    assert big.value.status == 400 and big.value.param == "items"
    assert [i["content"][0]["text"] for i in conversations.get(conv["id"], "o").input_items] == ["Hi"]
    assert store.get("resp_other", "p") is not None


def test_a_conversation_renders_model_output_a_client_could_not_send():
    """A conversation's items include the model's own output, read back without the limits
    a client's input has (a tool name over 64 characters): it still renders."""
    from server.conversations import Conversations
    from server.response_store import ResponseStore
    conversations = Conversations(ResponseStore())
    conv = conversations.create("o", [], None)
    name = "n" * 80
    conversations.extend(conv["id"], "o", [
        {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": "Go"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": name, "arguments": "{}",
         "status": "completed"},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "done"}])
    assert conversations.messages(conv["id"], "o") == [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": None, "reasoning_content": "Hm.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": name, "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]


def test_text_the_template_drops_is_not_counted_against_the_context_window():
    """The cheap size check before rendering counts only text every template renders: an
    earlier turn's ``reasoning_content`` (the demo's template, as Qwen3's, drops it) and an
    unused ``chat_template_kwargs`` value are not the prompt; text that is still refuses
    (``context_length_exceeded``) without being rendered."""
    long = "x" * 150_000
    with _client(_Recorder(), max_model_len=2048) as client:
        for extra in ({"messages": [{"role": "user", "content": "a"},
                                    {"role": "assistant", "content": "b", "reasoning_content": long},
                                    {"role": "user", "content": "c"}]},
                      {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"unused": long}}):
            r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4, **extra})
            assert r.status_code == 200, r.text
        with_think = [{"role": "user", "content": "a"}, {"role": "assistant", "content": f"<think>{long}</think>b"},
                      {"role": "user", "content": "c"}]
        assert client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 4,
                                                         "messages": with_think}).status_code == 400   # (rendered)
        for where in ("user", "assistant"):   # refused by the bound, before rendering ("at least")
            messages = [{"role": where, "content": long}, {"role": "user", "content": "c"}]
            error = _error(client.post("/v1/chat/completions", json={"model": "m", "messages": messages}), 400)
            assert error["code"] == "context_length_exceeded" and "at least" in error["message"], where


def test_reasoning_effort_reaches_the_chat_template():
    """Chat's ``reasoning_effort`` and Responses' ``reasoning.effort`` reach the template as
    ``reasoning_effort``; "none" and "minimal" also turn ``enable_thinking`` off (Qwen3's
    switch), unless ``chat_template_kwargs`` set it."""
    from server.protocol import ResponsesRequest
    from server.responses import chat_request, input_messages
    engine = _Recorder()
    engine.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %} no-think{% endif %}"
        "{% if reasoning_effort is defined %} effort={{ reasoning_effort }}{% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    with _client(engine, max_model_len=4096) as client:
        def rendered(**fields):
            ids = client.post("/tokenize", json={"model": "m", "messages": messages, "tool_choice": "none",
                                                 **fields}).json()["tokens"]
            return engine.tokenizer.decode(ids)
        assert rendered() == "hi"
        assert rendered(reasoning_effort="none") == rendered(reasoning_effort="minimal").replace("minimal", "none") \
            == "hi no-think effort=none"
        assert rendered(reasoning_effort="high") == "hi effort=high"
        assert rendered(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == "hi effort=none"
        assert _error(client.post("/tokenize", json={"model": "m", "messages": messages,
                                                     "reasoning_effort": "extreme"}), 400)["param"] == "reasoning_effort"
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "reasoning": {"effort": "minimal"}})
    assert chat_request(body, [], input_messages(body.input)).template_options()["enable_thinking"] is False


def test_a_response_store_file_is_private_locked_and_never_fails_a_response(tmp_path):
    """The store's folder and file are the server user's only; a second process (or store)
    cannot open a file in use; text the API takes that UTF-8 cannot hold (a lone surrogate
    in a metadata key) is kept and read back; a file that cannot be written only logs, and
    the store goes on in memory; a row that cannot be read is a ``ValueError``."""
    import sqlite3
    import stat

    from server.response_store import ResponseStore, StoredResponse
    folder = tmp_path / "private"
    path = folder / "responses.sqlite3"
    store = ResponseStore(path=path)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="in use by another process"):
        ResponseStore(path=path)
    odd = {"metadata": {"\ud800key": "v"}}
    store.put("odd", StoredResponse("o", None, [], odd))
    store.file._db.execute("PRAGMA query_only = ON")   # (every write now fails, as on a full disk)
    store.put("memory-only", StoredResponse("o", None, [], {"id": "m"}))
    assert store.get("memory-only", "o").response == {"id": "m"}
    store.close()
    again = ResponseStore(path=path)
    assert again.get("odd", "o").response == odd and again.get("memory-only", "o") is None
    again.close()
    sqlite3.connect(path).execute("INSERT INTO responses VALUES ('bad', 'o', 99, '{}')").connection.commit()
    with pytest.raises(ValueError, match="unreadable"):
        ResponseStore(path=path)



def test_a_version_1_store_file_is_opened_and_gains_the_files_and_batches_tables(tmp_path):
    """A store written before files and batches were kept (version 1: responses alone)
    opens with its responses and the new tables; an unknown version is refused."""
    import sqlite3

    from server.response_store import ResponseStore, StoredResponse, _entry_text
    path = tmp_path / "responses.sqlite3"
    old = sqlite3.connect(path)
    old.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, used INTEGER NOT NULL, "
                "entry TEXT NOT NULL)")
    old.execute("INSERT INTO responses VALUES ('r', 'o', 1, ?)",
                (_entry_text(StoredResponse("o", None, [], {"id": "r"})),))
    old.execute("PRAGMA user_version = 1")
    old.commit()
    old.close()
    store = ResponseStore(path=path)
    assert store.get("r", "o").response == {"id": "r"}
    tables = {row[0] for row in store.file.rows("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"files", "batches", "batch_lines"} <= tables and store.file.rows("PRAGMA user_version") == [(3,)]
    store.close()
    newer = sqlite3.connect(path)
    newer.execute("PRAGMA user_version = 7")
    newer.commit()
    newer.close()
    with pytest.raises(ValueError, match="not a jaxserve response store"):
        ResponseStore(path=path)


def test_the_version_route_names_the_installed_package():
    import importlib.metadata
    with _client(_ScriptedEngine()) as client:
        assert client.get("/version").json() == {"version": importlib.metadata.version("jaxserve")}


def test_an_uploads_expiry_fields_are_read_as_openai_sends_them():
    """``expires_after[anchor]`` and ``expires_after[seconds]`` (the official client's form
    fields): both or neither; ``created_at`` and an hour to 30 days; anything else, odd
    digits and huge numbers included, a 400 naming ``expires_after`` (never a 500)."""
    from server.app import _file_expiry
    from server.errors import APIError
    assert _file_expiry(None, None) is None
    assert _file_expiry("created_at", "3600") == 3600 and _file_expiry("created_at", " 2592000 ") == 2592000
    for anchor, seconds in (("created_at", None), (None, "3600"), ("last_active_at", "3600"),
                            ("created_at", "3599"), ("created_at", "2592001"), ("created_at", "1.5e4"),
                            ("created_at", "²"), ("created_at", "9" * 5000), ("created_at", "")):
        with pytest.raises(APIError) as refused:
            _file_expiry(anchor, seconds)
        assert refused.value.status == 400 and refused.value.param == "expires_after"


@pytest.mark.parametrize("path", ["/v1/files?limit=abc", "/v1/batches?limit=abc"])
def test_a_query_parameter_of_the_wrong_type_is_named_bare(path):
    """Query parameters are named as the client wrote them (``limit``), as their range errors
    already were; a type error named them ``query.limit``."""
    with _client(_ScriptedEngine()) as client:
        error = _error(client.get(path), 400)
        assert error["param"] == "limit" and error["message"].startswith("limit: "), error


def test_metadata_keys_and_values_are_held_to_openais_limits():
    """``metadata``: at most 16 pairs, keys of at most 64 characters (a longer key was
    accepted), values of at most 512."""
    from pydantic import ValidationError

    from server.protocol import ConversationCreateRequest
    ConversationCreateRequest.model_validate({"metadata": {"k" * 64: "v" * 512}})
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}, {f"k{i}": "v" for i in range(17)}):
        with pytest.raises(ValidationError):
            ConversationCreateRequest.model_validate({"metadata": metadata})


def test_a_request_the_servers_shutdown_cancels_is_answered_503_json():
    """SIGTERM while a request waited (on a hung tool): after uvicorn's 5-s grace it cancels
    the request's task, and uvicorn answered a plain-text 500 with a traceback in the log.
    The response not begun is an OpenAI-shaped 503 now; one already streaming is left to
    the cancel (nothing can be answered after it started)."""
    import asyncio

    from server.middleware import CatchAllMiddleware

    async def waits(scope, receive, send):
        await asyncio.Event().wait()

    async def streams(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.Event().wait()

    async def run(app):
        sent = []

        async def send(message):
            sent.append(message)
        task = asyncio.ensure_future(CatchAllMiddleware(app)({"type": "http", "path": "/v1/chat/completions",
                                                              "headers": []}, None, send))
        await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return sent, "cancelled"
        return sent, "returned"

    sent, ended = asyncio.run(run(waits))
    assert ended == "returned" and sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "server_shutting_down"
    sent, ended = asyncio.run(run(streams))
    assert ended == "cancelled" and [m["type"] for m in sent] == ["http.response.start"]
