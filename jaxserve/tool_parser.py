"""Tool-call parsers: watch generated text, fire when a complete call is emitted.

Pluggable by name; ``hermes`` (also used by Qwen) parses
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str   # JSON text of the arguments object
    raw: str         # the call as emitted, markup included


class HermesToolParser:
    """Fires once per complete ``<tool_call>…</tool_call>``; a malformed body is
    reported as a call named ``""`` carrying the raw text (the engine answers it
    with an error so the model can continue)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self) -> None:
        self._text = ""
        self._scan = 0   # where to look for the next start tag

    def feed(self, delta: str) -> ParsedToolCall | None:
        self._text += delta
        start = self._text.find(self.start_tag, self._scan)
        if start == -1:
            self._scan = max(self._scan, len(self._text) - len(self.start_tag) + 1)
            return None
        end = self._text.find(self.end_tag, start)
        if end == -1:
            return None
        raw = self._text[start:end + len(self.end_tag)]
        self._scan = end + len(self.end_tag)
        body = self._text[start + len(self.start_tag):end].strip()
        try:
            obj = json.loads(body)
            name = obj["name"]
            args = obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, (dict, str)):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return ParsedToolCall(name="", arguments=body, raw=raw)
        return ParsedToolCall(name=name, arguments=args if isinstance(args, str) else json.dumps(args), raw=raw)


TOOL_PARSERS: dict[str, type] = {"hermes": HermesToolParser, "qwen": HermesToolParser}


def make_tool_parser(name: str):
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; available: {', '.join(sorted(TOOL_PARSERS))}") from None
