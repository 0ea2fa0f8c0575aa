"""The replica front's bookkeeping of a streamed response (``jaxserve.distributed.frontend``), without Ray:
the replica's deployment handle is replaced by a stand-in that yields a head and SSE chunks."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect, Request

from jaxserve.distributed.asgi_bridge import call_app
from jaxserve.distributed.frontend import Frontend


class ReplicaStream:
    """What ``handle.options(stream=True).handle.remote(...)`` gives: the head, then body chunks."""

    def __init__(self, items: list) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class ReplicaHandle:
    def __init__(self, stream: ReplicaStream) -> None:
        self.stream = stream
        self.health = self.Health()

    class Health:
        async def remote(self):
            return {"alive": True}

    def options(self, **_):
        return self

    @property
    def handle(self):
        return self

    def remote(self, *_):
        return self.stream


def _request(body: dict | bytes, path: str = "/v1/chat/completions", host: str | None = None) -> Request:
    """A POST of ``body`` (JSON of a dict, or the bytes as given) to the front, as the client sent it."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return {"type": "http.disconnect"}

    headers = [(b"content-type", b"application/json")] + ([(b"host", host.encode())] if host else [])
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "scheme": "http"}
    return Request(scope, receive)


def test_a_client_gone_before_the_stream_starts_is_released_and_cancelled():
    stream = ReplicaStream([{"status": 200, "headers": [["content-type", "text/event-stream"]]},
                            b'data: {"choices": []}\n\n', b"data: [DONE]\n\n"])
    front = Frontend({"r0": ReplicaHandle(stream)}, {"model": "smollm2-135m", "page_size": 16})

    async def gone(message):
        raise OSError("client disconnected")

    async def run():
        request = _request({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        response = await front.forward_request(request)
        assert front.router.in_flight["r0"] == 1
        with pytest.raises(ClientDisconnect):
            await response(request.scope, request.receive, gone)

    asyncio.run(run())
    assert front.router.in_flight["r0"] == 0           # not counted in flight forever
    assert stream.cancelled                            # the replica stops generating for nobody


def test_a_stream_read_to_its_end_is_released_not_cancelled_and_its_tool_calls_noted():
    chunk = b'data: {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_abc123"}]}}]}\n\n'
    stream = ReplicaStream([{"status": 200, "headers": [["content-type", "text/event-stream"]]},
                            chunk, b"data: [DONE]\n\n"])
    front = Frontend({"r0": ReplicaHandle(stream)}, {"model": "smollm2-135m", "page_size": 16})
    sent = []

    async def send(message):
        sent.append(message)

    async def run():
        request = _request({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        response = await front.forward_request(request)
        await response(request.scope, request.receive, send)

    asyncio.run(run())
    assert b"".join(m.get("body", b"") for m in sent) == chunk + b"data: [DONE]\n\n"
    assert front.router.in_flight["r0"] == 0 and not stream.cancelled
    assert front.router.parked_calls == {"call_abc123": "r0"}


def test_a_call_that_fails_before_it_reaches_the_replica_is_a_503_and_released():
    class Unreachable(ReplicaHandle):
        def remote(self, *_):
            raise RuntimeError("deployment handle is shutting down")

    front = Frontend({"r0": Unreachable(ReplicaStream([]))}, {"model": "smollm2-135m", "page_size": 16})

    async def run():
        return await front.forward_request(_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}))

    response = asyncio.run(run())
    assert response.status_code == 503 and json.loads(response.body)["error"]["code"] == "replica_failed"
    assert front.router.in_flight["r0"] == 0


def test_health_reports_the_prefill_deployment_and_degrades_without_it():
    class DownPrefill:
        class health:
            @staticmethod
            async def remote():
                raise RuntimeError("actor died")

    class UpPrefill:
        class health:
            @staticmethod
            async def remote():
                return {"alive": True}

    settings = {"model": "smollm2-135m", "page_size": 16, "prefill_replicas": 2}

    async def health(prefill):
        front = Frontend({"decode-0": ReplicaHandle(ReplicaStream([]))}, settings, prefill)
        response = await front.health_response()
        front._monitor.cancel()
        return response.status_code, json.loads(response.body)

    code, body = asyncio.run(health(UpPrefill()))
    assert code == 200 and body["status"] == "ok"
    assert body["prefill"] == {"status": "up", "replicas_desired": 2}
    code, body = asyncio.run(health(DownPrefill()))   # decode replicas compute prompts themselves: still served
    assert code == 200 and body["status"] == "degraded" and body["prefill"]["status"] == "down"
    assert body["replicas"] == {"decode-0": "up"}
    code, body = asyncio.run(health(None))            # colocated replicas: no prefill entry
    assert body["status"] == "ok" and "prefill" not in body


@pytest.mark.parametrize("method, path", [("GET", "/v1/responses/resp_abc"), ("DELETE", "/v1/responses/resp_abc"),
                                          ("POST", "/v1/responses/resp_abc/cancel"),
                                          ("GET", "/v1/responses/resp_abc/input_items")])
def test_a_stored_or_background_response_is_read_and_cancelled_on_the_replica_that_holds_it(method, path):
    """Stored responses and background runs live on one replica: reading, deleting,
    cancelling and listing the input items of one go there."""
    front = Frontend({name: ReplicaHandle(ReplicaStream([])) for name in ("r0", "r1")},
                     {"model": "smollm2-135m", "page_size": 16})
    front.router.stored("r1", ["resp_abc"])
    hints = front._hints(path, method, {}, b"")
    assert hints.stored_response == "resp_abc"
    assert front.router.choose(hints)[0] == "r1"



def test_files_and_batches_are_used_on_the_replica_that_holds_them():
    """A file lives on the replica it was uploaded to, a batch and its output files on its
    input file's: the front learns their ids from the replicas' answers and routes by them."""
    front = Frontend({name: ReplicaHandle(ReplicaStream([])) for name in ("r0", "r1")},
                     {"model": "smollm2-135m", "page_size": 16})
    front._note_tool_calls("r1", json.dumps({"id": "file-1a2b", "object": "file", "purpose": "batch"}).encode())
    create = front._hints("/v1/batches", "POST", {}, json.dumps({"input_file_id": "file-1a2b"}).encode())
    assert front.router.choose(create)[0] == "r1"
    front._note_tool_calls("r1", json.dumps({"id": "batch_9f", "input_file_id": "file-1a2b",
                                             "output_file_id": "file-77", "error_file_id": None}).encode())
    for method, path in [("GET", "/v1/batches/batch_9f"), ("POST", "/v1/batches/batch_9f/cancel"),
                         ("GET", "/v1/files/file-77/content"), ("GET", "/v1/files/file-1a2b"),
                         ("DELETE", "/v1/files/file-1a2b")]:
        hints = front._hints(path, method, {}, b"")
        assert front.router.choose(hints)[0] == "r1", path
    assert front._hints("/v1/files", "GET", {}, b"").stored_response is None


def test_counting_a_follow_up_goes_to_the_replica_that_holds_its_conversation():
    front = Frontend({name: ReplicaHandle(ReplicaStream([])) for name in ("r0", "r1")},
                     {"model": "smollm2-135m", "page_size": 16})
    front.router.stored("r1", ["resp_abc"])
    body = json.dumps({"previous_response_id": "resp_abc", "input": "more"}).encode()
    hints = front._hints("/v1/responses/input_tokens", "POST", {}, body)
    assert hints.stored_response == "resp_abc" and not hints.page_hashes
    assert front.router.choose(hints)[0] == "r1"
    assert front._hints("/v1/responses/resp_abc", "POST", {}, b"{}").stored_response is None   # (no such route)


class AppReplica(ReplicaHandle):
    """A replica stand-in that serves with a real ASGI app, through the bridge replicas use."""

    def __init__(self, app) -> None:
        self.app, self.health = app, self.Health()

    def remote(self, method, path, query, headers, body):
        return BridgedStream(call_app(self.app, method, path, query, headers, body))


class BridgedStream:
    def __init__(self, items) -> None:
        self.items = items

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.items.__anext__()

    def cancel(self) -> None:
        pass


def test_the_replica_answers_for_the_front_the_client_called():
    """What the replica's app answers reaches the client as the single server's would: a
    redirect names the front's host (it named ``127.0.0.1:0``, the bridge's), and a body
    nested too deeply for the front to read for routing goes to a replica to judge (it was
    a plain-text 500 from the front)."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return JSONResponse({"read": len(await request.body())}, status_code=400)

    front = Frontend({"r0": AppReplica(app)}, {"model": "smollm2-135m", "page_size": 16})
    deep = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": ' + \
        b"[" * 100_000 + b"]" * 100_000 + b"}"

    async def run():
        moved = await front.forward_request(_request(b"{}", "/v1/chat/completions/", "front.example:8000"))
        answered = await front.forward_request(_request(deep, host="front.example:8000"))
        return moved, answered

    moved, answered = asyncio.run(run())
    assert moved.status_code == 307 and moved.headers["location"] == "http://front.example:8000/v1/chat/completions"
    assert answered.status_code == 400 and json.loads(answered.body) == {"read": len(deep)}
