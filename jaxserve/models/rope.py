"""Rotary position embeddings (Hugging Face's rotate-half convention)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """``[head_dim // 2]`` float32 inverse frequencies, with ``linear`` or ``llama3`` scaling."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv.astype(np.float32)
    kind = scaling.get("rope_type", scaling.get("type", "default"))

    def need(key: str) -> float:
        if scaling.get(key) is None:
            raise ValueError(f"rope_scaling of type {kind!r} is missing {key!r}")
        return float(scaling[key])

    if kind == "default":
        return inv.astype(np.float32)
    if kind == "linear":
        return (inv / need("factor")).astype(np.float32)
    if kind == "llama3":
        factor = need("factor")
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = need("original_max_position_embeddings")
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(is_mid, mid, scaled).astype(np.float32)
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """Rotate ``x [T, H, D]`` by ``positions [T]``; computed in float32, returned in x's dtype."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb)[:, None, :], jnp.sin(emb)[:, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)
