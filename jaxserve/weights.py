"""Load a checkpoint into a ``flax.nnx`` model.

A Hugging Face directory: reads ``config.json`` and ``*.safetensors`` (single
file or sharded with ``model.safetensors.index.json``), renames Hugging Face
tensors to nnx parameter paths, transposes linear weights. A ``.gguf`` file:
config from its metadata, weights dequantized (``jaxserve.gguf_checkpoint``).
Either way the weights are cast to the requested dtype; ``"auto"`` is float32
on CPU and bfloat16 on accelerators. ``load_format="dummy"`` builds random
weights of the checkpoint's shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from jaxserve import gguf_checkpoint
from jaxserve.models import ModelConfig, model_class_for

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_dtype(dtype: str) -> str:
    """``"auto"`` -> ``"float32"`` on CPU, ``"bfloat16"`` on GPU/TPU; other names unchanged."""
    if str(dtype) == "auto":
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return str(dtype)


def parse_dtype(dtype: str) -> jnp.dtype:
    try:
        return DTYPES[resolve_dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}") from None


def read_config(model_dir: Path) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint directory or ``.gguf`` file."""
    if gguf_checkpoint.is_gguf_path(model_dir):
        return ModelConfig.from_hf(gguf_checkpoint.hf_config(gguf_checkpoint.open_gguf(model_dir)))
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face checkpoint directory: no config.json")
    return ModelConfig.from_hf(json.loads(path.read_text()))


def hf_name(path: tuple) -> tuple[str, bool]:
    """nnx parameter path -> (Hugging Face tensor name, needs transpose)."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    if parts[0] == "embed_tokens":
        return "model.embed_tokens.weight", False
    if parts[0] == "lm_head":
        return "lm_head.weight", True
    if parts[0] == "norm":
        return "model.norm.weight", False
    stem = "model." + ".".join(parts[:-1])
    if leaf == "kernel":
        return stem + ".weight", True
    return stem + "." + leaf, False


def _safetensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / f for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    out = {}
    for f in files:
        with safe_open(f, framework="numpy") as handle:
            for name in handle.keys():
                out[name] = f
    return out


def abstract_model(cfg: ModelConfig, dtype, attention_impl: str):
    cls = model_class_for(cfg.model_type)
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, attention_impl=attention_impl, rngs=nnx.Rngs(0)))


def load_model(model_dir: str | Path, dtype: str = "auto", attention_impl: str = "reference",
               load_format: str = "safetensors", seed: int = 0, progress: bool = True):
    """Build the model for ``model_dir`` (a checkpoint directory or a ``.gguf``
    file) with weights on the default device.

    Returns ``(model, config)``. Raises ``ValueError`` naming any missing or
    mis-shaped tensor, or an unsupported GGUF architecture or quantization.
    """
    model_dir = Path(model_dir)
    jdtype = parse_dtype(dtype)
    reader = gguf_checkpoint.open_gguf(model_dir) if gguf_checkpoint.is_gguf_path(model_dir) else None
    if reader is not None:
        raw = gguf_checkpoint.hf_config(reader)
        cfg = ModelConfig.from_hf(raw)
    else:
        cfg = read_config(model_dir)
    graphdef, state = nnx.split(abstract_model(cfg, jdtype, attention_impl))
    flat = list(nnx.to_flat_state(state))
    if load_format == "dummy":
        values = _dummy_values(flat, seed)
    elif reader is not None:
        values = gguf_checkpoint.tensor_values(reader, raw, flat, progress)
    elif load_format == "safetensors":
        values = _checkpoint_values(model_dir, flat, progress)
    else:
        raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
    for (path, var), value in zip(flat, values):
        var.set_value(jnp.asarray(value, dtype=var.get_value().dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), cfg


def _checkpoint_values(model_dir: Path, flat: list, progress: bool) -> list[np.ndarray]:
    where = _safetensor_files(model_dir)
    handles: dict[Path, object] = {}
    values = []
    try:
        for path, var in tqdm(flat, desc=f"loading {model_dir.name}", disable=not progress, leave=False):
            name, transpose = hf_name(path)
            if name not in where:
                raise ValueError(f"checkpoint {model_dir} is missing tensor {name!r}")
            f = where[name]
            if f not in handles:
                handles[f] = safe_open(f, framework="numpy").__enter__()
            arr = handles[f].get_tensor(name)
            if transpose:
                arr = arr.T
            want = tuple(var.get_value().shape)
            if tuple(arr.shape) != want:
                raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, the model expects {want}")
            values.append(arr)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return values


def _dummy_values(flat: list, seed: int) -> list[jax.Array]:
    """Random weights of the right shapes: N(0, 0.02) matrices, ones for norms, zeros for biases."""
    key = jax.random.key(seed)
    values = []
    for i, (path, var) in enumerate(flat):
        sds = var.get_value()
        leaf = str(path[-1])
        if leaf == "weight":      # RMSNorm scale
            values.append(jnp.ones(sds.shape, sds.dtype))
        elif leaf == "bias":
            values.append(jnp.zeros(sds.shape, sds.dtype))
        else:
            values.append(0.02 * jax.random.normal(jax.random.fold_in(key, i), sds.shape, sds.dtype))
    return values
