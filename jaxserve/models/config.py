"""Model configuration read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field


MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")   # ``config.json`` model types (all ``LlamaForCausalLM``)
# ``hidden_act`` values the MLP runs exactly as ``transformers`` does (``jaxserve.models.llama.ACTIVATIONS``)
MLP_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Llama-family decoder.

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``.
    ``qkv_bias`` is True for Qwen2. ``qk_norm`` (Qwen3): each head's query and
    key are RMS-normalized over ``head_dim`` (weights ``[head_dim]``) before
    the rotary embedding. ``rope_scaling`` is the checkpoint's dict
    (``rope_type`` "default", "linear" or "llama3") or None. ``hidden_act``: the
    MLP gate's activation (``MLP_ACTIVATIONS``). ``sliding_window`` (tokens): the
    attention window of every layer but those in ``full_attention_layers`` (Qwen2/3's
    ``layer_types``, from ``max_window_layers``), None for full attention everywhere.
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
    full_attention_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cache per token over all layers, at 4 bytes per element
        (multiply by itemsize/4 for other dtypes)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s attention window in tokens (None: full attention)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @classmethod
    def from_hf(cls, cfg: dict, generation: dict | None = None) -> "ModelConfig":
        """Build from a parsed ``config.json`` (and ``generation_config.json``, whose
        ``eos_token_id`` ends generation too, as ``transformers``' ``generate`` reads
        it); missing required keys, and a ``model_type`` or ``hidden_act`` this
        package does not run, are a ``ValueError``."""
        def need(key: str):
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"config.json is missing {key!r}")
            return cfg[key]

        model_type = need("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODEL_TYPES))}")
        hidden_act = cfg.get("hidden_act") or "silu"
        if hidden_act not in MLP_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {', '.join(MLP_ACTIVATIONS)}")
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        layers = int(need("num_hidden_layers"))
        eos_ids: tuple[int, ...] = ()
        for source in (cfg, generation or {}):
            eos = source.get("eos_token_id")
            for token in eos if isinstance(eos, list) else ([eos] if eos is not None else []):
                if token not in eos_ids:
                    eos_ids += (token,)
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # transformers v5 spelling
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        sliding = cfg.get("sliding_window") if model_type != "llama" else None   # (Llama has no window)
        full_layers: tuple[int, ...] = ()
        if model_type in ("qwen2", "qwen3"):   # (Mistral windows every layer)
            if not cfg.get("use_sliding_window", False):
                sliding = None
            kinds = cfg.get("layer_types") or ["sliding_attention" if i >= int(cfg.get("max_window_layers", 28))
                                               else "full_attention" for i in range(layers)]
            full_layers = tuple(i for i, kind in enumerate(kinds) if kind != "sliding_attention")
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=layers,
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
            full_attention_layers=full_layers if sliding else (),
            hidden_act=hidden_act,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=cfg,
        )
