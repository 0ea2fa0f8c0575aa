"""What every tool-call format shares: the parsed call, a JSON-extent scanner,
the two streaming helpers (call parser, markup filter) and the ``ToolFormat``
interface each format module implements.

A format answers four questions about one model family's tool calling:
how a call looks in generated text (``parser``), which text to hide from chat
clients while it streams (``markup_filter``), how a tool's result goes back
into the context (``wrap_result``), and, for chat templates that know nothing
about tools, how to describe the tools and past calls in plain messages
(``system_prompt``, ``render_call``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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
            return ParsedToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args), raw)
    return ParsedToolCall("", raw, raw)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class TaggedMarkupFilter:
    """Hide ``start … end`` spans from streamed text. Text that could be the
    start of ``start`` is held back until decided; an unterminated span stays hidden."""

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self._pending = ""
        self._inside = False

    def feed(self, delta: str) -> str:
        """Next text delta in -> the part a chat client may see now."""
        self._pending += delta
        out = []
        while self._pending:
            if self._inside:
                end = self._pending.find(self.end)
                if end == -1:
                    self._pending = self._pending[-(len(self.end) - 1):] if len(self.end) > 1 else ""
                    break
                self._pending = self._pending[end + len(self.end):]
                self._inside = False
                continue
            start = self._pending.find(self.start)
            if start != -1:
                out.append(self._pending[:start])
                self._pending = self._pending[start + len(self.start):]
                self._inside = True
                continue
            hold = partial_suffix(self._pending, self.start)
            out.append(self._pending[:len(self._pending) - hold])
            self._pending = self._pending[len(self._pending) - hold:]
            break
        return "".join(out)

    def flush(self) -> str:
        """At the end of the text: release held-back text that never became a tag."""
        text, self._pending = ("" if self._inside else self._pending), ""
        return text


class JsonMarkupFilter:
    """Hide ``marker`` + the JSON value after it (Mistral ``[TOOL_CALLS][…]``,
    Llama 3 ``<|python_tag|>{…}``). With ``bare_at_turn_start`` a JSON object that
    opens a turn is held back too and hidden if it is a call (Llama 3 writes its
    calls as bare JSON); JSON that is not a call is released."""

    def __init__(self, marker: str, bare_at_turn_start: bool = False) -> None:
        self.marker = marker
        self.bare = bare_at_turn_start
        self._pending = ""
        self._at_turn_start = bare_at_turn_start
        self._in_json = False     # _pending starts with the JSON of a span being decided
        self._bare_span = False   # that span opened a turn without a marker

    def feed(self, delta: str) -> str:
        """Next text delta in -> the part a chat client may see now."""
        self._pending += delta
        out = []
        while self._pending:
            if self._in_json:
                end = json_extent(self._pending, 0)
                if end is None:
                    break
                self._in_json = False
                if end == -1:            # a marker not followed by JSON: only the marker is hidden
                    continue
                body, self._pending = self._pending[:end], self._pending[end:]
                if self._bare_span and not _is_call_json(body):
                    out.append(body)     # plain JSON content, not a call
                else:
                    self._at_turn_start = self.bare   # the call's result opens a new turn
                continue
            if self._at_turn_start:
                stripped = self._pending.lstrip()
                if not stripped:
                    break
                self._at_turn_start = False
                if stripped[0] == "{":
                    out.append(self._pending[:len(self._pending) - len(stripped)])
                    self._pending, self._in_json, self._bare_span = stripped, True, True
                    continue
            at = self._pending.find(self.marker)
            if at != -1:
                out.append(self._pending[:at])
                self._pending = self._pending[at + len(self.marker):]
                self._in_json, self._bare_span = True, False
                continue
            hold = partial_suffix(self._pending, self.marker)
            out.append(self._pending[:len(self._pending) - hold])
            self._pending = self._pending[len(self._pending) - hold:]
            break
        return "".join(out)

    def flush(self) -> str:
        """At the end of the text: an unfinished marked call stays hidden, other held text is released."""
        text = "" if self._in_json and not self._bare_span else self._pending
        self._pending, self._in_json = "", False
        return text


def _is_call_json(body: str) -> bool:
    try:
        return call_from_json(json.loads(body), body).name != ""
    except ValueError:
        return False


def chatml_tool_turn(text: str) -> str:
    """Close the assistant turn, add a ChatML ``tool`` turn, reopen the assistant turn."""
    return f"<|im_end|>\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n"


class ToolFormat:
    """Interface of one tool-call format (one module per format implements it).

    ``template_markers``: substrings of a chat template that show the template
    was written for this format (used by detection).
    """

    name: str = ""
    template_markers: tuple[str, ...] = ()

    def parser(self):
        """A fresh per-request parser: ``feed(delta) -> ParsedToolCall | None``,
        firing once per complete call."""
        raise NotImplementedError

    def markup_filter(self):
        """A fresh per-response filter: ``feed(delta) -> visible str``, ``flush() -> str``."""
        raise NotImplementedError

    def wrap_result(self, text: str, chat_template: str | None) -> str:
        """Context text that returns a tool's output ``text`` to the model mid-generation."""
        raise NotImplementedError

    def render_call(self, name: str, arguments: str) -> str:
        """A past call (``arguments``: JSON text) as the model would have written it."""
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        """Tool definitions (OpenAI ``{"type": "function", "function": {...}}``) and
        how to call them, for a system message when the template has no tool support."""
        raise NotImplementedError


def tool_list_json(tools: list[dict]) -> str:
    """One compact JSON function definition per line."""
    return "\n".join(json.dumps(t.get("function", t), separators=(", ", ": ")) for t in tools)
