"""Static argument checks for the attention and KV-write entry points.

Every check reads only shapes and dtypes, so it runs at trace time under
``jax.jit`` and raises a ``ValueError`` naming the bad argument before any
kernel is built or launched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("reference", "pallas_gpu", "pallas_mosaic_gpu", "pallas_tpu")
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _check_rank(name: str, x: jax.Array, rank: int, layout: str) -> None:
    if jnp.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {jnp.shape(x)}")


def _check_int32(name: str, x: jax.Array) -> None:
    if jnp.result_type(x) != jnp.int32:
        raise ValueError(f"{name} must be int32, got {jnp.result_type(x)}")


def _check_float(name: str, x: jax.Array) -> None:
    if jnp.result_type(x) not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {jnp.result_type(x)}")


def _check_pages(k_pages: jax.Array, v_pages: jax.Array) -> None:
    _check_rank("k_pages", k_pages, 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    _check_rank("v_pages", v_pages, 4, "[num_pages, page_size, num_kv_heads, head_dim]")
    _check_float("k_pages", k_pages)
    if jnp.shape(v_pages) != jnp.shape(k_pages):
        raise ValueError(f"v_pages shape {jnp.shape(v_pages)} != k_pages shape {jnp.shape(k_pages)}")
    if jnp.result_type(v_pages) != jnp.result_type(k_pages):
        raise ValueError(f"v_pages dtype {jnp.result_type(v_pages)} != k_pages dtype {jnp.result_type(k_pages)}")


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_attention_args(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None,
    sliding_window: int | None,
    soft_cap: float | None,
    impl: str,
) -> None:
    """Raise ``ValueError`` if a ``ragged_paged_attention`` call is malformed.

    See ``kernels.ragged_paged_attention`` for the expected shapes.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _check_rank("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    _check_float("q", q)
    _check_pages(k_pages, v_pages)
    if jnp.result_type(q) != jnp.result_type(k_pages):
        raise ValueError(f"q dtype {jnp.result_type(q)} != k_pages dtype {jnp.result_type(k_pages)}")
    _, num_q_heads, head_dim = jnp.shape(q)
    _, page_size, num_kv_heads, page_head_dim = jnp.shape(k_pages)
    if page_head_dim != head_dim:
        raise ValueError(f"k_pages head_dim {page_head_dim} != q head_dim {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q num_q_heads ({num_q_heads}) must be a multiple of k_pages num_kv_heads ({num_kv_heads})"
        )
    _check_rank("page_table", page_table, 2, "[max_num_seqs, pages_per_seq]")
    _check_rank("kv_lens", kv_lens, 1, "[max_num_seqs]")
    _check_rank("cu_q_lens", cu_q_lens, 1, "[max_num_seqs + 1]")
    _check_rank("num_seqs", num_seqs, 1, "[1]")
    for name, x in (("page_table", page_table), ("kv_lens", kv_lens),
                    ("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
        _check_int32(name, x)
    max_num_seqs = jnp.shape(page_table)[0]
    if jnp.shape(kv_lens)[0] != max_num_seqs:
        raise ValueError(f"kv_lens length {jnp.shape(kv_lens)[0]} != page_table rows {max_num_seqs}")
    if jnp.shape(cu_q_lens)[0] != max_num_seqs + 1:
        raise ValueError(f"cu_q_lens length {jnp.shape(cu_q_lens)[0]} != page_table rows + 1 ({max_num_seqs + 1})")
    if jnp.shape(num_seqs)[0] != 1:
        raise ValueError(f"num_seqs must have shape (1,), got {jnp.shape(num_seqs)}")
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale must be positive, got {sm_scale}")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int, got {sliding_window}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    check_impl_tiling(impl, jnp.result_type(q), head_dim, page_size, num_q_heads // num_kv_heads)


def check_impl_tiling(impl: str, dtype, head_dim: int, page_size: int, group: int) -> None:
    """Raise ``ValueError`` (its message starting ``impl='...'``) if ``impl`` cannot tile an
    attention of this cache ``dtype``, ``head_dim``, ``page_size`` (tokens per page) and GQA
    ``group`` (query heads per KV head); the reference and the TPU kernel tile any."""
    if impl == "pallas_gpu":
        # Triton tensors must have power-of-two sizes and tl.dot needs >= 16.
        for name, n in (("head_dim", head_dim), ("page_size", page_size)):
            if not _is_power_of_two(n) or n < 16:
                raise ValueError(f"impl='pallas_gpu' needs a power-of-two {name} >= 16, got {n}")
    if impl == "pallas_mosaic_gpu":
        _check_mosaic_gpu_tiling(jnp.dtype(dtype), head_dim, page_size, group)


def _check_mosaic_gpu_tiling(dtype: jnp.dtype, head_dim: int, page_size: int, group: int) -> None:
    """What ``kernels.pallas_mosaic_gpu`` can tile (wgmma + 128-byte swizzled TMA)."""
    from kernels import pallas_mosaic_gpu as mosaic  # Its limits live with the kernel.

    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"impl='pallas_mosaic_gpu' needs a bfloat16 or float16 cache (tensor cores "
                         f"have no float32 wgmma), got {dtype}; use 'pallas_gpu' or 'reference' for float32")
    if head_dim % mosaic.HEAD_DIM_MULTIPLE or head_dim > mosaic.MAX_HEAD_DIM:
        raise ValueError(f"impl='pallas_mosaic_gpu' needs head_dim a multiple of {mosaic.HEAD_DIM_MULTIPLE} "
                         f"up to {mosaic.MAX_HEAD_DIM}, got {head_dim}")
    if page_size not in mosaic.PAGE_SIZES:
        raise ValueError(f"impl='pallas_mosaic_gpu' needs page_size in {mosaic.PAGE_SIZES}, got {page_size}")
    if group > mosaic.ROWS:
        raise ValueError(f"impl='pallas_mosaic_gpu' packs a GQA group into {mosaic.ROWS} rows; "
                         f"num_q_heads / num_kv_heads = {group} is larger")


def check_kv_write_args(
    k_pages: jax.Array,
    v_pages: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    slot_mapping: jax.Array,
) -> None:
    """Raise ``ValueError`` if a ``write_kv_pages`` call is malformed."""
    _check_pages(k_pages, v_pages)
    _check_rank("new_k", new_k, 3, "[num_tokens, num_kv_heads, head_dim]")
    _check_rank("new_v", new_v, 3, "[num_tokens, num_kv_heads, head_dim]")
    page_row = tuple(jnp.shape(k_pages)[2:])
    for name, x in (("new_k", new_k), ("new_v", new_v)):
        if tuple(jnp.shape(x)[1:]) != page_row:
            raise ValueError(f"{name} shape {jnp.shape(x)} does not match k_pages [.., .., {page_row[0]}, {page_row[1]}]")
        if jnp.result_type(x) != jnp.result_type(k_pages):
            raise ValueError(f"{name} dtype {jnp.result_type(x)} != k_pages dtype {jnp.result_type(k_pages)}")
    if jnp.shape(new_v) != jnp.shape(new_k):
        raise ValueError(f"new_v shape {jnp.shape(new_v)} != new_k shape {jnp.shape(new_k)}")
    _check_rank("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _check_int32("slot_mapping", slot_mapping)
    if jnp.shape(slot_mapping)[0] != jnp.shape(new_k)[0]:
        raise ValueError(f"slot_mapping length {jnp.shape(slot_mapping)[0]} != new_k tokens {jnp.shape(new_k)[0]}")
