"""One host-to-device copy per step: a step's small input arrays packed into one buffer.

A step takes a dozen small arrays (token ids, positions, page table, sampling settings...).
Staged one by one, ``jax.device_put`` handles each in Python; packed, the jitted call of a
CPU step returns 0.5 ms sooner (1.62 -> 1.08 ms, ``tools/step_time.py --baseline``,
docs/benchmarks.md "Second GPU session"). On the H200 the host's share of a 1B decode step
was most of it (the GPU computed 1.4 of 3.3 ms), so host work per step is what bounds it.

``pack`` lays 4-byte arrays (int32, uint32, float32) end to end as int32, in name order,
and returns the layout (name order: a multi-host worker gets the step's inputs through a
pytree round trip that sorts dict keys, and must pack the same bytes and compile the same
program as process 0). ``unpack``, inside the jitted step, cuts them back out with static
slices (and bitcasts the floats and unsigned ints back, bit for bit). The layout is a tuple of
``(name, shape, dtype)``, hashable, passed to ``jax.jit`` as a static argument: it is fixed
by the step's buckets, so it adds no compiled programs.
"""

from __future__ import annotations

import math

import jax
import numpy as np

Layout = tuple[tuple[str, tuple[int, ...], str], ...]

_WORD = np.dtype(np.int32)


def pack(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, Layout]:
    """``(flat int32 [sum of sizes], layout)`` for ``arrays`` (name -> 4-byte numpy array),
    laid out in name order whatever the dict's order."""
    named = sorted(arrays.items())
    for name, a in named:
        if a.dtype.itemsize != _WORD.itemsize:
            raise ValueError(f"step input {name!r} is {a.dtype}: only 4-byte dtypes can be packed")
    layout = tuple((name, a.shape, a.dtype.str) for name, a in named)
    flat = np.concatenate([np.ascontiguousarray(a).view(np.int32).ravel() for _, a in named])
    return flat, layout


def unpack(flat: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    """``pack``'s arrays back from ``flat`` (traced): name -> array of its shape and dtype."""
    out, offset = {}, 0
    for name, shape, dtype in layout:
        size = math.prod(shape)
        part = flat[offset:offset + size].reshape(shape)
        dtype = np.dtype(dtype)
        out[name] = part if dtype == _WORD else jax.lax.bitcast_convert_type(part, dtype)
        offset += size
    return out
