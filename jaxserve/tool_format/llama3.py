"""Llama 3.x JSON format: a turn that is a bare JSON object
``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``) is a
call; results as an ``ipython`` turn."""

from __future__ import annotations

import json

from jaxserve.tool_format.base import (CHATML_START, JsonMarkupFilter, ParsedToolCall, ToolFormat, call_from_json,
                                       chatml_tool_turn, json_extent, tool_list_json)

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser:
    """A JSON object that opens a turn (first non-space text, or right after
    ``<|python_tag|>``) fires when it closes: a call if it has ``name`` and
    ``parameters``/``arguments``; a ``<|python_tag|>`` body that is not a call is
    a malformed call; bare JSON that is not a call is plain content."""

    def __init__(self) -> None:
        self._text = ""
        self._turn = 0       # where the current turn's text starts
        self._done = False   # this turn has been decided (content, or a call already fired)

    def feed(self, delta: str) -> ParsedToolCall | None:
        self._text += delta
        tag = self._text.find(PYTHON_TAG, self._turn)
        if tag != -1:
            start, tagged = tag + len(PYTHON_TAG), True
        elif self._done:
            return None
        else:
            start, tagged = self._turn, False
        end = json_extent(self._text, start)
        if end is None:
            return None
        if end == -1:
            self._done = not tagged
            if tagged:
                self._turn = start
            return None
        body = self._text[start:end].strip()
        raw = self._text[tag if tagged else start:end]
        self._turn = end
        try:
            call = call_from_json(json.loads(body), raw, ("parameters", "arguments"))
        except ValueError:
            call = ParsedToolCall("", body, raw)
        if call.name or tagged:
            self._done = False   # the result opens a new turn
            return call if call.name else ParsedToolCall("", body, raw)
        self._done = True
        return None


class Llama3Format(ToolFormat):
    name = "llama3_json"
    template_markers = (PYTHON_TAG, "ipython")

    def parser(self) -> Llama3Parser:
        return Llama3Parser()

    def markup_filter(self) -> JsonMarkupFilter:
        return JsonMarkupFilter(PYTHON_TAG, bare_at_turn_start=True)

    def wrap_result(self, text: str, chat_template: str | None) -> str:
        if CHATML_START in (chat_template or ""):
            return chatml_tool_turn(text)
        return (f"<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n{text}<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")

    def render_call(self, name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": {arguments or "{}"}}}'

    def system_prompt(self, tools: list[dict]) -> str:
        return ("You have access to the following functions. To call a function, respond with only a JSON "
                'object of the form {"name": function name, "parameters": dictionary of argument name and its '
                f"value}}. Do not use variables.\n\n{tool_list_json(tools)}")
