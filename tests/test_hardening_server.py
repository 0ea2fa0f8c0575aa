"""Hostile and careless HTTP clients against a real server (issue 13): a real
``uvicorn`` process on 127.0.0.1 serving the demo model with an API key, short
header/body timeouts, a fan-out cap of 8 and a cap of 160 open connections.

Each test names the defect it guards against; they fail on the code before the
hardening (engine death, 500s, coercion, ``param: null``, unbounded fan-out...).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import httpx
import pytest

from conftest_server import ServerProcess
from server.metrics import parse_metrics_text

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONNECTIONS = 160


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    proc = ServerProcess("demo", ["--api-key", KEY, "--max-num-batched-tokens", "64", "--num-pages", "256",
                                  "--max-model-len", "512", "--max-num-seqs", "32", "--policy", "fcfs",
                                  "--max-concurrent-requests", "128", "--max-fanout", "8",
                                  "--header-timeout", "2", "--body-timeout", "2",
                                  "--max-connections", str(MAX_CONNECTIONS)], log_path=log).start()
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as c:
        yield c


def gauges(client: httpx.Client) -> dict[str, float]:
    m = parse_metrics_text(client.get("/metrics").text)
    return {"running": m["jaxserve:num_requests_running"], "waiting": m["jaxserve:num_requests_waiting"],
            "pages": m['jaxserve:kv_pages_used{memory="device"}']}


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> float:
    """Seconds until nothing runs or waits and no device page is held (fails after ``timeout``)."""
    start = time.monotonic()
    while True:
        g = gauges(client)
        if not any(g.values()):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, g
        time.sleep(0.05)


def assert_400(r: httpx.Response, param: str, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


def fresh_completion(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"model": "demo", "prompt": "hello", "max_tokens": 4,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


# ------------------------------------------------------------- cancellation
async def _hang_up_client(url: str, rng: random.Random, deadline_s: float) -> None:
    """One streaming client that hangs up after a random time (sometimes before the
    request is even sent, sometimes mid-stream)."""
    body = {"model": "demo", "messages": [{"role": "user", "content": f"story {rng.random()}"}],
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as c:
        async def run():
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    pass
        try:
            await asyncio.wait_for(run(), deadline_s)
        except (asyncio.TimeoutError, httpx.HTTPError):
            pass


def test_cancellation_storm_leaves_the_server_healthy_and_idle(server, client):
    """Defect 1 (critical): 100 streaming clients hanging up at random points killed the
    engine thread (InvalidStateError); /health stopped answering. Two storms in a row."""
    for storm in range(2):
        rng = random.Random(storm)

        async def storm_once():
            await asyncio.gather(*[_hang_up_client(server.url, rng, rng.uniform(0.0, 1.5)) for _ in range(100)])
        asyncio.run(storm_once())
        assert client.get("/health").json() == {"status": "ok"}
        wait_idle(client, timeout=10)
        fresh_completion(client)


def test_a_client_that_leaves_is_counted_in_every_latency_histogram(server, client):
    """A client that left mid-stream (or mid-answer) was observed in the TTFT and ITL
    histograms but never in E2E, queue time or ``responses_total``: its final output
    never reached the handler, and queue time came only with final outputs. Now each
    such response ends ``abort`` in all of them (queue time from its first tokens).
    (A non-streamed client's leaving is seen at the server's next 0.25-s check: an
    answer that ends first is a ``length``; the leaving is tried until one is seen.)"""
    names = ["jaxserve:time_to_first_token_seconds_count", "jaxserve:e2e_request_latency_seconds_count",
             "jaxserve:request_queue_time_seconds_count", 'jaxserve:responses_total{finish_reason="abort"}',
             'jaxserve:responses_total{finish_reason="length"}']

    def counts() -> list[float]:
        m = parse_metrics_text(client.get("/metrics").text)
        return [m.get(name, 0.0) for name in names]

    def settle(want_e2e: float) -> list[float]:
        wait_idle(client)
        deadline = time.monotonic() + 5
        while counts()[1] < want_e2e and time.monotonic() < deadline:
            time.sleep(0.05)
        return counts()

    wait_idle(client)
    before = counts()
    body = {"model": "demo", "prompt": "a long story", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data: ")
                if lines == 3:
                    break   # leaves mid-stream
    sent = 1
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    for _ in range(4):
        now = settle(before[1] + sent)
        if now[3] - before[3] >= 2:
            break   # a non-streamed one was seen leaving
        with socket.create_connection((host, int(port))) as sock:   # (an answer's headers come with its end)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                         + payload)
            deadline = time.monotonic() + 10
            while counts()[0] < before[0] + sent + 1 and time.monotonic() < deadline:
                time.sleep(0.02)   # its first tokens were made: now leave before the answer
        sent += 1
    delta = [after - was for after, was in zip(settle(before[1] + sent), before)]
    assert delta[:3] == [sent] * 3, (delta, sent)   # every response in TTFT, E2E and queue time
    assert delta[3] >= 2 and delta[3] + delta[4] == sent, (delta, sent)   # each ended abort, or length


# --------------------------------------------------------------- range checks
@pytest.mark.parametrize("field,value", [("top_k", 2**31), ("top_k", 2**63), ("max_tokens", 2**31),
                                         ("seed", 2**32), ("temperature", 2.5), ("n", 17)])
def test_values_the_engine_cannot_hold_are_400_naming_the_field(client, field, value):
    """Defect 2 (critical): top_k >= 2**31 overflowed the step's int32 array: a 500, every
    other request in the batch aborted, five in a row and the engine was dead."""
    with httpx.Client(base_url=client.base_url, headers=AUTH, timeout=60) as c2:
        bystander = c2.build_request("POST", "/v1/completions", json={
            "model": "demo", "prompt": "bystander", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True})
        response = c2.send(bystander, stream=True)
        try:
            for _ in range(5):
                r = client.post("/v1/completions", json={"model": "demo", "prompt": "x", field: value})
                assert_400(r, field)
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-3:]
        finally:
            response.close()
    assert client.get("/health").json() == {"status": "ok"}


# ------------------------------------------------------------------- fan-out
def test_fan_out_is_capped_before_anything_is_queued(client):
    """Defect 4: prompts x n became that many engine requests, uncounted and unbounded."""
    before = parse_metrics_text(client.get("/metrics").text).get("jaxserve:prompt_tokens_total", 0)
    err = assert_400(client.post("/v1/completions", json={"model": "demo", "prompt": ["a", "b", "c"], "n": 3}), "n")
    assert err["code"] == "fanout_exceeded" and "--max-fanout" in err["message"]
    assert_400(client.post("/v1/completions", json={"model": "demo", "prompt": [[1, 2]] * 9}), "prompt")
    assert_400(client.post("/v1/chat/completions", json={
        "model": "demo", "messages": [{"role": "user", "content": "x"}], "n": 9}), "n")
    assert parse_metrics_text(client.get("/metrics").text).get("jaxserve:prompt_tokens_total", 0) == before
    r = client.post("/v1/completions", json={"model": "demo", "prompt": ["a", "b"], "n": 4, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


# ------------------------------------------------------------- size limits
def test_huge_prompts_are_refused_before_tokenizing_and_do_not_block_a_bystander(server, client):
    """Defect 5: four 1.9 MB prompts were tokenized one at a time behind one lock, then
    refused anyway; a 2-token chat waited 39.8 s behind them."""
    huge = {"model": "demo", "prompt": "word " * 380_000}   # 1.9 MB

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:
            hogs = [c.post("/v1/completions", json=huge) for _ in range(4)]
            chat = c.post("/v1/chat/completions", json={
                "model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            return await asyncio.gather(*hogs, chat)
    *hogs, chat = asyncio.run(scenario())
    for r in hogs:
        err = assert_400(r, "prompt")
        assert err["code"] == "context_length_exceeded" and "at least" in err["message"]   # the cheap bound
    assert chat.status_code == 200, chat.text


# ---------------------------------------------------------- strict requests
@pytest.mark.parametrize("body,param", [
    ({"prompt": [True, False]}, "prompt.0"),   # (the element that is no token id)
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"prompt": "x", "echo": 0}, "echo"),
    ({"prompt": "x", "stream": True, "stream_options": "yes"}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
    ({"prompt": "x", "user": 12}, "user"),
])
def test_no_truthiness_coercion_and_every_type_error_names_its_field(client, body, param):
    """Defects 9 and 10: `stream: "yes"`, `max_tokens: true`, `prompt: [true, false]` were
    accepted; type errors in stream_options, messages or tools came back with param null."""
    assert_400(client.post("/v1/completions", json={"model": "demo", **body}), param)


@pytest.mark.parametrize("extra,param", [
    ({"messages": [1]}, "messages.0"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"tools": "calculator"}, "tools"),
    ({"tools": [{"type": "function", "function": "f"}]}, "tools.0.function"),
    ({"stream_options": [], "stream": True}, "stream_options"),
])
def test_chat_type_errors_name_their_field(client, extra, param):
    body = {"model": "demo", "messages": [{"role": "user", "content": "x"}], **extra}
    assert_400(client.post("/v1/chat/completions", json=body), param)


def _raw_exchange(server, requests: list[bytes]) -> list[bytes]:
    """Send requests one after another on one keep-alive connection; the raw responses."""
    host, port = "127.0.0.1", server.port
    out = []
    with socket.create_connection((host, port), timeout=30) as s:
        for req in requests:
            s.sendall(req)
            data = b""
            while b"\r\n\r\n" not in data:
                data += s.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(rest) < length:
                rest += s.recv(65536)
            out.append(head + b"\r\n\r\n" + rest)
    return out


def _post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def test_invalid_unicode_is_400_and_the_connection_stays_usable(server):
    """Defect 8: a lone surrogate in valid JSON gave a 500 and dropped the keep-alive connection."""
    bad = _post("/v1/completions", b'{"model": "demo", "prompt": "\\ud800", "max_tokens": 2}')
    bad_chat = _post("/v1/chat/completions",
                     b'{"model": "demo", "messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}')
    good = _post("/v1/completions", b'{"model": "demo", "prompt": "ok", "max_tokens": 2}')
    first, second, third = _raw_exchange(server, [bad, bad_chat, good])
    assert first.startswith(b"HTTP/1.1 400") and b'"param":"prompt"' in first, first
    assert second.startswith(b"HTTP/1.1 400") and b'"param":"messages.0.content"' in second, second
    assert third.startswith(b"HTTP/1.1 200"), third


# -------------------------------------------------------------- the schema
def test_openapi_json_is_served_behind_the_api_key(server, client):
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    schema = client.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["top_k"]["maximum"] == 2**31 - 1


def test_schemathesis_cases_from_the_app_schema_give_no_5xx(server, client):
    """A small fuzz run in CI (tools/hostile.py fuzz runs the long one)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from hostile import fuzz

    result = fuzz(server.url, KEY, examples_per_operation=20, seed=0)
    assert result["cases"] >= 60 and result["5xx"] == 0, result
    assert client.get("/health").json() == {"status": "ok"}


# --------------------------------------------------------- slow connections
def test_slow_headers_and_bodies_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")   # headers never finish
        start = time.monotonic()
        assert s.recv(1024) == b""       # closed by the server
        assert time.monotonic() - start < 8
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(_post("/v1/completions", b"{}")[:-2].replace(b"Content-Length: 2", b"Content-Length: 100"))
        data = b""
        while chunk := s.recv(4096):    # the server answers, then closes
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["param"] == "body", data


def test_open_connections_are_capped(server, client):
    """Connections beyond --max-connections are answered 503 and closed at once; the
    ones under the cap that never send a request are closed by the header deadline."""
    import select
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(MAX_CONNECTIONS + 5)]
    replies: dict[int, bytes] = {}
    try:
        deadline = time.monotonic() + 15
        while len(replies) < len(socks) and time.monotonic() < deadline:
            readable, _, _ = select.select([s for s in socks if s.fileno() not in replies], [], [], 0.5)
            for s in readable:
                replies[s.fileno()] = s.recv(4096)
    finally:
        for s in socks:
            s.close()
    refused = [r for r in replies.values() if r.startswith(b"HTTP/1.1 503")]
    closed_idle = [r for r in replies.values() if r == b""]
    assert 1 <= len(refused) <= 6 and len(refused) + len(closed_idle) == len(socks), (len(refused), len(closed_idle))
    assert client.get("/health").json() == {"status": "ok"}


def test_error_bodies_carry_param(server, client):
    r = httpx.post(server.url + "/v1/completions", json={"model": "demo", "prompt": "x"})
    assert_400(r, "authorization", status=401)
    r = client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert_400(r, "body")
    r = client.post("/v1/completions", content=b"[]", headers={"content-type": "application/json"})
    assert_400(r, "body")
    assert_400(client.get("/v1/nothing"), "path", status=404)
    assert_400(client.get("/v1/completions"), "method", status=405)
    assert_400(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), "model", status=404)
    assert json.loads(client.get("/v1/models").text)["data"][0]["id"] == "demo"
