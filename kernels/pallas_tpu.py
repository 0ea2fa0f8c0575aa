"""Ragged paged attention as a Pallas/Mosaic kernel for TPUs.

Grid ``(num_query_blocks, pages_per_seq)``. Axis 0 picks a query block
(``block_q`` tokens of one sequence x all query heads, laid out
``[Hkv, rows, D]`` with ``rows = block_q * group``, see ``ragged_blocks``);
axis 1 walks the cache pages of that block's sequence. The page table, the
lengths, ``num_seqs`` and the block-to-sequence map are scalar-prefetched into
SMEM, so the K/V ``BlockSpec`` index maps look the page up and the Pallas
pipeline double-buffers one whole page ``[page_size, Hkv, D]`` per step from
HBM into VMEM. Steps past the pages a block needs re-point at its last page
(no new DMA) and skip the compute. The online-softmax state lives in VMEM
scratch: initialised at page step 0, written out (normalised) at the last.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.ragged_blocks import (
    block_kv_range,
    default_block_q,
    gather_query_blocks,
    num_query_blocks,
    plan_query_blocks,
    scatter_query_blocks,
)

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LANES = 128  # Softmax statistics are kept lane-replicated, [rows, 128].
MIN_ROWS = 8  # One sublane tile.
MAX_ROWS = 128


def _bounds(b, block_seq_ref, block_q_start_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref,
            *, block_q: int, page_size: int, sliding_window: int | None):
    """(seq, first_pos, page_lo, page_hi) of query block ``b`` from SMEM scalars."""
    seq = block_seq_ref[b]
    q_len = jnp.where(seq < num_seqs_ref[0], cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq], 0)
    first_pos, page_lo, page_hi = block_kv_range(
        block_q_start_ref[b], q_len, kv_lens_ref[seq],
        block_q=block_q, page_size=page_size, sliding_window=sliding_window)
    return seq, first_pos, page_lo, page_hi


def _kernel(
    block_seq_ref, block_q_start_ref, page_table_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref,
    q_ref, k_ref, v_ref,
    o_ref,
    m_ref, l_ref, acc_ref,
    *, sm_scale: float, sliding_window: int | None, soft_cap: float | None,
    block_q: int, group: int,
):
    """One (query block, page step).

    Refs: q/o ``[Hkv, rows, D]``; k/v one page ``[page_size, Hkv, D]``;
    scratch m, l ``[Hkv, rows, LANES]`` and acc ``[Hkv, rows, D]`` float32.
    """
    del page_table_ref  # Only the index maps read it.
    b, step = pl.program_id(0), pl.program_id(1)
    num_kv_heads, rows, _ = q_ref.shape
    page_size = k_ref.shape[0]
    _, first_pos, page_lo, page_hi = _bounds(
        b, block_seq_ref, block_q_start_ref, kv_lens_ref, cu_q_lens_ref, num_seqs_ref,
        block_q=block_q, page_size=page_size, sliding_window=sliding_window)

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    col = page_lo + step

    @pl.when(col < page_hi)
    def _attend():
        q_pos = first_pos + lax.div(lax.broadcasted_iota(jnp.int32, (rows, page_size), 0), group)
        kv_pos = col * page_size + lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
        mask = kv_pos <= q_pos
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window
        for h in range(num_kv_heads):
            k = k_ref[:, h, :]  # [page_size, D]
            v = v_ref[:, h, :]
            s = lax.dot_general(q_ref[h], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, MASK_VALUE)
            m_prev = m_ref[h][:, :1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            correction = jnp.exp(m_prev - m_next)
            p = jnp.exp(s - m_next)
            l_next = l_ref[h][:, :1] * correction + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            acc_ref[h] = acc_ref[h] * correction + pv
            m_ref[h] = jnp.broadcast_to(m_next, (rows, LANES))
            l_ref[h] = jnp.broadcast_to(l_next, (rows, LANES))

    @pl.when(step == pl.num_programs(1) - 1)
    def _finish():
        l = jnp.maximum(l_ref[...][:, :, :1], 1e-30)  # Padding blocks have l = 0.
        o_ref[...] = (acc_ref[...] / l).astype(o_ref.dtype)


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
) -> jax.Array:
    """Mosaic ragged paged attention; shapes as in ``kernels.ragged_paged_attention``.

    ``interpret=True`` runs the kernel with Pallas' TPU interpreter
    (``pltpu.InterpretParams``), which also checks out-of-bounds reads, on any
    backend. Padding query rows return zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    max_num_seqs, pages_per_seq = page_table.shape
    group = num_q_heads // num_kv_heads
    if block_q is None:
        block_q = default_block_q(num_tokens, max_num_seqs, group, MIN_ROWS, MAX_ROWS)
    num_blocks = num_query_blocks(num_tokens, max_num_seqs, block_q)
    rows = block_q * group

    blocks = plan_query_blocks(cu_q_lens, num_seqs, num_tokens, block_q)
    q_blocks = gather_query_blocks(
        q.reshape(num_tokens, num_kv_heads, group, head_dim), blocks, cu_q_lens, block_q)
    bounds = functools.partial(_bounds, block_q=block_q, page_size=page_size,
                               sliding_window=sliding_window)

    def kv_index_map(b, step, block_seq, block_q_start, page_table, kv_lens, cu_q_lens, num_seqs):
        seq, _, page_lo, page_hi = bounds(b, block_seq, block_q_start, kv_lens, cu_q_lens, num_seqs)
        col = jnp.minimum(page_lo + step, jnp.maximum(page_hi - 1, page_lo))
        return (jnp.clip(page_table[seq, col], 0, num_pages - 1), 0, 0, 0)

    q_spec = pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda b, step, *_: (b, 0, 0, 0))
    kv_spec = pl.BlockSpec((None, page_size, num_kv_heads, head_dim), kv_index_map)
    scalars = (blocks.seq, blocks.q_start, page_table, kv_lens, cu_q_lens, num_seqs)
    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, sliding_window=sliding_window,
                          soft_cap=soft_cap, block_q=block_q, group=group),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(num_blocks, pages_per_seq),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                            pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention_tpu",
    )(*scalars, q_blocks, k_pages, v_pages)
    return scatter_query_blocks(out, blocks, group).reshape(num_tokens, num_q_heads, head_dim)
