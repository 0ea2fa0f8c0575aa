"""Tokenization for the HTTP routes: off the event loop and the engine thread,
several at a time, and a cheap length bound that refuses huge prompts before
any tokenizer runs.

A fast (Rust) tokenizer must not be used from two threads at once, so the pool
holds ``size`` private copies; a call borrows one, runs on a worker thread and
gives it back. A short chat never waits behind one long prompt unless every
copy is busy.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, Callable

SAFETY = 4


class TokenizerPool:
    """``await pool.run(lambda tok: tok.encode(text))`` on one of ``size`` copies of ``tokenizer``."""

    def __init__(self, tokenizer, size: int = 4) -> None:
        if size < 1:
            raise ValueError(f"tokenizer pool size must be >= 1, got {size}")
        self.template = tokenizer
        self.size = size
        self._free: asyncio.Queue | None = None
        self.max_token_bytes = max_token_bytes(tokenizer)

    def _queue(self) -> asyncio.Queue:
        # Built lazily inside the running loop (an asyncio.Queue binds to it).
        if self._free is None:
            self._free = asyncio.Queue()
            for _ in range(self.size):
                self._free.put_nowait(copy.deepcopy(self.template))
        return self._free

    async def run(self, fn: Callable[[Any], Any]) -> Any:
        free = self._queue()
        tok = await free.get()
        try:
            return await asyncio.to_thread(fn, tok)
        finally:
            free.put_nowait(tok)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens ``text`` encodes to, in O(len) without tokenizing:
        no token stands for more UTF-8 bytes than the longest one in the vocabulary (times
        ``SAFETY``, for normalizers that shrink text before it is split)."""
        return len(text.encode("utf-8", "surrogatepass")) // (SAFETY * self.max_token_bytes)


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the input bytes one token can stand for: the UTF-8 length of the
    longest vocabulary entry. Byte-level BPE writes each input byte as one character
    (1-2 UTF-8 bytes); SentencePiece writes text as itself (``▁`` is 3 bytes for a 1-byte
    space), byte fallback as ``<0xNN>``: each entry is at least as long as what it encodes."""
    vocab = tokenizer.get_vocab()
    return max(1, max((len(piece.encode("utf-8", "surrogatepass")) for piece in vocab), default=1))
