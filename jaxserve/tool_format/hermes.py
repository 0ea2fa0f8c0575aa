"""Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
one block per call (several blocks in one turn are parallel calls); results as
ChatML ``tool`` turns (or ``<tool_response>…</tool_response>`` outside ChatML)."""

from __future__ import annotations

import json
from typing import Callable

from jaxserve.tool_format.base import (CHATML_START, ParsedToolCall, TaggedMarkupFilter, ToolFormat, call_from_json,
                                       chatml_tool_turns, contains, tool_list_json)

START, END = "<tool_call>", "</tool_call>"


class HermesParser:
    """Returns each complete ``<tool_call>…</tool_call>`` once; a body that is not a
    call object is a malformed call (``name == ""``)."""

    def __init__(self) -> None:
        self._text = ""
        self._scan = 0   # where to look for the next start tag

    def feed(self, delta: str) -> list[ParsedToolCall]:
        self._text += delta
        calls = []
        while True:
            start = self._text.find(START, self._scan)
            if start == -1:
                self._scan = max(self._scan, len(self._text) - len(START) + 1)
                return calls
            end = self._text.find(END, start)
            if end == -1:
                return calls
            raw = self._text[start:end + len(END)]
            self._scan = end + len(END)
            body = self._text[start + len(START):end].strip()
            try:
                call = call_from_json(json.loads(body), raw, ("arguments",))
            except ValueError:
                call = ParsedToolCall("", body, raw)
            calls.append(call if call.name else ParsedToolCall("", body, raw))


class HermesFormat(ToolFormat):
    name = "hermes"
    template_markers = (START,)
    call_opener = START
    call_starts = (contains(START),)
    calls_as_list = False

    def parser(self) -> HermesParser:
        return HermesParser()

    def forced_call_grammar(self, call: str, parallel: bool, markup: Callable[[str], str],
                            opener: str | None = None) -> str:
        block = f"{markup(START)} {call} {markup(END)}"
        first = f"{opener or markup(START)} {call} {markup(END)}"
        # blocks one line apart, exactly as ``render_calls`` writes them back (a follow-up re-renders the turn)
        return f'start: {first} ("\\n" {block})*' if parallel else f"start: {first}"

    def turn_ends_with_eos(self, parallel: bool) -> bool:
        return parallel   # after a block the model either opens another one or ends its turn

    def markup_filter(self) -> TaggedMarkupFilter:
        return TaggedMarkupFilter(START, END)

    def wrap_results(self, texts: list[str], chat_template: str | None) -> str:
        if CHATML_START in (chat_template or ""):
            return chatml_tool_turns(texts)
        return "".join(f"<tool_response>{text}</tool_response>" for text in texts)

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f'{START}{{"name": {json.dumps(name)}, "arguments": {arguments or "{}"}}}{END}'
                         for name, arguments in calls)

    def system_prompt(self, tools: list[dict]) -> str:
        return ("You may call one or more functions to assist with the user query. The functions are listed "
                f"within <tools></tools>:\n<tools>\n{tool_list_json(tools)}\n</tools>\n"
                "To call a function, write a JSON object with the function name and arguments within "
                f'{START}{END} tags:\n{START}{{"name": <function-name>, "arguments": <args-json-object>}}{END}')
