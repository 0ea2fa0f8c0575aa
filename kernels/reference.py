"""Plain-jnp ragged paged attention: the definition of the kernels' result.

Each query token gathers the pages of its own sequence and attends to them
under a causal (and optionally sliding-window) mask. Tokens are processed in
chunks of ``TOKEN_CHUNK`` so memory stays
``O(TOKEN_CHUNK * pages_per_seq * page_size * num_kv_heads * head_dim)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TOKEN_CHUNK = 64


def token_positions(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Map each query row to its sequence and cache position.

    Returns ``(seq [T] int32, pos [T] int32, valid [T] bool)``: the sequence a
    row belongs to (0 for padding rows), its position in that sequence's cache
    (``kv_lens[s] - q_len_s + j``) and whether it is a real (non-padding) row.
    """
    num_real = cu_q_lens[num_seqs[0]]
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], rows, side="right").astype(jnp.int32)
    valid = (rows < num_real) & (seq < num_seqs[0])
    seq = jnp.where(valid, seq, 0)
    pos = kv_lens[seq] - (cu_q_lens[seq + 1] - rows)
    return seq, pos, valid


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Reference attention. Shapes as in ``kernels.ragged_paged_attention``.

    Padding rows (past ``cu_q_lens[num_seqs]``) return zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_table.shape[1]
    kv_capacity = pages_per_seq * page_size

    seq, pos, valid = token_positions(cu_q_lens, kv_lens, num_seqs, num_tokens)
    chunk = min(TOKEN_CHUNK, num_tokens)
    padded = -(-num_tokens // chunk) * chunk

    def pad(x: jax.Array) -> jax.Array:
        widths = [(0, padded - num_tokens)] + [(0, 0)] * (x.ndim - 1)
        return jnp.pad(x, widths).reshape(padded // chunk, chunk, *x.shape[1:])

    kv_pos = jnp.arange(kv_capacity, dtype=jnp.int32)

    def attend(args: tuple[jax.Array, ...]) -> jax.Array:
        q_c, seq_c, pos_c, valid_c = args  # [C, Hq, D], [C], [C], [C]
        # Columns past a sequence's length may hold any id (e.g. -1); they are
        # masked, but clamp them so the gather never reads out of bounds.
        pages = jnp.clip(page_table[seq_c], 0, k_pages.shape[0] - 1)  # [C, pages_per_seq]
        k = k_pages[pages].reshape(chunk, kv_capacity, num_kv_heads, head_dim)
        v = v_pages[pages].reshape(chunk, kv_capacity, num_kv_heads, head_dim)
        qg = q_c.reshape(chunk, num_kv_heads, group, head_dim).astype(jnp.float32)
        logits = jnp.einsum("chgd,clhd->chgl", qg, k.astype(jnp.float32)) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        mask = kv_pos[None, :] <= pos_c[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > pos_c[:, None] - sliding_window
        mask &= valid_c[:, None]
        logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
        # Padding rows are fully masked; give them a finite max so they yield 0.
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.exp(logits - row_max)
        denom = jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
        out = jnp.einsum("chgl,clhd->chgd", p / denom, v.astype(jnp.float32))
        return out.reshape(chunk, num_q_heads, head_dim)

    out = jax.lax.map(attend, (pad(q), pad(seq), pad(pos), pad(valid)))
    return out.reshape(padded, num_q_heads, head_dim)[:num_tokens].astype(q.dtype)
