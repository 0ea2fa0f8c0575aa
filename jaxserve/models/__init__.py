"""Model registry keyed by ``config.json``'s ``model_type``."""

from __future__ import annotations

from jaxserve.models.config import MODEL_TYPES, ModelConfig
from jaxserve.models.llama import AttentionMetadata, LlamaForCausalLM

MODEL_REGISTRY: dict[str, type] = {model_type: LlamaForCausalLM for model_type in MODEL_TYPES}


def model_class_for(model_type: str) -> type:
    """The model class for ``model_type``; unknown types are a ``ValueError`` naming the supported ones."""
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}") from None


__all__ = ["AttentionMetadata", "LlamaForCausalLM", "MODEL_REGISTRY", "ModelConfig", "model_class_for"]
