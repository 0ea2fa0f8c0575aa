"""Multi-host: ``jax.distributed`` start-up, and the mesh an engine runs on.

See ``jaxserve.parallel.protocol`` for how worker processes follow process 0's
steps.
"""

from __future__ import annotations

from pathlib import Path

import jax
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.parallel.liveness import Heartbeat
from jaxserve.parallel.mesh import check_tensor_parallel, make_mesh


def init_distributed(config: EngineConfig) -> None:
    """Join the ``jax.distributed`` job of ``config`` (``coordinator_address``,
    ``num_processes``, ``process_id``) unless it is one process or already joined.
    Must run before JAX starts its backends (before any device is used); on CPU
    it selects gloo collectives. Recoverability is on, so process 0 outlives a
    dead worker and can answer that it is unhealthy (``protocol``). A worker
    starts its heartbeat here (``liveness``)."""
    if config.num_processes == 1 or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                               heartbeat_timeout_seconds=10)
    if config.process_id != 0:
        Heartbeat(config.process_id).start()


def tensor_parallel_mesh(config: EngineConfig, model_dir: Path) -> Mesh | None:
    """The mesh for ``config`` (None: one device, one process). Joins the
    distributed job first; checks the TP degree against the checkpoint's
    ``config.json`` and the devices (a ``ValueError`` naming
    ``tensor_parallel_size`` and the numbers) before any weight is read."""
    from jaxserve.weights import read_config

    init_distributed(config)
    tp = config.tensor_parallel_size
    if tp == 1 and config.num_processes == 1:
        return None
    check_tensor_parallel(read_config(Path(model_dir)), tp, jax.device_count())
    if config.num_processes > 1 and tp != jax.device_count():
        raise ValueError(f"tensor_parallel_size={tp} must equal the {jax.device_count()} devices of the "
                         f"{config.num_processes} processes (one mesh over every process's devices)")
    return make_mesh(tp)
