"""What every tool-call format shares: the parsed call, a JSON-extent scanner,
the two streaming helpers (call parser, markup filter) and the ``ToolFormat``
interface each format module implements.

A format answers five questions about one model family's tool calling:
how calls look in generated text (``parser``), which text to hide from chat
clients while it streams (``markup_filter``), how the tools' results go back
into the context (``wrap_results``), which grammar forces a turn of calls
(``forced_call_grammar``), where a call may open after text (``call_opener``)
and which text holds none (``call_starts``), and, for chat templates that know nothing about
tools, how to describe the tools and past calls in plain messages
(``system_prompt``, ``render_calls``).

Several calls in one turn (OpenAI ``parallel_tool_calls``): Hermes writes one
``<tool_call>`` block after another, Llama 3 JSON and Mistral a JSON list of
call objects. A parser returns every call a delta completes; the results of
one turn's calls are wrapped together, in call order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from jaxserve.tool_format.call_stream import CallStream

CHATML_START = "<|im_start|>"


@dataclass(frozen=True)
class ParsedToolCall:
    """One call found in generated text. ``name == ""`` marks a malformed call
    (``arguments`` then holds the raw body; the engine answers it with an error)."""

    name: str
    arguments: str   # JSON text of the arguments object
    raw: str         # the call as emitted, markup included


def json_extent(text: str, start: int) -> int | None:
    """End index (exclusive) of the JSON object or array opening at ``text[start]``
    (after whitespace), or ``None`` while it is still incomplete. Brackets inside
    strings are ignored. A text that does not open with ``{``/``[`` there: ``-1``."""
    i = start
    while i < len(text) and text[i].isspace():
        i += 1
    if i == len(text):
        return None
    if text[i] not in "{[":
        return -1
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def call_from_json(obj, raw: str, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedToolCall:
    """``{"name": str, "arguments"|"parameters": object|str}`` -> a call; anything else: a malformed call."""
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]:
        args = next((obj[k] for k in args_keys if k in obj), {})
        if isinstance(args, (dict, str)):
            # (non-ASCII as written, not \u-escaped: a follow-up re-renders the call from these arguments)
            return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                                  raw)
    return ParsedToolCall("", raw, raw)


def calls_from_json(obj, raw: str, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[ParsedToolCall]:
    """A call object, or a non-empty list of them (several calls in one turn), -> its calls in
    order; anything else (an empty list included) -> one malformed call."""
    if isinstance(obj, list):
        return [call_from_json(item, raw, args_keys) for item in obj] if obj else [ParsedToolCall("", raw, raw)]
    return [call_from_json(obj, raw, args_keys)]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``. Only
    prefixes ending in ``text``'s last character are tried (a 1,024-character stop string
    costs a few comparisons per step, not half a million)."""
    if not text:
        return 0
    last = text[-1]
    end = tag.rfind(last, 0, min(len(tag) - 1, len(text)))
    while end != -1:
        if text.endswith(tag[:end + 1]):
            return end + 1
        end = tag.rfind(last, 0, end)
    return 0


class TaggedMarkupFilter:
    """Hide ``start … end`` spans from streamed text. Text that could be the
    start of ``start`` is held back until decided; whitespace between two spans
    (parallel calls) is hidden with them. A span the text ends inside, never
    closed, was no call (the model quoted the tag) or was cut by ``max_tokens``:
    ``flush`` gives it back as written, and the caller shows it or reads it as a
    cut call (``spans`` then holds it without the start of an end tag it was cut in)."""

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self._pending = ""
        self._inside = False
        self._after_span = False   # a span just ended: whitespace up to the next one is hidden
        self.spans: list[str] = []   # each span's text between the tags (the last growing while open)

    def feed(self, delta: str) -> str:
        """Next text delta in -> the part a chat client may see now."""
        self._pending += delta
        out = []
        while self._pending:
            if self._inside:
                end = self._pending.find(self.end)
                if end == -1:
                    cut = max(0, len(self._pending) - (len(self.end) - 1))   # (the rest could start the end tag)
                    self.spans[-1] += self._pending[:cut]
                    self._pending = self._pending[cut:]
                    break
                self.spans[-1] += self._pending[:end]
                self._pending = self._pending[end + len(self.end):]
                self._inside, self._after_span = False, True
                continue
            if self._after_span:
                rest = self._pending.lstrip()
                if self.start.startswith(rest):   # only whitespace, or the start of a tag, so far
                    break
                self._after_span = False
                if rest.startswith(self.start):
                    self._pending = rest
            start = self._pending.find(self.start)
            if start != -1:
                out.append(self._pending[:start])
                self._pending = self._pending[start + len(self.start):]
                self._inside = True
                self.spans.append("")
                continue
            hold = partial_suffix(self._pending, self.start)
            out.append(self._pending[:len(self._pending) - hold])
            self._pending = self._pending[len(self._pending) - hold:]
            break
        return "".join(out)

    @property
    def in_call(self) -> bool:
        """The text so far ends inside a span (a call being written)."""
        return self._inside

    def flush(self) -> str:
        """At the end of the text: release held-back text that never became a tag, and
        a span never closed (it was no call unless the text ends inside its end tag; its
        held-back end joins ``spans``, all but the start of the end tag the text was cut
        in, so a call whose close was cut reads as the complete call it is). After the
        last closed span, what is held stays hidden: whitespace, or the start of a tag the
        turn was cut in (a token such as ``><`` ends one call and starts the next). A span
        whose JSON is still open keeps that text: it was cut inside the call (a ``<`` in a
        string of its arguments), not inside its end tag."""
        if self._inside:
            closing = len(self._pending) - partial_suffix(self._pending, self.end)
            if json_extent(self.spans[-1] + self._pending[:closing], 0) is None:
                closing = len(self._pending)   # (its JSON is not complete: no end tag was begun)
            self.spans[-1] += self._pending[:closing]
            text = self.start + self.spans[-1] + self._pending[closing:]
        else:
            text = "" if self._after_span else self._pending
        self._pending, self._inside = "", False
        return text


class JsonMarkupFilter:
    """Hide ``marker`` + the JSON value after it (Mistral ``[TOOL_CALLS][…]``,
    Llama 3 ``<|python_tag|>{…}``). With ``bare_at_turn_start`` a JSON object or
    list that opens a turn is held back too and hidden if it is a call or a list of
    calls (Llama 3 writes its calls as bare JSON, arguments under ``args_keys``,
    tried in order as the parser does); JSON that is not is released.

    What is hidden is what the format's parser reports as a call. A span the text
    ends inside, its JSON never closed, was no call (the model ran out of tokens, or
    the brackets never balanced): it is shown at the end, as written, marker included.
    A marker not followed by JSON is hidden when the parser reports it as a malformed
    call (``marker_alone_is_call``, Mistral) and shown when it reports nothing (Llama 3)."""

    def __init__(self, marker: str, bare_at_turn_start: bool = False, marker_alone_is_call: bool = True,
                 args_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self.marker = marker
        self.bare = bare_at_turn_start
        self.marker_alone_is_call = marker_alone_is_call
        self.args_keys = args_keys
        self._pending = ""
        self._at_turn_start = bare_at_turn_start
        self._in_json = False     # _pending starts with the JSON of a span being decided
        self._bare_span = False   # that span opened a turn without a marker
        self._marker_held = ""    # the marker of that span, held back with it ("" for a bare span)
        self.spans: list[str] = []   # each span's text after its marker (the last growing while open)

    def feed(self, delta: str) -> str:
        """Next text delta in -> the part a chat client may see now."""
        self._pending += delta
        out = []
        while self._pending:
            if self._in_json:
                end = json_extent(self._pending, 0)
                if end is None:          # the JSON may still close (a call) or never (no call): hold it
                    self.spans[-1] = self._pending
                    break
                self._in_json, marker, self._marker_held = False, self._marker_held, ""
                if end == -1:            # a marker not followed by JSON: the text after it is released
                    if not self.marker_alone_is_call:
                        out.append(marker)
                    continue
                body, self._pending = self._pending[:end], self._pending[end:]
                self.spans[-1] = body
                if self._bare_span and not self._is_call_json(body):
                    out.append(body)     # plain JSON content, not a call
                else:
                    self._at_turn_start = self.bare   # the call's result opens a new turn
                continue
            if self._at_turn_start:
                stripped = self._pending.lstrip()
                if not stripped:
                    break
                self._at_turn_start = False
                if stripped[0] in "{[":
                    out.append(self._pending[:len(self._pending) - len(stripped)])
                    self._pending, self._in_json, self._bare_span = stripped, True, True
                    self.spans.append("")
                    continue
            at = self._pending.find(self.marker)
            if at != -1:
                out.append(self._pending[:at])
                self._pending = self._pending[at + len(self.marker):]
                self._in_json, self._bare_span, self._marker_held = True, False, self.marker
                self.spans.append("")
                continue
            hold = partial_suffix(self._pending, self.marker)
            out.append(self._pending[:len(self._pending) - hold])
            self._pending = self._pending[len(self._pending) - hold:]
            break
        return "".join(out)

    @property
    def in_call(self) -> bool:
        """The text so far ends inside a span (a call's JSON being written)."""
        return self._in_json

    def flush(self) -> str:
        """At the end of the text: release everything held. A call's JSON that never closed
        was no call (the parser reports none), so it is shown as written, its marker included;
        otherwise what is held is whitespace at a turn start, or the start of a marker."""
        text = self._marker_held + self._pending
        self._pending, self._marker_held, self._in_json, self._bare_span = "", "", False, False
        return text

    def _is_call_json(self, body: str) -> bool:
        try:
            return all(call.name for call in calls_from_json(json.loads(body), body, self.args_keys))
        except ValueError:
            return False


def chatml_tool_turns(texts: list[str]) -> str:
    """Close the assistant turn, add one ChatML ``tool`` turn per result, reopen the assistant turn."""
    turns = "".join(f"<|im_start|>tool\n{text}<|im_end|>\n" for text in texts)
    return f"<|im_end|>\n{turns}<|im_start|>assistant\n"


class ToolFormat:
    """Interface of one tool-call format (one module per format implements it).

    ``template_markers``: substrings of a chat template that show the template
    was written for this format (used by detection).
    """

    name: str = ""
    template_markers: tuple[str, ...] = ()
    args_key: str = "arguments"   # the key of a call object's arguments
    # The markup that opens a turn's calls, which may follow text (Hermes, Mistral);
    # None: calls can only open a turn (Llama 3's bare JSON).
    call_opener: str | None = None
    # Rust regexes (whole text, llguidance's dialect) of the texts in which the parser may
    # find a call: text that matches none of them holds no call.
    call_starts: tuple[str, ...] = ()
    # The keys the parser reads a call's arguments from, in its order, and whether a turn's
    # calls may come as one JSON list (both for ``call_stream``).
    call_args_keys: tuple[str, ...] = ("arguments",)
    calls_as_list: bool = True

    def parser(self):
        """A fresh per-request parser: ``feed(delta) -> list[ParsedToolCall]``, the calls
        this delta completed (each call once, in order; usually none)."""
        raise NotImplementedError

    def forced_call_grammar(self, call: str, parallel: bool, markup: Callable[[str], str],
                            opener: str | None = None) -> str:
        """The lark ``start`` rule (llguidance dialect) of an assistant turn that is nothing
        but calls: ``call`` names the rule of one call object ``{"name": ..., args_key: ...}``;
        ``parallel``: one or more calls, else exactly one. ``markup(text)`` renders fixed
        markup as a lark terminal (a special token when the tokenizer has one); ``opener``,
        when given, is written in place of the turn's first ``call_opener`` (a rule that
        lets text come before it). It takes
        what ``render_calls`` writes, separators included, and no other spelling where
        refusing one costs the model nothing: a client's follow-up re-renders the turn, and
        a paused context resumes only if the re-rendered turn spells what the model wrote."""
        raise NotImplementedError

    def turn_ends_with_eos(self, parallel: bool) -> bool:
        """Whether a forced turn of calls is complete only when the model ends its turn (an
        EOS token after the last call, as in Hermes blocks), not when the grammar's text is."""
        return False

    def markup_filter(self):
        """A fresh per-response filter: ``feed(delta) -> visible str``, ``flush() -> str``, and
        ``spans``: the text of each call it hid, after the opening markup."""
        raise NotImplementedError

    def call_stream(self, hidden: frozenset[str] = frozenset()) -> CallStream:
        """A fresh per-response reader of the calls in a markup filter's ``spans`` as they are
        written (``hidden``: server-side tools' names, whose turns are not streamed)."""
        return CallStream(self.call_args_keys, self.calls_as_list, hidden)

    def wrap_results(self, texts: list[str], chat_template: str | None) -> str:
        """Context text that returns the outputs ``texts`` of one turn's calls (in call
        order) to the model mid-generation."""
        raise NotImplementedError

    def result_spans(self, texts: list[str], chat_template: str | None) -> list[tuple[int, int]]:
        """``[start, end)`` of each of ``texts`` as ``wrap_results(texts, chat_template)`` writes it
        (as written: Mistral's results are JSON strings), so the text a tool returned can be told
        from the wrapper's around it. Found by wrapping placeholders: each result's text sits
        where its placeholder does, written as a result alone would be."""
        marks = [f"JAXSERVERESULT{i}PLACE" for i in range(len(texts))]
        skeleton = self.wrap_results(marks, chat_template)
        alone = self.wrap_results(marks[:1], chat_template)   # (a result alone: the wrapper's text around it)
        before = alone.index(marks[0]) if marks else 0
        after = len(alone) - before - len(marks[0]) if marks else 0
        spans, read, at = [], 0, 0
        for mark, text in zip(marks, texts):
            found = skeleton.index(mark, read)
            at += found - read   # (the wrapper's text before this result)
            written = self.wrap_results([text], chat_template)
            length = len(written) - before - after
            spans.append((at, at + length))
            at, read = at + length, found + len(mark)
        return spans

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """Past calls of one turn (``(name, JSON arguments)``) as the model would have written them."""
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        """Tool definitions (OpenAI ``{"type": "function", "function": {...}}``) and
        how to call them, for a system message when the template has no tool support."""
        raise NotImplementedError


def contains(text: str) -> str:
    """A ``call_starts`` regex: any text with ``text`` in it."""
    return f"(?s:.*{regex_literal(text)}.*)"


def regex_literal(text: str) -> str:
    """``text`` as a literal in a Rust regex inside a lark ``/…/`` terminal."""
    return "".join(f"\\{ch}" if ch in "\\.+*?()|[]{}^$#&-~/" else ch for ch in text)


def tool_list_json(tools: list[dict]) -> str:
    """One compact JSON function definition per line."""
    return "\n".join(json.dumps(t.get("function", t), separators=(", ", ": ")) for t in tools)
