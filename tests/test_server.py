"""The HTTP server end to end: real ``uvicorn`` processes on 127.0.0.1 driven with httpx.

Two servers for the whole module, started once:

- ``demo``: the built-in demo model, configured only through ``JAXSERVE_*``
  environment variables, no API key, at most 16 concurrent requests.
- ``tools``: a tiny checkpoint trained in the fixture to call tools
  (``conftest_server``), with an API key, ``--handling preserve`` (paused
  contexts stay on device, so a resumption never recomputes), a 5 s paused
  context TTL and the Python tool ``record_note`` registered with ``--tools``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import AsyncExitStack

import httpx
import pytest

from conftest_server import (CALC_ANSWER, CALC_USER, NOTE_ANSWER, NOTE_GATE_ENV, NOTE_LOG_ENV, NOTE_USER, WEATHER_ANSWER,
                             WEATHER_CALL, WEATHER_RESULT, WEATHER_TOOL, WEATHER_USER, ServerProcess,
                             check_with_engine)
from server.metrics import parse_metrics_text as parse_metrics

API_KEY = "test-key-123"
# The tool model's prompts carry three tool schemas (~280-470 tokens), hence a longer context window.
TOOL_SIZES = ["--max-num-batched-tokens", "64", "--num-pages", "128", "--max-model-len", "640", "--max-num-seqs", "32"]


class Servers:
    def __init__(self, demo, tools, convs, note_log, note_gate):
        self.demo, self.tools, self.convs, self.note_log, self.note_gate = demo, tools, convs, note_log, note_gate


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tool_checkpoint):
    tmp = tmp_path_factory.mktemp("server")
    env = {"JAXSERVE_MAX_NUM_BATCHED_TOKENS": "64", "JAXSERVE_NUM_PAGES": "128", "JAXSERVE_MAX_MODEL_LEN": "512",
           "JAXSERVE_MAX_NUM_SEQS": "32", "JAXSERVE_MAX_CONCURRENT_REQUESTS": "16", "JAXSERVE_POLICY": "fcfs"}
    demo = ServerProcess("demo", [], env=env, log_path=tmp / "demo.log").start()
    tools = None
    try:
        ckpt, convs = tool_checkpoint
        note_log = tmp / "notes.txt"
        note_log.touch()
        os.environ[NOTE_LOG_ENV] = str(note_log)   # for record_note run by the in-process check
        try:
            check_with_engine(ckpt, convs, max_num_batched_tokens=64, num_pages=128, max_model_len=640,
                              handling="preserve")
        finally:
            del os.environ[NOTE_LOG_ENV]
        note_log.write_text("")
        note_gate = tmp / "note-gate"
        note_gate.touch()
        tools = ServerProcess(str(ckpt), [*TOOL_SIZES, "--api-key", API_KEY, "--handling", "preserve",
                                          "--paused-context-ttl", "5", "--served-model-name", "tool-model",
                                          "--max-concurrent-requests", "4",
                                          "--tools", "record_note=tests.conftest_server:record_note"],
                              env={NOTE_LOG_ENV: str(note_log), NOTE_GATE_ENV: str(note_gate)},
                              log_path=tmp / "tools.log").start()
        demo.wait_ready()
        tools.wait_ready()
        yield Servers(demo, tools, convs, note_log, note_gate)
    finally:
        demo.stop()
        if tools is not None:
            tools.stop()


@pytest.fixture(scope="module")
def demo(servers):
    with httpx.Client(base_url=servers.demo.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tools(servers):
    with httpx.Client(base_url=servers.tools.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        yield client


# ----------------------------------------------------------------- helpers
def sse_events(response: httpx.Response) -> list:
    """``data:`` payloads of an SSE response, JSON-decoded except ``[DONE]``."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        else:
            assert line == "", line
    return events


def stream(client: httpx.Client, path: str, body: dict) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def assert_no_nulls(obj, where="") -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert v is not None, f"null at {where}.{k}"
            assert_no_nulls(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            assert_no_nulls(v, f"{where}[{i}]")


def metrics(client: httpx.Client) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no device KV page is used."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(client)
        idle = (m["jaxserve:num_requests_running"] == 0 and m["jaxserve:num_requests_waiting"] == 0
                and m['jaxserve:kv_pages_used{memory="device"}'] == 0)
        if idle or time.monotonic() > deadline:
            assert idle, {k: v for k, v in m.items() if "num_requests" in k or "kv_pages" in k}
            return m
        time.sleep(0.1)


def assert_error(r: httpx.Response, status: int, param=..., code=...) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "/work" not in err["message"] and ".py" not in err["message"] and "Traceback" not in err["message"]
    if param is not ...:
        assert err["param"] == param, err
    if code is not ...:
        assert err["code"] == code, err
    return err


def chat(content: str, **kw) -> dict:
    return {"model": "tool-model", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 64, **kw}


# ------------------------------------------------------------- demo server
def test_models_health_and_env_configuration(demo):
    assert demo.get("/health").json() == {"status": "ok"}
    models = demo.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["demo"]
    assert models["data"][0]["max_model_len"] == 512          # from JAXSERVE_MAX_MODEL_LEN
    m = metrics(demo)
    assert m['jaxserve:kv_pages_total{memory="device"}'] == 128  # from JAXSERVE_NUM_PAGES


def test_completions_non_streaming_and_streaming_agree(demo):
    body = {"model": "demo", "prompt": "Hello, world!", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = demo.post("/v1/completions", json=body).json()
    assert full["object"] == "text_completion" and full["id"].startswith("cmpl-")
    choice = full["choices"][0]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert full["usage"]["completion_tokens"] == 12
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] + 12
    events = stream(demo, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    for c in events[:-1]:
        assert_no_nulls(c)


def test_completion_logprobs_streamed_as_not_and_per_choice(demo):
    """Legacy completions ``logprobs``: one entry per generated token, ``text_offset`` into
    the choice's text, each choice its own; the stream's pieces add up to the whole."""
    body = {"model": "demo", "prompt": "Hello, world!", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "n": 2}
    full = demo.post("/v1/completions", json=body).json()
    first, second = (c["logprobs"] for c in full["choices"])
    assert first == second   # greedy: both choices the same tokens
    assert len(first["tokens"]) == len(first["token_logprobs"]) == len(first["top_logprobs"]) == 8
    text = full["choices"][0]["text"]
    assert first["text_offset"] == sorted(first["text_offset"]) and first["text_offset"][-1] <= len(text)
    for token, start in zip(first["tokens"], first["text_offset"]):   # (the demo writes parts of characters too)
        if "\ufffd" not in token and not (token.startswith("<|") and token.endswith("|>")):
            assert text[start:start + len(token)] == token
    for token_logprob, top in zip(first["token_logprobs"], first["top_logprobs"]):
        assert len(top) <= 2 and token_logprob == max(top.values()) <= 0   # greedy: the likeliest token
    plain = demo.post("/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]
    assert "logprobs" not in plain and plain["text"] == full["choices"][0]["text"]
    pieces = [e["choices"][0] for e in stream(demo, "/v1/completions", {**body, "n": 1})[:-1]]
    streamed = {key: [v for p in pieces if "logprobs" in p for v in p["logprobs"][key]] for key in first}
    # (the same tokens; the values to float32 rounding: the repeat's prompt comes from the prefix cache)
    assert streamed["tokens"] == first["tokens"] and streamed["text_offset"] == first["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(first["token_logprobs"], abs=1e-5)
    assert [list(t) for t in streamed["top_logprobs"]] == [list(t) for t in first["top_logprobs"]]


def test_completion_echo_scores_the_prompt_as_lm_eval_reads_it(demo):
    """``echo`` with ``logprobs`` (what lm-eval's loglikelihood sends: token ids, ``max_tokens``
    1, ``logprobs`` 1, ``echo``): the text starts with the prompt's, and the logprobs list the
    prompt's tokens first (the first one unscored: null), then the generated one. A prompt
    token's alternatives are those a request for the prompt up to it gets for its first
    token (another path: the sampled row's logprobs); the generated token's are the plain
    request's; the stream carries the same in pieces; ``max_tokens`` 0 returns the prompt
    alone, scored."""
    ids = [84, 104, 101, 32, 99, 97, 112, 105, 116, 97, 108]
    body = {"model": "demo", "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 5, "echo": True}
    choice = demo.post("/v1/completions", json=body).json()["choices"][0]
    plain = demo.post("/v1/completions", json={**body, "echo": False}).json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].endswith(plain["text"]) and len(choice["text"]) > len(plain["text"])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["token_logprobs"][-1] == pytest.approx(plain["logprobs"]["token_logprobs"][0], abs=1e-4)
    for j in (1, 4, len(ids) - 1):
        head = demo.post("/v1/completions", json={**body, "prompt": ids[:j], "echo": False}).json()["choices"][0]
        alternatives = head["logprobs"]["top_logprobs"][0]
        assert all(lp["top_logprobs"][j][t] == pytest.approx(v, abs=1e-4) for t, v in alternatives.items())
        assert lp["token_logprobs"][j] <= max(alternatives.values()) + 1e-4
    ctxlen = 5   # as lm-eval scores a continuation: the tokens after the context, less the generated one
    continuation = lp["token_logprobs"][ctxlen:-1]
    assert sum(continuation) < 0 and len(continuation) == len(ids) - ctxlen
    pieces = [e["choices"][0] for e in stream(demo, "/v1/completions", body)[:-1]]
    assert "".join(p["text"] for p in pieces) == choice["text"]
    assert pieces[0]["text"].startswith(choice["text"][:len(choice["text"]) - len(plain["text"])])
    streamed = [v for p in pieces if "logprobs" in p for v in p["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    text = demo.post("/v1/completions", json={**body, "prompt": "The capital", "logprobs": None}).json()
    assert text["choices"][0]["text"].startswith("The capital") and "logprobs" not in text["choices"][0]
    scored = demo.post("/v1/completions", json={**body, "max_tokens": 0}).json()   # the prompt alone
    only = scored["choices"][0]
    assert only["text"] == choice["text"][:len(choice["text"]) - len(plain["text"])]
    assert only["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    assert only["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:-1], abs=1e-4)
    assert len(only["logprobs"]["tokens"]) == len(ids)


def test_skip_special_tokens_false_keeps_them_in_the_text(demo):
    """The demo model writes its special tokens (``<|im_end|>``...) now and then when told to
    ignore EOS: the default text leaves them out, ``skip_special_tokens: false`` keeps them."""
    specials = ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>")
    body = {"model": "demo", "prompt": ["Hello", "hi", "Paris", "zzz", "What", "Why"], "max_tokens": 60,
            "temperature": 0, "ignore_eos": True}
    skipped = [c["text"] for c in demo.post("/v1/completions", json=body).json()["choices"]]
    kept = [c["text"] for c in demo.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()["choices"]]
    assert not any(s in text for text in skipped for s in specials)
    assert any(s in text for text in kept for s in specials)
    bad = demo.post("/v1/completions", json={**body, "skip_special_tokens": "no"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "skip_special_tokens"


def test_logit_bias_and_penalties_steer_the_answer(demo):
    """A +100 ``logit_bias`` makes greedy decoding write that token only (completions and
    chat); with a repetition penalty and a presence penalty no token comes twice where the
    free answer repeats."""
    from transformers import AutoTokenizer

    from jaxserve.demo import demo_dir
    tokenizer = AutoTokenizer.from_pretrained(str(demo_dir()))
    body = {"model": "demo", "prompt": [72, 101, 108], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}
    forced = tokenizer.encode("Q", add_special_tokens=False)[0]
    r = demo.post("/v1/completions", json={**body, "logit_bias": {str(forced): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([forced])] * 12
    asked = chat("Hi", model="demo", max_tokens=16, ignore_eos=True, logprobs=True)

    def token_bytes(extra: dict) -> list[tuple[int, ...]]:   # (bytes: distinct tokens may print alike)
        r = demo.post("/v1/chat/completions", json={**asked, **extra})
        assert r.status_code == 200, r.text
        return [tuple(item["bytes"]) for item in r.json()["choices"][0]["logprobs"]["content"]]
    free = token_bytes({})
    assert len(set(free)) < len(free) == 16
    penalised = token_bytes({"repetition_penalty": 10, "presence_penalty": 2})
    assert len(set(penalised)) == len(penalised) == 16
    assert token_bytes({"logit_bias": {str(forced): 100}, "max_tokens": 6}) == [tuple(b"Q")] * 6


def test_completions_token_ids_batches_and_n(demo):
    body = {"model": "demo", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    ids = demo.post("/v1/completions", json={**body, "prompt": [72, 101, 108]}).json()
    assert ids["usage"]["prompt_tokens"] == 3
    batch = demo.post("/v1/completions", json={**body, "prompt": ["Hello", "The quick"], "n": 2}).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["choices"][0]["text"] == batch["choices"][1]["text"]   # greedy: n copies agree
    single = demo.post("/v1/completions", json={**body, "prompt": "The quick"}).json()
    assert batch["choices"][2]["text"] == single["choices"][0]["text"]
    assert batch["usage"]["completion_tokens"] == 16


def test_chat_streaming_role_content_usage_done(demo):
    body = {"model": "demo", "messages": [{"role": "system", "content": "you are terse"},
                                          {"role": "user", "content": "hi"}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = demo.post("/v1/chat/completions", json=body).json()
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["role"] == "assistant"
    assert full["choices"][0]["finish_reason"] == "length"
    events = stream(demo, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert content == full["choices"][0]["message"]["content"]
    repeat = dict(events[-2]["usage"])
    # the same prompt again: all its full pages but the one holding its last token come from the cache
    assert repeat.pop("prompt_tokens_details") == {"cached_tokens": (full["usage"]["prompt_tokens"] - 1) // 16 * 16}
    assert events[-2]["choices"] == [] and repeat == {k: v for k, v in full["usage"].items()
                                                      if k != "prompt_tokens_details"}
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    without_usage = stream(demo, "/v1/chat/completions", body)
    assert all("usage" not in e for e in without_usage[:-1]) and without_usage[-1] == "[DONE]"
    # a priority class changes when a request runs, not what it answers; the tier asked is reported
    tiered = demo.post("/v1/chat/completions", json={**body, "service_tier": "flex", "priority": 3}).json()
    assert tiered["service_tier"] == "flex" and tiered["choices"] == full["choices"]


def test_n_choices_compute_their_prompt_once(demo):
    """With ``n`` = 3 the first choice computes the prompt and the other two link its 3
    full pages from the prefix cache (they wait a step for them rather than computing
    them again alongside): the cache serves 2 x 48 tokens of this 60-token prompt. The
    prompt was not cached before the request, so usage reports no cached tokens."""
    prompt = [(37 * i * i + 11 * i) % 480 + 20 for i in range(60)]   # token ids no other test sends
    before = metrics(demo)
    body = {"model": "demo", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 3}
    out = demo.post("/v1/completions", json=body).json()
    after = wait_idle(demo)
    assert len(out["choices"]) == 3 and len({c["text"] for c in out["choices"]}) == 1
    assert out["usage"]["prompt_tokens"] == 60 and "prompt_tokens_details" not in out["usage"]
    assert after["jaxserve:prefix_cache_hits_total"] - before["jaxserve:prefix_cache_hits_total"] == 2 * 48


def _timed_stream(client: httpx.Client, body: dict) -> tuple[list, float]:
    """SSE events of a streamed chat completion with usage, and its TTFT (s, test clock)."""
    start, ttft, events = time.monotonic(), None, []
    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                    ttft = time.monotonic() - start
                events.append(event)
    return events, ttft


def test_follow_up_chat_turn_reads_its_earlier_turns_from_the_prefix_cache(demo):
    system = "You are a careful assistant for a travel agency. " * 10
    first_body = {"model": "demo", "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": "plan a trip"}],
                  "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    before = metrics(demo)
    events, ttft_first = _timed_stream(demo, first_body)
    first_usage = events[-1]["usage"]
    # at most the chat template's fixed head was cached by earlier requests, not the system prompt
    first_cached = first_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert first_cached < first_usage["prompt_tokens"] - 16
    reply = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    second_body = {**first_body, "messages": first_body["messages"] + [
        {"role": "assistant", "content": reply}, {"role": "user", "content": "and back"}]}
    events, ttft_second = _timed_stream(demo, second_body)
    usage = events[-1]["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    page = 16
    # every full page of the first turn's prompt (the chat template renders it unchanged)
    assert cached % page == 0 and first_usage["prompt_tokens"] // page * page <= cached < usage["prompt_tokens"]
    after = wait_idle(demo)
    assert after["jaxserve:prefix_cache_hits_total"] - before["jaxserve:prefix_cache_hits_total"] >= \
        cached + first_cached
    assert after["jaxserve:prefix_cache_queries_total"] - before["jaxserve:prefix_cache_queries_total"] >= \
        first_usage["prompt_tokens"] + usage["prompt_tokens"]
    assert after["jaxserve:prefix_cache_pages"] >= cached // page
    print(f"TTFT first turn {ttft_first * 1e3:.1f} ms ({first_usage['prompt_tokens']} prompt tokens), "
          f"follow-up {ttft_second * 1e3:.1f} ms ({usage['prompt_tokens']} prompt tokens, {cached} cached)")


def test_greedy_and_seeded_output_same_alone_and_among_16_concurrent(servers, demo):
    prompts = [f"Request {i}: the quick brown fox" for i in range(16)]

    def body(i):
        sampled = i % 2 == 1
        return {"model": "demo", "prompt": prompts[i], "max_tokens": 20, "ignore_eos": True,
                "temperature": 0.8 if sampled else 0, **({"seed": 1000 + i} if sampled else {})}

    alone = [demo.post("/v1/completions", json=body(i)).json()["choices"][0]["text"] for i in range(16)]

    async def together():
        async with httpx.AsyncClient(base_url=servers.demo.url, timeout=60) as client:
            rs = await asyncio.gather(*[client.post("/v1/completions", json=body(i)) for i in range(16)])
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(together()) == alone
    wait_idle(demo)


def test_disconnect_mid_stream_aborts_and_frees_pages(demo):
    before = metrics(demo).get('jaxserve:request_finished_total{finish_reason="abort"}', 0)
    body = {"model": "demo", "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 300,
            "ignore_eos": True, "stream": True}
    with demo.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in seen)
        assert metrics(demo)["jaxserve:num_requests_running"] == 1
    m = wait_idle(demo, timeout=10)
    assert m['jaxserve:request_finished_total{finish_reason="abort"}'] == before + 1


def test_latency_histograms_are_exported(demo):
    m = metrics(demo)
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert m[f"jaxserve:{name}_count"] > 0, name
    for name in ("prompt_tokens_total", "generation_tokens_total", "recomputed_tokens_total",
                 "num_preemptions_total", 'num_requests_paused{handling="swap"}', 'kv_pages_used{memory="host"}',
                 'api_calls_total{handling="discard"}'):
        assert f"jaxserve:{name}" in m, name


# ------------------------------------------------------------------ errors
def test_malformed_json_and_schema_errors_are_400_naming_the_field(demo):
    bad = demo.post("/v1/chat/completions", content=b'{"model": "demo", "messages": [',
                    headers={"content-type": "application/json"})
    assert_error(bad, 400, param="body")
    cases = [
        ({"model": "demo"}, "messages"),
        ({"model": "demo", "messages": "hi"}, "messages"),
        ({"model": "demo", "messages": []}, "messages"),
        ({"model": "demo", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "demo", "messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
        ({"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "demo", "messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"model": "demo", "messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ]
    for body, param in cases:
        assert_error(demo.post("/v1/chat/completions", json=body), 400, param=param)
    assert_error(demo.post("/v1/completions", json={"model": "demo", "prompt": ""}), 400, param="prompt")
    assert_error(demo.post("/v1/completions", json={"model": "demo", "prompt": "x", "logprobs": 21}), 400,
                 param="logprobs")
    # token ids outside the vocabulary: the engine's ValueError, mapped to the field
    assert_error(demo.post("/v1/completions", json={"model": "demo", "prompt": [10**6]}), 400, param="prompt")


def test_context_window_errors(demo):
    long_text = "The quick brown fox jumps over the lazy dog. " * 60
    assert_error(demo.post("/v1/completions", json={"model": "demo", "prompt": long_text}), 400,
                 param="prompt", code="context_length_exceeded")
    assert_error(demo.post("/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": long_text}]}), 400,
        param="messages", code="context_length_exceeded")
    assert_error(demo.post("/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 511}), 400,
                 param="max_tokens", code="context_length_exceeded")
    assert_error(demo.post("/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500, "stream": True}),
        400, param="max_tokens")


def test_unknown_model_route_and_oversized_body(demo):
    assert_error(demo.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404,
                 param="model", code="model_not_found")
    assert_error(demo.get("/v1/nothing"), 404)
    assert_error(demo.get("/v1/completions"), 405)
    huge = {"model": "demo", "prompt": "x" * (2 * 1024 * 1024 + 10)}
    assert_error(demo.post("/v1/completions", json=huge), 413)
    chunked = demo.post("/v1/completions", content=iter([b'{"prompt": "', b"y" * (2 * 1024 * 1024), b'"}']),
                        headers={"content-type": "application/json"})
    assert_error(chunked, 413)


# -------------------------------------------------------------- tool server
def test_api_key_guards_every_route_but_health_and_metrics(servers, tools):
    url = servers.tools.url
    requests = [("GET", "/v1/models", None), ("POST", "/v1/completions", {"model": "tool-model", "prompt": "hi"}),
                ("POST", "/v1/chat/completions", chat("hi")), ("GET", "/v1/unknown", None), ("GET", "/version", None),
                ("POST", "/v1/responses/resp_x/cancel", None), ("GET", "/v1/responses/resp_x/input_items", None),
                ("POST", "/v1/responses/input_tokens", {"input": "hi"})]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path, body in requests:
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            err = assert_error(r, 401, code="invalid_api_key")
            assert err["type"] == "authentication_error"
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    assert tools.get("/v1/models").json()["data"][0]["id"] == "tool-model"
    assert tools.post("/v1/completions", json={"model": "tool-model", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_server_side_calculator_runs_inside_one_response(tools):
    before = metrics(tools)
    r = tools.post("/v1/chat/completions", json=chat(CALC_USER))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": CALC_ANSWER}
    assert choice["finish_reason"] == "stop"
    after = metrics(tools)
    assert after["jaxserve:request_api_pause_time_seconds_count"] == \
        before["jaxserve:request_api_pause_time_seconds_count"] + 1
    assert after["jaxserve:recomputed_tokens_total"] == before["jaxserve:recomputed_tokens_total"]


def test_server_side_python_tool_streams_one_response(servers, tools):
    events = stream(tools, "/v1/chat/completions", chat(NOTE_USER))
    assert events[-1] == "[DONE]"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert content == NOTE_ANSWER
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all("tool_calls" not in e["choices"][0]["delta"] for e in events[:-1])
    assert servers.note_log.read_text() == "the sky is blue\n"    # the server ran the Python tool


def test_over_concurrency_limit_is_429_and_disconnect_while_paused_in_a_tool_frees_pages(servers, tools):
    """Four requests held paused inside ``record_note`` fill the limit of 4; a fifth is
    refused; dropping the four connections aborts them although no token flows."""
    servers.note_gate.unlink()
    try:
        async def run():
            headers = {"Authorization": f"Bearer {API_KEY}"}
            async with httpx.AsyncClient(base_url=servers.tools.url, timeout=60, headers=headers) as client:
                async with AsyncExitStack() as streams:
                    for _ in range(4):
                        r = await streams.enter_async_context(
                            client.stream("POST", "/v1/chat/completions", json={**chat(NOTE_USER), "stream": True}))
                        assert r.status_code == 200
                    deadline = time.monotonic() + 20
                    while True:
                        m = parse_metrics((await client.get("/metrics")).text)
                        if m['jaxserve:num_requests_paused{handling="preserve"}'] == 4 or time.monotonic() > deadline:
                            break
                        await asyncio.sleep(0.05)
                    over = await client.post("/v1/chat/completions", json=chat("hi"))
                # leaving the stack drops all four connections
            return m, over

        paused, over = asyncio.run(run())
        assert paused['jaxserve:num_requests_paused{handling="preserve"}'] == 4
        assert paused['jaxserve:kv_pages_used{memory="device"}'] > 0
        err = assert_error(over, 429, code="too_many_requests")
        assert over.headers["retry-after"] == "1" and err["type"] == "rate_limit_error"
        m = wait_idle(tools, timeout=10)
        assert m['jaxserve:num_requests_paused{handling="preserve"}'] == 0
        assert m['jaxserve:request_finished_total{finish_reason="abort"}'] >= 4
    finally:
        servers.note_gate.touch()


def _follow_up(first_request: dict, assistant_message: dict) -> dict:
    call = assistant_message["tool_calls"][0]
    return {**first_request, "messages": first_request["messages"] + [
        assistant_message, {"role": "tool", "tool_call_id": call["id"], "content": WEATHER_RESULT}]}


def _weather_conv(servers):
    return next(c for c in servers.convs if c.call == WEATHER_CALL)


def test_client_side_tool_round_trip_resumes_the_paused_context(servers, tools):
    conv = _weather_conv(servers)
    first_request = chat(WEATHER_USER, tools=[WEATHER_TOOL])
    r = tools.post("/v1/chat/completions", json=first_request)
    assert r.status_code == 200, r.text
    first = r.json()
    assert_no_nulls(first)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert set(message) == {"role", "tool_calls"}
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps(WEATHER_CALL["arguments"])}
    paused = metrics(tools)
    assert paused["jaxserve:num_parked_tool_contexts"] == 1
    assert paused['jaxserve:num_requests_paused{handling="preserve"}'] == 1
    assert paused['jaxserve:kv_pages_used{memory="device"}'] > 0

    r = tools.post("/v1/chat/completions", json=_follow_up(first_request, message))
    assert r.status_code == 200, r.text
    second = r.json()
    assert second["choices"][0]["message"] == {"role": "assistant", "content": WEATHER_ANSWER}
    assert second["choices"][0]["finish_reason"] == "stop"
    assert first["usage"]["prompt_tokens"] == len(conv.prompt_ids)
    context = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["prompt_tokens"] == context + len(conv.tool_turn_ids)
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": context}
    resumed = wait_idle(tools)
    # No recompute of the paused context, and no new engine request: only the tool turn was processed.
    assert resumed["jaxserve:recomputed_tokens_total"] == paused["jaxserve:recomputed_tokens_total"]
    assert resumed["jaxserve:prompt_tokens_total"] == paused["jaxserve:prompt_tokens_total"]
    assert resumed["jaxserve:resume_appended_tokens_total"] == \
        paused["jaxserve:resume_appended_tokens_total"] + len(conv.tool_turn_ids)
    assert resumed["jaxserve:resumed_requests_total"] == paused["jaxserve:resumed_requests_total"] + 1
    assert resumed["jaxserve:num_parked_tool_contexts"] == 0
    assert resumed['jaxserve:num_requests_paused{handling="preserve"}'] == 0
    assert resumed["jaxserve:request_api_pause_time_seconds_count"] == \
        paused["jaxserve:request_api_pause_time_seconds_count"] + 1


def test_client_side_tool_call_streams_then_resumes_streaming(servers, tools):
    first_request = chat(WEATHER_USER, tools=[WEATHER_TOOL])
    events = stream(tools, "/v1/chat/completions", {**first_request, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        assert_no_nulls(e)
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("<tool_call>" not in d.get("content", "") for d in deltas)
    call_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    head, fragments = call_deltas[0], call_deltas[1:]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    assert len(fragments) >= 2 and all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"}
                                       for f in fragments)
    arguments = "".join(f["function"]["arguments"] for f in fragments)
    assert json.loads(arguments) == WEATHER_CALL["arguments"]
    # (unforced too, the arguments go out as the model writes them, not in 16-character pieces at the end)
    assert len(fragments) > -(-len(arguments) // 16) + 1, fragments
    assert events[-3]["choices"][0]["finish_reason"] == "tool_calls"
    usage = events[-2]["usage"]
    paused = metrics(tools)
    assert paused["jaxserve:num_parked_tool_contexts"] == 1

    assistant = {"role": "assistant", "tool_calls": [{"id": head["id"], "type": "function",
                                                      "function": {"name": "get_weather", "arguments": arguments}}]}
    events = stream(tools, "/v1/chat/completions", {**_follow_up(first_request, assistant),
                                                    "stream_options": {"include_usage": True}})
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert content == WEATHER_ANSWER
    assert events[-2]["usage"]["prompt_tokens_details"] == {
        "cached_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}
    resumed = wait_idle(tools)
    assert resumed["jaxserve:recomputed_tokens_total"] == paused["jaxserve:recomputed_tokens_total"]
    assert resumed["jaxserve:prompt_tokens_total"] == paused["jaxserve:prompt_tokens_total"]
    assert resumed["jaxserve:resumed_requests_total"] == paused["jaxserve:resumed_requests_total"] + 1


def test_responses_api_round_trip_resumes_the_paused_context(servers, tools):
    """OpenAI's Responses API through the official client: the model's call comes back as a
    ``function_call`` item; the follow-up sends only ``previous_response_id`` and the
    ``function_call_output`` (streamed), and resumes the paused context as chat's follow-up
    does: the whole first context is cached, nothing is recomputed."""
    import openai
    client = openai.OpenAI(base_url=servers.tools.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    weather = {"type": "function", **WEATHER_TOOL["function"]}
    first = client.responses.create(model="tool-model", input=WEATHER_USER, tools=[weather], temperature=0,
                                    max_output_tokens=64)
    assert first.status == "completed"
    details = first.usage.input_tokens_details   # (pages of 16 tokens; the prefix cache keeps the computed ones)
    assert details.cache_write_tokens == first.usage.input_tokens // 16 * 16 - details.cached_tokens
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == WEATHER_CALL["arguments"]
    paused = metrics(tools)
    assert paused["jaxserve:num_parked_tool_contexts"] == 1

    events = list(client.responses.create(
        model="tool-model", previous_response_id=first.id, tools=[weather], temperature=0, max_output_tokens=64,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT}], stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == WEATHER_ANSWER
    second = events[-1].response
    assert second.output_text == WEATHER_ANSWER and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens
    resumed = wait_idle(tools)
    assert resumed["jaxserve:recomputed_tokens_total"] == paused["jaxserve:recomputed_tokens_total"]
    assert resumed["jaxserve:prompt_tokens_total"] == paused["jaxserve:prompt_tokens_total"]
    assert resumed["jaxserve:resumed_requests_total"] == paused["jaxserve:resumed_requests_total"] + 1
    assert client.responses.retrieve(second.id).output_text == WEATHER_ANSWER
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_the_batch_api_runs_an_uploaded_file_on_the_server(servers, tools):
    """OpenAI's Files and Batch APIs through the official client: a file uploaded for
    "batch", a batch on it run by the server (the calculator inside each answer), its
    output and error files; a file with bad lines makes a failed batch naming them; a
    running batch is cancelled; bad arguments are 400s and unknown ids 404s."""
    import openai
    client = openai.OpenAI(base_url=servers.tools.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def jsonl(rows) -> bytes:
        return "".join(json.dumps(r) + "\n" for r in rows).encode()

    def line(custom_id, body, url="/v1/chat/completions"):
        return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}

    def settle(batch):
        deadline = time.monotonic() + 120
        while batch.status in ("validating", "in_progress", "finalizing", "cancelling") and time.monotonic() < deadline:
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        return batch

    rows = [line(f"calc-{i}", chat(CALC_USER)) for i in range(4)] + [line("cold", chat(CALC_USER, temperature=-1))]
    upload = client.files.create(file=("agents.jsonl", jsonl(rows)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes == len(jsonl(rows)) and upload.filename == "agents.jsonl"
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"run": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "nightly"}
    assert batch.model == "tool-model"
    batch = settle(batch)
    assert batch.status == "completed" and batch.completed_at is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 4, 1)
    done = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in done) == [f"calc-{i}" for i in range(4)]
    for x in done:
        assert x["response"]["status_code"] == 200
        assert x["response"]["body"]["choices"][0]["message"]["content"] == CALC_ANSWER   # the tool ran inside
    [refused] = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert refused["custom_id"] == "cold" and refused["response"]["status_code"] == 400
    usages = [x["response"]["body"]["usage"] for x in done]   # the batch's usage: its answers' summed
    assert (batch.usage.input_tokens, batch.usage.output_tokens, batch.usage.total_tokens) == (
        sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages),
        sum(u["total_tokens"] for u in usages)) and batch.usage.output_tokens > 0
    assert batch.usage.input_tokens_details.cached_tokens == sum(
        (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    assert client.batches.list().data[0].id == batch.id
    assert upload.id in {f.id for f in client.files.list(purpose="batch").data}
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert upload.expires_at is None and client.files.retrieve(batch.output_file_id).expires_at is None

    # OpenAI's expiry: an upload's expires_after, a batch's output_expires_after (an hour to 30 days).
    brief = client.files.create(file=("brief.jsonl", jsonl(rows[:1])), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 3600})
    assert brief.expires_at == brief.created_at + 3600
    with pytest.raises(openai.BadRequestError) as too_short:
        client.files.create(file=("x.jsonl", jsonl(rows[:1])), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 60})
    assert too_short.value.body["param"] == "expires_after"
    expiring = settle(client.batches.create(input_file_id=brief.id, endpoint="/v1/chat/completions",
                                            completion_window="24h",
                                            output_expires_after={"anchor": "created_at", "seconds": 7200}))
    output = client.files.retrieve(expiring.output_file_id)
    assert expiring.status == "completed" and output.expires_at == output.created_at + 7200
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=brief.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after={"anchor": "last_active_at", "seconds": 7200})

    # A file the batch cannot run: failed at once, each bad line named, nothing run.
    bad = client.files.create(file=("bad.jsonl", jsonl([line("a", chat(CALC_USER)),
                                                        line("b", {"prompt": "hi"}, url="/v1/completions")])
                                    + b"{not json\n"), purpose="batch")
    failed = settle(client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions",
                                          completion_window="24h"))
    assert failed.status == "failed" and failed.output_file_id is None
    assert [(e.line, e.code) for e in failed.errors.data] == [(2, "invalid_request"), (3, "invalid_request")]
    assert "the batch is for '/v1/chat/completions'" in failed.errors.data[0].message

    # Cancelled while it runs: it ends cancelled, with what had ended.
    many = client.files.create(file=("many.jsonl", jsonl([line(f"m{i}", chat(CALC_USER)) for i in range(24)])),
                               purpose="batch")
    running = client.batches.create(input_file_id=many.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelled = settle(client.batches.cancel(running.id))
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.request_counts.completed < 24
    wait_idle(tools)

    with pytest.raises(openai.BadRequestError) as wrong:
        client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    assert wrong.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert purpose.value.body["param"] == "purpose"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_a_conversation_holds_an_agent_turn_and_its_follow_up_resumes_the_paused_context(servers, tools):
    """The Conversations API through the official client: a response that continues a
    conversation (``conversation``) adds its input and output items to it; the follow-up
    sends only the tool's output, and the context rendered from the conversation's items
    spells what the model wrote, so the paused context is resumed (every token of the first
    turn cached). Items are listed, read and deleted one by one; metadata is replaced; a
    deleted conversation is a 404 for its routes and for a response that names it."""
    import openai
    client = openai.OpenAI(base_url=servers.tools.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    weather = {"type": "function", **WEATHER_TOOL["function"]}
    conversation = client.conversations.create(metadata={"topic": "weather"})
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "weather"}
    assert conversation._request_id.startswith("req_")   # (the client reads the server's x-request-id)
    first = client.responses.create(model="tool-model", conversation=conversation.id, input=WEATHER_USER,
                                    tools=[weather], temperature=0, max_output_tokens=64)
    [call] = first.output
    assert call.type == "function_call" and first.conversation.id == conversation.id
    paused = metrics(tools)
    second = client.responses.create(model="tool-model", conversation={"id": conversation.id}, tools=[weather],
                                     temperature=0, max_output_tokens=64, input=[
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": WEATHER_RESULT}])
    assert second.output_text == WEATHER_ANSWER
    assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + first.usage.output_tokens
    assert wait_idle(tools)["jaxserve:resumed_requests_total"] == paused["jaxserve:resumed_requests_total"] + 1

    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [i.type for i in items] == ["message", "function_call", "function_call_output", "message"]
    assert items[0].content[0].text == WEATHER_USER and items[1].call_id == call.call_id
    assert items[3].role == "assistant" and items[3].content[0].text == WEATHER_ANSWER
    assert client.conversations.items.retrieve(items[1].id, conversation_id=conversation.id).name == call.name
    page = client.conversations.items.list(conversation.id, limit=2, after=items[3].id)   # (newest first)
    assert [i.id for i in page.data] == [items[2].id, items[1].id] and page.has_more
    added = client.conversations.items.create(conversation.id, items=[{"type": "message", "role": "user",
                                                                       "content": "Thanks!"}])
    assert [i.content[0].text for i in added.data] == ["Thanks!"]
    client.conversations.items.delete(added.data[0].id, conversation_id=conversation.id)
    assert len(client.conversations.items.list(conversation.id).data) == 4
    assert client.conversations.update(conversation.id, metadata={"topic": "done"}).metadata == {"topic": "done"}
    assert client.conversations.retrieve(conversation.id).metadata == {"topic": "done"}
    # One response at a time on a conversation: while a background one runs (held inside record_note),
    # a second is a 400 conversation_locked; once it has ended (cancelled here), the next one runs.
    busy = client.conversations.create()
    servers.note_gate.unlink()
    try:
        running = client.responses.create(model="tool-model", conversation=busy.id, input=NOTE_USER,
                                          temperature=0, max_output_tokens=64, background=True)
        _wait_paused(tools, 1)
        with pytest.raises(openai.BadRequestError) as locked:
            client.responses.create(model="tool-model", conversation=busy.id, input="Hi", max_output_tokens=4)
        assert locked.value.body["code"] == "conversation_locked" and locked.value.body["param"] == "conversation"
        assert client.responses.cancel(running.id).status == "cancelled"
    finally:
        servers.note_gate.touch()
    wait_idle(tools)
    after = client.responses.create(model="tool-model", conversation=busy.id, input="Hi", max_output_tokens=4)
    assert after.status in ("completed", "incomplete")
    assert len(client.conversations.items.list(busy.id).data) == 2   # (the cancelled one added nothing)
    with pytest.raises(openai.BadRequestError, match="cannot both be given") as both:
        client.responses.create(model="tool-model", conversation=conversation.id, previous_response_id=first.id,
                                input="Hi", max_output_tokens=4)
    assert both.value.body["param"] == "conversation"
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError, match="conversation"):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model="tool-model", conversation=conversation.id, input="Hi", max_output_tokens=4)
    assert gone.value.body["param"] == "conversation" and gone.value.body["code"] == "conversation_not_found"
    assert client.responses.retrieve(second.id).output_text == WEATHER_ANSWER   # (responses outlive it)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(conversation.id)   # (a conversation is no response)


def test_follow_up_that_does_not_match_is_computed_fresh_and_stale_context_expires(servers, tools):
    first_request = chat(WEATHER_USER, tools=[WEATHER_TOOL])
    first = tools.post("/v1/chat/completions", json=first_request).json()
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    before = metrics(tools)
    assert before["jaxserve:num_parked_tool_contexts"] == 1
    # a different conversation: no prefix match, so a new engine request computes it from scratch
    other = tools.post("/v1/chat/completions", json=chat(CALC_USER)).json()
    assert other["choices"][0]["message"]["content"] == CALC_ANSWER
    m = metrics(tools)
    assert m["jaxserve:resumed_requests_total"] == before["jaxserve:resumed_requests_total"]
    assert m["jaxserve:prompt_tokens_total"] == before["jaxserve:prompt_tokens_total"] + \
        other["usage"]["prompt_tokens"]
    assert m["jaxserve:num_parked_tool_contexts"] == 1
    # nobody comes back for the paused weather request: after the 5 s TTL it is aborted and its pages freed
    deadline = time.monotonic() + 15
    while metrics(tools)["jaxserve:num_parked_tool_contexts"] and time.monotonic() < deadline:
        time.sleep(0.2)
    m = wait_idle(tools)
    assert m["jaxserve:num_parked_tool_contexts"] == 0
    assert m['jaxserve:num_requests_paused{handling="preserve"}'] == 0
    # the follow-up to the expired context still works: computed from scratch
    late = tools.post("/v1/chat/completions", json=_follow_up(first_request, first["choices"][0]["message"]))
    assert late.status_code == 200
    assert late.json()["choices"][0]["message"]["content"] == WEATHER_ANSWER
    # ... and its earlier turns' full pages still come from the prefix cache (the expired
    # context's pages were released into it, not wiped; nothing needed the memory since)
    page = 16
    cached = late.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % page == 0 and cached >= first["usage"]["prompt_tokens"] // page * page
    wait_idle(tools)


def test_parked_context_is_resumed_only_by_the_user_that_created_it(servers, tools):
    """Issue 13: parked contexts were matched by prefix only; another user (or key) could
    continue someone else's paused conversation."""
    first_request = chat(WEATHER_USER, tools=[WEATHER_TOOL], user="alice")
    r = tools.post("/v1/chat/completions", json=first_request)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
    message = r.json()["choices"][0]["message"]
    before = metrics(tools)
    assert before["jaxserve:num_parked_tool_contexts"] == 1
    stranger = tools.post("/v1/chat/completions", json={**_follow_up(first_request, message), "user": "mallory"})
    assert stranger.status_code == 200, stranger.text
    # A new engine request, not alice's paused one: the prefix cache may serve the token prefix
    # both conversations share (as it would for any two users), but never more than that.
    cached = stranger.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached < stranger.json()["usage"]["prompt_tokens"] and cached % 16 == 0
    after_stranger = metrics(tools)
    assert after_stranger["jaxserve:resumed_requests_total"] == before["jaxserve:resumed_requests_total"]
    assert after_stranger["jaxserve:num_parked_tool_contexts"] == 1          # still waiting for alice
    owner = tools.post("/v1/chat/completions", json=_follow_up(first_request, message))
    assert owner.status_code == 200 and owner.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metrics(tools)["jaxserve:resumed_requests_total"] == before["jaxserve:resumed_requests_total"] + 1
    wait_idle(tools)


def _wait_paused(client: httpx.Client, count: int, timeout: float = 20.0) -> None:
    """Poll /metrics until ``count`` requests are paused (inside ``record_note``, gate closed)."""
    deadline = time.monotonic() + timeout
    while metrics(client)['jaxserve:num_requests_paused{handling="preserve"}'] != count:
        assert time.monotonic() < deadline, "requests did not pause in the tool"
        time.sleep(0.05)


def test_a_background_response_outlives_its_client_and_is_polled_resumed_and_cancelled(servers, tools):
    """``background: true`` through the official client, with ``record_note`` holding each
    run paused inside the tool: the create call answers ``queued`` at once; polling shows
    it ``in_progress``; a streamed run whose connection is dropped goes on, and its events
    resume after the last sequence number seen up to ``response.completed``, with the same
    answer as in the foreground; a cancelled run aborts its engine request (its KV freed)
    and stays ``cancelled``."""
    import openai
    client = openai.OpenAI(base_url=servers.tools.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    servers.note_gate.unlink()
    try:
        created = client.responses.create(model="tool-model", input=NOTE_USER, temperature=0, max_output_tokens=64,
                                          background=True)
        assert created.status == "queued" and created.background is True and created.output == []
        _wait_paused(tools, 1)
        assert client.responses.retrieve(created.id).status == "in_progress"
        assert metrics(tools)["jaxserve:num_background_responses"] == 1
        [item] = client.responses.input_items.list(created.id).data
        assert item.type == "message" and item.content[0].text == NOTE_USER
        before = metrics(tools)
        cancelled = client.responses.cancel(created.id)
        assert cancelled.status == "cancelled" and cancelled.id == created.id
        after = wait_idle(tools)
        assert after['jaxserve:num_requests_paused{handling="preserve"}'] == 0
        aborted = 'jaxserve:request_finished_total{finish_reason="abort"}'
        assert after[aborted] == before.get(aborted, 0) + 1
        assert after["jaxserve:num_background_responses"] == 0
        assert client.responses.cancel(created.id).status == "cancelled"   # (cancelling again changes nothing)
        assert client.responses.retrieve(created.id).status == "cancelled"

        stream = client.responses.create(model="tool-model", input=NOTE_USER, temperature=0, max_output_tokens=64,
                                         background=True, stream=True)
        seen = []
        for event in stream:
            seen.append(event)
            if event.type == "response.in_progress":
                break
        stream.close()   # the client goes away: the run does not
        assert [e.type for e in seen] == ["response.created", "response.queued", "response.in_progress"]
        response_id = seen[0].response.id
        _wait_paused(tools, 1)
    finally:
        servers.note_gate.touch()
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert rest[-1].type == "response.completed"
    assert "".join(e.delta for e in rest if e.type == "response.output_text.delta") == NOTE_ANSWER
    done = client.responses.retrieve(response_id)
    assert done.status == "completed" and done.output_text == NOTE_ANSWER and done.background is True
    again = list(client.responses.retrieve(response_id, stream=True))   # (an ended run's log is kept a while)
    assert [e.sequence_number for e in again] == list(range(len(events)))
    foreground = client.responses.create(model="tool-model", input=NOTE_USER, temperature=0, max_output_tokens=64)
    assert foreground.output_text == NOTE_ANSWER and foreground.background is False
    assert client.responses.input_tokens.count(model="tool-model", input=NOTE_USER).input_tokens == \
        foreground.usage.input_tokens
    wait_idle(tools)


def test_stored_responses_survive_a_restart_with_a_response_store(tmp_path):
    """``--response-store DIR``: a conversation stored before the server is killed (SIGKILL,
    mid-run) is read back and continued (``previous_response_id``) after it restarts,
    through the official client; the background response that was running reads back
    ``failed`` with a ``server_error``, not a 404; a batch running at the kill runs on after
    the restart and completes with every line once, and its uploaded file is still
    listed; a file that is not a store stops the server at start with a clear error."""
    import openai
    args = ["--max-num-batched-tokens", "64", "--num-pages", "128", "--max-model-len", "512",
            "--response-store", str(tmp_path / "store")]
    rows = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "demo", "prompt": f"line {i}", "max_tokens": 96, "ignore_eos": True}}
            for i in range(24)]

    def serve():
        return ServerProcess("demo", args, log_path=tmp_path / "server.log").start().wait_ready()

    server = serve()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        first = client.responses.create(model="demo", input="Hello", max_output_tokens=8, temperature=0)
        running = client.responses.create(model="demo", input="Tell me everything", max_output_tokens=300,
                                          temperature=0, background=True)
        assert client.responses.retrieve(running.id).status in ("queued", "in_progress")
        upload = client.files.create(file=("b.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()),
                                     purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).status == "validating":
            time.sleep(0.05)
        server.proc.kill()
        server.proc.wait(30)
    finally:
        server.stop()
    assert (tmp_path / "store" / "responses.sqlite3").exists()
    server = serve()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
        lost = client.responses.retrieve(running.id)
        assert lost.status == "failed" and lost.error.code == "server_error" and lost.background
        assert "1 background response(s) were running" in server.log_tail()
        second = client.responses.create(model="demo", input="And then?", previous_response_id=first.id,
                                         max_output_tokens=8, temperature=0)
        assert second.status in ("completed", "incomplete") and second.previous_response_id == first.id
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        deadline = time.monotonic() + 120
        while (after := client.batches.retrieve(batch.id)).status == "in_progress" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert after.status == "completed" and after.request_counts.completed == 24
        done = [json.loads(x) for x in client.files.content(after.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in done) == sorted(r["custom_id"] for r in rows)
        assert all(len(x["response"]["body"]["choices"][0]["text"]) > 0 for x in done)
        assert upload.id in {f.id for f in client.files.list(purpose="batch").data}
        assert "running on after a restart" in server.log_tail()
    finally:
        server.stop()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "responses.sqlite3").write_bytes(b"not a database at all" * 100)
    bad = ServerProcess("demo", [*args[:-1], str(tmp_path / "bad")], log_path=tmp_path / "bad.log").start()
    assert bad.proc.wait(120) == 2 and "response store" in bad.log_tail()


def test_many_background_runs_cancelled_or_finished_leave_nothing_held(servers, demo):
    """Twelve background runs on the demo server (limit 16 engine requests), half cancelled
    at once: every run ends (cancelled or done), then the engine is idle (no page held)
    and all 16 concurrency slots are free again (16 requests at once, none refused)."""
    import openai
    client = openai.OpenAI(base_url=servers.demo.url + "/v1", api_key="x", max_retries=0, timeout=120)
    runs = [client.responses.create(model="demo", input=f"Tell me about {i}", max_output_tokens=120, temperature=0,
                                    background=True) for i in range(12)]
    cancelled = [client.responses.cancel(r.id) for r in runs[::2]]
    assert all(r.status in ("cancelled", "completed", "incomplete") for r in cancelled)
    assert any(r.status == "cancelled" for r in cancelled)   # (a run may end before its cancel; not all of them)
    deadline = time.monotonic() + 120
    ended = {}
    while len(ended) < len(runs):
        assert time.monotonic() < deadline, "background runs did not end"
        for r in runs:
            status = client.responses.retrieve(r.id).status
            if status not in ("queued", "in_progress"):
                ended[r.id] = status
        time.sleep(0.1)
    assert {ended[r.id] for r in runs[1::2]} <= {"completed", "incomplete"}
    for r in runs:   # every item a run's stream announced is done before its last event, cancelled ones' too
        events = list(client.responses.retrieve(r.id, stream=True))
        added = {e.output_index for e in events if e.type == "response.output_item.added"}
        assert added == {e.output_index for e in events if e.type == "response.output_item.done"}, r.id

    writing = client.responses.create(model="demo", input="Tell me more", max_output_tokens=300, temperature=0,
                                      background=True)
    while not client.responses.retrieve(writing.id).output:   # (cancelled with its message open)
        assert time.monotonic() < deadline, "the background run wrote nothing"
        time.sleep(0.05)
    assert client.responses.cancel(writing.id).status == "cancelled"
    events = list(client.responses.retrieve(writing.id, stream=True))
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "response.incomplete"]
    assert events[-2].item.status == "incomplete" and events[-2].item.content[0].text == \
        "".join(e.delta for e in events if e.type == "response.output_text.delta") != ""
    assert metrics(demo)["jaxserve:num_background_responses"] == 0
    wait_idle(demo, timeout=20)

    async def burst():
        async with httpx.AsyncClient(base_url=servers.demo.url, timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json={
                "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}) for _ in range(16)))
    assert [r.status_code for r in asyncio.run(burst())] == [200] * 16
