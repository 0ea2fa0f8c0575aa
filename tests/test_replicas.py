"""Replicas on Ray Serve, end to end on CPU: a real local Ray cluster (started
once for the module), the demo model in float32 with a small KV pool, the
single-engine server in a subprocess as the reference.

- ``dp``: ``--data-parallel-size 2`` (route ``/dp``), affinity routing;
- ``pd``: ``--prefill-replicas 1 --decode-replicas 1`` (route ``/pd``);
- the single server (``ServerProcess``) with the same engine settings.

The replica-kill test runs last: it kills ``replica-1``'s actor.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from conftest_server import ServerProcess, free_port  # noqa: E402
from server.metrics import parse_metrics_text  # noqa: E402

ENGINE_ARGS = ["--dtype", "float32", "--num-pages", "96", "--max-model-len", "512", "--max-num-batched-tokens", "64",
               "--max-num-seqs", "32", "--policy", "fcfs"]
# A short forced call: the demo model's random weights write whatever the grammar allows.
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
SYSTEM = ("You are a careful assistant for a travel agency. Answer briefly, name the city, the dates and the price "
          "of every option, and never invent a booking reference.")


def _settings(port: int, *extra: str) -> dict:
    import argparse

    from server.cli import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args(["demo", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                                   *ENGINE_ARGS, *extra]))


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from jaxserve.distributed import launch
    port = free_port()
    launch.tolerate_busy_hosts()   # (the suite's other worker compiles a model meanwhile)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": launch.REPO_ROOT, "TOKENIZERS_PARALLELISM": "false"}})
    single = ServerProcess("demo", ENGINE_ARGS).start()
    try:
        launch.start(_settings(port, "--data-parallel-size", "2"), route_prefix="/dp", name="dp")
        launch.start(_settings(port, "--prefill-replicas", "1", "--decode-replicas", "1"), route_prefix="/pd",
                     name="pd")
        single.wait_ready()
        yield {"dp": f"http://127.0.0.1:{port}/dp", "pd": f"http://127.0.0.1:{port}/pd", "single": single.url}
    finally:
        single.stop()
        serve.shutdown()
        ray.shutdown()


def _chat(url: str, messages: list[dict], **extra) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": "demo", "messages": messages, "max_tokens": 8,
                                                         "temperature": 0, **extra}, timeout=120)


async def _concurrent_chats(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=180) as client:
        return await asyncio.gather(*(client.post(url + "/v1/chat/completions",
                                                  json={"model": "demo", "max_tokens": 8, "temperature": 0, **b})
                                      for b in bodies))


def _metrics(url: str) -> dict[str, float]:
    return parse_metrics_text(httpx.get(url + "/metrics", timeout=30).text)


# -------------------------------------------------------------------- tests
def test_greedy_answers_identical_to_single_server(cluster):
    prompts = ["hello there", "Write a haiku about the sea.", SYSTEM]
    answers = {}
    for name in ("single", "dp", "pd"):
        client = openai.OpenAI(base_url=cluster[name] + "/v1", api_key="none", max_retries=0, timeout=120)
        chats = [client.chat.completions.create(model="demo", messages=[{"role": "user", "content": p}],
                                                max_tokens=12, temperature=0) for p in prompts]
        completion = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=12,
                                               temperature=0)
        answers[name] = [c.choices[0].message.content for c in chats] + [completion.choices[0].text]
        assert all(c.usage.completion_tokens == 12 for c in chats)
    assert answers["dp"] == answers["single"]
    assert answers["pd"] == answers["single"]
    # The disaggregated answers really came from moved pages (SYSTEM and the haiku prompt span full pages).
    moved = _metrics(cluster["pd"])
    assert moved['jaxserve:remote_prefills_total{replica="decode-0"}'] >= 3
    assert moved['jaxserve:kv_transfer_pages_total{replica="decode-0"}'] >= 3
    assert moved.get('jaxserve:remote_prefill_fallbacks_total{replica="decode-0"}', 0) == 0


def test_routes_errors_and_header_match_single_server(cluster):
    bad = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    for name in ("single", "dp"):
        r = httpx.post(cluster[name] + "/v1/chat/completions", json=bad, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        models = httpx.get(cluster[name] + "/v1/models", timeout=60)
        assert models.json()["data"][0]["id"] == "demo"
        if name == "dp":
            assert r.headers["x-jaxserve-replica"] in ("replica-0", "replica-1")
            assert models.headers["x-jaxserve-replica"] in ("replica-0", "replica-1")
    health = httpx.get(cluster["dp"] + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["replicas_up"] == 2 and "prefill" not in health
    health = httpx.get(cluster["pd"] + "/health", timeout=30).json()
    assert health["status"] == "ok" and health["prefill"] == {"status": "up", "replicas_desired": 1}
    single = _metrics(cluster["single"])   # the vLLM-named gauges on the single server too
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= set(single)


def test_client_leaving_mid_stream_stops_its_generation_on_the_replica(cluster):
    body = {"model": "demo", "messages": [{"role": "user", "content": "a very long story"}], "max_tokens": 300,
            "ignore_eos": True, "stream": True}
    before = _metrics(cluster["dp"])
    with httpx.stream("POST", cluster["dp"] + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        replica = r.headers["x-jaxserve-replica"]
        for line in r.iter_lines():
            if '"content"' in line and '"content":""' not in line:
                break   # one token arrived: leave
    gauge = f'vllm:num_requests_running{{replica="{replica}"}}'
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _metrics(cluster["dp"])[gauge] > 0:
        time.sleep(0.5)
    metrics = _metrics(cluster["dp"])
    assert metrics[gauge] == 0
    generated = f'jaxserve:generation_tokens_total{{replica="{replica}"}}'
    assert metrics[generated] - before[generated] < 300
    aborted = f'jaxserve:request_finished_total{{finish_reason="abort",replica="{replica}"}}'
    assert metrics[aborted] - before.get(aborted, 0) == 1


def test_sixteen_concurrent_requests_spread_over_both_replicas(cluster):
    bodies = [{"messages": [{"role": "user", "content": f"question number {i}: what is {i} plus {i}?"}]}
              for i in range(16)]
    responses = asyncio.run(_concurrent_chats(cluster["dp"], bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    served = [r.headers["x-jaxserve-replica"] for r in responses]
    assert {"replica-0", "replica-1"} == set(served)
    assert min(served.count("replica-0"), served.count("replica-1")) >= 4
    metrics = _metrics(cluster["dp"])
    for replica in ("replica-0", "replica-1"):   # the vLLM-named gauges, per replica
        for gauge in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert f'{gauge}{{replica="{replica}"}}' in metrics
        assert metrics[f'jaxserve:request_finished_total{{finish_reason="length",replica="{replica}"}}'] >= 4


def test_second_turn_lands_on_the_same_replica_with_cached_tokens(cluster):
    # Distinct system prompts: one shared by all would send every first turn to the replica that
    # cached it (up to MAX_IMBALANCE requests in flight), which is the point of prefix affinity.
    firsts = [[{"role": "system", "content": f"Agency {i}. {SYSTEM}"},
               {"role": "user", "content": "Lisbon or Porto?"}] for i in range(4)]
    responses = asyncio.run(_concurrent_chats(cluster["dp"], [{"messages": m} for m in firsts]))
    first_replicas = [r.headers["x-jaxserve-replica"] for r in responses]
    assert set(first_replicas) == {"replica-0", "replica-1"}   # concurrent first turns are spread
    seconds = [m + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And the cheaper one?"}] for m, r in zip(firsts, responses)]
    for messages, replica in zip(seconds, first_replicas):
        r = _chat(cluster["dp"], messages)
        assert r.status_code == 200, r.text
        assert r.headers["x-jaxserve-replica"] == replica
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    # A session key pins a conversation whose prompt is too short for a full page.
    pinned = _chat(cluster["dp"], [{"role": "user", "content": "hi"}], user="alice").headers["x-jaxserve-replica"]
    for text in ("again", "and again", "once more"):
        r = _chat(cluster["dp"], [{"role": "user", "content": text}], user="alice")
        assert r.headers["x-jaxserve-replica"] == pinned
    r = httpx.post(cluster["dp"] + "/v1/chat/completions", headers={"x-session-affinity": "s-1"}, timeout=60,
                   json={"model": "demo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    again = httpx.post(cluster["dp"] + "/v1/chat/completions", headers={"x-session-affinity": "s-1"}, timeout=60,
                       json={"model": "demo", "messages": [{"role": "user", "content": "y"}], "max_tokens": 2})
    assert r.headers["x-jaxserve-replica"] == again.headers["x-jaxserve-replica"]
    decisions = _metrics(cluster["dp"])
    assert decisions['jaxserve:router_decisions_total{reason="prefix"}'] >= 4
    assert decisions['jaxserve:router_decisions_total{reason="session"}'] >= 4


@pytest.mark.parametrize("app", ["dp", "pd"])
def test_client_tool_follow_up_resumes_on_the_parking_replica(cluster, app):
    """With ``pd`` the first turn's prompt KV came from the prefill replica; the API pause
    (the client's tool call) and the follow-up stay on the decode replica."""
    before = _metrics(cluster[app])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "weather in Paris?"}]
    # One call (no parallel turn): the demo's EOS is not its template's end of turn, so a
    # parallel turn's closing EOS would not re-render (docs/server.md, parallel_tool_calls).
    first = _chat(cluster[app], messages, tools=[WEATHER_TOOL], max_tokens=64, parallel_tool_calls=False,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    replica = first.headers["x-jaxserve-replica"]
    follow = messages + [{"role": "assistant", "content": choice["message"].get("content") or "",
                          "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21C"}]
    r = _chat(cluster[app], follow, tools=[WEATHER_TOOL], max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.headers["x-jaxserve-replica"] == replica
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    after = _metrics(cluster[app])
    assert after['jaxserve:router_decisions_total{reason="parked"}'] == \
        before.get('jaxserve:router_decisions_total{reason="parked"}', 0) + 1
    resumed = f'jaxserve:resumed_requests_total{{replica="{replica}"}}'
    assert after[resumed] == before.get(resumed, 0) + 1


def test_responses_api_follow_up_and_retrieval_reach_the_storing_replica(cluster):
    """``previous_response_id`` and ``GET /v1/responses/{id}`` go to the replica that stored the
    response (the only store that has it); the follow-up resumes the parked tool context there.
    Conversations likewise: created on one replica, continued and read there."""
    url = cluster["dp"]
    weather = {"type": "function", **WEATHER_TOOL["function"]}
    first = httpx.post(url + "/v1/responses", timeout=120, json={
        "model": "demo", "instructions": SYSTEM, "input": "weather in Paris?", "tools": [weather],
        "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "max_output_tokens": 64, "temperature": 0})
    assert first.status_code == 200, first.text
    replica = first.headers["x-jaxserve-replica"]
    [call] = [item for item in first.json()["output"] if item["type"] == "function_call"]
    before = _metrics(url).get('jaxserve:router_decisions_total{reason="stored"}', 0)
    for _ in range(3):   # whatever else is in flight, the stored response's replica answers
        got = httpx.get(url + f"/v1/responses/{first.json()['id']}", timeout=60)
        assert got.status_code == 200 and got.headers["x-jaxserve-replica"] == replica
    assert _metrics(url)['jaxserve:router_decisions_total{reason="stored"}'] == before + 3
    follow = httpx.post(url + "/v1/responses", timeout=120, json={
        "model": "demo", "instructions": SYSTEM, "previous_response_id": first.json()["id"], "tools": [weather],
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21C"}],
        "max_output_tokens": 4, "temperature": 0})
    assert follow.status_code == 200, follow.text
    assert follow.headers["x-jaxserve-replica"] == replica
    assert follow.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0

    # A conversation lives on the replica that created it: its routes and the responses that
    # continue it go there, whatever else is in flight.
    conversation = httpx.post(url + "/v1/conversations", timeout=60, json={"items": [
        {"type": "message", "role": "user", "content": "Hello"}]})
    assert conversation.status_code == 200, conversation.text
    holder, conv_id = conversation.headers["x-jaxserve-replica"], conversation.json()["id"]
    for _ in range(3):
        turn = httpx.post(url + "/v1/responses", timeout=120, json={
            "model": "demo", "conversation": conv_id, "input": "And then?", "max_output_tokens": 4, "temperature": 0})
        assert turn.status_code == 200 and turn.headers["x-jaxserve-replica"] == holder, turn.text
    items = httpx.get(url + f"/v1/conversations/{conv_id}/items", timeout=60)
    assert items.headers["x-jaxserve-replica"] == holder and len(items.json()["data"]) == 7
    assert httpx.delete(url + f"/v1/conversations/{conv_id}", timeout=60).json()["deleted"]
    # The request id (Ray Serve's proxy's: the client's own, or a new one; passed to the replica) is on
    # every answer, once.
    assert items.headers["x-request-id"] and "," not in items.headers["x-request-id"]
    traced = httpx.get(url + f"/v1/responses/{first.json()['id']}", timeout=60, headers={"x-request-id": "trace-9"})
    assert traced.headers["x-request-id"] == "trace-9" and traced.headers["x-jaxserve-replica"] == replica


def _upload_to(app: str, replica: str, name: str, data: bytes) -> str:
    """Upload ``data`` as a batch file to ``replica`` of ``app`` itself (its Ray Serve
    deployment, past the front, which learns of the file only when asked for it); its file id."""
    from ray import serve

    request = httpx.Request("POST", "http://replica/v1/files", data={"purpose": "batch"}, files={"file": (name, data)},
                            headers={"authorization": "Bearer none"})   # (the key the test's clients send: its owner)
    head, *chunks = serve.get_deployment_handle(replica, app_name=app).options(stream=True).handle.remote(
        "POST", "/v1/files", b"", list(request.headers.items()), request.read())
    assert head["status"] == 200, chunks
    return json.loads(b"".join(chunks))["id"]


def test_files_and_batches_on_both_replicas_list_as_one(cluster):
    """``GET /v1/files`` and ``GET /v1/batches`` through the front list every replica's (a
    file lives where it was uploaded, a batch where its input file is), paged as one server
    pages them: the official client's auto-paging sees them all, ``limit``/``after`` walk
    the merged list, bad values are the server's 400s."""
    url = cluster["dp"]
    line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    files = {replica: _upload_to("dp", replica, f"{replica}.jsonl", (json.dumps(line) + "\n").encode())
             for replica in ("replica-0", "replica-1")}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    # (the front has not seen these files: each batch is asked of the other replica after a 404)
    batches = {replica: client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                              completion_window="24h").id for replica, file_id in files.items()}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(client.batches.retrieve(b).status != "completed"
                                              for b in batches.values()):
        time.sleep(0.5)
    outputs = {client.batches.retrieve(b).output_file_id for b in batches.values()}
    assert None not in outputs
    listed = [f.id for f in client.files.list(limit=1)]   # (auto-paging: one file a page)
    assert set(files.values()) | outputs <= set(listed) and len(listed) == len(set(listed))
    key = {"authorization": "Bearer none"}
    page = httpx.get(url + "/v1/files", params={"order": "asc", "limit": 100}, headers=key, timeout=60)
    assert page.headers["x-jaxserve-replica"] == "replica-0,replica-1"
    assert [f["id"] for f in page.json()["data"]] == listed[::-1] and not page.json()["has_more"]
    assert [b.id for b in client.batches.list()][:2] in (list(batches.values()), list(batches.values())[::-1])
    walked, after = [], None
    while True:
        got = httpx.get(url + "/v1/batches", params={"limit": 1, **({"after": after} if after else {})},
                        headers=key, timeout=60).json()
        walked += [b["id"] for b in got["data"]]
        if not got["has_more"]:
            break
        after = got["last_id"]
    assert set(batches.values()) <= set(walked) and len(walked) == len(set(walked))
    for params, param in (({"limit": 0}, "limit"), ({"after": "file-nope"}, "after"), ({"order": "up"}, "order")):
        bad = httpx.get(url + "/v1/files", params=params, headers=key, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def _replica_actor(app: str, replica: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["namespace"] == "serve" and actor["name"].startswith(f"SERVE_REPLICA::{app}#{replica}#"):
            return ray.get_actor(actor["name"], namespace="serve")
    raise LookupError(f"no actor for {app}/{replica}")


def test_killed_replica_fails_only_its_requests_and_comes_back(cluster):
    url = cluster["dp"]

    async def run() -> tuple[list[httpx.Response], dict | None]:
        bodies = [{"messages": [{"role": "user", "content": f"long story {i}"}], "max_tokens": 300,
                   "ignore_eos": True} for i in range(8)]
        task = asyncio.ensure_future(_concurrent_chats(url, bodies))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # wait until replica-1 is generating
            await asyncio.sleep(0.5)
            running = await asyncio.to_thread(_metrics, url)
            if running.get('vllm:num_requests_running{replica="replica-1"}', 0) > 0:
                break
        ray.kill(_replica_actor("dp", "replica-1"), no_restart=False)
        degraded = None
        deadline = time.monotonic() + 20
        while degraded is None and time.monotonic() < deadline:   # before Ray Serve has restarted it
            health = await asyncio.to_thread(httpx.get, url + "/health", timeout=30)
            if health.json()["status"] == "degraded":
                degraded = health.json()
            await asyncio.sleep(0.2)
        return await task, degraded

    responses, degraded = asyncio.run(run())
    by_replica = {}
    for r in responses:
        by_replica.setdefault(r.headers.get("x-jaxserve-replica"), []).append(r)
    assert {r.status_code for r in by_replica["replica-0"]} == {200}
    failed = by_replica["replica-1"]
    assert failed and all(r.status_code == 503 for r in failed)
    assert all(r.json()["error"]["code"] == "replica_failed" for r in failed)
    assert degraded is not None and degraded["replicas"] == {"replica-0": "up", "replica-1": "down"}
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and httpx.get(url + "/health", timeout=30).json()["status"] != "ok":
        time.sleep(1)
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"
    back = asyncio.run(_concurrent_chats(url, [{"messages": [{"role": "user", "content": f"back? {i}"}]}
                                               for i in range(4)]))
    assert [r.status_code for r in back] == [200] * 4
    assert {r.headers["x-jaxserve-replica"] for r in back} == {"replica-0", "replica-1"}   # the new replica serves


if __name__ == "__main__":
    sys.exit(pytest.main([os.path.abspath(__file__), "-q"]))
