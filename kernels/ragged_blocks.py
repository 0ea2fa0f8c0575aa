"""Cut a ragged batch of query rows into fixed-size per-sequence query blocks.

Both Pallas kernels run one program per query block: ``block_q`` consecutive
query tokens of a single sequence, times the ``group`` query heads that share
one KV head (GQA), i.e. ``rows = block_q * group`` rows of a ``[rows, D]``
matrix. A sequence with ``q_len`` tokens gets ``ceil(q_len / block_q)``
blocks; its last block is partly padding. The number of blocks is bounded
statically by ``num_query_blocks`` so the grid has a static size; blocks past
the real ones are padding blocks and do no work.

This module holds the wrapper-side bookkeeping (plain jnp, runs before and
after the ``pallas_call``) and ``block_kv_range``, the scalar arithmetic both
kernels use inside the kernel to find which cache pages a block needs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class QueryBlocks(NamedTuple):
    """Where each query block comes from and where each query row goes.

    seq:         int32 [num_blocks] sequence of the block (0 for padding blocks).
    q_start:     int32 [num_blocks] first query token of the block, counted from
                 the sequence's first query token (``num_tokens`` for padding
                 blocks, so that ``q_start >= q_len`` marks them).
    token_block: int32 [T] block holding query row t (0 for padding rows).
    token_row:   int32 [T] token offset of row t inside its block.
    token_valid: bool  [T] whether row t is a real (non-padding) query row.
    """

    seq: jax.Array
    q_start: jax.Array
    token_block: jax.Array
    token_row: jax.Array
    token_valid: jax.Array


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def default_block_q(
    num_tokens: int, max_num_seqs: int, group: int, min_rows: int, max_rows: int
) -> int:
    """Query tokens per block: about the mean query length per sequence slot,
    a power of two, such that ``block_q * group`` lies in ``[min_rows,
    max_rows]`` where possible (decode batches get 1-token blocks, prefill
    chunks long ones)."""
    mean_q_len = -(-num_tokens // max(1, max_num_seqs))
    lo = max(1, min_rows // group)
    hi = max(lo, max_rows // group)
    return min(max(next_power_of_two(mean_q_len), lo), hi)


def num_query_blocks(num_tokens: int, max_num_seqs: int, block_q: int) -> int:
    """Static upper bound on the number of query blocks.

    ``sum_s ceil(q_s / b) <= (T + n (b - 1)) / b`` for ``n <= min(S, T)``
    non-empty sequences.
    """
    return max(1, (num_tokens + min(max_num_seqs, num_tokens) * (block_q - 1)) // block_q)


def plan_query_blocks(
    cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, block_q: int
) -> QueryBlocks:
    """Assign query blocks to sequences (jittable; see ``QueryBlocks``)."""
    max_num_seqs = cu_q_lens.shape[0] - 1
    live = jnp.arange(max_num_seqs) < num_seqs[0]
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks_per_seq = (q_lens + block_q - 1) // block_q
    block_end = jnp.cumsum(blocks_per_seq).astype(jnp.int32)
    block_begin = block_end - blocks_per_seq

    blocks = jnp.arange(num_query_blocks(num_tokens, max_num_seqs, block_q), dtype=jnp.int32)
    block_live = blocks < block_end[-1]
    seq = jnp.where(block_live, jnp.searchsorted(block_end, blocks, side="right"), 0)
    seq = seq.astype(jnp.int32)
    q_start = jnp.where(block_live, (blocks - block_begin[seq]) * block_q, num_tokens)

    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    token_valid = rows < cu_q_lens[num_seqs[0]]
    token_seq = jnp.where(token_valid, jnp.searchsorted(cu_q_lens[1:], rows, side="right"), 0)
    offset = jnp.where(token_valid, rows - cu_q_lens[token_seq], 0)
    token_block = jnp.where(token_valid, block_begin[token_seq] + offset // block_q, 0)
    return QueryBlocks(seq, q_start.astype(jnp.int32), token_block.astype(jnp.int32),
                       (offset % block_q).astype(jnp.int32), token_valid)


def gather_query_blocks(
    q: jax.Array, blocks: QueryBlocks, cu_q_lens: jax.Array, block_q: int
) -> jax.Array:
    """``q [T, Hkv, G, D]`` -> ``[num_blocks, Hkv, block_q * G, D]``.

    Row ``i * G + g`` of a block is query token ``q_start + i`` of the block's
    sequence, query head ``g`` of the KV head's group. Rows past the end of
    ``q`` repeat its last row (they are masked garbage the kernels ignore).
    """
    num_tokens, num_kv_heads, group, head_dim = q.shape
    first = cu_q_lens[blocks.seq] + blocks.q_start
    tokens = jnp.clip(first[:, None] + jnp.arange(block_q), 0, num_tokens - 1)
    gathered = q[tokens]  # [NB, block_q, Hkv, G, D]
    gathered = gathered.transpose(0, 2, 1, 3, 4)
    return gathered.reshape(-1, num_kv_heads, block_q * group, head_dim)


def scatter_query_blocks(out: jax.Array, blocks: QueryBlocks, group: int) -> jax.Array:
    """``[num_blocks, Hkv, block_q * G, D]`` -> ``[T, Hkv, G, D]``; padding rows are 0."""
    num_blocks, num_kv_heads, rows, head_dim = out.shape
    out = out.reshape(num_blocks, num_kv_heads, rows // group, group, head_dim)
    per_token = out[blocks.token_block, :, blocks.token_row]  # [T, Hkv, G, D]
    return jnp.where(blocks.token_valid[:, None, None, None], per_token, 0)


def block_kv_range(
    q_start: jax.Array,
    q_len: jax.Array,
    kv_len: jax.Array,
    *,
    block_q: int,
    page_size: int,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Scalar in-kernel bounds of one query block (all int32 scalars).

    ``q_len``/``kv_len`` are those of the block's sequence; padding blocks have
    ``q_start >= q_len``. Returns ``(first_pos, page_lo, page_hi)``: the cache position of the
    block's first query token and the half-open range of page-table columns
    the block attends to (empty for padding blocks). Each column is one page.
    """
    live = q_start < q_len
    first_pos = kv_len - q_len + q_start
    last_pos = kv_len - q_len + jnp.minimum(q_start + block_q, q_len) - 1
    kv_begin = jnp.int32(0)
    if sliding_window is not None:
        kv_begin = jnp.maximum(first_pos - (sliding_window - 1), 0)
    page_lo = jnp.where(live, lax.div(kv_begin, page_size), 0)
    page_hi = jnp.where(live, lax.div(last_pos + page_size, page_size), 0)
    return first_pos, page_lo, page_hi
