"""Prefix-cache page names for simulated requests, which carry no token ids.

The prefix cache (``scheduler.prefix_cache``) matches pages by the names in
``Request.block_hashes``: on the engine, chained BLAKE2b hashes of token ids;
here, integers handed out by a ``PageNamer`` so that two pages get the same
name exactly when the trace says they hold the same tokens after the same
prefix. Integers never equal the engine's ``bytes`` hashes, are collision-free
by construction (a fresh range per new identity) and cost a fraction of a
hash, which matters for traces of millions of pages.

Three sources of identity:

* ``fresh(request)`` — every full page the request's context can reach
  (prompt, generated and API-returned tokens) gets a name of its own: the
  request shares only with its own earlier copies (soft discard, preemption,
  swap-in re-linking).
* ``conversation(num_tokens)`` — one name per page of a conversation's whole
  context (a token-count trace's prefix structure: segment ``i+1``'s prompt is
  segment ``i``'s prompt + completion + API return). In re-send mode every
  segment request of the conversation lists the same names, so a follow-up
  matches the pages its predecessors computed.
* ``blocks(hash_ids, input_length, total_tokens)`` — a Mooncake-format
  request: its input is 512-token blocks named by ``hash_ids`` (equal id,
  equal block). A page of ``page_size`` tokens inside block ``b`` is named by
  (the chain of block ids up to ``b``, its index in the block); pages that
  reach past the input (generated tokens) get fresh names.
"""

from __future__ import annotations

from typing import Sequence

from scheduler import Request

MOONCAKE_BLOCK_TOKENS = 512


class PageNamer:
    """Hands out integer page names for one simulation (see module doc).

    ``page_size`` must divide ``block_tokens`` so a page never straddles two blocks.
    """

    def __init__(self, page_size: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> None:
        if page_size <= 0 or block_tokens % page_size:
            raise ValueError(f"page size {page_size} must divide the {block_tokens}-token block size")
        self.page_size = page_size
        self.block_tokens = block_tokens
        self.pages_per_block = block_tokens // page_size
        self._next = 0
        self._chains: dict[tuple[int, int], int] = {}   # (parent chain, block id) -> first page name

    def _range(self, n: int) -> range:
        start = self._next
        self._next += n
        return range(start, start + n)

    def conversation(self, num_tokens: int) -> list[int]:
        """Fresh names for the ``num_tokens // page_size`` full pages of a context."""
        return list(self._range(num_tokens // self.page_size))

    def fresh(self, request: Request) -> list[int]:
        """Fresh names for every full page ``request``'s context can reach."""
        return self.conversation(request.max_context_tokens)

    def blocks(self, hash_ids: Sequence[int], input_length: int, total_tokens: int) -> list[int]:
        """Names of the full pages of a ``total_tokens`` context whose first
        ``input_length`` tokens are the blocks ``hash_ids`` (see module doc)."""
        ps, per_block, chains = self.page_size, self.pages_per_block, self._chains
        names: list[int] = []
        input_pages = input_length // ps
        chain = -1
        for block_id in hash_ids:
            if len(names) >= input_pages:
                break
            key = (chain, block_id)
            base = chains.get(key)
            if base is None:
                base = chains[key] = self._range(per_block).start
            chain = base
            names.extend(range(base, base + min(per_block, input_pages - len(names))))
        names.extend(self._range(total_tokens // ps - len(names)))
        return names
