"""The OpenAI-compatible FastAPI app over a ``jaxserve.AsyncEngine``.

``create_app(engine, served_model_name=...)`` builds it; the engine is owned
by the caller (``server.cli`` builds one and shuts it down). Server-side
tools are registered in the engine (``AsyncEngine(..., tools=...)``, which
always includes ``calculator``); the app advertises them to the model in the
chat template of every chat request (unless ``tool_choice`` is ``"none"``)
and the engine runs them when the model calls them. Tools a request declares
itself are client-side: the response stops with ``finish_reason:
"tool_calls"`` and the paused context is kept for the follow-up
(``server.parked``).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import importlib.metadata
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from jaxserve.async_engine import EngineDeadError
from jaxserve.constraints import TOO_DEEP, StructuredOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.chat import advertised_tools, render_chat
from jaxserve.tool_format import get_format
from jaxserve.tools import Tool, normalize_tools
from server.background import BackgroundRun, BackgroundRuns
from server.batches import FILE_PURPOSES, Batches, FileStore
from server.conversations import Conversations
from server.errors import APIError, from_value_error, install_handlers
from server.generation import (ChoiceMerger, ChoiceState, ClientDisconnected, Job, new_timer, sampling_key,
                               wait_or_disconnect)
from server.logprobs import TokenSpellings
from server.metrics import ServerMetrics
from server.middleware import TRUSTED_OWNERS, CatchAllMiddleware, GuardMiddleware, RequestIdMiddleware, owner_of
from server.parked import ParkedContexts, Spelling
from server.protocol import (FILE_EXPIRY_RANGE_S, AllowedToolsChoice, BatchCreateRequest, ChatCompletionRequest,
                             CompletionRequest, ConversationCreateRequest, ConversationItemsRequest,
                             ConversationUpdateRequest, DetokenizeRequest, ExpiresAfter, ModelCard, ModelList,
                             ResponsesInputTokensRequest, ResponsesRequest, TokenizeRequest, ToolChoice)
from server.response_store import ResponseStore
from server.listing import MAX_FILES_LIMIT, items_page
from server.responses import (ResponsesWire, chat_request, check_call_outputs, check_item_ids, held_item_ids,
                              input_messages, responses_error)
from server.tokenizers import TokenizerPool
from server.wire import ChatWire

log = logging.getLogger("jaxserve.server")

MAX_BODY_BYTES = 2 * 1024 * 1024
MAX_UPLOAD_BYTES = 200 * 1024 * 1024   # a file for /v1/files (OpenAI's batch input limit)
MAX_FANOUT = 16                # engine requests one HTTP request may become (prompts x n)


def _nothing() -> None:
    """What ends a request that holds nothing but its slot."""


class ConcurrencyLimit:
    """Counts engine requests in flight for HTTP requests (one per choice: prompts x n);
    a request that would take the count over the limit is a 429."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {limit}")
        self.limit = limit
        self.in_flight = 0

    def acquire(self, count: int = 1) -> "_Slot":
        if self.in_flight + count > self.limit:
            raise APIError(429, f"too many concurrent requests (limit {self.limit} engine requests, this one "
                           f"needs {count}); retry later", code="too_many_requests", headers={"Retry-After": "1"})
        self.in_flight += count
        return _Slot(self, count)


class _Slot:
    """What one HTTP request holds while it runs; ``release`` (once, by whoever ends it: the
    handler, its stream's close, its background run) also runs ``on_release``."""

    def __init__(self, owner: ConcurrencyLimit, count: int) -> None:
        self.owner = owner
        self.count = count
        self.held = True
        self.on_release: Callable[[], None] = _nothing

    def release(self) -> None:
        if self.held:
            self.held = False
            self.owner.in_flight -= self.count
            self.on_release()


class _ManagedStream(StreamingResponse):
    """A streaming response that always closes its body iterator and runs
    ``on_close`` however the stream ends (finished, error, disconnect)."""

    def __init__(self, content, on_close, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._on_close()


class ServerState:
    """Everything the routes share."""

    def __init__(self, engine, served_model_name: str, max_model_len: int, max_concurrent_requests: int,
                 tools: dict[str, Tool], paused_context_ttl_s: float, max_fanout: int = MAX_FANOUT,
                 tokenizer_pool_size: int = 4, response_store: ResponseStore | None = None) -> None:
        if max_fanout < 1:
            raise ValueError(f"max_fanout must be >= 1, got {max_fanout}")
        self.engine = engine
        self.model_name = served_model_name
        self.max_model_len = max_model_len
        self.limit = ConcurrencyLimit(max_concurrent_requests)
        # A request wider than the concurrency limit could never be admitted: a 400, not an endless 429.
        self.max_fanout = min(max_fanout, max_concurrent_requests)
        self.tools = tools
        self.parked = ParkedContexts(engine, paused_context_ttl_s)
        self.background = BackgroundRuns()   # /v1/responses runs with ``background: true``
        self.metrics = ServerMetrics(engine, lambda: len(self.parked), lambda: self.background.num_live)
        # Private copies: the engine thread uses its own tokenizer for detokenization.
        self.tokenizers = TokenizerPool(engine.tokenizer, tokenizer_pool_size) if engine.tokenizer is not None \
            else None
        self.spelling = Spelling(copy.deepcopy(self.tokenizers.template)) if self.tokenizers is not None else None
        self.token_spellings = TokenSpellings(self.tokenizers.template) if self.tokenizers is not None else None
        # The engine parses calls in this format; the app hides its markup and renders tools with it.
        self.tool_format = getattr(getattr(engine, "engine", None), "tool_format", None) or get_format("hermes")
        # stored /v1/responses results (``previous_response_id``); in memory unless given one with a file
        self.responses = response_store if response_store is not None else ResponseStore()
        self.conversations = Conversations(self.responses)   # the Conversations API, kept in the same store
        # The Files and Batch APIs; all batches' requests together take at most half the concurrency limit.
        # With the response store's file they are kept there too (a running batch runs on after a restart).
        self.files = FileStore(state=self.responses.file)
        self.batches = Batches(self.files, served_model_name, max(1, max_concurrent_requests // 2),
                               state=self.responses.file)
        config = getattr(getattr(engine, "engine", None), "config", None)
        self.cache_page_size = config.page_size if getattr(config, "enable_prefix_caching", False) else None

    @property
    def tokenizer(self):
        return self.tokenizers.template if self.tokenizers is not None else None

    async def tokenize(self, fn):
        """Run a tokenizer call on a worker thread with one of the pool's tokenizers."""
        return await self.tokenizers.run(fn)

    def check_prompt_bytes(self, texts: list[str], param: str) -> None:
        """Refuse text that cannot fit the context window before tokenizing it (cheap bound)."""
        low = sum(self.tokenizers.min_tokens(t) for t in texts)
        if low >= self.max_model_len:
            raise APIError(400, f"{param}: the prompt has at least {low} tokens; the context window is "
                           f"{self.max_model_len} tokens", param=param, code="context_length_exceeded")


def create_app(engine, *, served_model_name: str, api_key: str | None = None, max_concurrent_requests: int = 256,
               tools: dict | list | None = None, paused_context_ttl_s: float = 60.0,
               max_model_len: int | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               max_fanout: int = MAX_FANOUT, body_timeout_s: float = 30.0,
               response_store: ResponseStore | None = None, max_upload_bytes: int = MAX_UPLOAD_BYTES) -> FastAPI:
    """Build the app.

    ``tools``: the server-side tools to advertise; each must already be
    registered in the engine (``AsyncEngine(..., tools=...)``). ``None``
    advertises every tool the engine has. ``max_model_len``: the context window
    in tokens (prompt + generated); required. ``max_fanout``: engine requests
    one HTTP request may become (prompts x ``n``). ``body_timeout_s``: seconds
    allowed to receive a request body (408 after). ``response_store``: where stored
    responses are kept (``ResponseStore(path=...)`` keeps them across restarts, and
    files and batches in the same file; None: a store in memory); the app closes it
    at shutdown. ``max_upload_bytes``: the largest
    file ``POST /v1/files`` takes.
    """
    if max_model_len is None or max_model_len < 2:
        raise ValueError("create_app needs max_model_len (the engine's context window, in tokens)")
    registered = getattr(getattr(engine, "engine", None), "tools", None)
    if tools is None:
        advertised = dict(registered) if registered is not None else normalize_tools(None)
    else:
        advertised = normalize_tools(tools)
        if registered is not None:
            missing = sorted(set(advertised) - set(registered))
            if missing:
                raise ValueError(f"tools {missing} are not registered in the engine; pass them to "
                                 f"AsyncEngine(..., tools=...) so the engine can run them")
    state = ServerState(engine, served_model_name, max_model_len, max_concurrent_requests, advertised,
                        paused_context_ttl_s, max_fanout, response_store=response_store)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.parked.start()
        state.batches.resume()   # (batches a state file held as running)
        yield
        await state.batches.close()
        await state.background.close()
        await state.parked.close()
        state.responses.close()

    # /openapi.json is served (fuzzers and client generators read it) behind the API key like every route.
    app = FastAPI(title="jaxserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = state
    state.batches.app = app   # (a batch's requests are served by this app)
    install_handlers(app)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
                       upload_paths=frozenset({"/v1/files"}), max_upload_bytes=max_upload_bytes)
    app.add_middleware(CatchAllMiddleware)
    app.add_middleware(RequestIdMiddleware)   # (outermost: every response has its id, the guard's errors too)

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return JSONResponse({"status": "dead"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():   # (vLLM's route: tools probe it)
        return {"version": importlib.metadata.version("jaxserve")}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=max_model_len)]).dump()

    @app.get("/v1/models/{model:path}")   # (``path``: served names may hold "/", e.g. "org/model")
    async def model(model: str):
        _check_model(state, model)
        return ModelCard(id=served_model_name, max_model_len=max_model_len).dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(state, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _serve(state, request, body, chat=True)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await _respond(state, request, body)

    @app.post("/v1/responses/input_tokens")
    async def count_input_tokens(body: ResponsesInputTokensRequest, request: Request):
        return await _count_input_tokens(state, request, body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request, stream: bool = False,
                           starting_after: int = -1):
        return _get_response(state, response_id, _owner(request, None), stream, starting_after)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request):
        return await _cancel_response(state, response_id, _owner(request, None))

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                               after: str | None = None):
        return _input_items_page(state, response_id, _owner(request, None), limit, order, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        owner = _owner(request, None)
        run = state.background.get(response_id, owner)
        if run is not None:   # (a live run is stopped first: nothing would be left to free its requests)
            await state.background.cancel(run)
            state.background.drop(response_id)
        if not state.responses.delete(response_id, owner) and run is None:
            raise _response_not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/files")
    async def upload_file(request: Request, file: UploadFile = File(), purpose: str = Form(),
                          anchor: str | None = Form(None, alias="expires_after[anchor]"),
                          seconds: str | None = Form(None, alias="expires_after[seconds]")):
        if purpose not in FILE_PURPOSES:
            raise APIError(400, f"purpose: this server takes files for {', '.join(FILE_PURPOSES)}, got {purpose!r}",
                           param="purpose")
        expires_after_s = _file_expiry(anchor, seconds)
        data = await file.read()
        if len(data) > max_upload_bytes:
            raise APIError(413, f"file: {len(data)} bytes; this server takes files of at most {max_upload_bytes} "
                           f"bytes (--max-upload-bytes)", param="file", code="request_too_large")
        return state.files.add(_owner(request, None), file.filename or "upload.jsonl", purpose, data,
                               expires_after_s=expires_after_s).object()

    @app.get("/v1/files")
    async def list_files(request: Request, purpose: str | None = None, limit: int = MAX_FILES_LIMIT,
                         order: str = "desc", after: str | None = None):
        return state.files.page(_owner(request, None), purpose, limit, order, after)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, request: Request):
        return state.files.get(file_id, _owner(request, None)).object()

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request):
        return Response(state.files.get(file_id, _owner(request, None)).data, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request):
        return state.files.delete(file_id, _owner(request, None))

    @app.post("/v1/batches")
    async def create_batch(body: BatchCreateRequest, request: Request):
        expiry = body.output_expires_after
        return state.batches.create(_owner(request, None), request.headers.get("authorization"), body.input_file_id,
                                    body.endpoint, body.completion_window, body.metadata,
                                    None if expiry is None else expiry.seconds).object()

    @app.get("/v1/batches")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None):
        return state.batches.page(_owner(request, None), limit, after)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, request: Request):
        return state.batches.get(batch_id, _owner(request, None)).object()

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request):
        return (await state.batches.cancel(batch_id, _owner(request, None))).object()

    @app.post("/v1/conversations")
    async def create_conversation(body: ConversationCreateRequest, request: Request):
        return state.conversations.create(_owner(request, None), body.items or [], body.metadata)

    @app.get("/v1/conversations/{conversation_id}")
    async def get_conversation(conversation_id: str, request: Request):
        return state.conversations.get(conversation_id, _owner(request, None)).response

    @app.post("/v1/conversations/{conversation_id}")
    async def update_conversation(conversation_id: str, body: ConversationUpdateRequest, request: Request):
        return state.conversations.update(conversation_id, _owner(request, None), body.metadata or {})

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(conversation_id: str, request: Request):
        return state.conversations.delete(conversation_id, _owner(request, None))

    @app.post("/v1/conversations/{conversation_id}/items")
    async def add_conversation_items(conversation_id: str, body: ConversationItemsRequest, request: Request):
        return state.conversations.add_items(conversation_id, _owner(request, None), body.items)

    @app.get("/v1/conversations/{conversation_id}/items")
    async def list_conversation_items(conversation_id: str, request: Request, limit: int = 20, order: str = "desc",
                                      after: str | None = None):
        return state.conversations.items(conversation_id, _owner(request, None), limit, order, after)

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_conversation_item(conversation_id: str, item_id: str, request: Request):
        return state.conversations.item(conversation_id, _owner(request, None), item_id)

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_conversation_item(conversation_id: str, item_id: str, request: Request):
        return state.conversations.delete_item(conversation_id, _owner(request, None), item_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await _tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await _detokenize(state, body)

    return app


# ---------------------------------------------------------------- requests
def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


async def _serve(state: ServerState, request: Request, body, chat: bool, wire=None,
                 rendered: tuple[list[int], bool] | None = None, on_end: Callable[[], None] = _nothing):
    """Run ``body`` (completions, or chat when ``chat``) and answer it in ``wire``'s shape
    (by default ``ChatWire``: chat completions or completions). ``rendered``: chat's
    ``_render_chat(state, body)``, when the caller has it. ``on_end``: called once when the
    request has ended, however (its response sent, its stream closed, its background run
    over), or when it never started."""
    try:
        _check_model(state, body.model)
        if wire is None:
            wire = ChatWire(state.model_name, state.token_spellings, body, chat)
        if not state.engine.is_alive:
            raise APIError(503, "the engine is not running", code="engine_dead")
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; only token-id prompts to /v1/completions work"
                           if chat else "this model has no tokenizer: send prompt as token ids", param="prompt")
        start = time.monotonic()
        slot = state.limit.acquire(_fanout(state, body, chat))
    except BaseException:
        on_end()
        raise
    slot.on_release = on_end
    try:
        owner = _owner(request, body)
        jobs = await (_chat_jobs(state, body, owner, rendered) if chat else _completion_jobs(state, body))
        if jobs[0].params.logprobs is not None:
            await state.token_spellings.ready()
        merger = ChoiceMerger(state.engine, jobs)
        choices = [ChoiceState(i, job, new_timer(state.metrics, job, start),
                               hide_tool_markup=chat and job.parse_tool_calls, tool_format=state.tool_format,
                               server_tools=frozenset(state.tools))
                   for i, job in enumerate(jobs)]
        if getattr(wire, "background", False):
            try:
                response = await _start_background(state, wire, merger, choices, owner, slot, body.stream)
            except BaseException:
                await merger.aclose()
                raise
            slot = None   # released by the run
            return response
        try:
            await wait_or_disconnect(request, merger.prime())
        except BaseException as e:
            await merger.aclose()
            if isinstance(e, ClientDisconnected):
                _end_unfinished(choices, "abort")   # (a client that gave up while its request was queued)
                return Response(status_code=499)
            raise _start_error(e, wire.prompt_param) from None
        if body.stream:
            response = _event_stream(_stream(state, request, wire, merger, choices, owner), on_close=slot.release)
            slot = None   # released by the stream
            return response
        try:
            try:
                await wait_or_disconnect(request, _collect(merger, choices))
            except BaseException as e:
                _end_unfinished(choices, "abort" if isinstance(e, (ClientDisconnected, asyncio.CancelledError))
                                else "error")
                raise
            finally:
                await merger.aclose()
            await _park_paused(state, choices, owner)
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError:
            raise APIError(503, "the engine stopped while generating", code="engine_dead") from None
        except ValueError as e:
            raise from_value_error(e, wire.prompt_param) from None
        except Exception as e:  # noqa: BLE001 - e.g. a failed engine step: report it, keep serving
            log.warning("request %s failed: %s", wire.response_id, e)
            raise APIError(500, f"generation failed: {type(e).__name__}: {e}") from None
        finally:
            await _abort_unsettled(state, choices)
        # Built and serialized off the event loop: n=16 x 1,000 tokens x 20 alternatives of logprobs
        # take ~1 s to build and ~0.7 s to serialize, which would stall every other client's stream
        # meanwhile (the C encoder holds the GIL while it writes, so the building is what moves).
        # Encoded as FastAPI's JSONResponse does: UTF-8, compact, no NaN.
        def build() -> tuple[dict, bytes]:
            response = wire.full(choices)
            return response, json.dumps(response, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

        response, content = await asyncio.to_thread(build)
        wire.keep(choices, response)   # (on the loop: what the wire keeps is shared with other requests)
        return Response(content, media_type="application/json")
    finally:
        if slot is not None:
            slot.release()


def _fanout(state: ServerState, body, chat: bool) -> int:
    """Engine requests this HTTP request becomes (prompts x n); over ``max_fanout`` is a 400,
    decided before anything is tokenized or queued."""
    prompts = 1
    if not chat and isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
        prompts = len(body.prompt)
    fanout = prompts * body.n
    if fanout > state.max_fanout:
        param = "prompt" if prompts > state.max_fanout else "n"
        raise APIError(400, f"{param}: this request would run {prompts} prompt(s) x n={body.n} = {fanout} "
                       f"generations; the server allows at most {state.max_fanout} per request (--max-fanout)",
                       param=param, code="fanout_exceeded")
    return fanout


def _owner(request: Request, body) -> str:
    """Who may resume a paused tool context: the API key sent and the ``user`` field
    (``body`` None: the key alone, the owner of stored responses). Hashed so the key is
    not kept in memory next to the contexts."""
    user = (body.user or "") if body is not None else ""
    owners = request.scope.get(TRUSTED_OWNERS)   # (a batch's line: its creator's, ``server.batches``)
    if owners is not None:
        return owners[user]
    return owner_of(request.headers.get("authorization", ""), user)


async def _respond(state: ServerState, request: Request, body: ResponsesRequest):
    """``POST /v1/responses``: the chat request it amounts to, answered as a ``response``
    (``background``: run on the server, ``server.background``)."""
    _check_model(state, body.model)
    asks = body.reasoning is not None and (body.reasoning.effort, body.reasoning.summary) != (None, None)
    if asks and getattr(getattr(state.engine, "engine", None), "reasoning_format", None) is None:   # ({}: asks nothing)
        raise APIError(400, "reasoning: this server returns no reasoning (serve the model with --reasoning-parser)",
                       param="reasoning")
    owner = _owner(request, None)
    conversation = body.conversation_id
    try:
        # One response at a time on a conversation, as OpenAI's: held from before it is read until the
        # response ends.
        on_end = state.conversations.lock(conversation, owner) if conversation is not None else _nothing
        try:
            chat, added, rendered = await _responses_chat(state, body, owner)
            continues = None if conversation is None else \
                functools.partial(state.conversations.extend, conversation, owner)
            wire = ResponsesWire(body, state.model_name, state.responses if body.store else None, owner, added,
                                 state.cache_page_size, state.token_spellings, continues)
        except BaseException:
            on_end()
            raise
        return await _serve(state, request, chat, chat=True, wire=wire, rendered=rendered, on_end=on_end)
    except APIError as e:
        raise responses_error(e) from None


async def _count_input_tokens(state: ServerState, request: Request, body: ResponsesInputTokensRequest) -> dict:
    """``POST /v1/responses/input_tokens``: the prompt tokens ``body`` would be as a
    response (its conversation, tools and ``truncation`` included); nothing runs."""
    if body.model is not None:
        _check_model(state, body.model)
    try:
        chat, _, rendered = await _responses_chat(state, body.model_copy(update={"model": state.model_name}),
                                                  _owner(request, None))
        _structured(state, chat)   # (the same 400s as the response would get for its tools and format)
        ids, _ = rendered if rendered is not None else await _render_chat(state, chat)
    except APIError as e:
        raise responses_error(e) from None
    return {"object": "response.input_tokens", "input_tokens": len(ids)}


async def _responses_chat(state: ServerState, body: ResponsesRequest, owner: str
                          ) -> tuple[ChatCompletionRequest, list[dict], tuple[list[int], bool] | None]:
    """``(chat request, the messages body adds to its conversation, the chat request's
    rendering when truncation already made it)`` of a Responses request."""
    earlier = state.background.get(body.previous_response_id, owner) if body.previous_response_id else None
    if earlier is not None and not earlier.done:
        raise APIError(400, f"previous response {body.previous_response_id!r} is still {earlier.status}: wait for "
                       "it to end (or cancel it)", param="previous_response_id", code="previous_response_in_progress")
    if body.conversation_id is not None:
        history = state.conversations.messages(body.conversation_id, owner, body.input)
    elif body.previous_response_id:
        chain = state.responses.chain(body.previous_response_id, owner)
        check_item_ids(body.input, held_item_ids(chain), "input")
        history = [message for entry in chain for message in entry.messages]
    else:
        check_item_ids(body.input, set(), "input")
        history = []
    added = input_messages(body.input)
    check_call_outputs(history, added)
    chat = chat_request(body, history, added)
    rendered = None
    if body.truncation == "auto":
        chat, rendered = await _truncated(state, chat)
    return chat, added, rendered


async def _truncated(state: ServerState, chat: ChatCompletionRequest
                     ) -> tuple[ChatCompletionRequest, tuple[list[int], bool] | None]:
    """``truncation: "auto"``: ``chat`` with as few of its oldest turns dropped as make the
    prompt and ``max_output_tokens`` (at least one token) fit the context window, with its
    rendering. Turns are dropped whole: the kept conversation starts at a user message,
    after the system message (``instructions``) when there is one. When even the last
    turn alone does not fit, that shortest conversation, unrendered: its 400 follows, naming
    what no truncation can fix (the last turn past the window, or ``max_output_tokens``)."""
    need = chat.token_limit or 1
    messages = chat.messages
    head = 1 if messages[0].role in ("system", "developer") else 0

    async def render(candidate: ChatCompletionRequest) -> tuple[list[int], bool] | None:
        try:
            rendered = await _render_chat(state, candidate)
        except APIError as e:
            if e.code != "context_length_exceeded":   # (the cheap bound ``check_prompt_bytes`` applies)
                raise
            return None
        return rendered if len(rendered[0]) + need <= state.max_model_len else None

    rendered = await render(chat)
    if rendered is not None:
        return chat, rendered
    starts = [i for i in range(head + 1, len(messages)) if messages[i].role == "user"]
    best: tuple[ChatCompletionRequest, tuple[list[int], bool]] | None = None
    low, high = 0, len(starts) - 1
    while low <= high:   # the earliest start that fits (a later start keeps fewer turns: never longer)
        mid = (low + high) // 2
        candidate = chat.model_copy(update={"messages": messages[:head] + messages[starts[mid]:]})
        rendered = await render(candidate)
        if rendered is not None:
            best, high = (candidate, rendered), mid - 1
        else:
            low = mid + 1
    if best is not None:
        return best
    return (chat.model_copy(update={"messages": messages[:head] + messages[starts[-1]:]}) if starts else chat), None


def _response_not_found(response_id: str) -> APIError:
    return APIError(404, f"response {response_id!r} not found", param="response_id", code="response_not_found")


class _Detached:
    """The client of a background run: never gone (``_stream`` polls it)."""

    @staticmethod
    async def is_disconnected() -> bool:
        return False


async def _start_background(state: ServerState, wire: ResponsesWire, merger: ChoiceMerger,
                            choices: list[ChoiceState], owner: str, slot: "_Slot", stream: bool) -> Response:
    """Run a background response (``server.background``); the answer to its create call:
    the response ``queued``, or (``stream``) a stream that follows the run from its first event."""
    queued, events = wire.queued()
    run = BackgroundRun(wire.response_id, wire.owner, lambda status: wire.snapshot(choices, status),
                        wire.input_items)
    run.add(events)
    await state.background.start(run, _run_background(state, run, wire, merger, choices, owner, slot))
    return _event_stream(run.follow()) if stream else JSONResponse(queued)


def _event_stream(events: AsyncIterator[str], on_close=lambda: None) -> "_ManagedStream":
    """An SSE response of ``events`` (``on_close`` runs however it ends)."""
    return _ManagedStream(events, on_close=on_close, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _start_error(error: BaseException, prompt_param: str) -> BaseException:
    """What an error before a response's first output is answered as: the engine's
    ``ValueError`` a 400 naming its field, a dead engine a 503; others as they are."""
    if isinstance(error, ValueError):
        return from_value_error(error, prompt_param)
    if isinstance(error, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_dead")
    return error


async def _run_background(state: ServerState, run: BackgroundRun, wire: ResponsesWire, merger: ChoiceMerger,
                          choices: list[ChoiceState], owner: str, slot: "_Slot") -> None:
    """The body of a background run: the stream a streamed response would send, into
    ``run``'s log; ends ``run`` with the final object (cancelled when the task is)."""
    try:
        try:
            await merger.prime()
        except BaseException:
            await merger.aclose()
            raise
        run.started()
        async for event in _stream(state, _Detached(), wire, merger, choices, owner):
            run.add([event])
    except asyncio.CancelledError:
        if wire.final is None:
            run.add(wire.cancelled(choices))
    except Exception as e:  # noqa: BLE001 - bad input the engine refused, engine gone; or in a stream's cleanup
        if wire.final is None:   # (one that ended keeps its final object and event)
            run.add(wire.error(_start_error(e, wire.prompt_param)))
        log.warning("background response %s: %s: %s", wire.response_id, type(e).__name__, e)
    finally:
        slot.release()
    if wire.final is not None:
        run.end(wire.final)


def _get_response(state: ServerState, response_id: str, owner: str, stream: bool, starting_after: int):
    """``GET /v1/responses/{id}``: the stored response, or a background run as it stands;
    ``stream``: a background run's events after ``starting_after``, then the rest as they come."""
    run = state.background.get(response_id, owner)
    if stream:
        if run is None:
            if state.responses.get(response_id, owner) is None:
                raise _response_not_found(response_id)
            raise APIError(400, "stream: only a background response's events can be streamed again (until "
                           f"{state.background.retention_s:.0f} s after it ended)", param="stream")
        if starting_after < -1:
            raise APIError(400, "starting_after: a sequence number (>= 0), or -1 for every event",
                           param="starting_after")
        return _event_stream(run.follow(starting_after))
    if run is not None:
        return run.response()
    entry = state.responses.get(response_id, owner)
    if entry is None:
        raise _response_not_found(response_id)
    return entry.response


async def _cancel_response(state: ServerState, response_id: str, owner: str) -> dict:
    """``POST /v1/responses/{id}/cancel``: stop a background run (one that ended is
    returned as it ended); other responses cannot be cancelled."""
    run = state.background.get(response_id, owner)
    if run is not None:
        return await state.background.cancel(run)
    entry = state.responses.get(response_id, owner)
    if entry is None:
        raise _response_not_found(response_id)
    if entry.response.get("background"):
        return entry.response
    raise APIError(400, f"response {response_id!r} was not created with background: true; only background "
                   "responses can be cancelled", param="response_id")


def _file_expiry(anchor: str | None, seconds: str | None) -> int | None:
    """An upload's ``expires_after[anchor]`` and ``expires_after[seconds]`` form fields
    (OpenAI's): the seconds it is kept, None when neither is sent; else a 400 naming
    ``expires_after``."""
    if anchor is None and seconds is None:
        return None
    try:   # (form fields are text: read leniently, as FastAPI reads a query's integer)
        return ExpiresAfter.model_validate({"anchor": anchor, "seconds": seconds}, strict=False).seconds
    except ValidationError:
        low, high = FILE_EXPIRY_RANGE_S
        raise APIError(400, f"expires_after: needs anchor 'created_at' and seconds in [{low}, {high}], got "
                       f"anchor {anchor!r}, seconds {seconds!r}", param="expires_after") from None


def _input_items_page(state: ServerState, response_id: str, owner: str, limit: int, order: str,
                      after: str | None) -> dict:
    """``GET /v1/responses/{id}/input_items``: a page of the response's input items
    (``order`` "asc": as sent, "desc": last first; ``after``: the page after that item id)."""
    entry = state.responses.get(response_id, owner)
    run = state.background.get(response_id, owner) if entry is None else None   # (a run still going)
    if entry is None and run is None:
        raise _response_not_found(response_id)
    return items_page(entry.input_items if entry is not None else run.input_items, limit, order, after,
                      f"response {response_id!r}")


def _advertised_tools(state: ServerState, body: ChatCompletionRequest) -> list[dict]:
    """The request's tools, then the server's that it does not shadow (OpenAI tool dicts)."""
    return advertised_tools([t.schema_dict() for t in body.tools or []], state.tools)


def _structured(state: ServerState, body) -> StructuredOutput | None:
    """The output constraint a request asks for: a forced tool call (``tool_choice``
    a named function, request's or server's; ``"required"``: one of the request's
    tools, or of the server's when it declares none; ``allowed_tools``: calls to those
    only, forced in mode ``required``, optional in mode ``auto``; it wins over
    ``response_format``), else ``response_format`` json_object / json_schema. Bad schemas
    (the request's tools' included, forced or not), duplicate tool names and unknown
    function names are 400s naming the field."""
    choice = getattr(body, "tool_choice", None)
    try:
        if getattr(body, "tools", None):   # the request's tools are checked whether or not a call is forced
            StructuredOutput.tool_call([t.schema_dict() for t in body.tools]).validate()
        if isinstance(choice, ToolChoice):
            spec = StructuredOutput.tool_call(_advertised_tools(state, body), choice.function.name,
                                              parallel=body.parallel_tool_calls is not False)
        elif choice == "required":   # one of the request's own tools (the server's when it declares none)
            tools = [t.schema_dict() for t in body.tools or []] or _advertised_tools(state, body)
            spec = StructuredOutput.tool_call(tools, parallel=body.parallel_tool_calls is not False)
        elif isinstance(choice, AllowedToolsChoice):
            spec = _allowed_tools(state, body, choice)
        elif (vllm := _vllm_structured(body)) is not None:
            if body.response_format is not None and body.response_format.type != "text":
                raise APIError(400, f"{vllm.param}: give response_format or {vllm.param}, not both", param=vllm.param)
            spec = vllm
        elif body.response_format is None or body.response_format.type == "text":
            return None
        elif body.response_format.type == "json_object":
            spec = StructuredOutput.json_object()
        else:
            spec = StructuredOutput.json(body.response_format.json_schema.schema_)
        spec.validate()
    except ValueError as e:
        raise from_value_error(e) from None
    return spec


def _allowed_tools(state: ServerState, body, choice: AllowedToolsChoice) -> StructuredOutput:
    """``tool_choice: {"type": "allowed_tools", ...}``: calls to the named tools only (each
    among the request's or the server's tools; all of them stay in the prompt), one or more
    in mode ``required``, none or some in mode ``auto``."""
    advertised = {t["function"]["name"]: t for t in _advertised_tools(state, body)}
    names = list(dict.fromkeys(t.function.name for t in choice.allowed_tools.tools))
    unknown = [name for name in names if name not in advertised]
    if unknown:
        raise ValueError(f"tool_choice: allowed tool {unknown[0]!r} is not among the tools "
                         f"({', '.join(advertised) or 'none'})")
    return StructuredOutput.tool_call([advertised[name] for name in names], parallel=body.parallel_tool_calls is not False,
                                      optional=choice.allowed_tools.mode == "auto")


def _vllm_structured(body) -> StructuredOutput | None:
    """The constraint of vLLM's ``structured_outputs`` (or its older ``guided_json``,
    ``guided_regex``, ``guided_choice``, ``guided_grammar``), if the request gives one;
    more than one is a 400."""
    given = []
    params = body.structured_outputs
    if params is not None:
        given += [("structured_outputs", kind, value) for kind, value in (
            ("json", params.json_), ("json_object", params.json_object or None), ("regex", params.regex),
            ("choice", params.choice), ("grammar", params.grammar)) if value is not None]
        if not given:
            raise APIError(400, "structured_outputs: give one of json, json_object, regex, choice or grammar",
                           param="structured_outputs")
    older = {kind: getattr(body, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")}
    given += [(f"guided_{kind}", kind, value) for kind, value in older.items() if value is not None]
    if not given:
        return None
    if len(given) > 1:
        names = [f"{field}.{kind}" if field == "structured_outputs" else field for field, kind, _ in given]
        raise APIError(400, f"{given[1][0]}: give one structured output constraint, not {' and '.join(names)}",
                       param=given[1][0])
    [(field, kind, value)] = given
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise APIError(400, f"{field}: not a JSON Schema (the text is not JSON)", param=field) from None
            except RecursionError:
                raise APIError(400, f"{field}: not a valid JSON Schema: {TOO_DEEP}", param=field) from None
        return StructuredOutput("json_schema", schema=value, field=field)
    if kind == "json_object":
        return StructuredOutput("json_object", field=field)
    return {"regex": StructuredOutput.regex, "choice": StructuredOutput.choice,
            "grammar": StructuredOutput.lark}[kind](value, field)


async def _render_chat(state: ServerState, body: ChatCompletionRequest,
                       within_window: bool = True) -> tuple[list[int], bool]:
    """Chat template -> token ids; and whether to parse tool calls. ``within_window``: text that
    cannot fit the context window is a 400 before it is rendered (``/tokenize`` counts any)."""
    use_tools = body.tool_choice != "none"
    tools = _advertised_tools(state, body) if use_tools else None
    messages = [m.template_dict() for m in body.messages]
    if within_window:
        _check_chat_bytes(state, messages, tools)

    def render(tok):
        return render_chat(tok, messages, tools, state.tool_format, body.template_options())

    try:
        ids = await state.tokenize(render)
    except Exception as e:  # jinja errors (e.g. the template rejects the roles' order)
        raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages") from None
    return ids, use_tools


def _check_chat_bytes(state: ServerState, messages: list[dict], tools: list[dict] | None) -> None:
    """``check_prompt_bytes`` for a chat's ``messages`` and advertised ``tools``."""
    # The cheap bound counts only text every template renders: not an earlier assistant turn's reasoning
    # (a thinking model's template drops it: ``reasoning_content``, and its content up to the last
    # ``</think>``, as Qwen3's and DeepSeek-R1's templates cut it), nor template kwargs it may never read.
    last = len(messages) - 1
    state.check_prompt_bytes([m["content"] if m["role"] != "assistant" or i == last else
                              m["content"].rpartition("</think>")[2]
                              for i, m in enumerate(messages) if isinstance(m["content"], str)]
                             + [json.dumps(t) for t in tools or []], "messages")


def _sampling(state: ServerState, body, prompt_len: int, default_max: int | None, seed_offset: int = 0,
              prompt_param: str = "prompt", structured: StructuredOutput | None = None) -> SamplingParams:
    if prompt_len >= state.max_model_len:
        raise APIError(400, f"{prompt_param}: the prompt has {prompt_len} tokens; the context window is "
                       f"{state.max_model_len} tokens", param=prompt_param, code="context_length_exceeded")
    limit = body.token_limit if isinstance(body, ChatCompletionRequest) else body.max_tokens
    if limit == 0:
        limit = 1   # echo scoring the prompt alone: the one token sampled is not returned (``Job.scores_only``)
    room = state.max_model_len - prompt_len
    if limit is None:
        limit = room if default_max is None else min(default_max, room)
    elif limit > room:
        field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise APIError(400, f"{field}: prompt ({prompt_len} tokens) + {field} ({limit}) exceeds the context "
                       f"window of {state.max_model_len} tokens", param=field, code="context_length_exceeded")
    try:
        return SamplingParams(max_tokens=limit, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                              min_p=body.min_p,
                              seed=None if body.seed is None else (body.seed + seed_offset) % 2**32,
                              stop=list(body.stop or []), stop_token_ids=list(body.stop_token_ids or []),
                              ignore_eos=body.ignore_eos,
                              skip_special_tokens=body.skip_special_tokens,
                              include_stop_str_in_output=body.include_stop_str_in_output, structured=structured,
                              logprobs=body.num_logprobs if isinstance(body, ChatCompletionRequest) else body.logprobs,
                              prompt_logprobs=body.logprobs if getattr(body, "echo", False) else None,
                              logit_bias=body.logit_bias, min_tokens=body.min_tokens,
                              repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                              frequency_penalty=body.frequency_penalty,
                              max_tool_calls=getattr(body, "max_tool_calls", None))
    except ValueError as e:
        raise from_value_error(e, prompt_param) from None


async def _chat_jobs(state: ServerState, body: ChatCompletionRequest, owner: str,
                     rendered: tuple[list[int], bool] | None = None) -> list[Job]:
    structured = _structured(state, body)
    ids, parse = rendered if rendered is not None else await _render_chat(state, body)
    # Calls are parsed (and their markup hidden) as the engine parses them: under a grammar only when
    # it forces calls; a JSON answer or a regex's text is the answer whatever markup it holds.
    parse = parse and (structured is None or structured.kind == "tool_call")
    base = f"chatcmpl-{uuid.uuid4().hex}"
    jobs = []
    for i in range(body.n):
        params = _sampling(state, body, len(ids), None, seed_offset=i, prompt_param="messages", structured=structured)
        job = Job(f"{base}-{i}", ids, params, parse, parse_reasoning=True, priority=body.priority_class)
        if body.n == 1 and parse and structured is None:   # a paused request cannot take a new grammar
            room = state.max_model_len - len(ids)
            taken = await state.parked.take(ids, sampling_key(params), owner, state.spelling, room)
            if taken is not None:
                job.resume_from, job.resume_at = taken
                job.request_id = job.resume_from.request_id
                longer = len(job.resume_from.context_ids) - job.resume_at   # the model's own spelling: > 0 tokens
                if params.max_tokens > room - longer:
                    job.params = dataclasses.replace(params, max_tokens=room - longer,
                                                     min_tokens=min(params.min_tokens, room - longer))
                state.metrics.resumed.inc()
                state.metrics.resumed_context_tokens.inc(job.cached_tokens)
                state.metrics.resume_appended_tokens.inc(len(ids) - job.cached_tokens)
        jobs.append(job)
    return jobs


async def _completion_jobs(state: ServerState, body: CompletionRequest) -> list[Job]:
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    texts = [p for p in prompt if isinstance(p, str)]
    for t in texts:
        state.check_prompt_bytes([t], "prompt")
    try:
        encoded = await state.tokenize(lambda tok: [tok.encode(t, add_special_tokens=True) for t in texts])
    except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take is the client's input
        raise APIError(400, f"prompt: the tokenizer rejected it ({type(e).__name__})", param="prompt") from None
    structured = _structured(state, body)
    base = f"cmpl-{uuid.uuid4().hex}"
    jobs = []
    for p in prompt:
        ids = encoded.pop(0) if isinstance(p, str) else list(p)
        params = [_sampling(state, body, len(ids), 16, seed_offset=i, structured=structured) for i in range(body.n)]
        echo = await _echo_text(state, body, p, ids) if body.echo else None
        for i in range(body.n):
            jobs.append(Job(f"{base}-{len(jobs)}", ids, params[i], parse_tool_calls=False, echo=echo,
                            scores_only=body.max_tokens == 0, priority=body.priority_class))
    return jobs


async def _echo_text(state: ServerState, body: CompletionRequest, prompt, ids: list[int]) -> str:
    """The text ``echo`` starts a choice with: a string prompt as sent, token ids as the text
    they spell (decoded once their count fits the context window; ids outside the vocabulary
    are the engine's 400 either way)."""
    if isinstance(prompt, str):
        return prompt
    try:
        return await state.tokenize(lambda tok: tok.decode(ids, skip_special_tokens=body.skip_special_tokens))
    except Exception as e:  # noqa: BLE001 - ids the tokenizer cannot spell are the client's input
        raise APIError(400, f"prompt: the tokenizer cannot decode these token ids ({type(e).__name__})",
                       param="prompt") from None


def _need_tokenizer(state: ServerState, route: str) -> None:
    if state.tokenizers is None:
        raise APIError(400, f"{route}: this model has no tokenizer")


async def _tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    """The token ids a completions ``prompt`` or chat ``messages`` become here, and their count
    (past the context window too, as vLLM's: a client budgets with it; the body's size bounds
    the work)."""
    _check_model(state, body.model)
    _need_tokenizer(state, "/tokenize")
    if body.messages is not None:
        chat = ChatCompletionRequest(model=body.model, messages=body.messages, tools=body.tools,
                                     tool_choice=body.tool_choice, add_generation_prompt=body.generation_prompt,
                                     continue_final_message=body.continue_final_message,
                                     chat_template_kwargs=body.chat_template_kwargs,
                                     reasoning_effort=body.reasoning_effort)
        _structured(state, chat)   # the same 400s as chat completions (bad tool schemas, unknown names)
        ids, _ = await _render_chat(state, chat, within_window=False)
    else:
        try:
            ids = await state.tokenize(lambda tok: tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take is the client's input
            raise APIError(400, f"prompt: the tokenizer rejected it ({type(e).__name__})", param="prompt") from None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}


async def _detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    """The text ``tokens`` spell (``skip_special_tokens`` as for generation)."""
    _check_model(state, body.model)
    _need_tokenizer(state, "/detokenize")
    vocab = len(state.tokenizer)
    if max(body.tokens) >= vocab:
        raise APIError(400, f"tokens: token ids must be in [0, {vocab})", param="tokens")
    text = await state.tokenize(lambda tok: tok.decode(body.tokens, skip_special_tokens=body.skip_special_tokens))
    return {"prompt": text}


async def _collect(merger: ChoiceMerger, choices: list[ChoiceState]) -> None:
    while (item := await merger.next()) is not None:
        index, out = item
        choices[index].on_output(out)


async def _park_paused(state: ServerState, choices: list[ChoiceState], owner: str) -> None:
    """Keep the contexts of choices that paused on a client-side tool call."""
    for c in choices:
        if not c.tool_calls or c.settled:
            continue
        context = c.parkable_context()
        if context is None:
            await state.engine.abort(c.job.request_id)
        else:
            await state.parked.park(c.job.request_id, context, sampling_key(c.job.params),
                                    calls_seen=len(c.last.api_calls) - 1, owner=owner,
                                    written_from=len(c.job.prompt_ids))
        c.settled = True


def _end_unfinished(choices: list[ChoiceState], reason: str) -> None:
    """The response ended before some choices' final outputs (``reason``: ``abort``, the
    client left; ``error``, it failed): their latency and count are observed all the same,
    so every response in the TTFT histogram is in the E2E one and in ``responses_total``."""
    now = time.monotonic()
    for c in choices:
        c.timer.on_end(reason, now)   # (once: a choice that ended is not counted again)


async def _abort_unsettled(state: ServerState, choices: list[ChoiceState]) -> None:
    """A response that ended before its paused tool calls were parked (client gone,
    a sibling choice failed): abort them, or they would hold their KV forever."""
    for c in choices:
        if c.tool_calls and not c.settled:
            c.settled = True
            await state.engine.abort(c.job.request_id)


# --------------------------------------------------------------- streaming
async def _stream(state: ServerState, request: Request, wire, merger: ChoiceMerger, choices: list[ChoiceState],
                  owner: str) -> AsyncIterator[str]:
    """The events of a streamed response as its choices progress, in ``wire``'s shape."""
    finished = failed = False
    try:
        for event in wire.start(choices):
            yield event
        while True:
            try:
                item = await merger.next(timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if item is None:
                break
            if await request.is_disconnected():
                return
            index, out = item
            c = choices[index]
            first = c.last is None
            text = c.on_output(out)
            logprobs, reasoning = c.new_logprobs, c.new_reasoning
            if first and c.job.echo is not None:   # the echoed prompt leads the choice's first chunk
                text, logprobs = c.job.echo + text, c.prompt_logprobs + logprobs
            if text or logprobs or reasoning:
                for event in wire.text(c, text, logprobs, reasoning):
                    yield event
            if c.new_calls:
                for event in wire.calls(c, c.new_calls):
                    yield event
            if c.finish_reason is not None:
                for event in wire.finish(c):
                    yield event
        finished = True
        await _park_paused(state, choices, owner)
        for event in wire.end(choices):
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band, then end it
        failed = True
        log.warning("stream %s failed: %s", wire.response_id, e)
        for event in wire.error(from_value_error(e, wire.prompt_param) if isinstance(e, ValueError) else e):
            yield event
    finally:
        if not finished:
            _end_unfinished(choices, "error" if failed else "abort")
            await merger.aclose()
        await _abort_unsettled(state, choices)
