"""Scatter this step's new K/V rows into the paged cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.validate import check_kv_write_args


def write_kv_pages(
    k_pages: jax.Array,
    v_pages: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Write ``new_k``/``new_v`` ``[T, Hkv, D]`` into the pages at flat slots.

    ``slot_mapping`` int32 ``[T]`` holds ``page_id * page_size + offset`` per
    token; slots that are negative or ``>= num_pages * page_size`` mark padding
    tokens and are dropped. The update is a single ``mode="drop"`` scatter per
    array, so inside a jitted function whose page arguments are donated XLA
    performs it in place.
    """
    check_kv_write_args(k_pages, v_pages, new_k, new_v, slot_mapping)
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    num_slots = num_pages * page_size
    # Negative indices would wrap around; send them out of range to be dropped.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def scatter(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(num_slots, num_kv_heads, head_dim)
        flat = flat.at[slots].set(new, mode="drop")
        return flat.reshape(pages.shape)

    return scatter(k_pages, new_k), scatter(v_pages, new_v)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv_pages_donated(
    k_pages: jax.Array,
    v_pages: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``write_kv_pages`` jitted with ``k_pages``/``v_pages`` donated.

    The passed page arrays are invalidated; the returned ones reuse their
    buffers (on backends that support donation).
    """
    return write_kv_pages(k_pages, v_pages, new_k, new_v, slot_mapping)
