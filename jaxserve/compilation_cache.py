"""JAX's persistent compilation cache, on by default, so a second start is fast."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from jaxserve.config import cache_root

_enabled = False


def cache_dir() -> Path:
    return cache_root() / "xla-cache"


def prune(path: Path, max_bytes: int) -> int:
    """Delete the oldest files of the folder ``path`` (by modification time: a program is
    written once) until it holds at most ``max_bytes``; returns the bytes freed. A file
    another process deletes meanwhile is skipped."""
    entries = []
    for entry in os.scandir(path):
        try:
            if entry.is_file():
                stat = entry.stat()
                entries.append((stat.st_mtime_ns, stat.st_size, entry.path))
        except FileNotFoundError:
            continue
    total = sum(size for _, size, _ in entries)
    freed = 0
    for _, size, name in sorted(entries):
        if total - freed <= max_bytes:
            break
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
        freed += size
    return freed


def enable_compilation_cache(max_gb: float) -> None:
    """Point JAX's persistent cache at ``~/.cache/jaxserve/xla-cache`` (once per
    process; ``JAXSERVE_NO_COMPILATION_CACHE=1`` turns it off), first pruned to at most
    ``max_gb`` GiB (``prune``). JAX's own limit (``jax_compilation_cache_max_size``) is
    not used: it failed every write on a cache folder written without it."""
    global _enabled
    if _enabled or os.environ.get("JAXSERVE_NO_COMPILATION_CACHE"):
        return
    path = cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    prune(path, int(max_gb * 2**30))
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = True
