"""Sampling parameters (validated at the edge) and the jitted sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable
    those filters. ``seed`` makes sampling reproducible per request: the same
    seed gives the same tokens whether the request runs alone or in a batch.
    ``max_tokens`` counts generated tokens only (not API-returned ones).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings for a padded batch of S rows."""

    temperature: jax.Array  # [S] float32; 0 = greedy
    top_k: jax.Array        # [S] int32; 0 = off
    top_p: jax.Array        # [S] float32
    seed: jax.Array         # [S] uint32
    step: jax.Array         # [S] int32: tokens generated so far (folds into the key)


def _filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Set logits outside each row's top-k / nucleus to -inf. ``logits [S, V]``."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs     # mass strictly above each sorted entry
    keep = before < top_p[:, None]
    p_threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, p_threshold)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Pick one token per row of ``logits [S, V]`` (float32). Returns ``[S]`` int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    needs_filter = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
    scaled = jax.lax.cond(needs_filter, _filter_top_k_top_p, lambda x, k, p: x, scaled, params.top_k, params.top_p)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(params.seed, params.step)
    sampled = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(params.temperature > 0, sampled, greedy)
