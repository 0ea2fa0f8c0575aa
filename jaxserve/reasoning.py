"""Reasoning ("thinking") text split from the answer, as vLLM's ``--reasoning-parser``.

Reasoning models write their thinking between tags before the answer:
Qwen3 starts a turn with ``<think>`` when it thinks (its template's
``enable_thinking: false`` writes an empty block into the prompt instead,
and the turn is then all answer); DeepSeek-R1 and QwQ's templates end the
prompt with ``<think>``, so a turn starts inside the reasoning. The engine
checks a request's prompt and a client's resumed context for that (the
``deepseek_r1`` format also assumes it for a request's first turn); the tool
results the engine wraps itself never write ``<think>``, so the turn after
them starts outside. Either way ``</think>`` ends it.

``ReasoningSplit`` follows one request's generated text (the detokenizer's,
growing; ``scan`` after each token) and classifies it into reasoning and
answer ("content"), turn by turn (``new_turn`` after a pause on tool calls:
the next assistant turn may think again). The tags themselves, the newlines
just inside them and those between ``</think>`` and the answer belong to
neither (as Qwen3's template writes them back: ``<think>\\n`` reasoning
``\\n</think>\\n\\n`` answer); the turns' reasoning is joined by a blank
line. A stream must not show text that may still
turn out to be a tag: ``reasoning(upto)`` and ``content(upto)`` hold back a
tail that could start one (and trailing newlines of reasoning that could sit
before ``</think>``) unless the text is final.

Pure Python over strings; the engine calls it (``LLMEngine.on_event`` feeds
the tool-call parser only the answer, so markup inside the reasoning is
never parsed as a call).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.tool_format.base import partial_suffix

_REASONING, _CONTENT = "reasoning", "content"
REASONING_TURN_SEPARATOR = "\n\n"   # between the reasoning of successive turns


@dataclass(frozen=True)
class ReasoningFormat:
    """``start``/``end``: the tags around the reasoning; ``opens_inside``: a request's
    first turn starts inside the reasoning even when its prompt does not end with
    ``start`` (otherwise a turn thinks when its text starts with ``start``, or its
    context ended with it)."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    opens_inside: bool = False


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", opens_inside=True),
}


def get_reasoning_format(name: str) -> ReasoningFormat:
    """The format called ``name``; an unknown name is a ``ValueError`` naming the known ones."""
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_FORMATS)}") from None


@dataclass(slots=True)
class _Span:
    """Text ``[start, end)`` of one kind (``end`` None: open). ``skipping``: the
    newlines that follow a tag are still being passed over (``start`` moves past
    them until other text comes)."""

    kind: str
    start: int
    end: int | None = None
    skipping: bool = False


class ReasoningSplit:
    """One request's text classified into reasoning and content (see module doc).
    Text between spans (tags, the newlines around them, a turn's undecided start)
    is in neither. ``opens_inside``: the first turn starts inside the reasoning
    (its prompt ends with the start tag; always for formats that say so)."""

    def __init__(self, fmt: ReasoningFormat, opens_inside: bool = False) -> None:
        self.fmt = fmt
        self.spans: list[_Span] = []
        self._turn = 0            # where the current turn's text starts
        self._inside = opens_inside or fmt.opens_inside   # the current turn starts inside the reasoning
        self._decided = False     # whether the current turn's first span is known
        self._scanned = 0         # text length seen by ``scan``
        self._fed = 0             # text up to here was handed out by ``take_content``
        self.reasoning_tokens = 0   # tokens of reasoning (tags included) since the count was last reset
        self._pending = 0           # tokens of the current turn before it was decided

    def new_turn(self, at: int) -> None:
        """A new assistant turn starts at text offset ``at`` (after a pause on tool calls),
        outside the reasoning unless ``reopen_inside`` says otherwise before its first token."""
        if self.spans and self.spans[-1].end is None:
            self.spans[-1].end = at
        self._turn, self._inside, self._decided, self._pending = at, False, False, 0

    @property
    def in_answer(self) -> bool:
        """Whether the text so far ends in the answer: the current turn is decided and its
        reasoning, if any, has ended."""
        return self._decided and self.spans[-1].kind == _CONTENT

    def answer_text(self, text: str) -> str:
        """The current turn's answer in ``text`` so far ("" before it, or while only the
        newlines it skips follow the end tag)."""
        span = self.spans[-1] if self.in_answer else None
        return "" if span is None or span.skipping else text[span.start:]

    def new_continuation(self) -> None:
        """The request resumes with a fresh token budget (a new response): count its
        reasoning tokens from 0, as its tokens are."""
        self.reasoning_tokens = 0

    def reopen_inside(self) -> None:
        """The current turn, not begun yet, starts inside the reasoning (its prompt wrote the start tag)."""
        if not self._decided:
            self._inside = True

    def on_token(self, text: str) -> None:
        """One more generated token, after which the request's text is ``text``: ``scan``
        it and count the token as reasoning when it falls in the reasoning (its start or
        end tag included; a turn's first tokens once the turn is decided)."""
        span = self.spans[-1] if self._decided else None
        inside = span is not None and span.kind == _REASONING and span.end is None
        decided, first = self._decided, len(self.spans)   # (the turn's first span, once it opens)
        self.scan(text)
        if decided:
            self.reasoning_tokens += inside
        elif self._decided:   # this token decided the turn: it and the turn's tokens before it
            self.reasoning_tokens += (self._pending + 1) * (self.spans[first].kind == _REASONING)
            self._pending = 0
        else:
            self._pending += 1

    def scan(self, text: str) -> None:
        """Classify ``text`` (the request's whole generated text so far: it grows, except
        that a stop string may cut its end) as far as it can be."""
        fmt = self.fmt
        seen, self._scanned = self._scanned, len(text)
        if not self._decided:
            rest = text[self._turn:]
            if rest.startswith(fmt.start):
                self._open(_REASONING, self._turn + len(fmt.start), skipping=True)
            elif fmt.start.startswith(rest):
                return   # may still become the start tag: wait for more
            else:
                self._open(_REASONING if self._inside else _CONTENT, self._turn, skipping=self._inside)
        span = self.spans[-1]
        self._skip_newlines(span, text)
        if span.kind == _REASONING and span.end is None and not span.skipping:
            at = text.find(fmt.end, max(span.start, seen - len(fmt.end) + 1))   # (text before was searched)
            if at != -1:
                span.end = at
                self._skip_newlines(self._open(_CONTENT, at + len(fmt.end), skipping=True), text)

    @staticmethod
    def _skip_newlines(span: _Span, text: str) -> None:
        """Pass ``span``'s start over the newlines after its tag, once other text follows them."""
        if span.skipping:
            while span.start < len(text) and text[span.start] == "\n":
                span.start += 1
            span.skipping = span.start >= len(text)

    def finish(self, text: str) -> None:
        """Nothing more comes: a turn still undecided (its text a proper prefix of the
        start tag) is what it opens as."""
        self.scan(text)
        if not self._decided and len(text) > self._turn:
            self._open(_REASONING if self._inside else _CONTENT, self._turn, skipping=False)
            self.reasoning_tokens += self._pending * self._inside
        self._pending = 0

    def _open(self, kind: str, start: int, skipping: bool) -> _Span:
        span = _Span(kind, start, None, skipping)
        self.spans.append(span)
        self._decided = True
        return span

    def _pieces(self, kind: str, text: str, upto: int, final: bool) -> list[str]:
        """The text of ``kind``'s spans shown once ``text[:upto]`` is released, one piece per
        span (so per turn). A stop string may have cut ``text`` short of spans found before."""
        out = []
        tag, n = self.fmt.end, len(text)
        for span in self.spans:
            if span.kind != kind or span.skipping:
                continue
            start, end = span.start, span.end
            if kind == _REASONING and end is not None:
                end = min(end, n)
                while end > start and text[end - 1] == "\n":
                    end -= 1   # the newlines before the end tag
            stop = min(upto, n) if end is None else min(end, upto)
            if kind == _REASONING and end is None and not final:
                stop -= partial_suffix(text[max(start, stop - len(tag)):stop], tag)   # a tail that may start
                while stop > start and text[stop - 1] == "\n":                        # the end tag, and newlines
                    stop -= 1                                                          # that may come before it
            if stop > start:
                out.append(text[start:stop])
        return out

    def reasoning(self, text: str, upto: int, final: bool) -> str:
        """The reasoning shown once ``text[:upto]`` is released (``final``: nothing more
        comes); turns' reasoning apart by a blank line."""
        return REASONING_TURN_SEPARATOR.join(self._pieces(_REASONING, text, upto, final))

    def content(self, text: str, upto: int, final: bool) -> str:
        """The answer shown once ``text[:upto]`` is released (``final``: nothing more comes)."""
        return "".join(self._pieces(_CONTENT, text, upto, final))

    def take_content(self, text: str) -> str:
        """The answer text scanned since the last call, for the tool-call parser (which
        must never see the reasoning); a turn's undecided start comes with the call
        that decides it."""
        end = self._scanned if self._decided else self._turn
        out = []
        for span in self.spans:
            if span.kind != _CONTENT or span.skipping:
                continue
            lo, hi = max(span.start, self._fed), min(end if span.end is None else span.end, end)
            if hi > lo:
                out.append(text[lo:hi])
        self._fed = max(self._fed, end)
        return "".join(out)
