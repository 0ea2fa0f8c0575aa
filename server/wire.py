"""How a response's choices are written for the client: OpenAI's chat completions and
(legacy) completions shapes (``ChatWire``); the Responses API's shape is
``server.responses.ResponsesWire``, with the same methods.

A wire gives the whole response (``full``) or, for ``stream: true``, the text of the
server-sent events of each moment of the stream (``start``, ``text``, ``finish``, ``end``,
``error``), which ``server.app`` sends as the choices progress (one loop for every shape).
"""

from __future__ import annotations

import json
import time
import uuid

from server.errors import APIError, sse_error_event
from server.generation import CallDelta, ChoiceState, ToolCallOut
from server.logprobs import TokenSpellings, chat_logprobs, completion_logprobs
from server.protocol import CompletionTokensDetails, PromptTokensDetails, Usage

ARGUMENT_FRAGMENT_CHARS = 16   # tool-call arguments sent at the end of a turn go in pieces of this size


def usage_of(choices: list[ChoiceState]) -> Usage:
    """Token counts of a response: each prompt once, every choice's completion tokens."""
    prompts = {id(c.job.prompt_ids): c.job for c in choices}
    prompt_tokens = sum(len(j.prompt_ids) for j in prompts.values())
    # Cached: the resumed parked context, or the prefix-cache hit of the prompt's first admission,
    # counted once per prompt: the least of its choices' hits (with ``n`` > 1 the later choices link
    # the pages the first one computed for this request; those were not cached before it).
    cached_of: dict[int, int] = {}
    for c in choices:
        hit = max(c.job.cached_tokens, c.last.num_cached_tokens if c.last is not None else 0)
        key = id(c.job.prompt_ids)
        cached_of[key] = min(cached_of.get(key, hit), hit)
    cached = sum(cached_of.values())
    completion = sum(c.completion_tokens for c in choices)
    reasoning = sum(c.reasoning_tokens for c in choices)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cached else None,
                 completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning) if reasoning else None)


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def argument_fragments(arguments: str) -> list[str]:
    """A tool call's arguments cut into the pieces a stream sends them in."""
    return [arguments[at:at + ARGUMENT_FRAGMENT_CHARS] for at in range(0, len(arguments), ARGUMENT_FRAGMENT_CHARS)]


class ChatWire:
    """``chat.completion`` (``chat``) or ``text_completion`` responses and their chunks."""

    def __init__(self, model_name: str, token_spellings: TokenSpellings, body, chat: bool) -> None:
        self.model_name, self.token_spellings, self.body, self.chat = model_name, token_spellings, body, chat
        self.prompt_param = "messages" if chat else "prompt"
        self.response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        tier = body.served_tier
        self._tier = {} if tier is None else {"service_tier": tier}   # (OpenAI reports it only when asked)

    # ------------------------------------------------------------------ whole
    def full(self, choices: list[ChoiceState]) -> dict:
        out = {"id": self.response_id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model_name, "choices": [], **self._tier}
        for c in choices:
            reason = c.finish_reason or "abort"
            if self.chat:
                message: dict = {"role": "assistant"}
                calls = tool_call_dicts(c)
                if c.text or not calls:
                    message["content"] = c.text
                if c.reasoning:
                    message.update(reasoning_fields(c.reasoning))
                if calls:
                    message["tool_calls"] = calls
                choice = {"index": c.index, "message": message, "finish_reason": reason}
            else:
                choice = {"index": c.index, "text": (c.job.echo or "") + c.text, "finish_reason": reason}
            if c.logprobs is not None:
                choice["logprobs"] = self._logprobs(c, c.prompt_logprobs + c.logprobs)
            out["choices"].append(choice)
        out["usage"] = usage_of(choices).dump()
        return out

    def keep(self, choices: list[ChoiceState], response: dict) -> None:
        """Nothing is kept of a chat or completions response once delivered."""

    # ----------------------------------------------------------------- stream
    def _chunk(self, choice: dict | None, **extra) -> str:
        """One stream chunk: ``choice`` (None: no choice, e.g. the usage chunk) and ``extra`` fields."""
        return sse({"id": self.response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created, "model": self.model_name,
                    "choices": [choice] if choice is not None else [], **self._tier, **extra})

    def start(self, choices: list[ChoiceState]) -> list[str]:
        return [self._chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}})
                for c in choices] if self.chat else []

    def text(self, c: ChoiceState, text: str, logprobs: list, reasoning: str = "") -> list[str]:
        if self.chat:
            delta = reasoning_fields(reasoning) if reasoning else {}
            if text or not reasoning:
                delta["content"] = text
            piece = {"index": c.index, "delta": delta}
        else:
            piece = {"index": c.index, "text": text}
        if logprobs:
            piece["logprobs"] = self._logprobs(c, logprobs)
        return [self._chunk(piece)]

    def calls(self, c: ChoiceState, deltas: list[CallDelta]) -> list[str]:
        """Chunks of calls as they are written: a call's id and name when it opens, then
        each piece of its arguments (``tool_calls[i]`` of the message, ``i`` its index)."""
        events = []
        for delta in deltas:
            if delta.opened:
                events.append(self._call_opened(c, delta.call))
            if delta.arguments:
                events.append(self._call_arguments(c, delta.call, delta.arguments))
        return events

    def _call_opened(self, c: ChoiceState, call: ToolCallOut) -> str:
        return self._chunk({"index": c.index, "delta": {"tool_calls": [{
            "index": call.index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]}})

    def _call_arguments(self, c: ChoiceState, call: ToolCallOut, piece: str) -> str:
        return self._chunk({"index": c.index, "delta": {"tool_calls": [
            {"index": call.index, "function": {"arguments": piece}}]}})

    def finish(self, c: ChoiceState) -> list[str]:
        events = []
        for call in c.tool_calls if self.chat else []:   # what was not streamed of each call
            if call.sent is None:
                events.append(self._call_opened(c, call))
            events += [self._call_arguments(c, call, piece)
                       for piece in argument_fragments(call.arguments[call.sent or 0:])]
        final = {"index": c.index, "delta": {}} if self.chat else {"index": c.index, "text": ""}
        final["finish_reason"] = c.finish_reason
        return events + [self._chunk(final)]

    def end(self, choices: list[ChoiceState]) -> list[str]:
        events = []
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            events.append(self._chunk(None, usage=usage_of(choices).dump()))
        return events + ["data: [DONE]\n\n"]

    def error(self, error: APIError | Exception) -> list[str]:
        return [sse_error_event(error), "data: [DONE]\n\n"]

    def _logprobs(self, c: ChoiceState, records: list) -> dict:
        """The OpenAI ``logprobs`` object of ``records``, the next of choice ``c``'s tokens."""
        if self.chat:
            return chat_logprobs(records, self.token_spellings)
        return completion_logprobs(records, self.token_spellings, c.text_offsets)


def reasoning_fields(reasoning: str) -> dict:
    """A chat message's (or delta's) reasoning, under both names clients read: ``reasoning``
    (vLLM's current name) and ``reasoning_content`` (DeepSeek's API, SGLang, earlier vLLM)."""
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def tool_call_dicts(c: ChoiceState) -> list[dict]:
    """Chat completions ``tool_calls`` of the turn choice ``c`` paused on (or ended inside:
    ``cut_calls``, the last one's arguments unfinished, as OpenAI's with ``finish_reason: "length"``)."""
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in c.tool_calls or c.cut_calls]
