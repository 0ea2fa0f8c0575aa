"""Runs the engine requests behind one HTTP request and turns their outputs
into per-choice events, independent of the response format.

One HTTP request has ``n`` choices (times prompts, for batched completions);
each is one engine request (``Job``). ``ChoiceMerger`` runs them
concurrently and interleaves their outputs; closing it aborts whatever is
still running in the engine. ``ChoiceState`` follows one choice: visible
text (tool markup hidden for chat), token counts, the tool calls it paused on
(one turn's, each with its own id), and its latency metrics.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from jaxserve.outputs import RequestOutput, TokenLogprob
from jaxserve.sampling_params import SamplingParams
from server.logprobs import TextOffsets
from server.metrics import ResponseTimer, ServerMetrics
from server.parked import ParkedContext
from jaxserve.tool_format import ToolFormat, get_format
from jaxserve.tool_format.call_stream import CallStream


def sampling_key(params: SamplingParams) -> tuple:
    """The sampling settings a resumed continuation must share with the paused request."""
    return (params.temperature, params.top_k, params.top_p, params.min_p, params.seed, tuple(params.stop),
            tuple(params.stop_token_ids), params.ignore_eos, params.skip_special_tokens,
            params.include_stop_str_in_output, params.logprobs,
            tuple(sorted((params.logit_bias or {}).items())), params.repetition_penalty, params.presence_penalty,
            params.frequency_penalty, params.min_tokens, params.max_tool_calls)


@dataclass
class Job:
    """One engine request: fresh from ``prompt_ids``, or a resumption of ``resume_from``
    whose context spells ``prompt_ids[:resume_at]``."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    parse_tool_calls: bool
    parse_reasoning: bool = False   # chat: split a thinking model's reasoning from its answer (when served so)
    resume_from: ParkedContext | None = None
    resume_at: int = 0   # prompt tokens the resumed context covers (its own tokens may cut them differently)
    echo: str | None = None   # completions with ``echo``: the prompt's text, which the choice's text starts with
    scores_only: bool = False   # echo with ``max_tokens`` 0: the one token the engine samples is not returned
    priority: int = 0   # the engine request's class, lower first (a resumption moves its paused request to it)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served by the resumed context (0 for a fresh request)."""
        return self.resume_at if self.resume_from else 0


async def job_outputs(engine, job: Job) -> AsyncIterator[RequestOutput]:
    """Stream a job's outputs. A resumption whose paused request is gone (expired,
    aborted) falls back to computing the prompt from scratch."""
    agen = None
    try:
        if job.resume_from is not None:
            agen = engine.resume(job.request_id, token_ids=job.prompt_ids[job.cached_tokens:],
                                 max_tokens=job.params.max_tokens, priority=job.priority)
            try:
                first = await agen.__anext__()
            except KeyError:
                await agen.aclose()
                job.resume_from = None
                job.request_id = f"{job.request_id}-r"
            except Exception:
                # Refused (a ValueError): the paused request, whose parked context was taken for
                # this resumption, would hold its pages with no TTL left to free them.
                await engine.abort(job.request_id)
                raise
            else:
                yield first
        if job.resume_from is None:
            agen = engine.generate(sampling_params=job.params, request_id=job.request_id,
                                   prompt_token_ids=job.prompt_ids, parse_tool_calls=job.parse_tool_calls,
                                   parse_reasoning=job.parse_reasoning, priority=job.priority)
        async for out in agen:
            yield out
    finally:
        if agen is not None:
            await agen.aclose()   # aborts the engine request if it has not finished


_END = object()


class ChoiceMerger:
    """Runs jobs concurrently; ``prime()`` waits for every job's first output (so
    input errors raise before a response starts), iteration yields
    ``(choice index, RequestOutput)`` in arrival order, ``aclose()`` aborts the rest."""

    def __init__(self, engine, jobs: list[Job]) -> None:
        self._engine, self._jobs = engine, jobs
        self._queue: asyncio.Queue = asyncio.Queue()
        self._started: set[int] = set()   # jobs whose pump ran (a task cancelled before it never does)
        self._tasks = [asyncio.ensure_future(self._pump(i, engine, job)) for i, job in enumerate(jobs)]
        self._buffer: list = []
        self._open = len(jobs)

    async def _pump(self, index: int, engine, job: Job) -> None:
        self._started.add(index)
        try:
            async for out in job_outputs(engine, job):
                self._queue.put_nowait((index, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((index, e))
        finally:
            self._queue.put_nowait((index, _END))

    async def prime(self) -> None:
        started: set[int] = set()
        while len(started) < len(self._tasks):
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise item
            started.add(index)
            self._buffer.append((index, item))

    async def next(self, timeout: float | None = None):
        """The next ``(index, output)``; ``None`` when all jobs ended; raises a job's
        exception; ``asyncio.TimeoutError`` after ``timeout`` seconds without output."""
        while True:
            if self._buffer:
                index, item = self._buffer.pop(0)
            elif self._open == 0:
                return None
            else:
                async with asyncio.timeout(timeout):   # (not ``wait_for``: see ``AsyncEngine._drain``)
                    index, item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, Exception):
                raise item
            return index, item

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for index, job in enumerate(self._jobs):
            if job.resume_from is not None and index not in self._started:
                # cancelled before it ran: its paused request (whose parked context was taken) is ended
                await self._engine.abort(job.request_id)


@dataclass
class ToolCallOut:
    """A call the response returns (or, while streaming, the part of one sent so far)."""

    id: str
    name: str
    arguments: str   # JSON text (while streaming: the part sent so far)
    index: int = 0   # its ``tool_calls`` index in a stream (its position, unless a call streamed before broke)
    sent: int | None = None   # argument characters a stream sent before the turn ended (None: not even its name)
    incomplete: bool = False  # a call the choice ended inside (``ChoiceState.cut_calls``)


@dataclass
class CallDelta:
    """What one output added to a streamed call: ``opened``, its name is new (send the
    call's id and name first); ``arguments``, the next piece of its arguments."""

    call: ToolCallOut
    opened: bool
    arguments: str


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    job: Job
    timer: ResponseTimer
    hide_tool_markup: bool
    text_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)   # with a reasoning parser: the thinking
    completion_tokens: int = 0
    finish_reason: str | None = None
    tool_calls: list[ToolCallOut] = field(default_factory=list)   # the turn's calls it paused on
    # The calls of a turn max_tokens ended while the model wrote calls: shown as calls (the last
    # ``incomplete`` if cut inside it), not as their markup; never run, parked or stored.
    cut_calls: list[ToolCallOut] = field(default_factory=list)
    server_tools: frozenset[str] = frozenset()   # the server's tools: their calls are run, not shown
    new_calls: list[CallDelta] = field(default_factory=list)   # what the last output added to streamed calls
    server_calls: int = 0        # server-side tool calls completed in this response
    last: RequestOutput | None = None
    settled: bool = False        # a paused tool call was parked for the follow-up, or aborted
    tool_format: ToolFormat = field(default_factory=lambda: get_format("hermes"))
    text_offsets: TextOffsets | None = None   # with logprobs, completions: where each token starts in the text
    _filter: object | None = None   # the format's markup filter when hiding markup
    _calls: CallStream | None = None   # reads the calls the filter hides as they are written
    _streamed: list[ToolCallOut] = field(default_factory=list)   # this turn's calls sent so far
    _indices_used: int = 0          # stream indices given to calls so far (every turn)
    _api_calls_seen: int = 0        # the request's API calls as of the last output

    def __post_init__(self) -> None:
        if self.hide_tool_markup:
            self._filter = self.tool_format.markup_filter()
            self._calls = self.tool_format.call_stream(self.server_tools)
        if self.job.resume_from is not None:
            self._api_calls_seen = self.job.resume_from.calls_seen + 1
        if self.job.params.logprobs is not None:
            self.text_offsets = TextOffsets(self.job.params.skip_special_tokens)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)

    @property
    def reasoning_tokens(self) -> int:
        """Generated tokens of this response that were reasoning (tags included)."""
        return self.last.num_reasoning_tokens if self.last is not None and not self.job.scores_only else 0

    @property
    def new_reasoning(self) -> str:
        """The reasoning the last output added (empty without a reasoning parser)."""
        return self.last.delta_reasoning if self.last is not None and not self.job.scores_only else ""

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """With logprobs asked, the records of the tokens this response generated (a resumed
        request's output lists earlier turns' too), else None."""
        if self.job.params.logprobs is None:
            return None
        records = self.last.logprobs if self.last is not None else None
        return records[len(records) - self.completion_tokens:] if records else []

    @property
    def prompt_logprobs(self) -> list[TokenLogprob]:
        """With ``echo`` and logprobs: a record per prompt token (the first has no
        log-probability: ``logprob`` None), else empty."""
        scored = self.last.prompt_logprobs if self.last is not None else None
        if self.job.echo is None or not scored:
            return []
        return [TokenLogprob(self.job.prompt_ids[0], None)] + scored[1:]

    @property
    def new_logprobs(self) -> list[TokenLogprob]:
        """The records of the last output's new tokens (empty without logprobs)."""
        out = self.last
        if self.job.scores_only:
            return []
        return out.logprobs[len(out.logprobs) - len(out.delta_token_ids):] if out and out.logprobs else []

    def on_output(self, out: RequestOutput) -> str:
        """Account for an output; returns the new visible text."""
        self.last = out
        self.timer.on_output(out, time.monotonic())
        if self.job.scores_only:   # the prompt was all it asked for: the sampled token ends it at "length"
            if out.finished:
                self.finish_reason = "length" if out.finish_reason in ("length", "stop") else out.finish_reason
                self.timer.on_end(self.finish_reason, time.monotonic())
            return ""
        self.completion_tokens += len(out.delta_token_ids)
        if out.delta_reasoning:
            self.reasoning_parts.append(out.delta_reasoning)
        text = self._filter.feed(out.delta_text) if self._filter else out.delta_text
        in_call = flushed = None
        if out.finished and self._filter:
            in_call = self._filter.in_call
            flushed = self._filter.flush()   # (an open call's held-back end goes to its span first)
        self.new_calls = self._stream_calls(out) if self._calls else []
        if out.finished:
            cut = out.finish_reason == "length" and bool(self._streamed) and not self._calls.held
            if cut:
                # max_tokens ended the choice in a turn whose calls the stream had begun, all of it what
                # the parser accepts so far: they are calls, the last one unfinished if it was being
                # written, not text (a call left open shows none of its markup). (A turn ended by
                # EOS or a stop string, or one the parser would refuse, keeps its text as written.)
                writing = self._calls.writing
                self.cut_calls = [replace(call, sent=len(call.arguments),
                                          incomplete=writing and i == len(self._streamed) - 1)
                                  for i, call in enumerate(self._streamed)]
            if flushed and not (in_call and (cut or (out.finish_reason == "length" and self._calls.server_call))):
                text += flushed   # (a server-side call cut by max_tokens is never run, nor shown as text)
            self.finish_reason = out.finish_reason
            if out.finish_reason == "tool_calls":
                self.tool_calls = self._final_calls(out.tool_calls)
            self.timer.on_end(self.finish_reason, time.monotonic())
        if text:
            self.text_parts.append(text)
        return text

    def _stream_calls(self, out: RequestOutput) -> list[CallDelta]:
        """Read the calls the markup filter hid so far; returns what they added since the last
        output. A turn whose calls went to the server's tools (the request made another API
        call and goes on) starts the next turn's calls afresh."""
        self._calls.update(self._filter.spans)
        if out.finished:
            self._calls.finish()   # (calls waiting for their span's end: the text is all written)
        deltas = []
        for position, call in enumerate(self._calls.calls):
            opened = position == len(self._streamed)
            if opened:
                self._streamed.append(ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", call.name, "",
                                                  index=self._indices_used))
                self._indices_used += 1
            sent = self._streamed[position]
            piece = call.arguments[len(sent.arguments):]
            if opened or piece:
                sent.arguments += piece
                deltas.append(CallDelta(sent, opened, piece))
        if len(out.api_calls) > self._api_calls_seen:
            self._api_calls_seen = len(out.api_calls)
            if out.finish_reason != "tool_calls":
                self._calls.new_turn()
                self._streamed = []
        return deltas

    def _final_calls(self, calls: list[dict]) -> list[ToolCallOut]:
        """The calls the turn paused on (``RequestOutput.tool_calls``), each with its id and
        stream index: those of a call already streamed when it is the same call (same name,
        its arguments so far a prefix of the parsed ones), else new ones after all used."""
        final = []
        for position, call in enumerate(calls):
            arguments = call.get("arguments") or "{}"
            sent = self._streamed[position] if position < len(self._streamed) else None
            if sent is not None and sent.name == call["name"] and arguments.startswith(sent.arguments):
                final.append(ToolCallOut(sent.id, sent.name, arguments, sent.index, len(sent.arguments)))
            else:
                final.append(ToolCallOut(f"call_{uuid.uuid4().hex[:24]}", call["name"], arguments,
                                         self._indices_used))
                self._indices_used += 1
        return final

    def parkable_context(self) -> list[int] | None:
        """The paused request's context ids when it can be resumed by a follow-up,
        else ``None``: server-side tool results inside this response put tokens in
        the context that the client never sees, so no follow-up could match it."""
        out = self.last
        if out is None or not self.tool_calls:
            return None
        earlier = self.job.resume_from.calls_seen + 1 if self.job.resume_from else 0
        if len(out.api_calls) != earlier + 1:
            return None
        generated_here = out.token_ids[len(out.token_ids) - self.completion_tokens:]
        return self.job.prompt_ids + generated_here


async def wait_or_disconnect(request, awaitable, poll_s: float = 0.25):
    """Await ``awaitable`` unless the client goes away first (then cancel it and
    raise ``ClientDisconnected``)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class ClientDisconnected(Exception):
    """The HTTP client closed the connection."""


def new_timer(metrics: ServerMetrics, job: Job, start: float) -> ResponseTimer:
    resumed = job.resume_from is not None
    return ResponseTimer(metrics, start, resumed=resumed,
                         calls_seen=job.resume_from.calls_seen if resumed else 0)
