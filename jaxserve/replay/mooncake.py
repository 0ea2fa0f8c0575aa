"""Mooncake traces: writing them and the prefix-cache bounds a trace sets.

Format (the public Mooncake traces, one JSON object per line; read by
``jaxserve.replay.trace.parse_mooncake``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp``: arrival in milliseconds; ``input_length``/``output_length``:
tokens; ``hash_ids``: one id per 512-token block of the input
(``ceil(input_length / 512)`` of them, the last block possibly partial), equal
ids meaning equal blocks after equal prefixes. Each line becomes a
``TraceEntry`` with one segment and no API call, ``arrival_time`` in seconds
and ``block_ids`` (page names: ``jaxserve.replay.page_keys``).

Bounds (``cache_bounds``), in input tokens served from a cache, over the
requests in arrival order, at block granularity (a request's hit is the
tokens of its leading run of cached blocks, the last, partial block counting
its own tokens):

* ``infinite``: a cache that keeps every block it ever saw — no cache of any
  size serves more;
* ``lru``: a block LRU of ``capacity_tokens`` (each request's input blocks
  become most recent after it is served) — what an ideal cache of the device
  pool's size would serve on this arrival order, ignoring that running
  requests' own pages and generated tokens take room too.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from jaxserve.replay.page_keys import MOONCAKE_BLOCK_TOKENS
from jaxserve.replay.trace import TraceEntry

def to_jsonl(records: Iterable[dict]) -> str:
    """Mooncake records (dicts with the four fields) as JSONL text."""
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)


@dataclass(frozen=True, slots=True)
class CacheBounds:
    """Input tokens of a trace and those a cache could serve (see module doc)."""

    input_tokens: int
    infinite_tokens: int
    lru_tokens: int
    capacity_tokens: int

    @property
    def infinite_share(self) -> float:
        return self.infinite_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def lru_share(self) -> float:
        return self.lru_tokens / self.input_tokens if self.input_tokens else 0.0


def cache_bounds(entries: Sequence[TraceEntry], capacity_tokens: int) -> CacheBounds:
    """The two bounds of ``entries`` (taken in arrival order) for an LRU of
    ``capacity_tokens`` (rounded down to whole blocks). Block identities are
    chained as the simulator names pages: equal id after equal prefix."""
    bt = MOONCAKE_BLOCK_TOKENS
    capacity = capacity_tokens // bt
    chain_ids: dict[tuple[int, int], int] = {}   # (parent chain, block id) -> chain id
    seen: set[int] = set()
    lru: OrderedDict[int, None] = OrderedDict()
    total = inf_hit = lru_hit = 0
    for e in sorted(entries, key=lambda e: e.arrival_time or 0.0):
        if e.block_ids is None:
            raise ValueError(f"request {e.request_id!r} has no hash_ids (not a Mooncake trace)")
        total += e.prompt_len
        keys = []
        chain = -1
        for b in e.block_ids:
            chain = chain_ids.setdefault((chain, b), len(chain_ids))
            keys.append(chain)
        inf_hit += _hit_tokens(keys, seen, e.prompt_len)
        lru_hit += _hit_tokens(keys, lru, e.prompt_len)
        seen.update(keys)
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > capacity:
            lru.popitem(last=False)
    return CacheBounds(total, inf_hit, lru_hit, capacity * bt)


def _hit_tokens(keys: list, cached, input_length: int) -> int:
    n = 0
    for k in keys:
        if k not in cached:
            break
        n += 1
    return min(n * MOONCAKE_BLOCK_TOKENS, input_length)
