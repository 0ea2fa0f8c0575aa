"""One host-to-device copy per step: a step's small input arrays packed into one buffer.

A step takes a dozen small arrays (token ids, positions, page table, sampling settings...).
Staged one by one, ``jax.device_put`` handles each in Python; packed, the jitted call of a
CPU step returns 0.5 ms sooner (1.62 -> 1.08 ms, ``tools/step_time.py --baseline``,
docs/benchmarks.md "Second GPU session"). On the H200 the host's share of a 1B decode step
was most of it (the GPU computed 1.4 of 3.3 ms); packed, that whole step took 0.88x and
0.95x of the unpacked one ("Third GPU session").

``pack`` lays 4-byte arrays (int32, uint32, float32) as int32, in name order, each one
starting on a 256-byte boundary (``ALIGN_WORDS``), and returns the layout (name order: a
multi-host worker gets the step's inputs through a pytree round trip that sorts dict keys,
and must pack the same bytes and compile the same program as process 0). ``unpack``,
inside the jitted step, cuts them back out with static slices (and bitcasts the floats and
unsigned ints back, bit for bit). The layout is a tuple of ``(name, shape, dtype)``,
hashable, passed to ``jax.jit`` as a static argument: it is fixed by the step's buckets, so
it adds no compiled programs.

Why aligned: XLA:GPU hands a static slice of a parameter to the next op as a view at its
offset, and the Mosaic GPU attention kernel's custom call refuses an input buffer that is not
256-byte aligned ("Input buffer 2 is not 256-byte aligned" on an H200 before this padding,
docs/benchmarks.md "Third GPU session"). Padding costs at most 63 words per array.
"""

from __future__ import annotations

import math

import jax
import numpy as np

Layout = tuple[tuple[str, tuple[int, ...], str], ...]

_WORD = np.dtype(np.int32)
ALIGN_WORDS = 64
"""Every packed array starts at a multiple of this many int32 words (256 bytes)."""
_PADDING = np.zeros(ALIGN_WORDS - 1, np.int32)   # (read only: sliced into ``pack``'s parts)


def _aligned(words: int) -> int:
    """``words`` rounded up to a multiple of ``ALIGN_WORDS``."""
    return -(-words // ALIGN_WORDS) * ALIGN_WORDS


def pack(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, Layout]:
    """``(flat int32 [sum of sizes, each rounded up to ALIGN_WORDS], layout)`` for ``arrays``
    (name -> 4-byte numpy array), laid out in name order whatever the dict's order; the
    padding words are zero."""
    named = sorted(arrays.items())
    parts = []
    for name, a in named:
        if a.dtype.itemsize != _WORD.itemsize:
            raise ValueError(f"step input {name!r} is {a.dtype}: only 4-byte dtypes can be packed")
        parts.append(np.ascontiguousarray(a).view(np.int32).ravel())
        pad = -a.size % ALIGN_WORDS
        if pad:
            parts.append(_PADDING[:pad])
    layout = tuple((name, a.shape, a.dtype.str) for name, a in named)
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    return flat, layout


def unpack(flat: jax.Array, layout: Layout) -> dict[str, jax.Array]:
    """``pack``'s arrays back from ``flat`` (traced): name -> array of its shape and dtype."""
    out, offset = {}, 0
    for name, shape, dtype in layout:
        size = math.prod(shape)
        part = flat[offset:offset + size].reshape(shape)
        dtype = np.dtype(dtype)
        out[name] = part if dtype == _WORD else jax.lax.bitcast_convert_type(part, dtype)
        offset += _aligned(size)
    return out
