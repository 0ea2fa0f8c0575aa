"""Ragged paged attention as a Pallas kernel for Hopper and newer (Mosaic GPU).

One CUDA block (one warpgroup, 128 threads) per ``(query block, KV head,
KV split)``. A query block is ``block_q`` tokens of one sequence times the
``group`` query heads that share the KV head (GQA), packed into the rows of a
``[ROWS, D]`` tile, ``ROWS = 64`` (one ``wgmma`` M tile); rows past
``block_q * group`` are zero padding (see ``ragged_blocks``). So a decode token
of a model with ``group = 8`` fills 8 rows, and a prefill chunk fills all 64.

The block walks the pages it needs (``block_kv_range``), ``pages_per_step``
pages per step, i.e. a ``[kv_tile, D]`` tile of K and of V,
``kv_tile = pages_per_step * page_size``. Every page is its own TMA copy
(``k_pages[page, :, h, :]``, a strided ``[page_size, D]`` box) into a slice
of a swizzled shared-memory buffer; the copies of one step arrive on one
barrier per operand. ``num_stages`` buffers form a ring: while step ``i`` is
computed, the copies of steps ``i + 1 … i + num_stages - 1`` are in flight.
``s = q kᵀ`` and ``acc += p v`` are ``wgmma`` tensor-core matmuls with float32
accumulators; the online softmax (exp2 with log2(e) folded in), soft cap and
the mask (causality inside a prefill chunk, sliding window, end of the
split) run on the accumulator fragments in registers.

With ``num_kv_splits > 1`` (flash-decoding) each block takes a contiguous
share of the pages and writes its unnormalised accumulator with its running
max and sum (float32, in HBM); a jnp epilogue merges the splits, as the
Triton kernel does. Splits default to enough blocks for ~2 per SM.

The kernel needs a ``bfloat16``/``float16`` cache (tensor cores have no
float32 ``wgmma``; TF32 would not meet the float32 contract), ``head_dim`` a
multiple of 64 up to 256 (128-byte swizzle) and a ``page_size`` from
``PAGE_SIZES``; ``kernels.validate`` rejects other calls before tracing.
``interpret=True`` runs it with JAX's Mosaic GPU interpreter on any backend,
which simulates shared memory, TMA copies and barriers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.ragged_blocks import (
    block_kv_range,
    gather_query_blocks,
    num_query_blocks,
    plan_query_blocks,
    scatter_query_blocks,
)

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
ROWS = 64  # Rows of a query tile: one wgmma M tile of one warpgroup.
KV_TILE = 64  # Default cached tokens per step (pages_per_step * page_size).
PAGE_SIZES = (8, 16, 32, 64, 128, 256)  # Multiples of the 8-row smem tile that tile KV_TILE.
HEAD_DIM_MULTIPLE = 64  # One 128-byte swizzle row of bfloat16.
MAX_HEAD_DIM = 256
MAX_KV_TILE = 256  # wgmma N limit (s = q kᵀ is [ROWS, kv_tile]).
SMEM_BYTES = 227 * 1024  # Shared memory a block may use on H100/H200 (and B200).
SMEM_SLACK = 4096  # Barriers and 1024-byte alignment of the swizzled buffers.
NUM_SMS = 132  # H100 SXM; only sizes the default split count.
LOG2E = math.log2(math.e)
SWIZZLE_BYTES = 128


def default_num_kv_splits(num_blocks: int, num_kv_heads: int, pages_per_seq: int) -> int:
    """Split the KV walk when there are fewer than ~2 blocks per SM."""
    programs = num_blocks * num_kv_heads
    return max(1, min(pages_per_seq // 4, -(-2 * NUM_SMS // programs)))


def smem_bytes(head_dim: int, kv_tile: int, num_stages: int, itemsize: int) -> int:
    """Shared memory of one block in bytes: q tile, K and V rings, barriers and alignment."""
    return (ROWS * head_dim * itemsize + 2 * num_stages * kv_tile * head_dim * itemsize
            + SMEM_SLACK)


def _smem_transforms(dtype: jnp.dtype) -> tuple:
    """Tiling + 128-byte swizzle that wgmma and TMA expect for a [rows, D] smem tile."""
    cols = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(SWIZZLE_BYTES))


def _wgmma(a, b_ref, *, transpose_b: bool) -> jax.Array:
    """``a @ b`` (or ``a @ bᵀ``) on the tensor cores into a fresh float32 accumulator.

    ``a``: ``[ROWS, K]`` smem ref or registers; ``b_ref``: smem ref ``[K, N]``
    (``[N, K]`` with ``transpose_b``). Returns ``[ROWS, N]`` float32 in the
    WGMMA register layout.
    """
    n = b_ref.shape[0] if transpose_b else b_ref.shape[1]
    b = b_ref.transpose((1, 0)) if transpose_b else b_ref   # plgpu.transpose_ref: deprecated in JAX 0.11

    def scope(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((ROWS, n), jnp.float32))


def _interpret_matmul(a, b_ref, *, transpose_b: bool) -> jax.Array:
    """What ``_wgmma`` computes, for the interpreter: float32-accumulated dot.

    JAX 0.10's Mosaic GPU interpreter runs ``wgmma`` only with both operands
    in smem and without ``transpose_ref``; this kernel keeps ``p`` in
    registers and reads K transposed, so in interpret mode the two matmuls
    are plain dots of the same (loaded) tiles. The TMA copies, barriers,
    ring slots and everything around the matmuls still run in the
    interpreter; the ``wgmma`` calls themselves are checked by lowering.
    """
    a = a[...]  # Loads a ref; a no-op on a value.
    dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
    return lax.dot_general(a, b_ref[...], dims, preferred_element_type=jnp.float32)


def _kernel(
    block_seq_ref, block_q_start_ref, page_table_ref, kv_lens_ref, cu_q_lens_ref,
    q_ref, k_pages_ref, v_pages_ref,
    o_ref, m_ref, l_ref,
    q_smem, k_smem, v_smem, q_bar, k_bar, v_bar,
    *, sm_scale: float, sliding_window: int | None, soft_cap: float | None,
    block_q: int, group: int, num_kv_splits: int, pages_per_step: int, num_stages: int,
    interpret: bool,
):
    """One (query block, KV head, KV split); all operands live in HBM (GMEM).

    Refs: metadata int32 (see ``ragged_paged_attention``); q ``[NB, Hkv, ROWS,
    D]``; k/v pages ``[P, page_size, Hkv, D]``; o ``[splits, NB, Hkv, ROWS,
    D]`` float32 unnormalised; m, l ``[splits, NB, Hkv, ROWS]`` float32.
    Scratch: the q tile ``[ROWS, D]``, K/V rings ``[num_stages, kv_tile, D]``
    and the barriers.
    Register layouts are hints for the compiler only; the interpreter has no
    rule for ``layout_cast``, so in interpret mode they are left out, and the
    two matmuls run as ``_interpret_matmul`` (see there).
    """
    layout_cast = (lambda x, _: x) if interpret else plgpu.layout_cast
    matmul = _interpret_matmul if interpret else _wgmma
    b, h, split = lax.axis_index("block"), lax.axis_index("head"), lax.axis_index("split")
    num_pages, page_size = k_pages_ref.shape[0], k_pages_ref.shape[1]
    max_col = page_table_ref.shape[1] - 1
    head_dim = q_ref.shape[-1]
    kv_tile = pages_per_step * page_size
    seq = block_seq_ref[b]
    q_start = block_q_start_ref[b]
    q_len = cu_q_lens_ref[seq + 1] - cu_q_lens_ref[seq]
    first_pos, page_lo, page_hi = block_kv_range(
        q_start, q_len, kv_lens_ref[seq],
        block_q=block_q, page_size=page_size, sliding_window=sliding_window)
    per_split = lax.div(page_hi - page_lo + num_kv_splits - 1, num_kv_splits)
    split_lo = page_lo + split * per_split
    split_hi = jnp.minimum(page_hi, split_lo + per_split)
    num_steps = jnp.maximum(lax.div(split_hi - split_lo + pages_per_step - 1, pages_per_step), 0)

    def start_loads(step):
        """Issue the TMA copies of one step's pages into its ring slot."""
        slot = lax.rem(step, num_stages)
        for i in range(pages_per_step):
            col = jnp.minimum(split_lo + step * pages_per_step + i, max_col)
            page = jnp.clip(page_table_ref[seq, col], 0, num_pages - 1)
            rows = pl.ds(i * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_pages_ref.at[page, :, h, :], k_smem.at[slot, rows], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_pages_ref.at[page, :, h, :], v_smem.at[slot, rows], v_bar.at[slot])

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
    for step in range(num_stages - 1):
        pl.when(step < num_steps)(functools.partial(start_loads, step))
    plgpu.barrier_wait(q_bar)

    row = layout_cast(lax.broadcasted_iota(jnp.int32, (ROWS, kv_tile), 0), plgpu.Layout.WGMMA)
    offset = layout_cast(lax.broadcasted_iota(jnp.int32, (ROWS, kv_tile), 1), plgpu.Layout.WGMMA)
    split_end = split_hi * page_size

    def body(step, carry):
        acc, m_prev, l_prev = carry
        slot = lax.rem(step, num_stages)
        pl.when(step + num_stages - 1 < num_steps)(
            functools.partial(start_loads, step + num_stages - 1))
        plgpu.barrier_wait(k_bar.at[slot])

        s = matmul(q_smem, k_smem.at[slot], transpose_b=True) * sm_scale
        if soft_cap is not None:
            s = jnp.tanh(s * (1.0 / soft_cap)) * soft_cap
        # Query row r is token r // group: pos(r) = first_pos + r // group, and
        # kv <= pos(r)  <=>  (kv - first_pos) * group <= r  (no integer division).
        kv_pos = (split_lo + step * pages_per_step) * page_size + offset
        delta = (kv_pos - first_pos) * group
        mask = (delta <= row) & (kv_pos < split_end)
        if sliding_window is not None:
            mask &= row < delta + sliding_window * group  # kv > pos(r) - window
        s = jnp.where(mask, s * LOG2E, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        correction = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
        l_next = l_prev * correction + p.sum(axis=1)
        plgpu.barrier_wait(v_bar.at[slot])

        pv_tile = matmul(p.astype(v_smem.dtype), v_smem.at[slot], transpose_b=False)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv_tile
        return acc, m_next, l_next

    init = (
        layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
        layout_cast(jnp.full((ROWS,), MASK_VALUE, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
    )
    acc, m, l = lax.fori_loop(0, num_steps, body, init)

    # Straight from registers to HBM (once per block; no smem staging, which
    # would not fit beside the rings at head_dim 256). m is kept in log2
    # units inside the loop; the merge works in natural units.
    o_ref[split, b, h] = acc
    m_ref[split, b, h] = m * (1.0 / LOG2E)
    l_ref[split, b, h] = l


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
    interpret=False,
    num_kv_splits: int | None = None,
    pages_per_step: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """Mosaic GPU ragged paged attention; shapes as in ``kernels.ragged_paged_attention``.

    ``num_kv_splits`` (blocks per query block and KV head) defaults to a
    heuristic of the static shapes (1 in interpret mode); ``pages_per_step``
    (pages per pipeline step) to ``KV_TILE // page_size`` (at least 1);
    ``num_stages`` (ring slots, >= 2) to 3, or 2 where 3 do not fit in
    shared memory. ``interpret`` is a bool or an ``InterpretGPUParams`` (e.g.
    with ``detect_races=True``). Padding query rows return zeros.

    Raises:
      ValueError: if ``pages_per_step``/``num_stages`` give a KV tile that is
        not a multiple of 64 up to ``MAX_KV_TILE`` or does not fit in shared
        memory (static, before tracing the kernel).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    max_num_seqs, pages_per_seq = page_table.shape
    group = num_q_heads // num_kv_heads
    block_q = max(1, ROWS // group)
    num_blocks = num_query_blocks(num_tokens, max_num_seqs, block_q)
    if num_kv_splits is None:
        num_kv_splits = 1 if interpret else default_num_kv_splits(
            num_blocks, num_kv_heads, pages_per_seq)
    if pages_per_step is None:
        pages_per_step = max(1, KV_TILE // page_size)
    kv_tile = pages_per_step * page_size
    if kv_tile % KV_TILE or kv_tile > MAX_KV_TILE:
        raise ValueError(f"pages_per_step * page_size = {kv_tile} must be a multiple of {KV_TILE} "
                         f"up to {MAX_KV_TILE} (wgmma tile)")
    itemsize = jnp.dtype(q.dtype).itemsize
    if num_stages is None:
        num_stages = 3 if smem_bytes(head_dim, kv_tile, 3, itemsize) <= SMEM_BYTES else 2
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2, got {num_stages}")
    if (need := smem_bytes(head_dim, kv_tile, num_stages, itemsize)) > SMEM_BYTES:
        raise ValueError(f"head_dim={head_dim}, KV tile {kv_tile} and {num_stages} stages need "
                         f"{need} bytes of shared memory, more than {SMEM_BYTES}")

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    blocks = plan_query_blocks(cu_q_lens, num_seqs, num_tokens, block_q)
    q_blocks = gather_query_blocks(qg, blocks, cu_q_lens, block_q)
    q_blocks = jnp.pad(q_blocks, ((0, 0), (0, 0), (0, ROWS - block_q * group), (0, 0)))

    kernel = functools.partial(
        _kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        block_q=block_q, group=group, num_kv_splits=num_kv_splits,
        pages_per_step=pages_per_step, num_stages=num_stages, interpret=bool(interpret))
    transforms = _smem_transforms(q.dtype)
    stats = jax.ShapeDtypeStruct((num_kv_splits, num_blocks, num_kv_heads, ROWS), jnp.float32)
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct(stats.shape + (head_dim,), jnp.float32), stats, stats),
        scratch_types=(
            plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((num_stages, kv_tile, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((num_stages, kv_tile, head_dim), q.dtype, transforms=transforms),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=num_stages),
        ),
        grid=(num_blocks, num_kv_heads, num_kv_splits),
        grid_names=("block", "head", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params(interpret),
    )
    acc, m, l = call(blocks.seq, blocks.q_start, page_table, kv_lens, cu_q_lens,
                     q_blocks, k_pages, v_pages)

    # Merge the splits: rescale each to the global max, then normalise.
    m_max = jnp.max(m, axis=0)
    weight = jnp.exp(m - m_max)
    l_total = jnp.sum(l * weight, axis=0)
    out = jnp.sum(acc * weight[..., None], axis=0) / jnp.maximum(l_total, 1e-30)[..., None]
    out = out[:, :, :block_q * group].astype(q.dtype)
    out = scatter_query_blocks(out, blocks, group)
    return out.reshape(num_tokens, num_q_heads, head_dim)


def _interpret_params(interpret):
    """``None`` (compile for the GPU) or parameters of JAX's Mosaic GPU interpreter.

    The interpreter simulates shared memory, TMA copies and barriers on any
    backend, raises on out-of-bounds reads, fills fresh buffers with NaN and
    (``detect_races=True``) reports data races. It lives under ``jax._src``
    in JAX 0.10 (no public alias yet).
    """
    if not interpret:
        return None
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return interpret if isinstance(interpret, InterpretGPUParams) else InterpretGPUParams()
