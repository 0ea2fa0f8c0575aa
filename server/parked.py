"""Paused client-side tool-call contexts kept for the follow-up request.

When a chat response ends with ``finish_reason: "tool_calls"`` the engine
request stays paused (its KV cache handled by the policy: preserved, swapped
or discarded). The client then sends the whole conversation again with the
tool's result. If that conversation, rendered with the chat template, starts
with the paused request's context (prompt + generated), the server resumes
the paused request with only the remaining tokens instead of computing the
conversation from scratch. "Starts with" is by text, token for token where
the two agree: a model does not always cut its own output into the tokens the
tokenizer would cut the re-rendered text into (SmolLM2 writes ``"}`` ``}``
where the re-rendered call encodes as ``"`` ``}}``), so a stretch of a few
tokens that differs but spells the same text (``Spelling``) still matches. A
context belongs to its ``owner`` (the API key and ``user`` that created it):
another owner's follow-up never matches it. Contexts nobody comes back for are aborted after ``ttl_s``
seconds, which frees their pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Sequence

log = logging.getLogger("jaxserve.server")


class Spelling:
    """Whether two token runs spell the same text, for one tokenizer: a run that holds
    an added token (special or markup) spells only itself, never plain text."""

    WINDOW = 16      # tokens: the longest stretch on either side that may differ
    MAX_STRETCHES = 8

    def __init__(self, tokenizer) -> None:
        """``tokenizer``: a copy of its own (the engine thread and the tokenizer pool use theirs)."""
        backend = getattr(tokenizer, "backend_tokenizer", None)   # the Rust decode: ~2x cheaper a call
        self._decode = backend.decode if backend is not None else tokenizer.decode
        self._unsplittable = frozenset(getattr(tokenizer, "added_tokens_decoder", {}) or ())

    def text(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids), skip_special_tokens=False)

    def covered(self, context: Sequence[int], token_ids: Sequence[int], start: int = 0) -> int | None:
        """How many leading tokens of ``token_ids`` spell what ``context`` spells: they
        agree token for token, except in stretches of at most ``WINDOW`` tokens a side
        (at most ``MAX_STRETCHES`` of them, none at the very start) whose texts are equal
        from the last token both share. None when no prefix of ``token_ids`` does. The
        caller may vouch that the first ``start`` tokens of both are equal (compared in
        one slice, in C): the scan starts there."""
        n, m = len(context), len(token_ids)
        i = j = start
        anchor = (start - 1, start - 1) if start else None   # (i, j) of the last token both runs share
        stretches = 0
        while True:
            k = _common_run(context, token_ids, i, j)
            if k:
                i, j = i + k, j + k
                anchor = (i - 1, j - 1)
            if i == n:
                return j
            if j == m or anchor is None or stretches == self.MAX_STRETCHES:
                return None
            step = self._resync(context, token_ids, i, j, anchor)
            if step is None:
                return None
            i, j = i + step[0], j + step[1]
            stretches += 1

    def _resync(self, context: Sequence[int], token_ids: Sequence[int], i: int, j: int,
                anchor: tuple[int, int]) -> tuple[int, int] | None:
        """The shortest ``(a, b)`` such that ``context[i:i+a]`` and ``token_ids[j:j+b]`` spell
        the same text after the shared run ending at ``anchor``; None if none within ``WINDOW``."""
        (ai, aj), unsplittable = anchor, self._unsplittable
        ours: dict[str, int] = {}
        for b in range(1, min(self.WINDOW, len(token_ids) - j) + 1):
            if token_ids[j + b - 1] in unsplittable:
                break
            ours.setdefault(self.text(token_ids[aj:j + b]), b)
        best = None
        for a in range(1, min(self.WINDOW, len(context) - i) + 1):
            if context[i + a - 1] in unsplittable:
                break
            text = self.text(context[ai:i + a])
            b = ours.get(text)
            if b is not None and "\ufffd" not in text and (best is None or a + b < sum(best)):
                best = (a, b)
        return best


def _common_run(a: Sequence[int], b: Sequence[int], i: int, j: int) -> int:
    """How many tokens ``a[i:]`` and ``b[j:]`` share from their start."""
    k, limit = 0, min(len(a) - i, len(b) - j)
    while k < limit and a[i + k] == b[j + k]:
        k += 1
    return k


@dataclass
class ParkedContext:
    request_id: str
    context_ids: list[int]      # every token in the request's context at the pause
    sampling_key: tuple         # sampling settings the continuation must share (all but max_tokens)
    calls_seen: int             # API calls of the request whose pause time was already observed
    expires_at: float
    owner: str = ""             # who created it (a hash of API key and user); only they may resume it
    written_from: int = 0       # context_ids[:written_from] is the prompt as the server rendered it; the
    #                             rest the model wrote (and may have cut into other tokens than a re-render)


class ParkedContexts:
    def __init__(self, engine, ttl_s: float, clock=time.monotonic) -> None:
        if ttl_s < 0:
            raise ValueError(f"paused_context_ttl_s must be >= 0, got {ttl_s}")
        self.engine = engine
        self.ttl_s = ttl_s
        self.clock = clock
        self._contexts: dict[str, ParkedContext] = {}
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._contexts)

    async def park(self, request_id: str, context_ids: list[int], sampling_key: tuple, calls_seen: int,
                   owner: str = "", written_from: int = 0) -> None:
        """Keep a paused request for resumption (aborted at once when the TTL is 0).
        ``written_from``: where the tokens the model wrote begin in ``context_ids``."""
        if self.ttl_s == 0:
            await self._abort(request_id)
            return
        self._contexts[request_id] = ParkedContext(request_id, list(context_ids), sampling_key, calls_seen,
                                                   self.clock() + self.ttl_s, owner, written_from)

    async def take(self, token_ids: list[int], sampling_key: tuple, owner: str = "",
                   spelling: Spelling | None = None, room: int | None = None) -> tuple[ParkedContext, int] | None:
        """Remove and return ``owner``'s parked context with the longest context that
        ``token_ids`` starts with and goes beyond, with how many of ``token_ids`` it
        covers; ``None`` when there is none. "Starts with": token for token, or, given
        ``spelling``, the same text where the model wrote it (``Spelling.covered``; the
        rendered prompt before it must agree token for token). ``room``: tokens the
        context window has beyond ``token_ids``; a context that spells the covered part
        in more tokens must leave at least one of them. A matching context with other
        sampling settings cannot continue this request: the longest such is aborted when it
        is longer than every match with this request's settings (it is this conversation,
        gone on with other settings); a match with this request's settings is taken before
        one as long with others (two conversations may share their tokens). Other owners'
        contexts are neither matched nor touched."""
        best: dict[bool, tuple[ParkedContext, int]] = {}   # same settings? -> (longest match, tokens covered)
        for ctx in self._contexts.values():
            same = ctx.sampling_key == sampling_key
            if ctx.owner != owner or (same in best and len(ctx.context_ids) <= len(best[same][0].context_ids)):
                continue
            covered = self._covered(ctx, token_ids, spelling, room)
            if covered is not None:
                best[same] = ctx, covered
        taken = best.get(True)
        other = best.get(False)
        # Every change to the books before the await: a follow-up sent twice at once would
        # otherwise take the same context in both (the first's ``del`` then raised, a 500).
        if taken is not None:
            del self._contexts[taken[0].request_id]
        if other is not None and (taken is None or len(other[0].context_ids) > len(taken[0].context_ids)):
            del self._contexts[other[0].request_id]   # (this conversation, gone on with other settings)
            await self._abort(other[0].request_id)
        return taken

    @staticmethod
    def _covered(ctx: ParkedContext, token_ids: list[int], spelling: Spelling | None, room: int | None) -> int | None:
        """How many of ``token_ids`` parked context ``ctx`` covers, when they start with it
        and go beyond (``take``); None otherwise."""
        ids, n = ctx.context_ids, len(ctx.context_ids)
        if n < len(token_ids) and token_ids[:n] == ids:
            return n
        if spelling is not None and token_ids[:ctx.written_from] == ids[:ctx.written_from]:
            j = spelling.covered(ids, token_ids, start=ctx.written_from)
            if j is not None and j < len(token_ids) and (room is None or n - j < room):
                return j
        return None

    def start(self) -> None:
        """Start the expiry loop (call from within the running event loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._expire_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for request_id in list(self._contexts):
            del self._contexts[request_id]
            await self._abort(request_id)

    async def expire(self) -> int:
        """Abort contexts past their TTL; returns how many."""
        now = self.clock()
        expired = [c.request_id for c in self._contexts.values() if c.expires_at <= now]
        for request_id in expired:
            if self._contexts.pop(request_id, None) is not None:   # (a follow-up may take it while we await)
                await self._abort(request_id)
        return len(expired)

    async def _expire_loop(self) -> None:
        interval = min(1.0, max(0.05, self.ttl_s / 4))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire()
            except Exception:  # noqa: BLE001 - keep expiring even if one abort fails
                log.exception("expiring paused tool contexts failed")

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 - the engine may be dead; nothing left to free then
            log.warning("abort of paused context %s failed", request_id, exc_info=True)
