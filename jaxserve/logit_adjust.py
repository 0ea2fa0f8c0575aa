"""A request's logit adjustments (``logit_bias``, ``min_tokens``, repetition, presence and
frequency penalties) as sparse entries the sampler applies (``jaxserve.sampling.adjust_logits``).

Every adjustment touches only some tokens: those ``logit_bias`` names, the stop tokens
``min_tokens`` holds back, the tokens already in the context (repetition) or generated
(presence, frequency). So a row's adjustments are a list of entries ``(token, pre, scale,
post)``, applied on the device as ``logit' = scale_op(logit + pre) + post``, where
``scale_op(x)`` is ``x / scale`` for ``x > 0`` and ``x * scale`` otherwise (the
repetition penalty; 1 leaves ``x`` alone). ``pre`` holds the bias (and ``-inf`` for a
stop token held back), ``post`` the penalties ``-(frequency * count + presence * [count > 0])``.

No JAX here: ``LogitAdjuster`` keeps one request's entries up to date as its context grows
(each context and generated token is read once, when it first reaches a step), and
``step_adjustments`` lays out a step's entries in padded arrays of a few fixed sizes.
"""

from __future__ import annotations

import numpy as np

from jaxserve.sampling_params import SamplingParams

PADDING_TOKEN = 2**31 - 1
"""Token id of a padding entry: out of every vocabulary, so the sampler's scatter drops it."""
MIN_ENTRIES = 64
"""Smallest entry bucket; each larger one is 4x (one compiled sampler per bucket and row count)."""


class LogitAdjuster:
    """One request's logit adjustments (``SamplingParams``' ``logit_bias``, ``min_tokens``,
    ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``), one entry per
    token any of them touches, in the order tokens first came up. The entries' values
    are kept up to date token by token, so a step reads them as they are."""

    def __init__(self, params: SamplingParams, stop_token_ids: frozenset[int]) -> None:
        """``stop_token_ids``: the ids that end the request (what ``min_tokens`` holds back)."""
        self.repetition = float(params.repetition_penalty)
        self.presence = float(params.presence_penalty)
        self.frequency = float(params.frequency_penalty)
        self._slot: dict[int, int] = {}        # token id -> its entry
        size = 16
        self._ids = np.full(size, PADDING_TOKEN, np.int32)
        self._pre = np.zeros(size, np.float32)     # bias; -inf for a stop token held back
        self._scale = np.ones(size, np.float32)    # the repetition penalty on context tokens
        self._post = np.zeros(size, np.float32)    # -(frequency * count + presence * [count > 0])
        self._generated = np.zeros(size, np.int32)   # times generated
        for token, value in (params.logit_bias or {}).items():
            if value:
                slot = self._entry(token)   # (may grow the arrays: look them up after)
                self._pre[slot] = value
        self._always = bool(self._slot) or self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0
        self._context_read = 0   # context tokens read so far (repetition)
        self._outputs_read = 0   # generated tokens read so far (presence, frequency)
        # ``min_tokens``: until ``min_generated`` tokens are generated (in all: a continuation with a fresh
        # budget moves it, ``new_turn``) the stop tokens are held back (``-inf``) and stop strings not matched.
        self.min_tokens = params.min_tokens
        self.min_generated = params.min_tokens
        self._stop_ids = frozenset(stop_token_ids)
        self._held: list[tuple[int, float]] = []   # (entry, its bias) of each stop token held back
        self._hold_stops(0)

    def _hold_stops(self, num_generated: int) -> None:
        """Hold back the stop tokens (their entries' ``pre`` at ``-inf``) when ``min_generated``
        is ahead of ``num_generated``; the ones held before are let go first."""
        self._release_stops()
        if num_generated < self.min_generated:
            for token in sorted(self._stop_ids):
                slot = self._entry(token)   # (may grow the arrays: look them up after)
                self._held.append((slot, float(self._pre[slot])))
                self._pre[slot] = -np.inf

    def _release_stops(self) -> None:
        for slot, bias in self._held:
            self._pre[slot] = bias
        self._held = []

    def holds_stops(self, num_generated: int) -> bool:
        """Whether stop tokens and stop strings are held back after ``num_generated`` tokens."""
        return num_generated < self.min_generated

    def set_stop_ids(self, stop_token_ids: frozenset[int], num_generated: int) -> None:
        """The request's stop tokens changed after ``num_generated`` tokens (EOS ends the
        request again after a forced turn of tool calls, which ended on it): hold these back."""
        self._stop_ids = frozenset(stop_token_ids)
        self._hold_stops(num_generated)

    def new_turn(self, num_generated: int) -> None:
        """A continuation with a fresh budget (``LLMEngine.resume(max_tokens=...)``: the next
        turn of a conversation) starts after ``num_generated`` tokens: as for a new request
        whose prompt holds them, ``min_tokens`` counts from here and presence and frequency
        only the tokens generated from here (the repetition penalty still covers the context)."""
        self.min_generated = num_generated + self.min_tokens
        self._generated[:] = 0
        self._post[:] = 0
        self._outputs_read = num_generated
        self._hold_stops(num_generated)

    def _entry(self, token: int) -> int:
        """The entry of ``token``, added (and the arrays grown) when it has none."""
        slot = self._slot.get(token)
        if slot is None:
            slot = self._slot[token] = len(self._slot)
            if slot == len(self._ids):
                self._grow()
            self._ids[slot] = token
        return slot

    def _grow(self) -> None:
        for name in ("_ids", "_pre", "_scale", "_post", "_generated"):
            old = getattr(self, name)
            new = np.empty(2 * len(old), old.dtype)
            new[:len(old)] = old
            new[len(old):] = {"_ids": PADDING_TOKEN, "_scale": 1}.get(name, 0)
            setattr(self, name, new)

    def active(self, num_generated: int) -> bool:
        """Whether a row sampling token ``num_generated + 1`` has anything to adjust."""
        return self._always or (bool(self._held) and self.holds_stops(num_generated))

    def entries(self, context: list[int], context_len: int, generated: list[int]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(ids int32 [E], pre float32 [E], scale float32 [E], post float32 [E])`` for the row
        that samples after ``context[:context_len]``, of which ``generated`` (in order) were
        sampled. Both only ever grow between calls: only their new tokens are read. The
        arrays are views of this adjuster's own, valid until the next call."""
        if self.repetition != 1.0 and context_len > self._context_read:
            scale = np.float32(self.repetition)
            for token in context[self._context_read:context_len]:
                slot = self._entry(token)
                self._scale[slot] = scale
            self._context_read = context_len
        if (self.presence or self.frequency) and len(generated) > self._outputs_read:
            for token in generated[self._outputs_read:]:
                slot = self._entry(token)
                count = self._generated[slot] = self._generated[slot] + 1
                self._post[slot] = -(self.frequency * count + self.presence)
            self._outputs_read = len(generated)
        if self._held and len(generated) >= self.min_generated:
            self._release_stops()
        n = len(self._slot)
        return self._ids[:n], self._pre[:n], self._scale[:n], self._post[:n]


def entry_bucket(n: int) -> int:
    """Padded entry count for ``n`` entries: ``MIN_ENTRIES`` times a power of 4."""
    bucket = MIN_ENTRIES
    while bucket < n:
        bucket *= 4
    return bucket


def step_adjustments(rows: list[tuple[int, tuple[np.ndarray, ...]]]) -> dict[str, np.ndarray]:
    """A step's adjustments for the sampler: ``rows`` lists ``(logits row, LogitAdjuster.entries(...))``;
    returns the arrays ``adjust_rows``, ``adjust_ids`` (int32), ``adjust_pre``, ``adjust_scale``,
    ``adjust_post`` (float32), each ``[entry_bucket(total entries)]``, padded with entries that
    change nothing (``PADDING_TOKEN``)."""
    lengths = [len(e[0]) for _, e in rows]
    total = sum(lengths)
    pad = entry_bucket(total) - total
    out = {"adjust_rows": np.concatenate([np.repeat(np.array([r for r, _ in rows], np.int32), lengths),
                                          np.zeros(pad, np.int32)])}
    for k, (name, fill, dtype) in enumerate((("adjust_ids", PADDING_TOKEN, np.int32), ("adjust_pre", 0, np.float32),
                                             ("adjust_scale", 1, np.float32), ("adjust_post", 0, np.float32))):
        out[name] = np.concatenate([e[k] for _, e in rows] + [np.full(pad, fill, dtype)])
    return out
