"""Load a checkpoint into a ``flax.nnx`` model.

A Hugging Face directory: reads ``config.json`` and ``*.safetensors`` (single
file or sharded with ``model.safetensors.index.json``), renames Hugging Face
tensors to nnx parameter paths, transposes linear weights. A ``.gguf`` file:
config from its metadata, weights dequantized (``jaxserve.gguf_checkpoint``).
Either way the weights are cast to the requested dtype; ``"auto"`` is float32
on CPU and bfloat16 on accelerators. ``load_format="dummy"`` builds random
weights of the checkpoint's shapes.

With a tensor-parallel ``mesh`` each tensor goes straight into its shards
(``jax.make_array_from_callback``: every device receives only its slice, read
from the host copy of the tensor; no device ever holds the whole of a split
tensor), and KV projections are repeated per head when the model has fewer KV
heads than the mesh has devices (``jaxserve.parallel.mesh``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from jax.sharding import Mesh

from jaxserve import gguf_checkpoint
from jaxserve.models import ModelConfig, model_class_for
from jaxserve.parallel.mesh import check_tensor_parallel, kv_head_repeats, tp_model_config
from jaxserve.parallel.sharding import param_sharding

log = logging.getLogger("jaxserve")

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
        return ModelConfig.from_hf(gguf_checkpoint.open_index(model_dir).config)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face checkpoint directory: no config.json")
    generation = model_dir / "generation_config.json"
    return ModelConfig.from_hf(json.loads(path.read_text()),
                               json.loads(generation.read_text()) if generation.is_file() else None)


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
    """Tensor name -> the file holding it: ``model.safetensors`` when there is one, else the
    shards its index names (``transformers``' order: a folder saved sharded and then whole
    keeps a stale index), else every ``*.safetensors`` file. A shard the index names but
    the folder lacks is a ``ValueError``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file() and not (model_dir / "model.safetensors").is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise ValueError(f"checkpoint {model_dir}: {index.name} names {len(missing)} shard(s) the folder "
                             f"lacks, e.g. {missing[0]!r}")
        return {name: model_dir / f for name, f in weight_map.items()}
    files = [model_dir / "model.safetensors"] if (model_dir / "model.safetensors").is_file() else \
        sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    out = {}
    for f in files:
        with safe_open(f, framework="numpy") as handle:
            for name in handle.keys():
                out[name] = f
    return out


def _untied_if_the_head_differs(model_dir: Path, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` (tied embeddings), untied when the checkpoint also holds an ``lm_head.weight``
    that is not the embedding matrix: that head is used, as ``transformers`` uses it
    (with a warning) rather than tying over it."""
    where = _safetensor_files(model_dir)
    names = ("model.embed_tokens.weight", "lm_head.weight")
    if not all(name in where for name in names):
        return cfg
    embedding, head = (_tensor(where[name], name) for name in names)
    if embedding.shape == head.shape and np.array_equal(embedding, head):
        return cfg
    log.warning("%s: tie_word_embeddings is set but lm_head.weight differs from the embeddings; "
                "using lm_head.weight (untied), as transformers does", model_dir)
    return dataclasses.replace(cfg, tie_word_embeddings=False)


def _tensor(path: Path, name: str) -> np.ndarray:
    with safe_open(path, framework="numpy") as handle:
        return handle.get_tensor(name)


class _ShapeOnlyKeys:
    """The key source ``abstract_model`` builds a model with: every layer's initializer gets
    the same key, and nothing counts draws. Only shapes are wanted there (the values are
    replaced by the checkpoint's), and ``nnx.Rngs`` counts each draw in a variable whose
    update, traced inside ``nnx.eval_shape``, walks the whole trace built so far (its
    ``sharding`` is compared): SmolLM2's build took 1.54 s with ``nnx.Rngs``, 0.39 s with
    this (``tools/gguf_load_parts.py``)."""

    def params(self) -> jax.Array:
        return jax.random.key(0)


def abstract_model(cfg: ModelConfig, dtype, attention_impl: str, mesh: Mesh | None = None):
    """The model of ``cfg`` with shapes and dtypes for values (``nnx.eval_shape``)."""
    cls = model_class_for(cfg.model_type)
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, attention_impl=attention_impl, rngs=_ShapeOnlyKeys(),
                                      mesh=mesh))


def load_model(model_dir: str | Path, dtype: str = "auto", attention_impl: str = "reference",
               load_format: str = "safetensors", seed: int = 0, progress: bool = True, mesh: Mesh | None = None):
    """Build the model for ``model_dir`` (a checkpoint directory or a ``.gguf``
    file) with weights on the default device, or split over ``mesh`` (tensor
    parallelism; see ``jaxserve.parallel.sharding``).

    Returns ``(model, config)``; with a mesh, ``config`` is the model as the
    shards see it (``tp_model_config``). Raises ``ValueError`` naming any missing
    or mis-shaped tensor, an unsupported GGUF architecture or quantization, or a
    TP degree that cannot shard the model (before any weight is read).
    """
    try:
        return _load_model(Path(model_dir), dtype, attention_impl, load_format, seed, progress, mesh)
    finally:
        if gguf_checkpoint.is_gguf_path(model_dir):
            gguf_checkpoint.release_readers()   # the weights are on the devices: unmap the file


def _load_model(model_dir: Path, dtype: str, attention_impl: str, load_format: str, seed: int, progress: bool,
                mesh: Mesh | None):
    index = gguf_checkpoint.open_index(model_dir) if gguf_checkpoint.is_gguf_path(model_dir) else None
    if index is not None:
        checkpoint_cfg = ModelConfig.from_hf(index.config)
    else:
        checkpoint_cfg = read_config(model_dir)
        if load_format == "safetensors" and checkpoint_cfg.tie_word_embeddings:
            checkpoint_cfg = _untied_if_the_head_differs(model_dir, checkpoint_cfg)
    tp = 1 if mesh is None else mesh.size
    if mesh is not None:
        check_tensor_parallel(checkpoint_cfg, tp, len(jax.devices()))
    cfg = tp_model_config(checkpoint_cfg, tp)
    repeats = kv_head_repeats(checkpoint_cfg, tp)
    jdtype = parse_dtype(dtype)
    graphdef, state = nnx.split(abstract_model(cfg, jdtype, attention_impl, mesh))
    flat = list(nnx.to_flat_state(state))
    if cfg == checkpoint_cfg:   # no tensor parallelism across KV heads: the file's shapes are the model's
        checkpoint_flat = flat
    else:
        _, checkpoint_state = nnx.split(abstract_model(checkpoint_cfg, jdtype, attention_impl))
        checkpoint_flat = list(nnx.to_flat_state(checkpoint_state))   # the tensors as the file holds them
    checkpoint_shapes = [tuple(var.get_value().shape) for _, var in checkpoint_flat]
    if load_format == "dummy":
        values = _dummy_values(flat, checkpoint_shapes, seed)
    elif index is not None:
        values = gguf_checkpoint.tensor_values(index, checkpoint_flat, progress)
    elif load_format == "safetensors":
        values = _checkpoint_values(model_dir, flat, checkpoint_shapes, progress)
    else:
        raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {load_format!r}")
    for (path, var), value in zip(flat, values):
        dtype, head_dim = var.get_value().dtype, checkpoint_cfg.head_dim
        sharding = None if mesh is None else param_sharding(mesh, path)
        if callable(value):      # dummy: generated on the devices, each its own slice
            make = lambda fn=value, p=path: _repeat_kv_heads(p, fn(), repeats, head_dim).astype(dtype)
            var.set_value(jax.jit(make, out_shardings=sharding)() if sharding else make())
        elif sharding is None:
            var.set_value(jnp.asarray(_repeat_kv_heads(path, value, repeats, head_dim), dtype=dtype))
        else:
            var.set_value(_sharded(_repeat_kv_heads(path, value, repeats, head_dim), dtype, sharding))
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), cfg


def _repeat_kv_heads(path: tuple, value, repeats: int, head_dim: int):
    """k_proj/v_proj kernel ``[hidden, Hkv*D]`` or bias ``[Hkv*D]`` with each head
    repeated ``repeats`` times along the head axis (unchanged when ``repeats == 1``)."""
    if repeats == 1 or str(path[-2]) not in ("k_proj", "v_proj"):
        return value
    lead = value.shape[:-1]
    heads = value.reshape(*lead, value.shape[-1] // head_dim, head_dim)
    xp = np if isinstance(value, np.ndarray) else jnp
    return xp.repeat(heads, repeats, axis=-2).reshape(*lead, -1)


def _sharded(value: np.ndarray, dtype, sharding) -> jax.Array:
    """Host ``value`` laid out by ``sharding``: each device is given only its own slice."""
    return jax.make_array_from_callback(value.shape, sharding,
                                        lambda index: np.ascontiguousarray(value[index]).astype(dtype))


def _checkpoint_values(model_dir: Path, flat: list, shapes: list[tuple], progress: bool) -> list[np.ndarray]:
    """The checkpoint's tensors for ``flat``'s paths (host numpy), checked against
    the checkpoint model's ``shapes``."""
    where = _safetensor_files(model_dir)
    handles: dict[Path, object] = {}
    values = []
    try:
        for (path, _), want in tqdm(list(zip(flat, shapes)), desc=f"loading {model_dir.name}", disable=not progress, leave=False):
            name, transpose = hf_name(path)
            if name not in where:
                raise ValueError(f"checkpoint {model_dir} is missing tensor {name!r}")
            f = where[name]
            if f not in handles:
                handles[f] = safe_open(f, framework="numpy").__enter__()
            arr = handles[f].get_tensor(name)
            if transpose:
                arr = arr.T
            if tuple(arr.shape) != want:
                raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, the model expects {want}")
            values.append(arr)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return values


def _dummy_values(flat: list, shapes: list[tuple], seed: int) -> list:
    """Zero-argument functions making random weights of the checkpoint's ``shapes``:
    N(0, 0.02) matrices, ones for norms, zeros for biases (the same values whatever
    the TP degree; the loader runs them on the devices, jitted)."""
    values = []
    for i, ((path, var), shape) in enumerate(zip(flat, shapes)):
        dtype = var.get_value().dtype
        leaf = str(path[-1])
        if leaf == "weight":      # RMSNorm scale
            values.append(lambda s=shape, d=dtype: jnp.ones(s, d))
        elif leaf == "bias":
            values.append(lambda s=shape, d=dtype: jnp.zeros(s, d))
        else:
            values.append(lambda s=shape, d=dtype, i=i:
                          0.02 * jax.random.normal(jax.random.fold_in(jax.random.key(seed), i), s, d))
    return values
