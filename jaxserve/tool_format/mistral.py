"""Mistral format: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``; results as
``[TOOL_RESULTS]{"content": ...}[/TOOL_RESULTS]``.

One call per pause: when the array holds several calls the first one runs
(parallel calls in one turn are not supported by the engine's pause model).
"""

from __future__ import annotations

import json

from jaxserve.tool_format.base import (CHATML_START, JsonMarkupFilter, ParsedToolCall, ToolFormat, call_from_json,
                                       chatml_tool_turn, json_extent, tool_list_json)

TOOL_CALLS = "[TOOL_CALLS]"


class MistralParser:
    """Fires when the JSON after ``[TOOL_CALLS]`` closes: the first call of the
    array (or the single object); anything else is a malformed call."""

    def __init__(self) -> None:
        self._text = ""
        self._scan = 0

    def feed(self, delta: str) -> ParsedToolCall | None:
        self._text += delta
        at = self._text.find(TOOL_CALLS, self._scan)
        if at == -1:
            self._scan = max(self._scan, len(self._text) - len(TOOL_CALLS) + 1)
            return None
        start = at + len(TOOL_CALLS)
        end = json_extent(self._text, start)
        if end is None:
            return None
        if end == -1:
            self._scan = start
            return ParsedToolCall("", self._text[start:], self._text[at:])
        self._scan = end
        raw, body = self._text[at:end], self._text[start:end].strip()
        try:
            obj = json.loads(body)
        except ValueError:
            return ParsedToolCall("", body, raw)
        first = obj[0] if isinstance(obj, list) and obj else obj
        call = call_from_json(first, raw, ("arguments",))
        return call if call.name else ParsedToolCall("", body, raw)


class MistralFormat(ToolFormat):
    name = "mistral"
    template_markers = (TOOL_CALLS,)

    def parser(self) -> MistralParser:
        return MistralParser()

    def markup_filter(self) -> JsonMarkupFilter:
        return JsonMarkupFilter(TOOL_CALLS)

    def wrap_result(self, text: str, chat_template: str | None) -> str:
        if CHATML_START in (chat_template or ""):
            return chatml_tool_turn(text)
        return f"[TOOL_RESULTS]{json.dumps({'content': text})}[/TOOL_RESULTS]"

    def render_call(self, name: str, arguments: str) -> str:
        return f'{TOOL_CALLS}[{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}]'

    def system_prompt(self, tools: list[dict]) -> str:
        return ("You can call these functions:\n"
                f"{tool_list_json(tools)}\n"
                f'To call one, answer with {TOOL_CALLS} followed by a JSON list: '
                f'{TOOL_CALLS}[{{"name": <function-name>, "arguments": <args-json-object>}}]')
