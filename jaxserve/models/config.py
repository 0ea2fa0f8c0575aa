"""Model configuration read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    ``qkv_bias`` is True for Qwen2. ``qk_norm`` (Qwen3): each head's query and
    key are RMS-normalized over ``head_dim`` (weights ``[head_dim]``) before
    the rotary embedding. ``rope_scaling`` is the checkpoint's dict
    (``rope_type`` "default", "linear" or "llama3") or None.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cache per token over all layers, at 4 bytes per element
        (multiply by itemsize/4 for other dtypes)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a parsed ``config.json``; missing required keys are a ``ValueError``."""
        def need(key: str):
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"config.json is missing {key!r}")
            return cfg[key]

        model_type = need("model_type")
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # transformers v5 spelling
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        sliding = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or model_type == "qwen2",
            o_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=cfg,
        )
