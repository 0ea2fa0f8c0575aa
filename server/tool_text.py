"""Hide tool-call markup from chat content as text streams in.

The model writes calls as ``<tool_call>{json}</tool_call>`` inside its text;
the engine parses them (and runs server-side tools). Chat clients should see
only the prose: calls reach them as structured ``tool_calls``, never as text.
"""

from __future__ import annotations

START, END = "<tool_call>", "</tool_call>"


class ToolMarkupFilter:
    """Feed text deltas, get back the visible part. Text that could be the start
    of a ``<tool_call>`` tag is held back until it is decided; everything from a
    start tag through its end tag is dropped."""

    def __init__(self) -> None:
        self._pending = ""
        self._inside = False

    def feed(self, delta: str) -> str:
        self._pending += delta
        out = []
        while self._pending:
            if self._inside:
                end = self._pending.find(END)
                if end == -1:
                    # Keep only what could still be the start of the end tag.
                    self._pending = self._pending[-(len(END) - 1):]
                    break
                self._pending = self._pending[end + len(END):]
                self._inside = False
                continue
            start = self._pending.find(START)
            if start != -1:
                out.append(self._pending[:start])
                self._pending = self._pending[start + len(START):]
                self._inside = True
                continue
            hold = _partial_suffix(self._pending, START)
            out.append(self._pending[:len(self._pending) - hold])
            self._pending = self._pending[len(self._pending) - hold:]
            break
        return "".join(out)

    def flush(self) -> str:
        """At the end of the text: release held-back text that never became a tag
        (an unterminated call stays hidden)."""
        text, self._pending = ("" if self._inside else self._pending), ""
        return text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
