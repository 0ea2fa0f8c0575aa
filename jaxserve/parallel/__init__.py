"""Scale-out (DESIGN section 11): the device mesh, the tensor-parallel sharding
rules, per-shard attention under ``shard_map``, and the multi-host protocol.

- ``mesh``: ``check_tensor_parallel`` (bad TP degrees, before weights load),
  ``make_mesh``, ``tp_model_config`` (KV heads replicated up to the TP degree).
- ``sharding``: which axis of every parameter, KV page array and host swap
  chunk is split over the mesh's ``"model"`` axis.
- ``attention``: the KV write and the attention kernel run per shard.
- ``multihost``: ``jax.distributed`` start-up and the step broadcast that
  keeps worker processes in lockstep with process 0.
"""

from jaxserve.parallel.mesh import MODEL_AXIS, check_tensor_parallel, make_mesh, tp_model_config

__all__ = ["MODEL_AXIS", "check_tensor_parallel", "make_mesh", "tp_model_config"]
