"""Paged-attention kernels for jaxserve and their plain-jnp references.

Public entry points (the contract in DESIGN.md section 8):

- ``ragged_paged_attention``: attention of a ragged batch of query tokens
  (prefill chunks and single decode tokens mixed) over a paged KV cache.
- ``write_kv_pages`` / ``write_kv_pages_donated``: scatter this step's K/V
  into the pages.
- ``default_impl``: the implementation to use on the current backend.

The Pallas kernels are imported on first use, so a JAX without Pallas Triton
(announced for removal) still imports this package and uses the others.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
from collections.abc import Callable

import jax

from kernels import reference
from kernels.kv_write import write_kv_pages, write_kv_pages_donated
from kernels.validate import IMPLS, check_attention_args, check_impl_tiling

__all__ = [
    "IMPLS",
    "compute_capability",
    "default_impl",
    "ragged_paged_attention",
    "select_impl",
    "triton_available",
    "write_kv_pages",
    "write_kv_pages_donated",
]

log = logging.getLogger(__name__)
MOSAIC_GPU_CAPABILITIES = (9.0, 10.0)  # [lo, hi): Hopper (wgmma is sm_90a only; Blackwell has tcgen05).
MOSAIC_GPU_DTYPES = ("bfloat16", "float16")


@functools.cache
def triton_available() -> bool:
    """Whether the installed JAX can still lower Pallas kernels to Triton."""
    try:
        from jax.experimental.pallas import triton as pallas_triton
    except ImportError:
        return False
    return hasattr(pallas_triton, "CompilerParams")


def select_impl(platform: str, compute_capability: float | None, dtype: str | None,
                has_triton: bool, tiling: tuple[int, int, int] | None = None) -> tuple[str, str | None]:
    """The attention implementation for a device, and why, if it is a fallback.

    ``platform``: ``jax.default_backend()`` ("gpu", "tpu", "cpu" …);
    ``compute_capability``: the GPU's, e.g. 9.0 (None off GPU); ``dtype``:
    the KV cache dtype name, None if unknown; ``has_triton``: see
    ``triton_available``; ``tiling``: ``(head_dim, page_size, GQA group)`` of
    the model's attention, None if unknown (then only the dtype is checked).
    A GPU kernel that cannot tile the shape (``validate.check_impl_tiling``)
    is skipped for the next one. Returns ``(impl, reason)``; ``reason`` is
    None when the native kernel for the device was chosen.
    """
    if platform == "tpu":
        return "pallas_tpu", None
    if platform != "gpu":
        return "reference", None

    def cannot_tile(impl: str) -> str | None:
        if tiling is None or dtype is None:
            return None
        try:
            check_impl_tiling(impl, dtype, *tiling)
        except ValueError as exc:
            return str(exc)
        return None

    lo, hi = MOSAIC_GPU_CAPABILITIES
    hopper = compute_capability is not None and lo <= compute_capability < hi
    if not hopper:
        why = (f"compute capability {compute_capability} is not Hopper (9.x), the only "
               f"generation the Mosaic GPU kernel (wgmma) is written for")
    elif dtype is not None and dtype not in MOSAIC_GPU_DTYPES:
        why = f"the Mosaic GPU kernel needs a bfloat16/float16 cache, not {dtype}"
    else:
        why = cannot_tile("pallas_mosaic_gpu")
        if why is None:
            return "pallas_mosaic_gpu", None
    if has_triton:
        triton_why = cannot_tile("pallas_gpu")
        if triton_why is None:
            return "pallas_gpu", f"{why}; using the Pallas Triton kernel"
        return "reference", f"{why}; {triton_why}; using the reference attention"
    return "reference", f"{why}, and this JAX has no Pallas Triton backend; using the reference attention"


def default_impl(dtype=None, tiling: tuple[int, int, int] | None = None) -> str:
    """The attention implementation for the default device, a KV cache of ``dtype``
    and, when given, ``tiling`` = ``(head_dim, page_size, GQA group)``.

    TPU: ``"pallas_tpu"``. GPU of compute capability 9.x (Hopper) with a
    bfloat16/float16 cache (or ``dtype=None``) whose shape the kernel tiles:
    ``"pallas_mosaic_gpu"``; other GPUs (Ampere, Blackwell), a float32 cache
    or a shape it cannot tile: ``"pallas_gpu"`` while the installed JAX has
    Pallas Triton and it tiles the shape, else ``"reference"``. Anything
    else: ``"reference"``. A fallback is logged once, with its reason.
    """
    platform = jax.default_backend()
    capability = None
    if platform == "gpu":
        capability = compute_capability(jax.devices()[0])
    name = None if dtype is None else jax.numpy.dtype(dtype).name
    impl, reason = select_impl(platform, capability, name,
                               triton_available() if platform == "gpu" else False, tiling)
    if reason:
        _log_once(f"attention: {reason}")
    return impl


def compute_capability(device) -> float | None:
    """``device.compute_capability`` ("9.0") as a float; None if absent or unparsable (off
    NVIDIA GPUs)."""
    try:
        return float(device.compute_capability)
    except (AttributeError, TypeError, ValueError):
        return None


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)


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
      impl: ``"reference"``, ``"pallas_gpu"`` (Triton), ``"pallas_mosaic_gpu"``
        (Hopper+, bfloat16/float16) or ``"pallas_tpu"``.
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
    return _pallas_kernel(impl, interpret=bool(interpret), **options)(*args)


@functools.cache
def _pallas_kernel(impl: str, **options) -> Callable:
    """``kernels.<impl>.ragged_paged_attention`` with ``options`` bound, jitted once per
    configuration. A model calls it once per layer inside its step; as one jitted function it
    is traced and lowered once per step program rather than once per layer (the Mosaic GPU
    kernel's lowering took ~0.47 s per layer on an H200)."""
    kernel = importlib.import_module(f"kernels.{impl}")
    return jax.jit(functools.partial(kernel.ragged_paged_attention, **options))
