"""Mistral format: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, …]`` (every
call of the turn in one list); results as ``[TOOL_RESULTS]{"content": ...}[/TOOL_RESULTS]``
each, in call order."""

from __future__ import annotations

import json
from typing import Callable

from jaxserve.tool_format.base import (CHATML_START, JsonMarkupFilter, ParsedToolCall, ToolFormat, calls_from_json,
                                       chatml_tool_turns, contains, json_extent, tool_list_json)

TOOL_CALLS = "[TOOL_CALLS]"


class MistralParser:
    """Returns the calls of the JSON list (or single object) after ``[TOOL_CALLS]``
    when it closes; a body that is not calls is one malformed call."""

    def __init__(self) -> None:
        self._text = ""
        self._scan = 0

    def feed(self, delta: str) -> list[ParsedToolCall]:
        self._text += delta
        at = self._text.find(TOOL_CALLS, self._scan)
        if at == -1:
            self._scan = max(self._scan, len(self._text) - len(TOOL_CALLS) + 1)
            return []
        start = at + len(TOOL_CALLS)
        end = json_extent(self._text, start)
        if end is None:
            return []
        if end == -1:
            self._scan = start
            return [ParsedToolCall("", self._text[start:], self._text[at:])]
        self._scan = end
        raw, body = self._text[at:end], self._text[start:end].strip()
        try:
            calls = calls_from_json(json.loads(body), raw, ("arguments",))
        except ValueError:
            return [ParsedToolCall("", body, raw)]
        return [call if call.name else ParsedToolCall("", body, raw) for call in calls]


class MistralFormat(ToolFormat):
    name = "mistral"
    template_markers = (TOOL_CALLS,)
    call_opener = TOOL_CALLS
    call_starts = (contains(TOOL_CALLS),)

    def parser(self) -> MistralParser:
        return MistralParser()

    def forced_call_grammar(self, call: str, parallel: bool, markup: Callable[[str], str],
                            opener: str | None = None) -> str:
        more = f' (", " {call})*' if parallel else ""
        return f'start: {opener or markup(TOOL_CALLS)} "[" {call}{more} "]"'

    def markup_filter(self) -> JsonMarkupFilter:
        return JsonMarkupFilter(TOOL_CALLS)

    def wrap_results(self, texts: list[str], chat_template: str | None) -> str:
        if CHATML_START in (chat_template or ""):
            return chatml_tool_turns(texts)
        return "".join(f"[TOOL_RESULTS]{json.dumps({'content': text})}[/TOOL_RESULTS]" for text in texts)

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        objects = ", ".join(f'{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}'
                            for name, arguments in calls)
        return f"{TOOL_CALLS}[{objects}]"

    def system_prompt(self, tools: list[dict]) -> str:
        return ("You can call these functions:\n"
                f"{tool_list_json(tools)}\n"
                f'To call one or more, answer with {TOOL_CALLS} followed by a JSON list: '
                f'{TOOL_CALLS}[{{"name": <function-name>, "arguments": <args-json-object>}}]')
