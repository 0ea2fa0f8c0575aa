"""Incremental detokenization with stop strings, safe for multi-byte characters."""

from __future__ import annotations

from jaxserve.tool_format.base import partial_suffix

DETOKENIZER_CONTEXT = 5   # prompt ids a detokenizer decodes before the first generated one (as vLLM's)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window (``prefix_offset`` … end) per token, and holds
    back a delta that ends in an incomplete UTF-8 sequence (U+FFFD).

    ``text`` is everything decoded so far (cut before a stop string once one is
    hit); ``releasable()`` is how much of it a stream may show before the
    request ends: it stops short of a tail that could still grow into a stop
    string, since a shown character cannot be taken back.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop: bool = False, context: list[int] = ()) -> None:
        """``include_stop``: a stop string stays in ``text`` (cut just after it, not before).
        ``context``: the last few prompt ids, decoded with the first tokens and not part of
        ``text``: a SentencePiece tokenizer drops the space of a piece it decodes first
        (``"▁Paris"`` alone is ``"Paris"``), so the text continues the prompt as written. Not
        used when it ends inside a character (a token-id prompt may)."""
        self.tokenizer = tokenizer
        # The Rust tokenizer's decode is ~4x cheaper per call than the Python wrapper's.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_fn = backend.decode if backend is not None else getattr(tokenizer, "decode", None)
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop
        self.ids: list[int] = list(context)
        if self.ids and self._decode(self.ids).endswith("\ufffd"):
            self.ids = []   # (a prompt cut inside a character: its bytes would not decode as they will complete)
        self.text = ""
        self._prefix = 0
        self._read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, match_stop: bool = True) -> tuple[str, bool]:
        """Append a token; returns ``(new text, hit a stop string)``. On a stop
        string the text is cut just before it (``include_stop``: just after it;
        the earliest to start, the shortest of those). ``match_stop`` False: the
        new text is not searched for stop strings (``SamplingParams.min_tokens``)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full = self._decode(self.ids[self._prefix:])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return "", False
        delta = full[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        before = len(self.text)
        self.text += delta
        hits = [(at, len(s)) for s in self.stop if (at := self.text.find(s, max(0, before - len(s) + 1))) != -1] \
            if match_stop else None
        if hits:   # cut at the earliest, whichever stop string it is
            at, length = min(hits)
            self.text = self.text[:at + length if self.include_stop else at]
            return self.text[before:], True
        return delta, False

    def releasable(self) -> int:
        """Length of the leading part of ``text`` that no stop string can still
        claim: all of it, less its longest tail that is a proper prefix of one
        of ``stop`` (``text`` holds no whole stop string: ``add`` cut it). With
        ``include_stop`` nothing is held: a stop string is shown either way."""
        if self.include_stop:
            return len(self.text)
        return len(self.text) - max((partial_suffix(self.text, s) for s in self.stop), default=0)
