"""Ragged paged attention as a Pallas kernel for NVIDIA GPUs (Triton lowering).

Grid ``(num_query_blocks, num_kv_heads, num_kv_splits)``. One program takes
one query block (``block_q`` tokens of one sequence x the ``group`` query
heads of one KV head: a ``[rows, D]`` tile, see ``ragged_blocks``) and walks
the sequence's pages it needs, ``pages_per_step`` pages per loop iteration
(a ``[pages_per_step * page_size, D]`` tile of K and of V gathered straight
from the paged cache through the page table), with an online softmax in
float32. Causality inside a prefill chunk, the sliding window, the split's
end and padding rows are handled by one mask per tile.

With ``num_kv_splits > 1`` (flash-decoding) each program handles a
contiguous share of the block's pages and writes an unnormalised partial
result plus its running max and sum; the partials are merged in jnp. This
keeps the GPU busy when there are few (query block, KV head) pairs, e.g.
small decode batches with long contexts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.ragged_blocks import (
    block_kv_range,
    default_block_q,
    gather_query_blocks,
    num_query_blocks,
    plan_query_blocks,
    next_power_of_two,
    scatter_query_blocks,
)

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
MIN_DOT_ROWS = 16  # tl.dot needs every operand dimension >= 16.
MAX_ROWS = 64
KV_TILE = 64  # Cached tokens per loop iteration (pages_per_step * page_size).


def default_num_kv_splits(num_blocks: int, num_kv_heads: int, pages_per_seq: int) -> int:
    """Split the KV walk when there are fewer than ~2 programs per GPU core."""
    programs = num_blocks * num_kv_heads
    return max(1, min(pages_per_seq // 4, -(-256 // programs)))


def _kernel(
    block_seq_ref, block_q_start_ref, page_table_ref, kv_lens_ref, cu_q_lens_ref,
    q_ref, k_pages_ref, v_pages_ref,
    o_ref, m_ref, l_ref,
    *, sm_scale: float, sliding_window: int | None, soft_cap: float | None,
    block_q: int, group: int, num_kv_splits: int, pages_per_step: int,
    precision: lax.Precision | None,
):
    """One (query block, KV head, KV split).

    Refs: q ``[rows, D]``; k/v pages ``[P, page_size, Hkv, D]`` (whole cache,
    in HBM); o ``[rows, D]`` float32 unnormalised; m, l ``[rows]`` float32
    running max and sum of the split.
    """
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size = k_pages_ref.shape[1]
    rows, head_dim = q_ref.shape
    seq = block_seq_ref[b]
    q_start = block_q_start_ref[b]
    q_len = cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq]
    first_pos, page_lo, page_hi = block_kv_range(
        q_start, q_len, kv_lens_ref[seq],
        block_q=block_q, page_size=page_size, sliding_window=sliding_window)
    per_split = lax.div(page_hi - page_lo + num_kv_splits - 1, num_kv_splits)
    split_lo = page_lo + split * per_split
    split_hi = jnp.minimum(page_hi, split_lo + per_split)

    q = q_ref[...]
    q_pos = first_pos + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)
    tile = pages_per_step * page_size
    offsets = lax.broadcasted_iota(jnp.int32, (1, tile), 1)
    num_pages = k_pages_ref.shape[0]

    def body(step, carry):
        acc, m_prev, l_prev = carry
        col = split_lo + step * pages_per_step
        # page_table is padded by pages_per_step columns; unused ids are masked.
        pages = jnp.clip(page_table_ref[seq, pl.ds(col, pages_per_step)], 0, num_pages - 1)
        k = k_pages_ref[pages, :, h, :].reshape(tile, head_dim)
        v = v_pages_ref[pages, :, h, :].reshape(tile, head_dim)
        s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = col * page_size + offsets
        mask = (kv_pos <= q_pos) & (kv_pos < split_hi * page_size)
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window
        s = jnp.where(mask, s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        l_next = l_prev * correction + jnp.sum(p, axis=1)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=precision).astype(jnp.float32)
        return acc * correction[:, None] + pv, m_next, l_next

    init = (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    num_steps = lax.div(split_hi - split_lo + pages_per_step - 1, pages_per_step)
    acc, m, l = lax.fori_loop(0, jnp.maximum(num_steps, 0), body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    block_q: int | None = None,
    num_kv_splits: int | None = None,
    pages_per_step: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """Triton ragged paged attention; shapes as in ``kernels.ragged_paged_attention``.

    ``block_q`` (query tokens per program), ``num_kv_splits`` (programs per
    query block and KV head) and ``pages_per_step`` (pages per loop iteration,
    a power of two) default to heuristics of the static shapes
    (``num_kv_splits`` to 1 in interpret mode).
    Padding query rows return zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    max_num_seqs, pages_per_seq = page_table.shape
    group = num_q_heads // num_kv_heads
    padded_group = next_power_of_two(group)  # Triton tiles are powers of two.
    if block_q is None:
        block_q = default_block_q(num_tokens, max_num_seqs, padded_group, MIN_DOT_ROWS, MAX_ROWS)
    num_blocks = num_query_blocks(num_tokens, max_num_seqs, block_q)
    if num_kv_splits is None:
        num_kv_splits = 1 if interpret else default_num_kv_splits(
            num_blocks, num_kv_heads, pages_per_seq)
    if pages_per_step is None:
        pages_per_step = max(1, KV_TILE // page_size)
    rows = block_q * padded_group

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded_group - group), (0, 0)))
    blocks = plan_query_blocks(cu_q_lens, num_seqs, num_tokens, block_q)
    q_blocks = gather_query_blocks(qg, blocks, cu_q_lens, block_q)

    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=block_q, group=padded_group, num_kv_splits=num_kv_splits,
        pages_per_step=pages_per_step,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)
    tile = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))
    partial_tile = pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (s, b, h, 0, 0))
    stat_tile = pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0))
    partial_shape = (num_kv_splits, num_blocks, num_kv_heads, rows)
    padded_table = jnp.pad(page_table, ((0, 0), (0, pages_per_step)))
    metadata = (blocks.seq, blocks.q_start, padded_table, kv_lens, cu_q_lens)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads, num_kv_splits),
        in_specs=[whole(x) for x in metadata] + [tile, whole(k_pages), whole(v_pages)],
        out_specs=[partial_tile, stat_tile, stat_tile],
        out_shape=[jax.ShapeDtypeStruct(partial_shape + (head_dim,), jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                   jax.ShapeDtypeStruct(partial_shape, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*metadata, q_blocks, k_pages, v_pages)

    # Merge the splits: rescale each to the global max, then normalise.
    m_max = jnp.max(m, axis=0)
    weight = jnp.exp(m - m_max)
    l_total = jnp.sum(l * weight, axis=0)
    out = jnp.sum(acc * weight[..., None], axis=0) / jnp.maximum(l_total, 1e-30)[..., None]
    out = scatter_query_blocks(out.astype(q.dtype), blocks, padded_group)
    return out[:, :, :group].reshape(num_tokens, num_q_heads, head_dim)
