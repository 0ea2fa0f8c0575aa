"""Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
results as a ChatML ``tool`` turn (or ``<tool_response>…</tool_response>`` outside ChatML)."""

from __future__ import annotations

import json

from jaxserve.tool_format.base import (CHATML_START, ParsedToolCall, TaggedMarkupFilter, ToolFormat, call_from_json,
                                       chatml_tool_turn, tool_list_json)

START, END = "<tool_call>", "</tool_call>"


class HermesParser:
    """Fires once per complete ``<tool_call>…</tool_call>``; a body that is not a
    call object is a malformed call (``name == ""``)."""

    def __init__(self) -> None:
        self._text = ""
        self._scan = 0   # where to look for the next start tag

    def feed(self, delta: str) -> ParsedToolCall | None:
        self._text += delta
        start = self._text.find(START, self._scan)
        if start == -1:
            self._scan = max(self._scan, len(self._text) - len(START) + 1)
            return None
        end = self._text.find(END, start)
        if end == -1:
            return None
        raw = self._text[start:end + len(END)]
        self._scan = end + len(END)
        body = self._text[start + len(START):end].strip()
        try:
            call = call_from_json(json.loads(body), raw, ("arguments",))
        except ValueError:
            return ParsedToolCall("", body, raw)
        return call if call.name else ParsedToolCall("", body, raw)


class HermesFormat(ToolFormat):
    name = "hermes"
    template_markers = (START,)

    def parser(self) -> HermesParser:
        return HermesParser()

    def markup_filter(self) -> TaggedMarkupFilter:
        return TaggedMarkupFilter(START, END)

    def wrap_result(self, text: str, chat_template: str | None) -> str:
        if CHATML_START in (chat_template or ""):
            return chatml_tool_turn(text)
        return f"<tool_response>{text}</tool_response>"

    def render_call(self, name: str, arguments: str) -> str:
        return f'{START}{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}{END}'

    def system_prompt(self, tools: list[dict]) -> str:
        return ("You may call one or more functions to assist with the user query. The functions are listed "
                f"within <tools></tools>:\n<tools>\n{tool_list_json(tools)}\n</tools>\n"
                "To call a function, write a JSON object with the function name and arguments within "
                f'{START}{END} tags:\n{START}{{"name": <function-name>, "arguments": <args-json-object>}}{END}')
