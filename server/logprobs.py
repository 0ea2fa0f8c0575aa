"""OpenAI ``logprobs`` objects from the engine's per-token records (``jaxserve.TokenLogprob``).

Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}, ...]}, ...]}``. Completions: ``{"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}, ...], "text_offset"}``
(with ``echo``, the prompt's tokens first: the first one's logprob and top_logprobs null),
each ``top_logprobs`` entry holding the alternatives and the sampled token
(so at most ``logprobs + 1`` keys, as OpenAI's; alternatives spelled alike keep
the likeliest's value).

A token's ``bytes`` are exactly the bytes it stands for (llguidance's view of
the vocabulary: a byte-level BPE token may hold part of a UTF-8 character), its
``token`` those bytes as text (an incomplete character as U+FFFD, as vLLM
shows it), special tokens spelled out. Every generated token of the choice is
listed, tool-call markup, a final end-of-turn token and tokens a stop string
cut from the text included, so the list lines up with
``usage.completion_tokens``; ``text_offset`` counts the characters of the
text before each token (a character split across tokens counts from the token
that completes it; special tokens count nothing when the text leaves them out).
"""

from __future__ import annotations

import asyncio
import codecs
import copy
import logging

from jaxserve.outputs import TokenLogprob

log = logging.getLogger("jaxserve.server")


class TokenSpellings:
    """Token id -> ``(text, bytes, special)``, built once per server on the first
    request that asks (llguidance's byte view of the tokenizer, about 0.6 s for a
    49k vocabulary, on a worker thread: ``ready``)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._spell = None
        self._lock = asyncio.Lock()
        self._cache: dict[int, tuple[str, list[int], bool]] = {}

    async def ready(self) -> None:
        """Build the byte view, once, off the event loop."""
        if self._spell is not None:
            return
        async with self._lock:
            if self._spell is None:
                self._spell = await asyncio.to_thread(self._build)

    def _build(self):
        """``token id -> (bytes, special)`` over a copy of the tokenizer of its own
        (other threads use theirs)."""
        hf = copy.deepcopy(self._tokenizer)
        try:
            import llguidance.hf
            llg = llguidance.hf.from_tokenizer(hf)
            return lambda token_id: (llg.decode_bytes([token_id]), llg.is_special_token(token_id))
        except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read: UTF-8 of the decoded text
            log.warning("logprobs: token bytes from decoded text (%s: %s)", type(e).__name__, e)
            specials = set(getattr(hf, "all_special_ids", ()))
            return lambda token_id: (hf.decode([token_id], skip_special_tokens=False).encode("utf-8"),
                                     token_id in specials)

    def __call__(self, token_id: int) -> tuple[str, list[int], bool]:
        spelled = self._cache.get(token_id)
        if spelled is None:
            raw, special = self._spell(token_id)
            spelled = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw), special)
        return spelled


class TextOffsets:
    """The character offset in a completion's text of each of its tokens in turn."""

    def __init__(self, skip_special_tokens: bool) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skip_special = skip_special_tokens
        self._chars = 0

    def advance(self, raw: list[int], special: bool) -> int:
        """The offset of a token of bytes ``raw``; it then counts as the text shows it."""
        if special and self._skip_special:
            return self._chars
        pending, _ = self._decoder.getstate()
        if pending and (not raw or raw[0] & 0xC0 != 0x80):   # a character never finished: U+FFFD before it
            self._chars += len(pending.decode("utf-8", errors="replace"))
            self._decoder.reset()
        offset = self._chars
        self._chars += len(self._decoder.decode(bytes(raw)))
        return offset


def chat_logprobs(records: list[TokenLogprob], spell: TokenSpellings) -> dict:
    """A chat choice's (or stream chunk's) ``logprobs`` object for ``records``."""
    content = []
    for r in records:
        text, raw, _ = spell(r.token_id)
        top = []
        for token_id, logprob in r.top:
            t, b, _ = spell(token_id)
            top.append({"token": t, "logprob": logprob, "bytes": b})
        content.append({"token": text, "logprob": r.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(records: list[TokenLogprob], spell: TokenSpellings, offsets: TextOffsets) -> dict:
    """A completion choice's (or stream chunk's) ``logprobs`` object for ``records``, the
    choice's next tokens (``offsets`` follows the choice's text across chunks)."""
    tokens, text_offset, top_logprobs = [], [], []
    for r in records:
        text, raw, special = spell(r.token_id)
        tokens.append(text)
        text_offset.append(offsets.advance(raw, special))
        if r.logprob is None:   # an echoed prompt's first token: nothing before it to score it by
            top_logprobs.append(None)
            continue
        top: dict[str, float] = {}
        for token_id, logprob in r.top:   # most likely first: a later alternative spelled alike is less likely
            top.setdefault(spell(token_id)[0], logprob)
        top.setdefault(text, r.logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records], "top_logprobs": top_logprobs,
            "text_offset": text_offset}
