"""The KV write and the attention kernel of one layer, run per shard.

Under tensor parallelism each device holds ``Hq / tp`` query heads and
``Hkv / tp`` KV heads (their pages included); grouped-query attention never
mixes heads across the KV-head groups, so each shard writes its new K/V and
runs the kernel (reference, Pallas GPU or Pallas TPU) on its own heads under
``shard_map`` with no communication. Without a mesh, or on a one-device mesh,
the kernels are called directly.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh, PartitionSpec as P

import kernels
from jaxserve.parallel.mesh import MODEL_AXIS

_HEADS = P(None, MODEL_AXIS, None)            # [T, H, D]
_PAGES = P(None, None, MODEL_AXIS, None)      # [P, page_size, Hkv, D]


def write_and_attend(q: jax.Array, k: jax.Array, v: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                     slot_mapping: jax.Array, page_table: jax.Array, kv_lens: jax.Array, cu_q_lens: jax.Array,
                     num_seqs: jax.Array, *, mesh: Mesh | None, sliding_window: int | None, impl: str,
                     interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write this step's ``k``/``v`` ``[T, Hkv, D]`` into the pages at ``slot_mapping``,
    then attend ``q [T, Hq, D]`` over them (shapes and metadata as in
    ``kernels.ragged_paged_attention``). Returns ``(out [T, Hq, D], k_pages, v_pages)``;
    with a mesh of several devices, every head axis stays split over ``"model"``."""
    body = functools.partial(_local, sliding_window=sliding_window, impl=impl, interpret=interpret)
    if mesh is None or mesh.size == 1:
        return body(q, k, v, k_pages, v_pages, slot_mapping, page_table, kv_lens, cu_q_lens, num_seqs)
    sharded = jax.shard_map(body, mesh=mesh,
                            in_specs=(_HEADS, _HEADS, _HEADS, _PAGES, _PAGES, P(), P(), P(), P(), P()),
                            out_specs=(_HEADS, _PAGES, _PAGES), check_vma=False)
    return sharded(q, k, v, k_pages, v_pages, slot_mapping, page_table, kv_lens, cu_q_lens, num_seqs)


def _local(q, k, v, k_pages, v_pages, slot_mapping, page_table, kv_lens, cu_q_lens, num_seqs, *,
           sliding_window, impl, interpret):
    """One shard's write + attention (or the whole of them without a mesh)."""
    k_pages, v_pages = kernels.write_kv_pages(k_pages, v_pages, k.astype(k_pages.dtype), v.astype(v_pages.dtype),
                                              slot_mapping)
    out = kernels.ragged_paged_attention(q.astype(k_pages.dtype), k_pages, v_pages, page_table, kv_lens, cu_q_lens,
                                         num_seqs, sliding_window=sliding_window, impl=impl, interpret=interpret)
    return out, k_pages, v_pages
