"""The tensor-parallel device mesh and the checks on a TP degree.

One ``jax.sharding.Mesh`` with a single ``"model"`` axis of
``tensor_parallel_size`` devices (over every process's devices when several
processes share the mesh). When the model has fewer KV heads than the TP
degree, each KV head is repeated ``tp / num_key_value_heads`` times (as
tpu-inference does) so every shard holds exactly one KV head:
``tp_model_config`` is the model as the shards see it.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh

MODEL_AXIS = "model"


class ModelShape(Protocol):
    """The fields of ``jaxserve.models.ModelConfig`` the TP checks read (a protocol,
    so ``jaxserve.models`` can import this package without a cycle)."""

    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int


C = TypeVar("C", bound=ModelShape)


def check_tensor_parallel(cfg: ModelShape, tp: int, num_devices: int) -> None:
    """Raise ``ValueError`` naming ``tensor_parallel_size`` and the numbers when
    ``tp`` cannot shard ``cfg`` over ``num_devices`` devices: not dividing the
    attention heads, the MLP width or the vocabulary (with fewer KV heads than
    ``tp``, ``tp`` must be a multiple of them: each shard then holds one
    repeated KV head; else it must divide them), or more than the devices."""
    checks = [("num_attention_heads", cfg.num_attention_heads), ("intermediate_size", cfg.intermediate_size),
              ("vocab_size", cfg.vocab_size)]
    for name, value in checks:
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name}={value}")
    kv = cfg.num_key_value_heads
    if kv >= tp and kv % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's num_key_value_heads={kv}")
    if kv < tp and tp % kv:
        raise ValueError(f"tensor_parallel_size={tp} is not a multiple of the model's num_key_value_heads={kv} "
                         f"(needed to replicate KV heads across shards)")
    if tp > num_devices:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {num_devices} available devices")


def tp_model_config(cfg: C, tp: int) -> C:
    """``cfg`` as the shards see it: ``num_key_value_heads`` raised to ``tp`` when
    it is smaller (each KV head repeated ``tp // num_key_value_heads`` times)."""
    if cfg.num_key_value_heads >= tp:
        return cfg
    return dataclasses.replace(cfg, num_key_value_heads=tp)


def kv_head_repeats(cfg: ModelShape, tp: int) -> int:
    """How many times each checkpoint KV head is stored (1 unless KV heads < ``tp``)."""
    return max(1, tp // cfg.num_key_value_heads)


def make_mesh(tp: int, devices: list | None = None) -> Mesh:
    """A 1-D mesh ``("model",)`` over the first ``tp`` of ``devices`` (default: all
    devices of all processes, in JAX's global order)."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {len(devices)} available devices")
    return Mesh(np.array(devices[:tp]), (MODEL_AXIS,))
