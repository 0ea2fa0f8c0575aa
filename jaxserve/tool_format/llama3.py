"""Llama 3.x JSON format: a turn that is a bare JSON object
``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``) is a
call, a JSON list of such objects is several calls in one turn; results as
``ipython`` turns."""

from __future__ import annotations

import json
from typing import Callable

from jaxserve.tool_format.base import (CHATML_START, JsonMarkupFilter, ParsedToolCall, ToolFormat, calls_from_json,
                                       chatml_tool_turns, contains, json_extent, tool_list_json)

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser:
    """A JSON object or list that opens a turn (first non-space text, or right after
    ``<|python_tag|>``) is returned when it closes: its calls if it is a call object
    with ``name`` and ``parameters``/``arguments`` or a list of them; a
    ``<|python_tag|>`` body that is not is a malformed call; bare JSON that is not
    a call is plain content."""

    def __init__(self) -> None:
        self._text = ""
        self._turn = 0       # where the current turn's text starts
        self._done = False   # this turn has been decided (content, or its calls already returned)

    def feed(self, delta: str) -> list[ParsedToolCall]:
        self._text += delta
        tag = self._text.find(PYTHON_TAG, self._turn)
        if tag != -1:
            start, tagged = tag + len(PYTHON_TAG), True
        elif self._done:
            return []
        else:
            start, tagged = self._turn, False
        end = json_extent(self._text, start)
        if end is None:
            return []
        if end == -1:
            self._done = not tagged
            if tagged:
                self._turn = start
            return []
        body = self._text[start:end].strip()
        raw = self._text[tag if tagged else start:end]
        self._turn = end
        try:
            calls = calls_from_json(json.loads(body), raw, ("parameters", "arguments"))
        except ValueError:
            calls = [ParsedToolCall("", body, raw)]
        if all(call.name for call in calls):
            self._done = False   # the result opens a new turn
            return calls
        if tagged:
            self._done = False
            return [ParsedToolCall("", body, raw)]
        self._done = True
        return []


class Llama3Format(ToolFormat):
    name = "llama3_json"
    template_markers = (PYTHON_TAG, "ipython")
    args_key = "parameters"
    call_args_keys = ("parameters", "arguments")
    # JSON opening the turn (after what ``str.isspace`` skips, as ``json_extent`` does: Unicode's spaces
    # and the separators \x1c-\x1f), or the tag anywhere
    call_starts = (r"(?s:[\s\x1c-\x1f]*[\[{].*)", contains(PYTHON_TAG))

    def parser(self) -> Llama3Parser:
        return Llama3Parser()

    def forced_call_grammar(self, call: str, parallel: bool, markup: Callable[[str], str],
                            opener: str | None = None) -> str:
        # (a list of one call is allowed, though ``render_calls`` writes one call bare: refusing it would make
        # a model that opened "[" invent a second call; such a turn's follow-up is served from the prefix cache)
        return f'start: {call} | "[" {call} (", " {call})* "]"' if parallel else f"start: {call}"

    def markup_filter(self) -> JsonMarkupFilter:
        # (arguments looked up as the parser does; a tag not followed by JSON is no call to the parser: shown)
        return JsonMarkupFilter(PYTHON_TAG, bare_at_turn_start=True, marker_alone_is_call=False,
                                args_keys=self.call_args_keys)

    def wrap_results(self, texts: list[str], chat_template: str | None) -> str:
        if CHATML_START in (chat_template or ""):
            return chatml_tool_turns(texts)
        turns = "".join(f"<|start_header_id|>ipython<|end_header_id|>\n\n{text}<|eot_id|>" for text in texts)
        return f"<|eot_id|>{turns}<|start_header_id|>assistant<|end_header_id|>\n\n"

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        objects = [f'{{"name": {json.dumps(name)}, "parameters": {arguments or "{}"}}}' for name, arguments in calls]
        return objects[0] if len(objects) == 1 else f"[{', '.join(objects)}]"

    def system_prompt(self, tools: list[dict]) -> str:
        return ("You have access to the following functions. To call a function, respond with only a JSON "
                'object of the form {"name": function name, "parameters": dictionary of argument name and its '
                "value}; to call several at once, a JSON list of such objects. Do not use variables.\n\n"
                f"{tool_list_json(tools)}")
