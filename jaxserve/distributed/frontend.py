"""``Frontend``: the one HTTP endpoint in front of the replicas (a Ray Serve ingress deployment).

Every route but ``/health`` and ``/metrics`` is forwarded, unchanged, to one
replica, which serves it with the single server's app (same routes, errors,
auth); the replica is picked by ``routing.ReplicaRouter`` from hints read in
the body. ``/health`` asks every replica; ``/metrics`` merges the replicas'
metrics, each sample labelled ``replica="<name>"``, with the front's own
(replicas up, routing decisions); ``GET /v1/files`` and ``GET /v1/batches``
merge the lists of every replica up (a file lives on the replica it was
uploaded to, a batch on its input file's) into one, paged as one server pages
it. A request naming stored state whose holder the front does not know is
asked of the other replicas after a 404. A replica that fails before its
response started gives a 503 JSON error body; one that fails while streaming
ends the stream with an SSE error event, as the single server does for
in-band errors.
"""

import asyncio
import heapq
import json
import logging
import re
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import TypeAdapter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.distributed.replica import REPLICA_HEADER
from jaxserve.distributed.routing import HEALTH_TIMEOUT_S, ReplicaRouter, RoutingHints, read_hints, stored_state
from server.errors import APIError
from server.listing import MAX_FILES_LIMIT, items_page

log = logging.getLogger("jaxserve.distributed")

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# GET / DELETE of a stored response, GET of its input items, POST of the cancel of a background one
_STORED_PATH = re.compile(r"^/v1/responses/([^/]+)(/input_items|/cancel)?$")
_BATCHES_PATH = "/v1/batches"
_COUNT_PATH = "/v1/responses/input_tokens"   # counts a Responses request: its previous_response_id's holder
# any call on a conversation (read, update, delete; its items listed, added, read, deleted)
_CONVERSATION_PATH = re.compile(r"^/v1/conversations/([^/]+)(/items(/[^/]+)?)?$")
HEALTH_PERIOD_S = 1.0           # how often the front re-checks which replicas are up
_CALL_ID = re.compile(r'"(?:call_)?id":\s*"(call_[A-Za-z0-9]+)"')   # chat tool_calls[].id; Responses call_id
# a stored response's, a conversation's, a file's (a batch's output files' too), a batch's
_STORED_ID = re.compile(r'"(?:id|output_file_id|error_file_id)":\s*'
                        r'"((?:resp|conv|batch)_[A-Za-z0-9]+|file-[A-Za-z0-9]+)"')
# lists merged over the replicas: path -> (what the list is, in error messages; whether it takes ``order``;
# its default and largest ``limit``)
_MERGED_LISTS = {"/v1/files": ("your files", True, MAX_FILES_LIMIT), "/v1/batches": ("your batches", False, 100)}
_INT = TypeAdapter(int)   # a query's integer as the replicas' FastAPI reads it ("1.0" is 1)
_HELD_PATH = re.compile(r"^/v1/(?:files|batches)/([^/]+)(/content|/cancel)?$")   # a file's or a batch's routes
# (Ray Serve's proxy sets ``x-request-id`` itself: the client's own id, or a new one, which it also passes
# on in the request, so the replica answers and logs the same id)
_DROPPED_HEADERS = {"content-length", "transfer-encoding", "connection", "x-request-id"}

def _error(status: int, message: str, code: str, replica: str | None = None) -> JSONResponse:
    headers = {REPLICA_HEADER: replica} if replica else None
    return JSONResponse({"error": {"message": message, "type": "server_error" if status >= 500 else
                                   "invalid_request_error", "param": None, "code": code}},
                        status_code=status, headers=headers)


def ingress_class():
    """``Frontend`` as a Ray Serve ingress class with its routes. Built per call (the FastAPI
    app inside travels with the class to the replica process; a module-level app would be
    imported there afresh, without the routes bound to the class). This module has no
    ``from __future__ import annotations``: FastAPI must see ``Request`` itself, not a name."""
    from ray import serve

    app = FastAPI(title="jaxserve replicas", docs_url=None, redoc_url=None, openapi_url=None)

    @serve.ingress(app)
    class FrontendIngress(Frontend):
        @app.get("/health")
        async def health(self):
            return await self.health_response()

        @app.get("/metrics")
        async def metrics(self):
            return await self.metrics_response()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
        async def forward(self, request: Request):
            return await self.forward_request(request)

    return FrontendIngress


class Frontend:
    """The front's state and behaviour (``ingress_class`` adds the routes).
    ``replicas``: name -> deployment handle; ``settings``: the ``jaxserve serve``
    arguments (model, page_size, replica_router, prefill_replicas); ``prefill``: the
    prefill deployment's handle when disaggregated (its health is reported, not routed to:
    decode replicas call it)."""

    def __init__(self, replicas: dict, settings: dict, prefill=None) -> None:
        from jaxserve.model_source import load_tokenizer, resolve_model

        self.handles = dict(replicas)
        self.prefill = prefill
        self.prefill_replicas = int(settings.get("prefill_replicas", 0) or 0)
        self.router = ReplicaRouter(list(self.handles), settings.get("replica_router", "affinity"))
        self.page_size = int(settings.get("page_size", 16))
        tokenizer = load_tokenizer(resolve_model(settings["model"]))
        self.tokenize = (lambda text: tokenizer.encode(text, add_special_tokens=False)) if tokenizer else None
        self._monitor: asyncio.Task | None = None

    # --------------------------------------------------------------- health
    @staticmethod
    async def _status(handle) -> dict | None:
        """The deployment's ``health()`` reply; None when it is down (dead actor,
        restarting, timed out)."""
        try:
            return await asyncio.wait_for(handle.health.remote(), HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure to answer is down
            return None

    @classmethod
    async def _alive(cls, handle) -> bool:
        status = await cls._status(handle)
        return status is not None and bool(status["alive"])

    async def _check(self, name: str) -> bool:
        status = await self._status(self.handles[name])
        if status is None or not status["alive"]:
            return False
        if "cached_pages" in status:
            self.router.set_capacity(name, status["cached_pages"])
        return True

    async def check_all(self) -> dict[str, bool]:
        """Ask every replica; update the router's view. ``{name: up}``."""
        names = list(self.handles)
        ups = await asyncio.gather(*(self._check(n) for n in names))
        for name, up in zip(names, ups):
            self.router.set_alive(name, up)
        return dict(zip(names, ups))

    async def _watch(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - keep watching
                log.exception("replica health check failed")
            await asyncio.sleep(HEALTH_PERIOD_S)

    def _ensure_monitor(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._watch())

    async def health_response(self) -> JSONResponse:
        """``ok`` when every replica (and the prefill deployment, if any) answers;
        ``degraded`` when some do not, or the prefill deployment is down (decode
        replicas then compute prompts themselves: slower, not failed); ``dead``
        (503) when no replica serves."""
        self._ensure_monitor()
        if self.prefill is None:
            ups, prefill_up = await self.check_all(), None
        else:
            ups, prefill_up = await asyncio.gather(self.check_all(), self._alive(self.prefill))
        up = sum(ups.values())
        status = "ok" if up == len(ups) and prefill_up is not False else "degraded" if up else "dead"
        body = {"status": status, "replicas_up": up, "replicas_desired": len(ups),
                "replicas": {n: "up" if u else "down" for n, u in ups.items()}}
        if self.prefill is not None:
            body["prefill"] = {"status": "up" if prefill_up else "down", "replicas_desired": self.prefill_replicas}
        return JSONResponse(body, status_code=503 if up == 0 else 200)

    # -------------------------------------------------------------- metrics
    async def metrics_response(self) -> Response:
        names = list(self.handles)

        async def scrape(name):
            try:
                return await asyncio.wait_for(self.handles[name].metrics.remote(), HEALTH_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a down replica has no metrics this scrape
                return None

        texts = await asyncio.gather(*(scrape(n) for n in names))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_MergedMetrics(dict(zip(names, texts)), self.router))
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------ forwarding
    async def forward_request(self, request: Request) -> Response:
        self._ensure_monitor()
        body = await request.body()
        path = request.url.path
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if request.method == "GET" and path in _MERGED_LISTS:
            return await self.merged_list(request, path)
        lower = {k.lower(): v for k, v in request.headers.items()}
        hints = await asyncio.to_thread(self._hints, path, request.method, lower, body)   # tokenizes
        try:
            replica, reason = self.router.choose(hints)
        except RuntimeError:
            return _error(503, "no replica is up; retry later", "no_replica")
        query, headers = request.url.query.encode(), _forwarded_headers(request)
        asking = [replica]
        if hints.stored_response is not None and reason != "stored":
            # Its holder is unknown (this front restarted, or the state was made past it): a 404
            # did nothing, so the other replicas up are asked in turn, and the holder remembered.
            asking += [r for r in self.router.replicas if r != replica and self.router.alive[r]]
        for i, name in enumerate(asking):
            answer = await self._serve_on(name, hints if i == 0 else RoutingHints(), request.method, path, query,
                                          headers, body, pass_404=i < len(asking) - 1)
            if answer is not None:
                if i > 0 and 200 <= answer.status_code < 300:
                    self.router.stored(name, [hints.stored_response])
                return answer
        raise AssertionError("the last replica asked always answers")   # (pass_404 is off for it)

    async def _serve_on(self, replica: str, hints: RoutingHints, method: str, path: str, query: bytes,
                        headers: list, body: bytes, pass_404: bool) -> Response | None:
        """The request served by ``replica``: its whole answer, or its stream relayed as it
        comes; a 503 JSON body when it fails before answering. ``pass_404``: None instead of
        a 404 answer (another replica is asked)."""
        self.router.routed(replica, hints)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.router.finished(replica)

        stream = None
        try:
            stream = self.handles[replica].options(stream=True).handle.remote(method, path, query, headers, body)
            head = await stream.__anext__()
        except asyncio.CancelledError:   # the client left while the replica was starting
            if stream is not None:
                stream.cancel()
            release()
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or failed before answering
            release()
            log.warning("replica %s failed before answering: %s", replica, e)
            return _error(503, f"replica {replica} failed while serving this request ({type(e).__name__}); "
                          f"retry", "replica_failed", replica)
        out_headers = {k: v for k, v in head["headers"] if k.lower() not in _DROPPED_HEADERS}
        if not out_headers.get("content-type", "").startswith("text/event-stream"):
            chunks = []
            try:
                async for chunk in stream:
                    chunks.append(chunk)
            except asyncio.CancelledError:   # the client left: the replica's app sees a disconnect
                stream.cancel()
                raise
            except Exception as e:  # noqa: BLE001
                log.warning("replica %s failed while answering: %s", replica, e)
                return _error(503, f"replica {replica} failed while serving this request ({type(e).__name__}); "
                              f"retry", "replica_failed", replica)
            finally:
                release()
            content = b"".join(chunks)
            if pass_404 and head["status"] == 404:
                return None
            if not path.endswith("/content"):   # (a file's content is the client's data, not this replica's state)
                self._note_tool_calls(replica, content)
            return Response(content, status_code=head["status"], headers=out_headers)

        finished = False

        async def relay():
            nonlocal finished
            try:
                async for chunk in stream:
                    self._note_tool_calls(replica, chunk)
                    yield chunk
                finished = True
            except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
                finished = True
                log.warning("replica %s failed while streaming: %s", replica, e)
                message = f"replica {replica} failed while serving this request ({type(e).__name__})"
                if path == "/v1/responses":   # the Responses API's error event (its streams have no [DONE])
                    error = {"type": "error", "code": "replica_failed", "message": message, "param": None}
                    yield f"event: error\ndata: {json.dumps(error)}\n\n".encode()
                else:
                    error = {"error": {"message": message, "type": "server_error", "param": None,
                                       "code": "replica_failed"}}
                    yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()

        def close() -> None:
            if not finished:   # the client left (maybe before the first chunk): stop the generation on the replica
                stream.cancel()
            release()

        return _RelayResponse(relay(), close, status_code=head["status"], headers=out_headers)

    async def merged_list(self, request: Request, path: str) -> Response:
        """``GET /v1/files`` or ``/v1/batches`` over every replica up: each one's whole list
        (the caller's, by its own key), merged by ``created_at`` (a replica's own order kept
        within a second) and paged with the caller's ``limit``, ``order`` and ``after``, as
        one server pages its list. The caller's query (but ``after``, an item maybe held
        elsewhere) is first put to one replica: a refusal (a bad key, a bad ``limit``) is
        answered as that replica gave it. A replica that fails is left out (its items with it),
        and ``x-jaxserve-replica`` names those listed."""
        where, takes_order, max_limit = _MERGED_LISTS[path]
        up = [r for r in self.router.replicas if self.router.alive[r]]
        headers = _forwarded_headers(request)
        params = dict(request.query_params)
        probe = None
        for replica in up:   # (one that fails is passed over)
            probe = await self._listing(replica, path, {"limit": "1", **{k: v for k, v in params.items()
                                                                        if k != "after"}}, headers)
            if isinstance(probe, Response):
                return probe
            if probe is not None:
                break
        if probe is None:
            return _error(503, "no replica is up; retry later", "no_replica")
        fixed = {k: v for k, v in params.items() if k not in ("after", "limit", "order")}
        lists = await asyncio.gather(*(self._whole_list(r, path, fixed, takes_order, max_limit, headers) for r in up))
        for answer in lists:
            if isinstance(answer, Response):
                return answer
        asked = [name for name, answer in zip(up, lists) if answer is not None]   # (one that failed is left out)
        items = list(heapq.merge(*[a for a in lists if a is not None], key=lambda item: item.get("created_at") or 0))
        limit = _INT.validate_python(params.get("limit", max_limit if takes_order else 20))   # (the probe took it)
        order = params.get("order", "desc") if takes_order else "desc"   # (batches list newest first)
        try:
            page = items_page(items, limit, order, params.get("after"), where, max_limit)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers={REPLICA_HEADER: ",".join(asked)})
        return JSONResponse(page, headers={REPLICA_HEADER: ",".join(asked)})

    async def _whole_list(self, replica: str, path: str, query: dict, takes_order: bool, max_limit: int,
                          headers: list) -> list[dict] | Response | None:
        """Every item of ``replica``'s list at ``path``, oldest first, ``max_limit`` a call (a
        refusal: its answer; None when it fails)."""
        items, after = [], None
        while True:
            page = await self._listing(replica, path, {**query, "limit": str(max_limit),
                                                    **({"order": "asc"} if takes_order else {}),
                                                    **({"after": after} if after else {})}, headers)
            if page is None or isinstance(page, Response):
                return page
            items += page["data"]
            if not page["has_more"] or not page["data"]:
                return items if takes_order else items[::-1]   # (batches list newest first)
            after = page["last_id"]

    async def _listing(self, replica: str, path: str, query: dict, headers: list) -> dict | Response | None:
        """``GET path?query`` on ``replica`` (counted in flight on it meanwhile): its JSON body
        when it answers 200, else its answer as a response; None when it fails."""
        self.router.routed(replica, RoutingHints())
        stream = None
        try:
            stream = self.handles[replica].options(stream=True).handle.remote(
                "GET", path, urlencode(query).encode(), headers, b"")
            head = await stream.__anext__()
            content = b"".join([chunk async for chunk in stream])
        except asyncio.CancelledError:   # the client left: the replica's app sees a disconnect
            if stream is not None:
                stream.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or failed while answering
            log.warning("replica %s failed while listing %s: %s", replica, path, e)
            return None
        finally:
            self.router.finished(replica)
        if head["status"] != 200:
            return Response(content, status_code=head["status"],
                            headers={k: v for k, v in head["headers"] if k.lower() not in _DROPPED_HEADERS})
        return json.loads(content)

    def _hints(self, path: str, method: str, headers: dict[str, str], body: bytes) -> RoutingHints:
        conversation = _CONVERSATION_PATH.match(path)
        if conversation is not None:
            return RoutingHints(stored_response=conversation.group(1))
        held = _HELD_PATH.match(path)
        if held is not None:
            return RoutingHints(stored_response=held.group(1))
        stored = _STORED_PATH.match(path)
        if stored is not None and path != _COUNT_PATH:
            suffix = stored.group(2)
            if method in (("POST",) if suffix == "/cancel" else ("GET",) if suffix else ("GET", "DELETE")):
                return RoutingHints(stored_response=stored.group(1))
        if method != "POST" or path not in (*ROUTED_PATHS, _COUNT_PATH, _BATCHES_PATH):
            return RoutingHints()
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):   # (the replica's answer to the body is the client's: a 400)
            return RoutingHints()
        if not isinstance(parsed, dict):
            return RoutingHints()
        if path == _BATCHES_PATH:   # a batch runs where its input file is
            file_id = parsed.get("input_file_id")
            return RoutingHints(stored_response=file_id if isinstance(file_id, str) else None)
        if path == _COUNT_PATH:   # (nothing runs: no prefix or session is placed by it)
            return RoutingHints(stored_response=stored_state(parsed))
        try:
            return read_hints(parsed, headers, self.tokenize, self.page_size)
        except Exception:  # noqa: BLE001 - text the tokenizer cannot take: route without hints
            return RoutingHints()

    def _note_tool_calls(self, replica: str, content: bytes) -> None:
        """Remember what ``replica``'s answer leaves there: the contexts parked on its client-side
        tool calls, and Responses API responses, conversations, files and batches it stored."""
        if b'"tool_calls"' in content or b'"function_call"' in content:
            ids = _CALL_ID.findall(content.decode("utf-8", "replace"))
            if ids:
                self.router.parked(replica, ids)
        if any(prefix in content for prefix in (b'"resp_', b'"conv_', b'"file-', b'"batch_')):
            self.router.stored(replica, list(dict.fromkeys(_STORED_ID.findall(content.decode("utf-8", "replace")))))


def _forwarded_headers(request: Request) -> list[tuple[str, str]]:
    """The client's headers as a replica gets them, ``host`` included: the URLs a replica
    writes (a redirect's ``location``) name the front the client called."""
    return list(request.headers.items())


class _RelayResponse(StreamingResponse):
    """A streamed response that runs ``on_close`` however it ends: also when its body
    iterator never started (a client gone before the first chunk leaves a never-started
    generator, whose ``finally`` never runs)."""

    def __init__(self, content, on_close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _MergedMetrics:
    """The replicas' families with a ``replica`` label, plus the front's own."""

    def __init__(self, texts: dict[str, str | None], router: ReplicaRouter) -> None:
        self.texts = texts
        self.router = router

    def collect(self):
        merged: dict[str, Metric] = {}
        for replica, text in self.texts.items():
            if text is None:
                continue
            for family in text_string_to_metric_families(text):
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(family.name, family.documentation, family.type)
                for s in family.samples:
                    target.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp)
        yield from merged.values()
        up = GaugeMetricFamily("jaxserve:replicas_up", "Replicas answering their health check.",
                               labels=["replica"])
        for replica, alive in self.router.alive.items():
            up.add_metric([replica], 1.0 if alive else 0.0)
        yield up
        yield GaugeMetricFamily("jaxserve:replicas_desired", "Replicas asked for.", value=len(self.router.replicas))
        in_flight = GaugeMetricFamily("jaxserve:router_requests_in_flight",
                                      "Requests the front has in flight, by replica.", labels=["replica"])
        for replica, n in self.router.in_flight.items():
            in_flight.add_metric([replica], n)
        yield in_flight
        decisions = CounterMetricFamily("jaxserve:router_decisions", "Requests routed, by the rule that chose "
                                        "the replica.", labels=["reason"])
        for reason, n in sorted(self.router.routed_by.items()):
            decisions.add_metric([reason], n)
        yield decisions
