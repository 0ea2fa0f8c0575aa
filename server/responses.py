"""OpenAI's Responses API (``POST /v1/responses``) over the chat machinery.

A Responses request becomes the chat completions request it amounts to
(``chat_request``): ``instructions`` a system message first, then the stored
conversation of ``previous_response_id``, then the ``input`` items (messages;
``function_call`` items the assistant message that made those calls;
``function_call_output`` items tool messages), function tools in the chat form,
``text.format`` as ``response_format``. So templates, tool-call parsing and
markup hiding, server-side tools, parked client-side tool contexts and the
prefix cache all work as for chat: a follow-up that sends a
``function_call_output`` after ``previous_response_id`` renders to the same
tokens as the paused context and resumes it.

``ResponsesWire`` writes the answer as a ``response`` object (``output``: a
``message`` item with ``output_text``, then one ``function_call`` item per call)
or, streamed, as the API's typed events (``response.created``,
``response.output_text.delta``, ``response.function_call_arguments.delta``,
..., ``response.completed``). ``ResponseStore`` keeps stored responses
(``store``, default true) for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``, per API key, in a bounded LRU
(``server.response_store``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable

from pydantic import BaseModel, ValidationError

from server.errors import APIError
from server.generation import CallDelta, ChoiceState, ToolCallOut
from server.logprobs import TokenSpellings, chat_logprobs
from server.protocol import (ChatCompletionRequest, ResponseAllowedTools, ResponseInputItem, ResponsesRequest,
                             ResponseToolChoiceFunction, reasoning_token)
from server.response_store import ResponseStore, StoredResponse
from server.wire import argument_fragments, usage_of

# Field names of the chat request that the Responses API spells otherwise (for 400s).
_RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                     "response_format": "text.format", "prompt": "input"}


def input_messages(given: str | list[ResponseInputItem]) -> list[dict]:
    """A request's ``input`` as chat messages (``item_messages`` of its ``input_items``)."""
    return item_messages(input_items(given))


def item_messages(items: list[dict]) -> list[dict]:
    """Items as the API lists them (``input_items``; a response's output items; a
    conversation's) as chat messages: a message's text parts joined; consecutive
    ``function_call`` items join the assistant message before them (or start one);
    a ``reasoning`` item's text is the ``reasoning_content`` of the assistant message
    (or call) that comes right after it (elsewhere it belongs to no message: dropped).
    Read as they are, not validated again: a model's own output may hold what a client
    may not send (a tool name over 64 characters)."""
    out: list[dict] = []
    reasoning: str | None = None   # a reasoning item's, for the next assistant message
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            text = "".join(part["text"] for part in item.get("content") or [])
            reasoning = text if reasoning is None else f"{reasoning}\n\n{text}"
            continue
        if not (kind == "function_call" or (kind == "message" and item["role"] == "assistant")):
            reasoning = None
        if kind == "message":
            out.append({"role": item["role"], "content": "".join(part["text"] for part in item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and reasoning is None:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        if reasoning is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"], reasoning = reasoning, None
    return out


def input_items(given: str | list[ResponseInputItem]) -> list[dict]:
    """Input items (a request's ``input``, items added to a conversation) as the API lists
    them (``GET /v1/responses/{id}/input_items``, a conversation's items): each with an
    ``id`` (the client's where the item had one, as an earlier response's output
    items sent back do; a new one otherwise) and its text parts as
    ``input_text`` (or ``output_text`` for an assistant's)."""
    def parts(content, kind: str) -> list[dict]:
        if isinstance(content, str):
            return [{"type": kind, "text": content}]
        return [{"type": part.type, "text": part.text} for part in content]

    if isinstance(given, str):
        return [{"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "completed", "role": "user",
                 "content": parts(given, "input_text")}]
    items = []
    for item in given:
        if item.type == "message":
            kind = "output_text" if item.role == "assistant" else "input_text"
            items.append({"type": "message", "id": item.id or f"msg_{uuid.uuid4().hex}", "status": "completed",
                          "role": item.role, "content": parts(item.content, kind)})
        elif item.type == "function_call":
            items.append({"type": "function_call", "id": item.id or f"fc_{uuid.uuid4().hex}", "status": "completed",
                          "call_id": item.call_id, "name": item.name, "arguments": item.arguments})
        elif item.type == "function_call_output":
            items.append({"type": "function_call_output", "id": item.id or f"fco_{uuid.uuid4().hex}", "status": "completed",
                          "call_id": item.call_id, "output": item.text})
        else:
            items.append({"type": "reasoning", "id": item.id or f"rs_{uuid.uuid4().hex}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": item.text}]})
    return items


def check_item_ids(given: str | list[ResponseInputItem], held: set[str], param: str) -> None:
    """As OpenAI's API: an id a client gives an item (an earlier response's output item sent
    back as input) names one item of the conversation. A 400 naming ``param`` when one
    repeats within ``given`` or is one the conversation holds already (``held``: its items'
    ids), as the item would reach the model twice."""
    seen = set(held)
    for item in () if isinstance(given, str) else given:
        if item.id is None:
            continue
        if item.id in seen:
            raise APIError(400, f"Duplicate item found with id {item.id!r}: remove duplicate items from your "
                                f"{param} and try again", param=param)
        seen.add(item.id)


def held_item_ids(entries: list[StoredResponse]) -> set[str]:
    """The ids of the items stored responses (or a conversation) hold: their input items
    and their output's."""
    return {item["id"] for entry in entries
            for item in entry.input_items + entry.response.get("output", []) if "id" in item}


def check_call_outputs(history: list[dict], added: list[dict]) -> None:
    """As OpenAI's Responses API: each ``function_call_output`` of the input answers a call
    made before it (in the conversation so far or earlier in the input), and every call the
    conversation holds has its output once the input is added; else a 400 naming ``input``
    (the model would read a result of nothing, or a call never answered)."""
    calls: list[str] = []
    answered: set[str] = set()
    for messages, checked in ((history, False), (added, True)):
        for message in messages:
            if message["role"] == "assistant":
                calls += [call["id"] for call in message.get("tool_calls") or []]
            elif message["role"] == "tool":
                if checked and message["tool_call_id"] not in calls:
                    raise APIError(400, f"input: no function call found for the function_call_output with call_id "
                                        f"{message['tool_call_id']!r}", param="input")
                answered.add(message["tool_call_id"])
    missing = [call for call in calls if call not in answered]
    if missing:
        raise APIError(400, f"input: no function_call_output found for the function call with call_id {missing[0]!r} "
                            "(give each call's output before going on)", param="input")


def chat_request(body: ResponsesRequest, history: list[dict], added: list[dict]) -> ChatCompletionRequest:
    """The chat completions request ``body`` amounts to after ``history`` (the stored
    conversation of its previous response, or its conversation's items) with ``added``
    (``input_messages(body.input)``)."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history + added
    choice = body.tool_choice
    if isinstance(choice, ResponseToolChoiceFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    elif isinstance(choice, ResponseAllowedTools):
        choice = {"type": "allowed_tools", "allowed_tools": {
            "mode": choice.mode, "tools": [{"type": "function", "function": {"name": t.name}} for t in choice.tools]}}
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None:
        response_format = {"type": fmt.type} if fmt.type != "json_schema" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in body.tools or []]
    try:
        return ChatCompletionRequest.model_validate({
            "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": tools or None, "tool_choice": choice,
            "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format,
            "user": body.user, "stream": body.stream, "logprobs": body.num_logprobs is not None,
            "top_logprobs": body.num_logprobs, "max_tool_calls": body.max_tool_calls,
            "priority": body.priority, "service_tier": body.service_tier,
            "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None})
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"input: {first.get('msg', 'invalid')}", param="input") from None


def responses_error(error: APIError) -> APIError:
    """``error`` (raised for the chat request) naming the Responses API's fields."""
    if error.param is not None:
        head = error.param.partition(".")[0]
        if head in _RESPONSES_PARAMS:
            error.param = _RESPONSES_PARAMS[head]
    named, colon, rest = error.message.partition(":")   # the message's leading field ("messages.0.content: ...")
    if colon and named.partition(".")[0] in _RESPONSES_PARAMS and " " not in named:
        error.message = _RESPONSES_PARAMS[named.partition(".")[0]] + colon + rest
    for chat_name in ("max_completion_tokens", "max_tokens"):
        error.message = error.message.replace(chat_name, "max_output_tokens")
    return error


class ResponsesWire:
    """A ``response`` object, or its typed stream events, for one choice (the Responses
    API has no ``n``); stores the result when ``store`` is given."""

    prompt_param = "input"

    def __init__(self, body: ResponsesRequest, model_name: str, store: ResponseStore | None, owner: str,
                 added: list[dict], cache_page_size: int | None = None,
                 token_spellings: TokenSpellings | None = None,
                 continues: Callable[[list[dict]], None] | None = None) -> None:
        """``cache_page_size``: the engine's page size when its prefix cache is on (else None);
        ``token_spellings``: for ``output_text.logprobs``; ``continues``: for a request that
        continues a conversation (``body.conversation``), what adds the response's input and
        output items to it when it ends completed or incomplete."""
        self.body, self.model_name, self.store, self.owner, self.added = body, model_name, store, owner, added
        self.cache_page_size, self.token_spellings = cache_page_size, token_spellings
        self.continues = continues
        self.background = bool(body.background)
        self.streaming = body.stream or self.background   # a background response runs as a stream (``server.background``)
        self.input_items = input_items(body.input) if store is not None or continues is not None else []
        self.final: dict | None = None   # the response object it ended with (completed, incomplete, failed, cancelled)
        self._held_logprobs: list = []   # records of tokens streamed before any text (tool markup, held text)
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._later_reasoning_id = f"rs_{uuid.uuid4().hex}"   # reasoning that came after the message started
        self._sequence = 0
        self._message_open = False    # its output item has been announced
        self._message_done = False    # and closed (a call opened after it, or the response ended)
        self._message_text: list[str] = []       # the text and logprobs its deltas carried
        self._message_logprobs: list[dict] = []
        self._open_call: ToolCallOut | None = None   # the call being streamed (its item added, not done)
        self._done_calls: dict[str, dict] = {}      # the items of the calls that are done, by call id
        self._announced = 0                 # output items announced so far (the next one's output_index)
        self._message_index = 0             # the message's output_index, once announced
        self._call_indices: dict[str, int] = {}   # each announced call's output_index, by id
        self._reasoning_open = False  # a reasoning item is being streamed (before the message)
        self._reasoning_streamed = ""  # its text so far (reasoning that comes after the message opened is not)

    # ----------------------------------------------------------------- object
    def _object(self, status: str, output: list[dict], choices: list[ChoiceState] | None = None,
                incomplete: str | None = None) -> dict:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        obj = {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
               "model": self.model_name, "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
               "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
               else (body.tool_choice or "auto"),
               "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
               "temperature": body.temperature, "top_p": body.top_p, "store": body.store,
               "truncation": body.truncation or "disabled", "background": self.background,
               "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
               "metadata": body.metadata or {}}
        for name in ("instructions", "max_output_tokens", "previous_response_id", "user", "top_logprobs",
                     "max_tool_calls"):
            if getattr(body, name) is not None:
                obj[name] = getattr(body, name)
        if body.conversation_id is not None:
            obj["conversation"] = {"id": body.conversation_id}
        if body.served_tier is not None:
            obj["service_tier"] = body.served_tier
        if body.reasoning is not None:
            obj["reasoning"] = body.reasoning.model_dump()
        if incomplete is not None:
            obj["incomplete_details"] = {"reason": incomplete}
        if choices is not None:
            usage = usage_of(choices)
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            # Written to the cache: the prompt's full pages computed for this request (the prefix cache
            # keeps them); none without a prefix cache.
            page = self.cache_page_size
            written = max(0, usage.prompt_tokens // page * page - cached) if page else 0
            obj["usage"] = {"input_tokens": usage.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
                            "output_tokens": usage.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": usage.completion_tokens_details.reasoning_tokens
                                                      if usage.completion_tokens_details else 0},
                            "total_tokens": usage.total_tokens}
        return obj

    def _logprobs(self, records: list | None) -> list | None:
        """``output_text.logprobs`` of ``records`` (as chat's ``logprobs.content``); None when not asked."""
        if records is None or self.body.num_logprobs is None:
            return None
        return chat_logprobs(records, self.token_spellings)["content"]

    def _text_part(self, c: ChoiceState) -> dict:
        part = {"type": "output_text", "text": c.text, "annotations": []}
        logprobs = self._logprobs(c.logprobs)
        if logprobs is not None:
            part["logprobs"] = logprobs
        return part

    def _reasoning_item(self, text: str, later: bool = False) -> dict:
        item = {"type": "reasoning", "id": self._later_reasoning_id if later else self._reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}
        if "reasoning.encrypted_content" in (self.body.include or ()):
            item["encrypted_content"] = reasoning_token(text)
        return item

    def _reasoning_parts(self, c: ChoiceState) -> tuple[str, str]:
        """``(first, later)``: the reasoning listed before the message (all of it, unless
        streaming: what was streamed before the message started) and the rest, listed
        after the message and calls (a later turn's, after server-side tool results)."""
        if not self.streaming:
            return c.reasoning, ""
        first = self._reasoning_streamed
        return first, c.reasoning[len(first):].lstrip("\n")   # (turns' reasoning are apart by a blank line)

    def _message_item(self, c: ChoiceState, status: str, part: dict | None = None) -> dict:
        return {"type": "message", "id": self._message_id, "status": status, "role": "assistant",
                "content": [part or self._text_part(c)]}

    @staticmethod
    def _call_item(call, status: str, arguments: str | None = None) -> dict:
        return {"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
                "arguments": call.arguments if arguments is None else arguments, "status": status}

    @staticmethod
    def _outcome(c: ChoiceState) -> tuple[str, str | None]:
        """``(status, incomplete_details.reason)`` of the finished choice: "error" (the
        engine failed it) is ``failed``, "abort" (aborted in the engine) ``cancelled``."""
        if c.finish_reason == "length":
            return "incomplete", "max_output_tokens"
        if c.finish_reason == "error":
            return "failed", None
        if c.finish_reason == "abort":
            return "cancelled", None
        return "completed", None   # "stop", "tool_calls"

    def full(self, choices: list[ChoiceState]) -> dict:
        [c] = choices
        status, reason = self._outcome(c)
        item_status = "incomplete" if status == "incomplete" else "completed"
        output = ([self._message_item(c, item_status)] if c.text or not (c.tool_calls or c.cut_calls) else []) + \
            [self._call_item(call, "completed") for call in c.tool_calls] + \
            [self._call_item(call, "incomplete" if call.incomplete else "completed") for call in c.cut_calls]
        first, later = self._reasoning_parts(c)
        output = ([self._reasoning_item(first)] if first else []) + output + \
            ([self._reasoning_item(later, later=True)] if later else [])
        response = self._object(status, output, choices, reason)
        if status == "failed":
            response["error"] = {"code": "server_error",
                                 "message": f"generation failed: {(c.last.error if c.last is not None else None) or 'engine error'}"}
        return response

    def _partial_output(self, c: ChoiceState, item_status: str) -> list[dict]:
        """The output of a response that has not ended: its reasoning and text so far."""
        return ([self._reasoning_item(c.reasoning)] if c.reasoning else []) + \
            ([self._message_item(c, item_status)] if c.text else [])

    def snapshot(self, choices: list[ChoiceState], status: str) -> dict:
        """The response while it runs (``status``: "queued", "in_progress"; "failed" when
        a background run ended without a final object): the reasoning and text so far,
        in items still ``in_progress``; no usage yet."""
        return self._object(status, self._partial_output(choices[0], "in_progress"))

    def cancelled(self, choices: list[ChoiceState]) -> list[str]:
        """A run cancelled before it ended: its response (``status: "cancelled"``, what it
        had produced: its reasoning and text in ``incomplete`` items, and the calls it streamed)
        becomes ``final`` and is stored when asked;
        returns the stream's last event (``response.incomplete``: the API has no event for
        a cancelled response)."""
        [c] = choices
        cut = self._open_call
        closing = self._close_reasoning() + self._close_calls(c, ended=True) + self._close_message(c, "incomplete")
        # The calls it streamed: those the model finished, and the one it was writing (incomplete); not
        # those it broke (closed incomplete when text came after them), which no response lists.
        calls = [item for call_id, item in self._done_calls.items()
                 if item["status"] == "completed" or (cut is not None and call_id == cut.id)]
        self.final = self._object("cancelled", self._partial_output(c, "incomplete") + calls, choices)
        self.keep(choices, self.final)
        return closing + [self._event("response.incomplete", response=self.final)]

    def keep(self, choices: list[ChoiceState], response: dict) -> None:
        """Store ``response`` (when asked), delivered to the client, with the messages it
        adds to its conversation (on the event loop)."""
        [c] = choices
        self.final = response
        if self.store is not None:
            answer: dict = {"role": "assistant", "content": c.text or None}
            if c.reasoning:   # (templates that show the reasoning of the current turn read it back)
                answer["reasoning_content"] = c.reasoning
            if c.tool_calls:
                answer["tool_calls"] = [{"id": call.id, "type": "function",
                                         "function": {"name": call.name, "arguments": call.arguments}}
                                        for call in c.tool_calls]
            if not self._store(self.added + [answer], response):
                self.store.delete(self.response_id, self.owner)   # (not its ``queued`` entry, stale: nothing)
        if self.continues is not None and response["status"] in ("completed", "incomplete"):
            cut = {call.id for call in c.cut_calls}   # (never run: not part of the conversation)
            self.continues(self.input_items + [item for item in response["output"] if item.get("call_id") not in cut])

    def _store(self, messages: list[dict], response: dict) -> bool:
        """Store ``response`` with the chat ``messages`` it adds to its conversation; whether it fit."""
        return self.store.put(self.response_id, StoredResponse(self.owner, self.body.previous_response_id, messages,
                                                               response, self.input_items))

    # ----------------------------------------------------------------- stream
    def _event(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"

    def queued(self) -> tuple[dict, list[str]]:
        """A background response as created: its object (``status: "queued"``) and the
        events that open its stream (``response.created``, ``response.queued``). It is
        stored as it is now, so a server that stops before the run ends (a crash) reads
        it back as failed (``ResponseStore``); its end stores it again."""
        pending = self._object("queued", [])
        if self.store is not None:
            self._store(self.added, pending)
        return pending, [self._event("response.created", response=pending),
                         self._event("response.queued", response=pending)]

    def start(self, choices: list[ChoiceState]) -> list[str]:
        pending = self._object("in_progress", [])
        if self.background:   # (created and queued when it was created: ``queued``)
            return [self._event("response.in_progress", response=pending)]
        return [self._event("response.created", response=pending), self._event("response.in_progress",
                                                                                response=pending)]

    def _announce(self) -> int:
        """The ``output_index`` of the next item the stream adds."""
        self._announced += 1
        return self._announced - 1

    def _open_message(self, c: ChoiceState) -> list[str]:
        """Announce the message; text after a message that was closed (a call came between:
        one the model broke, answered by the server) opens another, with its own id."""
        events = self._close_reasoning() + self._close_calls(c, ended=True)   # (text after a call: it is over)
        if self._message_done:
            self._message_id, self._message_done = f"msg_{uuid.uuid4().hex}", False
        self._message_open = True
        self._message_text, self._message_logprobs = [], []   # what this message's deltas carry
        index = self._message_index = self._announce()
        return events + [
            self._event("response.output_item.added", output_index=index,
                        item={"type": "message", "id": self._message_id, "status": "in_progress",
                              "role": "assistant", "content": []}),
            self._event("response.content_part.added", item_id=self._message_id, output_index=index,
                        content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _stream_reasoning(self, reasoning: str) -> list[str]:
        """Reasoning text as a ``reasoning`` item's ``reasoning_text`` deltas, while no other
        item has started (later reasoning goes to the final response only)."""
        if not reasoning or not (self._reasoning_open or self._announced == 0):
            return []
        events = []
        if not self._reasoning_open:
            self._reasoning_open = True
            events.append(self._event("response.output_item.added", output_index=self._announce(),
                                      item={"type": "reasoning", "id": self._reasoning_id, "summary": [],
                                            "content": []}))
        self._reasoning_streamed += reasoning
        return events + [self._event("response.reasoning_text.delta", item_id=self._reasoning_id, output_index=0,
                                     content_index=0, delta=reasoning)]

    def _close_reasoning(self) -> list[str]:
        if not self._reasoning_open:
            return []
        self._reasoning_open = False
        return self._reasoning_done(0, self._reasoning_streamed)

    def _reasoning_done(self, index: int, text: str, later: bool = False) -> list[str]:
        """The events that close the reasoning item at ``output_index`` ``index``, holding ``text``."""
        item = self._reasoning_item(text, later)
        return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=text),
                self._event("response.output_item.done", output_index=index, item=item)]

    def text(self, c: ChoiceState, text: str, logprobs: list, reasoning: str = "") -> list[str]:
        events = self._stream_reasoning(reasoning)
        if not text:   # (tokens with no visible text yet: their records go with the next delta)
            self._held_logprobs += logprobs
            return events
        if not self._message_open or self._message_done:
            events += self._open_message(c)
        records, self._held_logprobs = self._held_logprobs + logprobs, []
        return events + [self._text_delta(text, records)]

    def _text_delta(self, text: str, records: list) -> str:
        """An ``output_text.delta`` of the open message (``records``: its tokens' logprobs)."""
        converted = self._logprobs(records) or []
        self._message_text.append(text)
        self._message_logprobs += converted
        return self._event("response.output_text.delta", item_id=self._message_id, output_index=self._message_index,
                           content_index=0, delta=text, logprobs=converted)

    def _close_message(self, c: ChoiceState, item_status: str) -> list[str]:
        """The events that close the open message (its text is complete), if one is open."""
        if not self._message_open or self._message_done:
            return []
        self._message_done = True
        index, text = self._message_index, "".join(self._message_text)   # (this message's own: after a broken
        part = {"type": "output_text", "text": text, "annotations": []}      # call, a second message opens)
        if self.body.num_logprobs is not None:
            part["logprobs"] = self._message_logprobs
        return [self._event("response.output_text.done", item_id=self._message_id, output_index=index,
                            content_index=0, text=text, logprobs=self._message_logprobs),
                self._event("response.content_part.done", item_id=self._message_id, output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index,
                            item=self._message_item(c, item_status, part))]

    def _call_index(self, call: ToolCallOut) -> int:
        """A call's ``output_index``: the next free one when it is first announced."""
        index = self._call_indices.get(call.id)
        if index is None:
            index = self._call_indices[call.id] = self._announce()
        return index

    def _call_done(self, call: ToolCallOut, status: str) -> list[str]:
        """The events that close call ``call``'s item (its ``arguments`` as sent)."""
        item = self._done_calls[call.id] = self._call_item(call, status)
        index, item_id = self._call_index(call), f"fc_{call.id}"
        return [self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            name=call.name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _close_calls(self, c: ChoiceState, ended: bool) -> list[str]:
        """Close the call item still open before another item starts: with the rest of its
        arguments when the turn returned it, complete as sent when the model moved on to
        another call, or incomplete as sent when the choice ended (``ended``) without it
        (the model broke or did not finish a call the stream had begun to send, or the run
        was cancelled)."""
        call, self._open_call = self._open_call, None
        if call is None:
            return []
        cut = next((cut for cut in c.cut_calls if cut.id == call.id), None)
        if cut is not None:   # (sent whole: the stream read the call as far as it was written)
            return self._call_done(cut, "incomplete" if cut.incomplete else "completed")
        whole = next((final for final in c.tool_calls if final.id == call.id), None)
        if whole is None:
            return self._call_done(call, "incomplete" if ended else "completed")
        index = self._call_index(call)
        return [self._event("response.function_call_arguments.delta", item_id=f"fc_{call.id}", output_index=index,
                            delta=piece) for piece in argument_fragments(whole.arguments[len(call.arguments):])] + \
            self._call_done(whole, "completed")

    def calls(self, c: ChoiceState, deltas: list[CallDelta]) -> list[str]:
        """Events of calls as they are written: a call's item when it opens (the reasoning,
        the message and the call before it are complete then), then each piece of its arguments."""
        events = []
        for delta in deltas:
            call = delta.call
            if delta.opened:
                events += self._close_reasoning() + self._close_message(c, "completed") + \
                    self._close_calls(c, ended=False)
                self._open_call = call
                events.append(self._event("response.output_item.added", output_index=self._call_index(call),
                                          item=self._call_item(call, "in_progress", arguments="")))
            if delta.arguments:
                events.append(self._event("response.function_call_arguments.delta", item_id=f"fc_{call.id}",
                                          output_index=self._call_index(call), delta=delta.arguments))
        return events

    def finish(self, c: ChoiceState) -> list[str]:
        status, _ = self._outcome(c)
        item_status = "incomplete" if status == "incomplete" else "completed"
        events = self._close_reasoning() + self._close_calls(c, ended=True)
        if not self._message_open and not (c.tool_calls or c.cut_calls):
            events += self._open_message(c)   # an empty answer still has its message
        if self._held_logprobs and self._message_open and not self._message_done:   # (tokens with no text: EOS)
            records, self._held_logprobs = self._held_logprobs, []
            events.append(self._text_delta("", records))
        events += self._close_message(c, item_status)
        for call in c.tool_calls:   # the calls not streamed (held to the end of the turn)
            if call.id in self._done_calls:
                continue
            index, item_id = self._call_index(call), f"fc_{call.id}"
            events.append(self._event("response.output_item.added", output_index=index,
                                      item=self._call_item(call, "in_progress", arguments="")))
            events += [self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                   delta=piece) for piece in argument_fragments(call.arguments)]
            events += self._call_done(call, "completed")
        _, later = self._reasoning_parts(c)
        if later:   # (not streamed as it came: the message had started)
            index, item_id = self._announce(), self._later_reasoning_id
            events += [self._event("response.output_item.added", output_index=index,
                                   item={"type": "reasoning", "id": item_id, "summary": [], "content": []}),
                       self._event("response.reasoning_text.delta", item_id=item_id, output_index=index,
                                   content_index=0, delta=later), *self._reasoning_done(index, later, later=True)]
        return events

    def end(self, choices: list[ChoiceState]) -> list[str]:
        response = self.full(choices)
        self.keep(choices, response)
        # (The API has no event for a cancelled response: one aborted in the engine ends as incomplete ones do.)
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(response["status"],
                                                                                    "response.incomplete")
        return [self._event(kind, response=response)]

    def error(self, error: APIError | Exception) -> list[str]:
        if not isinstance(error, APIError):
            error = APIError(500, f"generation failed: {type(error).__name__}: {error}")
        error = responses_error(error)
        failed = self._object("failed", [])
        failed["error"] = {"code": error.code or error.type, "message": error.message}
        self.final = failed
        if self.background and self.store is not None:   # (polled: the failure must be there to read)
            self._store(self.added, failed)
        return [self._event("error", code=error.code or error.type, message=error.message, param=error.param),
                self._event("response.failed", response=failed)]
