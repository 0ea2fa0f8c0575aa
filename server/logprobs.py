"""OpenAI ``logprobs`` objects from the engine's per-token records (``jaxserve.TokenLogprob``).

Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}, ...]}``. Completions: ``{"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}, ...], "text_offset"}``.

A token's ``bytes`` are exactly the bytes it stands for (llguidance's view of
the vocabulary: a byte-level BPE token may hold part of a UTF-8 character), its
``token`` those bytes as text (an incomplete character as U+FFFD, as vLLM
shows it), special tokens spelled out. Every generated token of the choice is
listed, tool-call markup and a final end-of-turn token included, so the list
lines up with ``usage.completion_tokens``.
"""

from __future__ import annotations

import asyncio
import copy
import logging

from jaxserve.outputs import TokenLogprob

log = logging.getLogger("jaxserve.server")


class TokenSpellings:
    """Token id -> ``(text, bytes)``, built once per server (llguidance's byte view of the
    tokenizer, about 0.6 s for a 49k vocabulary, on a worker thread: ``ready``)."""

    def __init__(self, tokenizer) -> None:
        self._hf = copy.deepcopy(tokenizer)   # its own: other threads use theirs
        self._bytes_of = None
        self._lock = asyncio.Lock()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    async def ready(self) -> None:
        """Build the byte view, once, off the event loop."""
        if self._bytes_of is not None:
            return
        async with self._lock:
            if self._bytes_of is None:
                self._bytes_of = await asyncio.to_thread(self._build)

    def _build(self):
        try:
            import llguidance.hf
            llg = llguidance.hf.from_tokenizer(self._hf)
            return lambda token_id: llg.decode_bytes([token_id])
        except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read: UTF-8 of the decoded text
            log.warning("logprobs: token bytes from decoded text (%s: %s)", type(e).__name__, e)
            return lambda token_id: self._hf.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        spelled = self._cache.get(token_id)
        if spelled is None:
            try:
                raw = self._bytes_of(token_id)
            except Exception:  # noqa: BLE001 - an id past the tokenizer's vocabulary (padded logits)
                raw = b""
            spelled = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return spelled


def chat_logprobs(records: list[TokenLogprob], spell: TokenSpellings) -> dict:
    """A chat choice's (or stream chunk's) ``logprobs`` object for ``records``."""
    content = []
    for r in records:
        text, raw = spell(r.token_id)
        top = []
        for token_id, logprob in r.top:
            t, b = spell(token_id)
            top.append({"token": t, "logprob": logprob, "bytes": b})
        content.append({"token": text, "logprob": r.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(records: list[TokenLogprob], spell: TokenSpellings, offset: int) -> tuple[dict, int]:
    """A completion choice's (or stream chunk's) ``logprobs`` object for ``records``, their
    ``text_offset`` counted from ``offset`` (characters of token text before them in the
    choice); returns it and the offset after them."""
    tokens, offsets = [], []
    for r in records:
        text = spell(r.token_id)[0]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [{spell(token_id)[0]: logprob for token_id, logprob in r.top} for r in records]
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records], "top_logprobs": top,
            "text_offset": offsets}, offset
