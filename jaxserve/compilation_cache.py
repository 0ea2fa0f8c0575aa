"""JAX's persistent compilation cache, on by default, so a second start is fast."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jaxserve.config import cache_root

_enabled = False


def cache_dir() -> Path:
    return cache_root() / "xla-cache"


def enable_compilation_cache() -> None:
    """Point JAX's persistent cache at ``~/.cache/jaxserve/xla-cache`` (once per
    process; ``JAXSERVE_NO_COMPILATION_CACHE=1`` turns it off)."""
    global _enabled
    if _enabled or os.environ.get("JAXSERVE_NO_COMPILATION_CACHE"):
        return
    path = cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = True
