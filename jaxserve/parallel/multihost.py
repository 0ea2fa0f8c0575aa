"""Multi-host: ``jax.distributed`` start-up, and the mesh an engine runs on.

See ``jaxserve.parallel.protocol`` for how worker processes follow process 0's
steps.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.parallel.liveness import Heartbeat, leave_job, wait_for_workers_to_leave
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
    try:
        jax.distributed.initialize(config.coordinator_address, config.num_processes, config.process_id,
                                   heartbeat_timeout_seconds=10)
    except jax.errors.JaxRuntimeError as e:   # (the coordinator's port taken, no coordinator in time...)
        role = "start the coordinator at" if config.process_id == 0 else "join the coordinator at"
        raise ValueError(f"process {config.process_id} could not {role} {config.coordinator_address}: "
                         f"{str(e).splitlines()[0]}") from None
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


# Engine settings each process of a multi-host engine may have its own way (the checkpoint is
# compared by its config instead of its path; the rest is local to the process or to process 0)
PER_PROCESS = ("model", "process_id", "compilation_cache", "compilation_cache_max_gb", "check_invariants")


def check_same_settings(settings: dict[str, object]) -> None:
    """A ``ValueError`` naming the settings that differ between the processes of a
    multi-host engine (each compared by a checksum of its ``repr``), raised on every
    process: a worker follows process 0's steps on its own KV pool and weights, so a
    different page size, pool, dtype or checkpoint there gives wrong tokens or a hang,
    not an error; the processes leave the ``jax.distributed`` job first. A collective: every process calls it with the same keys, in the same
    order. Nothing to check in one process."""
    if jax.process_count() == 1:
        return
    keys = sorted(settings)
    mine = np.array([zlib.crc32(repr(settings[k]).encode()) & 0x7FFFFFFF for k in keys], dtype=np.int32)
    try:
        every = np.asarray(multihost_utils.process_allgather(mine))   # [processes, settings]
    except jax.errors.JaxRuntimeError as e:   # (another process stopped before comparing: its own error says why)
        raise ValueError(f"process {jax.process_index()}: another process of the job stopped before the "
                         f"processes compared their settings ({str(e).splitlines()[0]})") from None
    differ = [k for i, k in enumerate(keys) if (every[:, i] != every[0, i]).any()]
    if differ:   # (every process sees it: the workers leave the job, process 0 waits for them, as on STOP)
        if jax.process_index() == 0:
            wait_for_workers_to_leave(range(1, jax.process_count()))
        else:
            leave_job()
        here = ", ".join(f"{k}={settings[k]!r}" for k in differ)
        sized = " (sized from each process's free device memory: set --num-pages)" if "num_pages" in differ else ""
        raise ValueError(f"the {jax.process_count()} processes differ in {', '.join(differ)} (process "
                         f"{jax.process_index()} has {here}){sized}: start every process with the same "
                         "checkpoint and engine settings")
