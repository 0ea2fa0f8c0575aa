"""``jaxserve run-batch``: an OpenAI batch file served offline by the server's own app
(real subprocesses, the tool-calling checkpoint of ``conftest_server``)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections import Counter

import pytest

from conftest_server import (CALC_ANSWER, CALC_USER, REPO, WEATHER_CALL, WEATHER_TOOL, WEATHER_USER)
from server.batch import failed, parse_batch, summary
from server.batches import Batches, FileStore
from server.errors import APIError

# As the tool server of test_server runs it: the model was trained with record_note advertised.
SIZES = ["--max-num-batched-tokens", "64", "--num-pages", "128", "--max-model-len", "640", "--max-num-seqs", "32",
         "--policy", "fcfs", "--tools", "record_note=tests.conftest_server:record_note"]


def line(custom_id: str, url: str, body: dict, **entry) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "tool-model", **body}, **entry}


def chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 64, **kw}


def run_batch(model, input_path, output_path, *extra, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve.cli", "run-batch", str(model), "-i", str(input_path),
                           "-o", str(output_path), "--served-model-name", "tool-model", *SIZES, *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def answers(output_line: dict) -> list:
    """What a chat or completions output line's choices say, without their generated ids."""
    return [(c["finish_reason"], c.get("text"), c.get("message", {}).get("content"),
             [t["function"] for t in c.get("message", {}).get("tool_calls", [])])
            for c in output_line["response"]["body"].get("choices", [])]


def test_a_batch_file_is_checked_whole_and_every_bad_line_is_named(tmp_path):
    rows = [json.dumps(line("ok", "/v1/completions", {"prompt": "hi"})), "", "{not json", "[1, 2]",
            json.dumps(line("ok", "/v1/completions", {"prompt": "again"})),
            json.dumps({**line("get", "/v1/completions", {"prompt": "hi"}), "method": "GET"}),
            json.dumps(line("emb", "/v1/embeddings", {"input": "hi"})),
            json.dumps({"custom_id": "nobody", "method": "POST", "url": "/v1/completions", "body": "hi"}),
            json.dumps(line("other", "/v1/completions", {"prompt": "hi", "model": "gpt-4o"})),
            json.dumps(line("live", "/v1/chat/completions", chat("hi", stream=True))),
            json.dumps(line("later", "/v1/responses", {"input": "hi", "background": True})),
            json.dumps({**line("", "/v1/completions", {"prompt": "hi"})})]
    # A line separator inside a JSON string (written unescaped) is no end of line.
    rows[0] = json.dumps(line("ok", "/v1/completions", {"prompt": "one\u2028two\x85three"}), ensure_ascii=False)
    requests, errors = parse_batch("\n".join(rows), "tool-model")
    assert [r.custom_id for r in requests] == ["ok"] and requests[0].line == 1
    assert requests[0].body["prompt"] == "one\u2028two\x85three"
    assert [e.split(":")[0] for e in errors] == [f"line {n}" for n in (3, 4, 5, 6, 7, 8, 9, 10, 11, 12)]
    for fragment, n in [("not JSON", 3), ("expected a JSON object", 4), ("repeats line 1", 5), ("method", 6),
                        ("url must be one of", 7), ("body must be a JSON object", 8),
                        ("served as 'tool-model' (--served-model-name", 9), ("body.stream", 10),
                        ("body.background", 11), ("custom_id must be a non-empty string", 12)]:
        assert fragment in errors[n - 3], errors[n - 3]
    # The command says so before loading any model, and writes nothing.
    path = tmp_path / "in.jsonl"
    path.write_text("\ufeff" + "\n".join(rows) + "\n", encoding="utf-8")   # (a byte-order mark is no error)
    result = run_batch("/no/such/checkpoint", path, tmp_path / "out.jsonl", timeout=120)
    assert result.returncode == 2, result.stderr
    assert "10 invalid line(s), nothing was run" in result.stderr and "line 9: body.model" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_run_batch_refuses_an_output_that_is_a_directory_or_not_its_own(tmp_path, capsys):
    """Before any model loads, one line and status 2: a directory as ``--output`` was
    called an existing output (and with ``--resume`` a traceback); a file that is not a
    batch output is named."""
    from jaxserve import cli

    source = tmp_path / "in.jsonl"
    write_jsonl(source, [line("a", "/v1/completions", {"prompt": "hi"})])
    (tmp_path / "adir").mkdir()
    (tmp_path / "notes.txt").write_text("not a batch output\n")
    for output, resume, message in [("adir", [], "--output {} is a directory: name a file"),
                                     ("adir", ["--resume"], "--output {} is a directory: name a file"),
                                     ("notes.txt", ["--resume"], "--resume: {} line 1 is not a batch output line")]:
        path = tmp_path / output
        assert cli.main(["run-batch", "/no/such/checkpoint", "-i", str(source), "-o", str(path),
                         "--served-model-name", "tool-model", *resume]) == 2
        err = capsys.readouterr().err
        assert err == f"jaxserve run-batch: {message.format(path)}\n"
    assert (tmp_path / "notes.txt").read_text() == "not a batch output\n"


def test_run_batch_serves_each_line_with_server_side_tools_and_resumes_after_a_kill(tmp_path, tool_checkpoint):
    ckpt, _ = tool_checkpoint
    rows = [line(f"calc-{i}", "/v1/chat/completions", chat(CALC_USER)) for i in range(6)]
    # Third of three in flight (--max-concurrent-requests 3), it needs two engine requests
    # while two others hold one each: the app's 429, which the batch retries until served.
    rows.insert(2, line("two", "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0, "n": 2}))
    rows += [line("weather", "/v1/chat/completions", chat(WEATHER_USER, tools=[WEATHER_TOOL])),
             line("text", "/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0}),
             line("resp", "/v1/responses", {"input": CALC_USER, "temperature": 0, "max_output_tokens": 64}),
             line("bad-temperature", "/v1/chat/completions", chat(CALC_USER, temperature=-1))]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(source, rows)
    result = run_batch(ckpt, source, out, "--max-concurrent-requests", "3")
    assert result.returncode == 0, result.stderr
    assert "10 of 11 requests succeeded (1 x 400 did not)" in result.stderr
    assert re.search(r"; [1-9]\d* waited for room \(429\) and were retried", result.stderr)
    lines = read_jsonl(out)
    by_id = {x["custom_id"]: x for x in lines}
    assert len(lines) == len(by_id) == len(rows)
    for x in lines:
        assert x["id"].startswith("batch_req_") and x["response"]["request_id"].startswith("req_")
    # The built-in calculator ran inside each of the six answers, all in flight together.
    for i in range(6):
        response = by_id[f"calc-{i}"]["response"]
        assert response["status_code"] == 200 and by_id[f"calc-{i}"]["error"] is None
        assert response["body"]["choices"][0]["message"] == {"role": "assistant", "content": CALC_ANSWER}
    # A client-side call ends its request with the call, as the server answers it.
    weather = by_id["weather"]["response"]["body"]["choices"][0]
    assert weather["finish_reason"] == "tool_calls"
    call = weather["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == (WEATHER_CALL["name"], WEATHER_CALL["arguments"])
    assert by_id["text"]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert by_id["two"]["response"]["status_code"] == 200 and len(by_id["two"]["response"]["body"]["choices"]) == 2
    response = by_id["resp"]["response"]["body"]
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["output"][-1]["content"][0]["text"] == CALC_ANSWER
    refused = by_id["bad-temperature"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "temperature"

    # An existing output is never overwritten unasked.
    again = run_batch(ckpt, source, out, timeout=120)
    assert again.returncode == 2 and "--resume" in again.stderr
    assert read_jsonl(out) == lines
    # A run killed while writing its fourth line, whose second line is the server's failure
    # (a 503 of an engine that died): --resume keeps the other two whole lines and serves
    # the requests they do not hold, the failed one again.
    kept = lines[:3]
    dead = {**kept[1], "response": {"status_code": 503, "request_id": "req_x",
                                    "body": {"error": {"message": "the engine is not running", "code": "engine_dead"}}}}
    out.write_text("".join(json.dumps(x) + "\n" for x in (kept[0], dead, kept[2])) + json.dumps(lines[3])[:40])
    resumed = run_batch(ckpt, source, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "running again 1 request(s) the server failed and dropping a last line cut short" in resumed.stderr
    assert "resuming: 2 of 11 requests are already in" in resumed.stderr
    refused_left = "bad-temperature" not in {kept[0]["custom_id"], kept[2]["custom_id"]}   # (written as they end)
    assert f"{9 - refused_left} of 9 requests succeeded" in resumed.stderr
    after = read_jsonl(out)
    assert after[:2] == [kept[0], kept[2]]
    assert sorted(x["custom_id"] for x in after) == sorted(r["custom_id"] for r in rows)
    kept = [kept[0], kept[2]]
    assert {x["custom_id"]: answers(x) for x in after[2:]} == \
        {x["custom_id"]: answers(x) for x in lines if x["custom_id"] not in {k["custom_id"] for k in kept}}


def test_the_servers_failures_are_run_again_and_make_the_exit_status():
    assert failed({"response": {"status_code": 503}, "error": None})
    assert failed({"response": None, "error": {"code": "server_error"}})
    assert not failed({"response": {"status_code": 400}, "error": None})
    assert not failed({"response": {"status_code": 200}, "error": None})
    line = summary(Counter({200: 7, 400: 1, 503: 2, "retried": 3}), 10, 1.25, None)
    assert line == ("jaxserve run-batch: 7 of 10 requests succeeded (1 x 400, 2 x 503 did not) in 1.2 s; 3 waited "
                    "for room (429) and were retried; 2 failed on the server's side: --resume runs them again")


def test_batches_on_the_server_share_one_concurrency_limit_and_always_end():
    """``server.batches`` against a stand-in app that counts the requests in flight: three
    batches at once never hold more than the shared limit, each completes; a batch
    cancelled before its first step still ends ``cancelled``; a line nested too deeply
    fails its batch, naming the line."""
    from fastapi import FastAPI

    async def main():
        app, seen = FastAPI(), {"now": 0, "most": 0}

        @app.post("/v1/completions")
        async def completions():
            seen["now"] += 1
            seen["most"] = max(seen["most"], seen["now"])
            await asyncio.sleep(0.01)
            seen["now"] -= 1
            return {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                                             "prompt_tokens_details": {"cached_tokens": 4},
                                             "completion_tokens_details": {"reasoning_tokens": 1}}}

        files = FileStore()
        batches = Batches(files, "m", concurrency=3)
        batches.app = app
        rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                 "body": {"model": "m", "prompt": "x"}} for i in range(10)]
        source = files.add("me", "in.jsonl", "batch", "".join(json.dumps(r) + "\n" for r in rows).encode())
        jobs = [batches.create("me", None, source.id, "/v1/completions", "24h", None) for _ in range(3)]
        await asyncio.wait({j.task for j in jobs})
        assert [(j.status, j.completed, j.failed_count) for j in jobs] == [("completed", 10, 0)] * 3
        assert seen["most"] == 3   # all three batches together, not three each
        assert jobs[0].object()["usage"] == {"input_tokens": 70, "input_tokens_details": {"cached_tokens": 40},
                                             "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 10},
                                             "total_tokens": 90}   # (OpenAI's BatchUsage: the lines' sums)
        out = files.get(jobs[0].output_file_id, "me")
        assert out.purpose == "batch_output" and len(out.data.splitlines()) == 10
        early = batches.create("me", None, source.id, "/v1/completions", "24h", None)
        early.task.cancel()
        await asyncio.wait({early.task})
        assert early.status == "cancelled" and early.object()["cancelled_at"] is not None
        deep = files.add("me", "deep.jsonl", "batch", b"[" * 100_000 + b"\n")
        nested = batches.create("me", None, deep.id, "/v1/completions", "24h", None)
        await asyncio.wait({nested.task})
        assert nested.status == "failed" and nested.errors[0]["line"] == 1
        assert "nested too deeply" in nested.errors[0]["message"]

    asyncio.run(main())


def test_a_servers_batch_runs_after_interactive_requests_unless_a_line_chooses():
    """Lines that choose no class (no ``priority``, ``service_tier`` unset or "auto") reach
    the app in class ``BATCH_PRIORITY``; a line's own choice is left as it is."""
    from fastapi import Body, FastAPI

    from server.batches import BATCH_PRIORITY

    async def main():
        app, bodies = FastAPI(), {}

        @app.post("/v1/completions")
        async def completions(body: dict = Body()):
            bodies[body["prompt"]] = (body.get("priority"), body.get("service_tier"))
            return {"choices": []}

        chosen = {"none": {}, "auto": {"service_tier": "auto"}, "tier": {"service_tier": "priority"},
                  "zero": {"priority": 0}, "both": {"priority": 2, "service_tier": "flex"}}
        files = FileStore()
        batches = Batches(files, "m", concurrency=2)
        batches.app = app
        rows = [{"custom_id": name, "method": "POST", "url": "/v1/completions",
                 "body": {"model": "m", "prompt": name, **fields}} for name, fields in chosen.items()]
        source = files.add("me", "in.jsonl", "batch", "".join(json.dumps(r) + "\n" for r in rows).encode())
        job = batches.create("me", None, source.id, "/v1/completions", "24h", None)
        await asyncio.wait({job.task})
        assert job.status == "completed"
        assert bodies == {"none": (BATCH_PRIORITY, None), "auto": (BATCH_PRIORITY, "auto"),
                          "tier": (None, "priority"), "zero": (0, None), "both": (2, "flex")}

    asyncio.run(main())


def test_files_and_a_running_batch_outlive_a_restart_with_a_state_file(tmp_path):
    """With the state file (``--response-store``): files read back; a batch the server
    stopped mid-run stays ``in_progress`` there and, when the server starts again, serves
    only the lines it had not answered (the one in flight at the stop again), as its
    creator (the owners its Authorization header gives, per ``user``: the header itself
    is never stored), then completes with every line once; an ended batch reads back as
    it ended; batches stay listed in creation order whichever was updated last."""
    from server.middleware import TRUSTED_OWNERS, owner_of
    from server.state_file import StateFile

    creator = {"": owner_of("Bearer creator"), "alice": owner_of("Bearer creator", "alice")}

    path = tmp_path / "state" / "responses.sqlite3"

    def jsonl(prefix: str) -> bytes:
        return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                   "body": {"model": "m", "prompt": f"{prefix}{i}", "user": "alice"}}) + "\n"
                       for i in range(6)).encode()

    def stand_in(served: list, stall: str | None = None):
        """An ASGI app answering completions with the prompt in capitals, but ``stall``,
        which it answers only when its client leaves."""
        async def app(scope, receive, send):
            body = json.loads((await receive())["body"])
            served.append((body["prompt"], dict(scope["headers"]).get(b"authorization"), scope.get(TRUSTED_OWNERS)))
            if body["prompt"] == stall:
                while (await receive())["type"] != "http.disconnect":   # in flight when the server stops
                    pass
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps({
                "choices": [{"text": body["prompt"].upper()}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()})
        return app

    def open_state():
        state = StateFile(path)
        files = FileStore(state=state)
        return state, files, Batches(files, "m", concurrency=2, state=state)

    async def first_life():
        state, files, batches = open_state()
        batches.app = stand_in(served := [], stall="s2")
        source = files.add("me", "in.jsonl", "batch", jsonl("s"))
        running = batches.create("me", "Bearer creator", source.id, "/v1/completions", "24h", None)
        while running.completed < 5:   # all but the stalled line
            await asyncio.sleep(0.01)
        other = files.add("me", "other.jsonl", "batch", jsonl("p"))
        done = batches.create("me", "Bearer old", other.id, "/v1/completions", "24h", {"k": "v"})
        await asyncio.wait({done.task})   # (on the gate's other slot)
        await batches.close()
        assert running.status == "in_progress" and ("s2", None, creator) in served
        state.close()
        batches.resume()   # (the same app started again after its file closed: nothing to read, nothing run)
        assert running.status == "in_progress" and running.task.done()
        return source.id, done.object(), running.id

    async def second_life(source_id, done_object, running_id):
        state, files, batches = open_state()
        assert files.get(source_id, "me").data == jsonl("s")
        assert batches.get(done_object["id"], "me").object() == done_object
        batches.app = stand_in(served := [])
        batches.resume()
        job = batches.get(running_id, "me")
        await asyncio.wait({job.task})
        assert served == [("s2", None, creator)]
        assert b"Bearer creator" not in path.read_bytes() + path.with_name(path.name + "-wal").read_bytes()
        assert (job.status, job.completed, job.failed_count, job.total) == ("completed", 6, 0, 6)
        usage = job.object()["usage"]   # (the 5 lines answered before the stop read back from the file, then 1)
        assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (18, 6, 24)
        lines = [json.loads(x) for x in files.get(job.output_file_id, "me").data.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == [f"r{i}" for i in range(6)]
        assert all(x["response"]["body"]["choices"][0]["text"] == f"S{x['custom_id'][1:]}" for x in lines)
        assert not state.rows("SELECT * FROM batch_lines")   # folded into the output file
        [(kept,)] = state.rows("SELECT job FROM batches WHERE id = ?", running_id)
        assert job.owners is None and json.loads(kept)["owners"] is None   # (ended: not kept)
        state.close()

    source_id, done_object, running_id = asyncio.run(first_life())
    assert done_object["status"] == "completed" and done_object["request_counts"]["completed"] == 6
    asyncio.run(second_life(source_id, done_object, running_id))
    state, _, batches = open_state()
    assert [b["id"] for b in batches.page("me", 10, None)["data"]] == [done_object["id"], running_id]   # newest first
    state.close()


def test_a_batch_not_done_in_its_window_expires_with_its_answered_lines_kept(tmp_path):
    """When a batch's completion window ends, the lines in flight are cancelled (their
    requests leave the app), every line not answered goes to the error file as
    OpenAI's ``batch_expired``, the answered ones stay in the output file, and the
    batch ends ``expired``; a batch the server stopped, started again after its window,
    expires at once with the lines it had not answered."""
    from server.state_file import StateFile

    def stand_in(left: list):
        """Completions answered at once, but prompts starting with "slow": answered only
        when the client leaves (then noted in ``left``)."""
        async def app(scope, receive, send):
            body = json.loads((await receive())["body"])
            if body["prompt"].startswith("slow"):
                while (await receive())["type"] != "http.disconnect":
                    pass
                left.append(body["prompt"])
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps({"choices": [{"text": "ok"}]}).encode()})
        return app

    prompts = ["a", "slow1", "b", "slow2", "c", "d"]
    data = "".join(json.dumps({"custom_id": p, "method": "POST", "url": "/v1/completions",
                               "body": {"model": "m", "prompt": p}}) + "\n" for p in prompts).encode()

    async def in_memory():
        files = FileStore()
        batches = Batches(files, "m", concurrency=3, windows={"24h": 2.0})
        batches.app = stand_in(left := [])
        source = files.add("me", "in.jsonl", "batch", data)
        job = batches.create("me", None, source.id, "/v1/completions", "24h", None)
        assert job.object()["expires_at"] == job.created_at + 2
        await asyncio.wait({job.task}, timeout=10)
        assert (job.status, job.completed, job.failed_count, job.total) == ("expired", 4, 2, 6)
        assert sorted(left) == ["slow1", "slow2"]   # cancelled in flight: the app saw its client leave
        assert job.object()["expired_at"] is not None and job.object()["completed_at"] is None
        answered = [json.loads(x)["custom_id"] for x in files.get(job.output_file_id, "me").data.splitlines()]
        expired = [json.loads(x) for x in files.get(job.error_file_id, "me").data.splitlines()]
        assert sorted(answered) == ["a", "b", "c", "d"]
        assert sorted(x["custom_id"] for x in expired) == ["slow1", "slow2"]
        assert all(x["response"] is None and x["error"]["code"] == "batch_expired" and failed(x) for x in expired)
        with pytest.raises(APIError) as bad:
            batches.create("me", None, source.id, "/v1/completions", "1h", None)
        assert bad.value.status == 400 and "24h" in bad.value.message

    async def stopped_then_late():
        path = tmp_path / "state.sqlite3"
        state = StateFile(path)
        files = FileStore(state=state)
        batches = Batches(files, "m", concurrency=1, state=state, windows={"24h": 3.0})
        batches.app = stand_in([])
        source = files.add("me", "in.jsonl", "batch", data)
        job = batches.create("me", None, source.id, "/v1/completions", "24h", None)
        while job.completed < 1:   # "a"; then "slow1" stalls the only slot
            await asyncio.sleep(0.01)
        await batches.close()
        state.close()
        await asyncio.sleep(max(0.0, job.expires_at - time.time()) + 0.1)   # (the server is down past the window)
        state = StateFile(path)
        files = FileStore(state=state)
        batches = Batches(files, "m", concurrency=1, state=state, windows={"24h": 3.0})
        batches.app = stand_in(left := [])
        batches.resume()
        late = batches.get(job.id, "me")
        await asyncio.wait({late.task}, timeout=10)
        assert (late.status, late.completed, late.failed_count) == ("expired", 1, 5) and not left
        expired = [json.loads(x)["custom_id"] for x in files.get(late.error_file_id, "me").data.splitlines()]
        assert sorted(expired) == sorted(p for p in prompts if p != "a")
        state.close()

    asyncio.run(in_memory())
    asyncio.run(stopped_then_late())


def test_the_files_list_takes_openais_limits():
    """``GET /v1/files`` pages up to 10,000 files (OpenAI's largest and default
    ``limit``); other lists stay at 1-100 (batches: ``Batches.page``)."""
    files = FileStore()
    ids = [files.add("me", f"f{i}.jsonl", "batch", b"{}\n").id for i in range(150)]
    page = files.page("me", None, 10_000, "asc", None)
    assert [f["id"] for f in page["data"]] == ids and not page["has_more"]
    assert files.page("me", "batch", 100, "desc", None)["has_more"]
    for bad in (0, 10_001):
        with pytest.raises(APIError) as refused:
            files.page("me", None, bad, "desc", None)
        assert refused.value.param == "limit" and "10000" in refused.value.message
    with pytest.raises(APIError, match=r"\[1, 100\]"):
        Batches(files, "m", concurrency=1).page("me", 101, None)


def test_files_with_an_expiry_are_deleted_once_it_passes_and_old_state_files_still_open(tmp_path):
    """A file given ``expires_after`` says when (``expires_at``) and is gone after it, from
    memory and from the state file; a batch's ``output_expires_after`` applies to its
    output file; a state file of version 2 (files without ``expires_at``) opens, its
    files kept until deleted."""
    import sqlite3

    from server.state_file import StateFile

    old = tmp_path / "v2" / "responses.sqlite3"
    old.parent.mkdir()
    db = sqlite3.connect(old)
    db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, used INTEGER NOT NULL, "
               "entry TEXT NOT NULL)")
    db.execute("CREATE TABLE files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, "
               "purpose TEXT NOT NULL, created_at INTEGER NOT NULL, data BLOB NOT NULL)")
    db.execute("INSERT INTO files VALUES ('file-old', 'me', 'a.jsonl', 'batch', 1, x'7b7d0a')")
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()
    state = StateFile(old)
    files = FileStore(state=state)
    assert files.get("file-old", "me").data == b"{}\n" and files.get("file-old", "me").object()["expires_at"] is None

    brief = files.add("me", "brief.jsonl", "batch", b"{}\n", expires_after_s=1)
    kept = files.add("me", "kept.jsonl", "batch", b"{}\n")
    assert brief.object()["expires_at"] == brief.created_at + 1
    time.sleep(max(0.0, brief.expires_at - time.time()) + 0.05)
    with pytest.raises(APIError) as gone:
        files.get(brief.id, "me")
    assert gone.value.status == 404
    assert [f["id"] for f in files.page("me", None, 100, "asc", None)["data"]] == ["file-old", kept.id]
    state.close()
    state = StateFile(old)
    assert [row[0] for row in state.rows("SELECT id FROM files ORDER BY rowid")] == ["file-old", kept.id]

    async def batch_with_expiring_output():
        async def app(scope, receive, send):
            await receive()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"choices": []}'})
        files = FileStore(state=state)
        batches = Batches(files, "m", concurrency=1, state=state)
        batches.app = app
        source = files.add("me", "in.jsonl", "batch", json.dumps(
            {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}}
        ).encode() + b"\n")
        job = batches.create("me", None, source.id, "/v1/completions", "24h", None, output_expires_after_s=7200)
        await asyncio.wait({job.task})
        output = files.get(job.output_file_id, "me")
        assert job.status == "completed" and output.expires_at == output.created_at + 7200
        assert source.expires_at is None

    asyncio.run(batch_with_expiring_output())
    state.close()


def test_a_batchs_usage_counts_only_what_answers_report_as_counts():
    """Chat and completions ``usage`` (``prompt_tokens``...) and the Responses API's
    (``input_tokens``...) both add up; a line without usage, with ``usage: null`` or with
    values that are no counts adds nothing (and never stops the batch)."""
    from server.batches import BatchJob
    job = BatchJob("batch_1", "me", "m", "/v1/responses", "file-1", "24h", None)
    for body in ({"usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1}}},
                 {"usage": {"input_tokens": 5, "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 3}}},
                 {"usage": None}, "not json", {"usage": {"prompt_tokens": "3", "completion_tokens": True,
                                                          "prompt_tokens_details": [1]}}, {"choices": []}):
        job.count({"response": {"status_code": 200, "body": body}}, False)
    job.count({"response": None, "error": {"code": "batch_expired"}}, True)
    assert (job.completed, job.failed_count) == (6, 1)
    assert job.object()["usage"] == {"input_tokens": 8, "input_tokens_details": {"cached_tokens": 1},
                                     "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 3},
                                     "total_tokens": 14}


def test_a_running_batchs_input_file_outlives_its_expiry_until_the_batch_ends(tmp_path):
    """An input file whose ``expires_at`` passes while its batch runs (or while the server
    is down mid-batch) is kept until the batch ends, so the batch resumes and completes;
    then it is deleted at the next use of the store. A batch record from before usage was
    counted shows ``usage: null``."""
    from server.state_file import StateFile

    path = tmp_path / "state.sqlite3"
    stall = {"on": True}

    async def app(scope, receive, send):
        body = json.loads((await receive())["body"])
        while stall["on"] and body["prompt"] == "slow":
            if (await receive())["type"] == "http.disconnect":
                return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"choices": []}'})

    data = b"".join(json.dumps({"custom_id": p, "method": "POST", "url": "/v1/completions",
                                "body": {"model": "m", "prompt": p}}).encode() + b"\n" for p in ("a", "slow", "b"))

    async def first_life():
        state = StateFile(path)
        files = FileStore(state=state)
        batches = Batches(files, "m", concurrency=1, state=state)
        batches.app = app
        source = files.add("me", "in.jsonl", "batch", data, expires_after_s=1)
        job = batches.create("me", None, source.id, "/v1/completions", "24h", None)
        while job.completed < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(max(0.0, source.expires_at - time.time()) + 0.05)
        assert files.get(source.id, "me") is source   # (past its expiry: its batch runs)
        await batches.close()
        state.close()
        return source.id, job.id

    async def second_life(source_id, job_id):
        state = StateFile(path)
        files = FileStore(state=state)
        batches = Batches(files, "m", concurrency=1, state=state)
        batches.app = app
        stall["on"] = False
        batches.resume()
        job = batches.get(job_id, "me")
        await asyncio.wait({job.task})
        assert (job.status, job.completed) == ("completed", 3)
        with pytest.raises(APIError):
            files.get(source_id, "me")   # (its batch ended: expired now)
        assert files.get(job.output_file_id, "me").expires_at is None
        state.close()

    asyncio.run(second_life(*asyncio.run(first_life())))
    state = StateFile(path)
    [(record,)] = state.rows("SELECT job FROM batches")
    old = {k: v for k, v in json.loads(record).items()
           if k not in ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens", "usage_known")}
    state.write("UPDATE batches SET job = ?", json.dumps(old))
    assert Batches(FileStore(state=state), "m", concurrency=1, state=state).page("me", 20, None)["data"][0]["usage"] \
        is None
    state.close()


def test_a_damaged_batch_record_in_the_state_file_is_named_or_fails_its_batch_only(tmp_path):
    """A damaged ``batches`` record stopped the server with a bare JSON error naming no file;
    a damaged answered line of a running batch stopped it with a traceback ("Application
    startup failed"). The first is a one-line ``ValueError`` naming the file and the batch;
    the second fails that batch (keeping the lines it can read) and the server starts."""
    import sqlite3

    from server.state_file import StateFile

    path = tmp_path / "responses.sqlite3"

    async def stalled_batch() -> str:
        state = StateFile(path)
        files = FileStore(state=state)
        batches = Batches(files, "m", concurrency=2, state=state)

        async def app(scope, receive, send):   # answers "a…" lines, holds the others until the stop
            body = json.loads((await receive())["body"])
            if not body["prompt"].startswith("a"):
                while (await receive())["type"] != "http.disconnect":
                    pass
                return
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps({"choices": [{"text": "ok"}]}).encode()})
        batches.app = app
        lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": "m", "prompt": p}}) + "\n" for i, p in enumerate(["a0", "a1", "a2", "z"]))
        job = batches.create("me", None, files.add("me", "in.jsonl", "batch", lines.encode()).id, "/v1/completions",
                             "24h", None)
        while job.completed < 3:
            await asyncio.sleep(0.01)
        await batches.close()
        state.close()
        return job.id

    batch_id = asyncio.run(stalled_batch())
    db = sqlite3.connect(path)
    db.execute("UPDATE batch_lines SET line = ? WHERE rowid = (SELECT MIN(rowid) FROM batch_lines)", (b"{not json",))
    db.commit()

    async def restart():
        state = StateFile(path)
        batches = Batches(FileStore(state=state), "m", concurrency=2, state=state)
        batches.resume()
        job = batches.get(batch_id, "me")
        assert job.status == "failed" and "1 of the lines it had answered are unreadable" in job.errors[0]["message"]
        assert job.completed == 2 and len(batches.files.get(job.output_file_id, "me").data.splitlines()) == 2
        state.close()
    asyncio.run(restart())
    db.execute("UPDATE batches SET job = '{\"id\": 1' WHERE id = ?", (batch_id,))
    db.commit()
    state = StateFile(path)
    with pytest.raises(ValueError, match=f"response store {path}: batch {batch_id}: unreadable record"):
        Batches(FileStore(state=state), "m", concurrency=2, state=state)
    state.close()
