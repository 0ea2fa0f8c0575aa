"""Paged-attention kernels for jaxserve and their plain-jnp references.

Public entry points (the contract in DESIGN.md section 8):

- ``ragged_paged_attention``: attention of a ragged batch of query tokens
  (prefill chunks and single decode tokens mixed) over a paged KV cache.
- ``write_kv_pages`` / ``write_kv_pages_donated``: scatter this step's K/V
  into the pages.
- ``default_impl``: the implementation to use on the current backend.
"""

from __future__ import annotations

import math

import jax

from kernels import pallas_gpu, pallas_tpu, reference
from kernels.kv_write import write_kv_pages, write_kv_pages_donated
from kernels.validate import IMPLS, check_attention_args

__all__ = [
    "IMPLS",
    "default_impl",
    "ragged_paged_attention",
    "write_kv_pages",
    "write_kv_pages_donated",
]


def default_impl() -> str:
    """``"pallas_gpu"`` on a GPU backend, ``"pallas_tpu"`` on TPU, else ``"reference"``."""
    return {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(jax.default_backend(), "reference")


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str = "reference",
    interpret: bool = False,
) -> jax.Array:
    """Attention of this step's ragged query tokens over the paged KV cache.

    Args:
      q: ``[T, Hq, D]`` query tokens of all sequences, back to back.
      k_pages, v_pages: ``[P, page_size, Hkv, D]`` cache pages; ``Hq % Hkv == 0``.
      page_table: int32 ``[S, pages_per_seq]`` page ids of each sequence.
      kv_lens: int32 ``[S]`` tokens in the cache per sequence, this step's included.
      cu_q_lens: int32 ``[S + 1]`` cumulative query lengths (rows past
        ``num_seqs`` repeat the last value).
      num_seqs: int32 ``[1]`` live sequences; later rows are padding, never read.
      sm_scale: logit scale, default ``1 / sqrt(D)``.
      sliding_window: if set, query at position ``p`` sees only positions
        ``> p - sliding_window``.
      soft_cap: if set, logits become ``soft_cap * tanh(logits / soft_cap)``.
      impl: ``"reference"``, ``"pallas_gpu"`` or ``"pallas_tpu"``.
      interpret: run a Pallas kernel in interpret mode (any backend).

    Query ``j`` of sequence ``s`` sits at cache position
    ``kv_lens[s] - q_len_s + j`` and attends causally to positions up to it.

    Returns:
      ``[T, Hq, D]`` in ``q.dtype`` (float32 accumulation); rows past
      ``cu_q_lens[num_seqs]`` are zeros.

    Raises:
      ValueError: on malformed arguments (static checks, before any launch).
    """
    check_attention_args(q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs,
                         sm_scale=sm_scale, sliding_window=sliding_window,
                         soft_cap=soft_cap, impl=impl)
    args = (q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs)
    options = dict(
        sm_scale=1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale),
        sliding_window=None if sliding_window is None else int(sliding_window),
        soft_cap=None if soft_cap is None else float(soft_cap),
    )
    if impl == "reference":
        return reference.ragged_paged_attention(*args, **options)
    kernel = pallas_gpu if impl == "pallas_gpu" else pallas_tpu
    return kernel.ragged_paged_attention(*args, **options, interpret=interpret)
