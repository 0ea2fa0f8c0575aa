"""The jitted sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds;
optionally after sparse logit adjustments (``jaxserve.logit_adjust``) and under a
packed token bitmask (structured output)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.sampling_params import GREEDY_BELOW_TEMPERATURE


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings for a padded batch of S rows."""

    temperature: jax.Array  # [S] float32; 0 (or below GREEDY_BELOW_TEMPERATURE) = greedy
    top_k: jax.Array        # [S] int32; 0 = off
    top_p: jax.Array        # [S] float32
    min_p: jax.Array        # [S] float32; 0 = off
    seed: jax.Array         # [S] uint32
    step: jax.Array         # [S] int32: tokens generated so far (folds into the key)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LogitAdjustments:
    """A step's logit adjustments: entry ``e`` sets ``logits[rows[e], ids[e]]`` to
    ``scale_op(logit + pre[e]) + post[e]``, ``scale_op(x)`` being ``x / scale[e]`` for
    ``x > 0`` and ``x * scale[e]`` otherwise (``jaxserve.logit_adjust``). Entries name
    distinct (row, token) pairs; an id outside the vocabulary pads (nothing happens)."""

    rows: jax.Array    # [E] int32
    ids: jax.Array     # [E] int32
    pre: jax.Array     # [E] float32
    scale: jax.Array   # [E] float32
    post: jax.Array    # [E] float32


def adjust_logits(logits: jax.Array, adjust: LogitAdjustments) -> jax.Array:
    """``logits [S, V]`` with ``adjust``'s entries applied (a gather and a scatter of E values)."""
    ids = jnp.minimum(adjust.ids, logits.shape[-1] - 1)   # padding entries read some logit, write none
    value = logits[adjust.rows, ids] + adjust.pre
    value = jnp.where(value > 0, value / adjust.scale, value * adjust.scale) + adjust.post
    return logits.at[adjust.rows, adjust.ids].set(value, mode="drop")


def _filter(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Set logits outside each row's top-k, nucleus or min-p set to -inf. ``logits [S, V]``
    (temperature-scaled). In transformers' order: top-k, then top-p over the distribution
    renormalized to what top-k kept, then min-p, which keeps the tokens at least ``min_p``
    times as likely as the likeliest (``logit >= max logit + log(min_p)``, whatever the
    others removed)."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(jnp.where(sorted_desc < kth, -jnp.inf, sorted_desc), axis=-1)   # (ties at the k-th kept)
    before = jnp.cumsum(probs, axis=-1) - probs     # mass strictly above each sorted entry
    keep = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)   # (float32 sums can pass 1 in a long tail)
    keep = keep.at[:, 0].set(True)   # the likeliest always (a top_p below float32's normal range reads as 0)
    p_threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    min_p_threshold = sorted_desc[:, :1] + jnp.log(min_p)[:, None]   # (log 0 = -inf: off)
    threshold = jnp.maximum(jnp.maximum(kth, p_threshold), min_p_threshold)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _sample_random(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Temperature / top-k / top-p / min-p sampling of every row of ``logits [S, V]``; ``[S]`` int32."""
    temperature = jnp.where(params.temperature >= GREEDY_BELOW_TEMPERATURE, params.temperature, 1.0)
    scaled = logits / temperature[:, None]
    needs_filter = jnp.any((params.top_k > 0) | (params.top_p < 1.0) | (params.min_p > 0.0))
    scaled = jax.lax.cond(needs_filter, _filter, lambda x, k, p, m: x, scaled, params.top_k, params.top_p, params.min_p)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(params.seed, params.step)
    return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)


def sample(logits: jax.Array, params: SamplingArrays) -> jax.Array:
    """Pick one token per row of ``logits [S, V]`` (float32). Returns ``[S]`` int32. A row
    whose temperature is below ``GREEDY_BELOW_TEMPERATURE`` (0 included) is greedy.

    A batch whose rows are all greedy skips the random path (a Gumbel draw over the
    whole vocabulary per row, as costly as the LM head on CPU)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    random = params.temperature >= GREEDY_BELOW_TEMPERATURE
    sampled = jax.lax.cond(jnp.any(random), _sample_random, lambda x, p: greedy, logits, params)
    return jnp.where(random, sampled, greedy)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Set disallowed tokens' logits to -inf. ``logits [S, V]`` float32; ``bitmask
    [S, ceil(V / 32)]`` int32, bit ``j`` of word ``i`` set = token ``32 * i + j``
    allowed (all ones: row unconstrained)."""
    rows, vocab = logits.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(rows, -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def sample_masked(logits: jax.Array, bitmask: jax.Array, params: SamplingArrays) -> jax.Array:
    """``sample`` over the tokens ``bitmask`` allows (greedy: the best allowed token)."""
    return sample(apply_token_bitmask(logits, bitmask), params)


def token_logprobs(logits: jax.Array, tokens: jax.Array, num_top: int,
                   given: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The model's log-probabilities for ``tokens [S]`` under ``logits [S, V]``
    (log-softmax, float32) and each row's ``num_top`` most likely tokens:
    ``(sampled [S] float32, top ids [S, num_top] int32, top log-probabilities
    [S, num_top] float32)``, most likely first. ``given`` (int32 ``[S]``): where
    it is not -1, the log-probability is that token's instead (a prompt token);
    ``tokens`` may then cover only the first rows (those that sampled)."""
    if given is not None:
        tokens = jnp.where(given >= 0, given, jnp.pad(tokens, (0, given.shape[0] - tokens.shape[0])))
    logits = logits.astype(jnp.float32)
    norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)   # (no [S, V] log-softmax kept beside the logits)
    sampled = jnp.take_along_axis(logits, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0] - norm[:, 0]
    top_values, top_ids = jax.lax.top_k(logits, num_top)
    return sampled, top_ids.astype(jnp.int32), top_values - norm
