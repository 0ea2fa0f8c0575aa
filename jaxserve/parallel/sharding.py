"""Megatron-style sharding rules over the mesh's ``"model"`` axis.

=====================================  ======================  ==============
parameter (nnx path)                   shape                   split axis
=====================================  ======================  ==============
embed_tokens.embedding                 [vocab, hidden]         vocab
q/k/v_proj.kernel (column-parallel)    [hidden, heads*D]       heads
q/k/v_proj.bias                        [heads*D]               heads
o_proj.kernel (row-parallel)           [heads*D, hidden]       heads
gate/up_proj.kernel (column-parallel)  [hidden, inter]         inter
gate/up_proj.bias                      [inter]                 inter
down_proj.kernel (row-parallel)        [inter, hidden]         inter
lm_head.kernel                         [hidden, vocab]         vocab
norms, o_proj/down_proj biases         -                       replicated
KV pages (per layer, K and V)          [P, page, Hkv, D]       Hkv
host swap chunks                       [L, 2, n, page, Hkv, D] Hkv
=====================================  ======================  ==============

Row-parallel outputs are summed across shards by XLA (one all-reduce after
attention, one after the MLP per layer); logits are gathered to every shard
before sampling.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.parallel.mesh import MODEL_AXIS

M = MODEL_AXIS
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_ROW = {"o_proj", "down_proj"}

# Written as jit returns them (trailing Nones dropped; P() on one device): an array whose
# sharding object changed after a step would recompile every program it is passed to.
KV_PAGES_SPEC = P(None, None, M)                  # [P, page_size, Hkv, D]
HOST_CHUNK_SPEC = P(None, None, None, None, M)    # [L, 2, n, page_size, Hkv, D]


def param_spec(path: tuple) -> P:
    """The ``PartitionSpec`` of the parameter at nnx ``path`` (see the module table)."""
    parts = [str(p) for p in path]
    leaf, owner = parts[-1], parts[-2] if len(parts) > 1 else ""
    if parts[0] == "embed_tokens":
        return P(M, None)
    if parts[0] == "lm_head":
        return P(None, M)
    if owner in _COLUMN:
        return P(None, M) if leaf == "kernel" else P(M)
    if owner in _ROW and leaf == "kernel":
        return P(M, None)
    return P()


def param_sharding(mesh: Mesh, path: tuple) -> NamedSharding:
    return NamedSharding(mesh, param_spec(path))


def replicated(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    """Every device of ``mesh`` holds the whole array."""
    return NamedSharding(mesh, P(), memory_kind=memory_kind)


def kv_pages_sharding(mesh: Mesh) -> NamedSharding:
    """KV page arrays ``[P, page_size, Hkv, D]`` split by KV head, in device memory."""
    return NamedSharding(mesh, KV_PAGES_SPEC if mesh.size > 1 else P(), memory_kind=_device_memory_kind(mesh))


def chunk_sharding(mesh: Mesh, memory_kind: str) -> NamedSharding:
    """Swap chunks ``[L, 2, n, page_size, Hkv, D]`` split by KV head, in ``memory_kind``."""
    return NamedSharding(mesh, HOST_CHUNK_SPEC if mesh.size > 1 else P(), memory_kind=memory_kind)


def host_chunk_sharding(mesh: Mesh) -> NamedSharding:
    """Swapped-out chunks ``[L, 2, n, page_size, Hkv, D]``, each device's KV heads in
    its host memory: ``pinned_host`` where the backend has it, else ``unpinned_host``,
    else device memory."""
    kinds = {m.kind for m in _local_device(mesh).addressable_memories()}
    kind = next((k for k in ("pinned_host", "unpinned_host") if k in kinds), _device_memory_kind(mesh))
    return chunk_sharding(mesh, kind)


def _device_memory_kind(mesh: Mesh) -> str:
    return _local_device(mesh).default_memory().kind


def _local_device(mesh: Mesh):
    """A device of ``mesh`` attached to this process (every process has one in the mesh)."""
    return next(d for d in mesh.devices.flat if d.process_index == jax.process_index())


def put_replicated(tree, mesh: Mesh):
    """Host numpy arrays (a pytree) copied whole to every device of ``mesh``. With
    several processes every process must pass the same values (the multi-host
    protocol broadcasts them first); each one fills only its own devices."""
    sharding = replicated(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda index: np.asarray(x)[index]), tree)


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated array's value as numpy, read from this process's first copy."""
    return np.asarray(x.addressable_data(0))
