"""Llama-family decoder in ``flax.nnx``: Llama 2/3, Mistral, Qwen2, Qwen3.

RMSNorm, rotary embeddings (with llama3/linear scaling), grouped-query
attention over a paged KV cache (Qwen3: each head's q and k RMS-normalized
first; a sliding window per layer), gated MLP (SwiGLU, or the checkpoint's
``hidden_act``), tied or untied embeddings.
Parameter names follow Hugging Face's so loading is a rename plus a transpose.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import Mesh

from jaxserve.models.config import MLP_ACTIVATIONS, ModelConfig
from jaxserve.models.rope import apply_rope, inverse_frequencies
from jaxserve.parallel.attention import write_and_attend


# The MLP gate's activation by ``hidden_act`` (``transformers``' ``ACT2FN``: "gelu" is the exact
# erf form, "gelu_new" and "gelu_pytorch_tanh" the tanh approximation).
ACTIVATIONS = {"silu": jax.nn.silu, "swish": jax.nn.silu, "gelu": functools.partial(jax.nn.gelu, approximate=False),
               "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
               "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True), "relu": jax.nn.relu}
assert set(ACTIVATIONS) == set(MLP_ACTIVATIONS)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache (shapes in tokens T and sequences S).

    ``positions [T]`` token positions; ``slot_mapping [T]`` flat cache slot each
    token's K/V is written to (-1 for padding); ``page_table [S, W]``,
    ``kv_lens [S]``, ``cu_q_lens [S+1]``, ``num_seqs [1]`` as in
    ``kernels.ragged_paged_attention``.
    """

    positions: jax.Array
    slot_mapping: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs | None = None) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


def _linear(din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query attention; with a ``mesh``, q/k/v/o are split by head over its
    ``"model"`` axis and the KV write + kernel run per shard (``jaxserve.parallel``)."""

    def __init__(self, cfg: ModelConfig, dtype, attention_impl: str, rngs: nnx.Rngs,
                 mesh: Mesh | None = None, sliding_window: int | None = None) -> None:
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = _linear(h, self.num_heads * d, cfg.qkv_bias, dtype, rngs)
        self.k_proj = _linear(h, self.num_kv_heads * d, cfg.qkv_bias, dtype, rngs)
        self.v_proj = _linear(h, self.num_kv_heads * d, cfg.qkv_bias, dtype, rngs)
        self.o_proj = _linear(self.num_heads * d, h, cfg.o_bias, dtype, rngs)
        if cfg.qk_norm:   # Qwen3: per-head RMSNorm of q and k over head_dim, before RoPE
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.qk_norm = cfg.qk_norm
        self.inv_freq = tuple(float(f) for f in inverse_frequencies(d, cfg.rope_theta, cfg.rope_scaling))
        self.sliding_window = sliding_window   # (tokens; None: full attention)
        self.attention_impl = attention_impl
        self.mesh = mesh

    def __call__(self, x: jax.Array, kv: tuple[jax.Array, jax.Array], meta: AttentionMetadata,
                 interpret: bool) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
        q, k = apply_rope(q, meta.positions, inv_freq), apply_rope(k, meta.positions, inv_freq)
        out, k_pages, v_pages = write_and_attend(
            q, k, v, kv[0], kv[1], meta.slot_mapping, meta.page_table, meta.kv_lens, meta.cu_q_lens,
            meta.num_seqs, mesh=self.mesh, sliding_window=self.sliding_window, impl=self.attention_impl,
            interpret=interpret)
        return self.o_proj(out.reshape(t, -1).astype(x.dtype)), (k_pages, v_pages)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> None:
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(h, i, cfg.mlp_bias, dtype, rngs)
        self.up_proj = _linear(h, i, cfg.mlp_bias, dtype, rngs)
        self.down_proj = _linear(i, h, cfg.mlp_bias, dtype, rngs)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, attention_impl: str, rngs: nnx.Rngs,
                 mesh: Mesh | None = None, sliding_window: int | None = None) -> None:
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, attention_impl, rngs, mesh, sliding_window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, kv, meta, interpret):
        attn, kv = self.self_attn(self.input_layernorm(x), kv, meta, interpret)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class LlamaForCausalLM(nnx.Module):
    """Decoder over a ragged batch of T tokens with a paged KV cache per layer.

    ``mesh``: the tensor-parallel mesh the attention kernels run per shard on
    (None: one device)."""

    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, attention_impl: str = "reference",
                 rngs: nnx.Rngs | None = None, mesh: Mesh | None = None) -> None:
        rngs = rngs or nnx.Rngs(0)
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, attention_impl, rngs, mesh, cfg.window_of(i))
                                for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype, rngs)

    def __call__(self, input_ids: jax.Array, kv_caches: list, meta: AttentionMetadata,
                 logits_indices: jax.Array, interpret: bool = False,
                 return_hidden: bool = False) -> tuple[jax.Array, ...]:
        """``input_ids [T]`` -> float32 logits ``[len(logits_indices), vocab]`` and the updated caches;
        with ``return_hidden`` also the final-norm hidden states of those rows, float32
        ``[len(logits_indices), hidden_size]`` (what a length probe reads)."""
        x = self.embed_tokens(input_ids)
        new_caches = []
        for layer, kv in zip(self.layers, kv_caches):
            x, kv = layer(x, kv, meta, interpret)
            new_caches.append(kv)
        x = self.norm(x[logits_indices])
        if self.lm_head is None:
            logits = jnp.dot(x, self.embed_tokens.embedding[...].T)
        else:
            logits = self.lm_head(x)
        if return_hidden:
            return logits.astype(jnp.float32), new_caches, x.astype(jnp.float32)
        return logits.astype(jnp.float32), new_caches
