"""A turn's tool calls as the model writes them, so a stream can send each call's
name once it is written and then its arguments piece by piece, as OpenAI's
streams do (``tool_calls[i].function.arguments`` deltas), instead of all at the
end of the turn.

A ``CallStream`` reads the call spans of a markup filter (``spans``: the text
after each opening marker, the last one growing while it is open) as JSON, one
character at a time: a call object ``{"name": ..., <args key>: ...}`` or, in
formats that write a turn's calls as a list, a list of them. A call's arguments are written as
the format's parser will return them when the call closes (``json.dumps`` of
the value with ``ensure_ascii=False``; an arguments string as its text), so what
has been sent is a prefix of the parsed call's arguments. A call is announced
once its name is complete and its arguments have begun as an object or a
string, so JSON with a ``name`` whose arguments are of another kind (Llama 3
content such as ``{"name": "Bob", "parameters": [1]}``) is never announced. A
call whose object closes without arguments (the parser gives it ``{}``) has
nothing to stream but its name, so it, and every call after it in its span,
waits for the span to end (the next span opens, or ``finish`` at the end of
the output): text after it that the parser refuses (a stray ``}``) then holds
it instead of leaving a call in the stream that the response does not list.

What is held to the end of the turn instead (the response then lists it whole):
a call to a server-side tool (``hidden``: a turn of those is run, not shown) and
every call after it in the turn, and from the first character the parser would
refuse or read otherwise than left to right (a syntax error, a name that is not
a string, arguments that are neither an object nor a string, a key written
twice), the rest of the turn. A call broken after it began to stream stays in
the stream as far as it went: a stream cannot take back what it sent.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_JSON_SPACE = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_SEPARATORS = {",": ("comma_or_close", ", "), ":": ("colon", ": ")}   # what each follows, and how it is written
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NUMBER_CHARS = re.compile(r"[0-9.eE+-]*")   # what may still extend a number
_HEX = re.compile(r"[0-9a-fA-F]{4}")


@dataclass
class StreamedCall:
    """One call of the turn, as far as it is written: ``name`` once complete (None
    before), ``arguments`` the text of its arguments so far."""

    name: str | None = None
    arguments: str = ""


class _Frame:
    """An open JSON container: an object (``keys`` seen, ``key`` the current one) or a list."""

    __slots__ = ("is_object", "key", "keys", "role")

    def __init__(self, is_object: bool, role: str) -> None:
        self.is_object, self.role = is_object, role   # role: "calls" (a list of calls), "call", "args", "other"
        self.key: str | None = None
        self.keys: set[str] = set()


class CallStream:
    """Reads a markup filter's call spans (see module doc). ``args_keys``: the keys the
    parser takes arguments from, in its order; ``lists``: whether a span may hold a
    list of calls; ``hidden``: names of server-side tools."""

    def __init__(self, args_keys: tuple[str, ...], lists: bool, hidden: frozenset[str] = frozenset()) -> None:
        self.args_keys, self.lists, self.hidden = args_keys, lists, hidden
        self.calls: list[StreamedCall] = []   # this turn's streamable calls, in order
        self.held = False                      # the rest of this turn is held to its end
        self.server_call = False               # held from a server-side tool's name on
        self._deferred: list[StreamedCall] = []   # calls of the current span waiting for its end
        self._span, self._pos = 0, 0           # next span to read, and where in it
        self._reset_span()

    @property
    def writing(self) -> bool:
        """A call whose name is known is being written (its object not closed yet)."""
        return self._call is not None and bool(self.calls) and self.calls[-1] is self._call and not self.held

    def new_turn(self) -> None:
        """The turn's calls went to the tools; the spans from now on are the next turn's."""
        self.calls, self.held, self.server_call, self._deferred = [], False, False, []
        self._reading = False   # (the current span, closed, was the last turn's)

    def finish(self) -> None:
        """The output is all written: calls waiting for their span's end are sent (unless
        the turn was held)."""
        self._release_deferred()

    def _release_deferred(self) -> None:
        if not self.held:
            self.calls += self._deferred
        self._deferred = []

    def update(self, spans: list[str]) -> None:
        """Read what the spans added since the last call."""
        while self._span < len(spans):
            text = spans[self._span]
            if self._reading and not self.held:
                self._read(text)
            if self._span == len(spans) - 1:
                return   # (the last span may still grow)
            self._release_deferred()   # (the span ended as the parser takes it)
            self._span, self._pos = self._span + 1, 0
            self._reset_span()

    # ------------------------------------------------------------------ reading
    def _reset_span(self) -> None:
        self._reading = True
        self._stack: list[_Frame] = []
        self._expect = "value"     # value, key_or_close, key, colon, comma_or_close, value_or_close, end
        self._string: list[str] | None = None   # the string being read, if any (a key's or name's text, decoded)
        self._string_role = ""     # what it is: key, name, args (a string of arguments), value
        self._call: StreamedCall | None = None
        self._args_depth = -1      # stack depth of the arguments value being written; -1: none
        self._high_surrogate: str | None = None

    def _hold(self) -> None:
        self.held = True
        self._deferred = []

    def _read(self, text: str) -> None:
        pos, n = self._pos, len(text)
        while pos < n and not self.held:
            if self._string is not None:
                pos = self._read_string(text, pos)
                if pos < 0:
                    pos = -pos - 1
                    break   # (an escape not complete yet)
                continue
            ch = text[pos]
            if self._expect == "end" or (not self._stack and self._expect == "value"):
                if ch.isspace():   # (the parser strips the body: any Unicode space around the value)
                    pos += 1
                    continue
                if self._expect == "end":
                    self._hold()   # text after the call's JSON: the parser refuses the body
                    break
            elif ch in _JSON_SPACE:
                pos += 1
                continue
            if ch == '"':
                pos += 1
                self._open_string()
                continue
            if ch in "{[":
                if self._expect not in ("value", "value_or_close"):
                    self._hold()
                    break
                self._open(ch == "{")
                pos += 1
                continue
            if ch in "}]":
                if self._expect not in ("key_or_close", "comma_or_close", "value_or_close") or \
                        self._stack[-1].is_object != (ch == "}"):
                    self._hold()
                    break
                self._close(ch)
                pos += 1
                continue
            if ch in _SEPARATORS:   # "," or ":", written as json.dumps writes them
                expected, written = _SEPARATORS[ch]
                if self._expect != expected:
                    self._hold()
                    break
                self._emit(written)
                self._expect = "value" if ch == ":" or not self._stack[-1].is_object else "key"
                pos += 1
                continue
            if self._expect not in ("value", "value_or_close"):
                self._hold()
                break
            end = self._scalar_end(text, pos)
            if end is None:
                break   # (may still grow)
            if end < 0:
                self._hold()
                break
            try:
                value = json.loads(text[pos:end])
            except ValueError:   # (an integer past Python's digit limit)
                self._hold()
                break
            if not self._value_starts("scalar"):
                break
            self._emit(json.dumps(value))
            self._value_ends()
            pos = end
        self._pos = pos

    def _scalar_end(self, text: str, pos: int) -> int | None:
        """End of the number or literal at ``pos``; None while it may still grow, -1 if none."""
        for literal in _LITERALS:
            if text.startswith(literal, pos):
                return pos + len(literal)
            if literal.startswith(text[pos:]):
                return None
        match = _NUMBER.match(text, pos)
        if match is None:
            return -1
        if _NUMBER_CHARS.match(text, match.end()).end() == len(text):
            return None   # ("1.5e" may become "1.5e3"; followed by anything else it is refused after "1.5")
        return match.end()

    def _value_starts(self, kind: str) -> bool:
        """A value of ``kind`` (object, list, string, scalar) begins; what it means for the
        calls. False: the turn is held from here."""
        if self._args_depth >= 0:
            return True
        frame = self._stack[-1] if self._stack else None
        if frame is None:   # the span's value: a call, or a list of calls
            if kind == "object" or (kind == "list" and self.lists):
                return True
            self._hold()
            return False
        if frame.role == "calls":
            if kind == "object":
                return True
            self._hold()
            return False
        if frame.role == "call":
            key = frame.key
            if key == "name":
                if kind != "string":
                    self._hold()
                    return False
            elif key in self.args_keys:
                if kind not in ("object", "string") or any(k in frame.keys for k in self.args_keys if k != key):
                    self._hold()   # not arguments, or a second arguments key (the parser picks by key, not order)
                    return False
                self._args_depth = len(self._stack)
                self._announce()   # (a call is announced once its name is known and its arguments are of a kind it takes)
        return True

    def _value_ends(self) -> None:
        if self._args_depth == len(self._stack):
            self._args_depth = -1
        if not self._stack:
            self._expect = "end"
            return
        self._expect = "comma_or_close"

    def _open(self, is_object: bool) -> None:
        if not self._value_starts("object" if is_object else "list"):
            return
        parent = self._stack[-1] if self._stack else None
        if self._args_depth >= 0:
            role = "args" if self._args_depth == len(self._stack) else "other"
        elif parent is None:
            role = "call" if is_object else "calls"
        elif parent.role == "calls":
            role = "call"
        else:
            role = "other"
        if role == "call":
            self._call = StreamedCall()
        self._emit("{" if is_object else "[")
        self._stack.append(_Frame(is_object, role))
        self._expect = "key_or_close" if is_object else "value_or_close"

    def _close(self, ch: str) -> None:
        frame = self._stack.pop()
        self._emit(ch)
        if frame.role == "call":
            if self._call.name is None:
                self._hold()   # a call object without a name: the parser refuses it
            else:
                self._announce(bare=True)   # (announced at once if its arguments began)
            self._call = None
        self._value_ends()

    def _open_string(self) -> None:
        if self._expect in ("key_or_close", "key"):
            self._string_role = "key"
        elif self._expect in ("value", "value_or_close"):
            if not self._value_starts("string"):
                return
            frame = self._stack[-1] if self._stack else None
            if self._args_depth == len(self._stack):
                self._string_role = "args"
            elif frame is not None and frame.role == "call" and frame.key == "name":
                self._string_role = "name"
            else:
                self._string_role = "value"
        else:
            self._hold()
            return
        self._string = []
        if self._string_role != "args":
            self._emit('"')

    def _read_string(self, text: str, pos: int) -> int:
        """Read string characters from ``pos``; returns the next position, or ``-(pos + 1)``
        to wait for more text (an escape not complete)."""
        n = len(text)
        while pos < n:
            ch = text[pos]
            if ch == '"':
                self._flush_surrogate()
                self._close_string()
                return pos + 1
            if ch == "\\":
                if pos + 1 >= n:
                    return -(pos + 1)
                code = text[pos + 1]
                if code == "u":
                    if pos + 6 > n:
                        return -(pos + 1)
                    if not _HEX.fullmatch(text, pos + 2, pos + 6):
                        self._hold()
                        return n
                    char = chr(int(text[pos + 2:pos + 6], 16))
                    pos += 6
                    if self._high_surrogate is not None and "\udc00" <= char <= "\udfff":
                        pair = (ord(self._high_surrogate) - 0xD800) * 0x400 + (ord(char) - 0xDC00) + 0x10000
                        self._high_surrogate = None
                        self._add_char(chr(pair))
                        continue
                    self._flush_surrogate()
                    if "\ud800" <= char <= "\udbff":
                        self._high_surrogate = char   # (a low surrogate may follow: one character then)
                    else:
                        self._add_char(char)
                    continue
                if code not in _ESCAPES:
                    self._hold()
                    return n
                self._flush_surrogate()
                self._add_char(_ESCAPES[code])
                pos += 2
                continue
            if ch < " ":   # (the parser is strict: no control characters inside strings)
                self._hold()
                return n
            if self._high_surrogate is not None:
                self._flush_surrogate()
            self._add_char(ch)
            pos += 1
        return pos

    def _flush_surrogate(self) -> None:
        if self._high_surrogate is not None:
            char, self._high_surrogate = self._high_surrogate, None
            self._add_char(char)

    def _add_char(self, char: str) -> None:
        if self._string_role in ("key", "name"):   # (their text is read when they close; values are only written)
            self._string.append(char)
        if self._string_role == "args":
            self._emit(char)
        elif self._string_role != "name":
            self._emit(json.dumps(char, ensure_ascii=False)[1:-1])

    def _close_string(self) -> None:
        text, role = "".join(self._string), self._string_role
        self._string = None
        if role != "args":
            self._emit('"')
        if role == "key":
            frame = self._stack[-1]
            if text in frame.keys and (frame.role != "call" or text == "name" or text in self.args_keys):
                self._hold()   # a key written twice: the parser keeps the last value, in the first one's place
                return
            frame.keys.add(text)
            frame.key = text
            self._expect = "colon"
            return
        if role == "name":
            call = self._call
            if not text or text in self.hidden:
                self._hold()   # no call (an empty name), or a server-side tool's: the turn is held
                self.server_call = bool(text)
                return
            call.name = text
            if any(k in self._stack[-1].keys for k in self.args_keys):   # (its arguments came first)
                self._announce()
        self._value_ends()

    def _announce(self, bare: bool = False) -> None:
        """The current call is one the stream may send: add it to ``calls`` (once), or to
        the calls waiting for the span's end when it closed without arguments (``bare``)
        or a call before it in the span did."""
        call = self._call
        if call is None or call.name is None or (self.calls and self.calls[-1] is call) \
                or (self._deferred and self._deferred[-1] is call):
            return
        if bare or self._deferred:
            self._deferred.append(call)
        else:
            self.calls.append(call)

    def _emit(self, piece: str) -> None:
        """Arguments text: kept when inside the arguments value of the current call."""
        if self._args_depth >= 0 and self._call is not None:
            self._call.arguments += piece
