"""Start replicas on Ray Serve: ``jaxserve serve MODEL --data-parallel-size N``
(or ``--prefill-replicas N --decode-replicas M``).

``build_application(settings)`` is the Ray Serve application: one deployment
per replica slot (``replica-0`` ..., or ``decode-0`` ... when disaggregated,
with one Ray Serve replica each, so each
has a stable name for the response header, the metric labels and the
affinity maps; Ray Serve restarts a slot's replica when its actor dies) and
the ``Frontend`` ingress deployment that routes to them; when disaggregated,
also the ``prefill`` deployment (``--prefill-replicas`` Ray Serve replicas,
``kv_transfer``). ``main(args)``
starts or joins the Ray cluster (``--ray-address``), runs the application on
``--host/--port`` and blocks until interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from jaxserve.config import EngineConfig

log = logging.getLogger("jaxserve.distributed")

APP_NAME = "jaxserve"
REPO_ROOT = str(Path(__file__).resolve().parents[2])


def replica_names(config: EngineConfig) -> list[str]:
    """The serving replicas' names (decode replicas when disaggregated)."""
    if config.prefill_replicas:
        return [f"decode-{i}" for i in range(config.decode_replicas)]
    return [f"replica-{i}" for i in range(config.data_parallel_size)]


def _actor_options(accelerator: str | None, devices: int, replica_cpus: float) -> dict:
    """Each replica process: ``devices`` chips of ``accelerator`` ("GPU", "TPU"; Ray then
    shows the replica only those), or CPU JAX when the cluster has no accelerator."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    options: dict = {"num_cpus": replica_cpus}
    if accelerator == "GPU":
        options["num_gpus"] = devices
    elif accelerator == "TPU":
        options["resources"] = {"TPU": devices}
    else:
        env["JAX_PLATFORMS"] = "cpu"
    options["runtime_env"] = {"env_vars": env}
    return options


def build_application(settings: dict, *, accelerator: str | None = None, replica_cpus: float = 1.0):
    """The Ray Serve application for the parsed ``serve`` arguments ``settings`` (``vars(args)``).
    ``accelerator``: "GPU" or "TPU" (each replica takes ``--tensor-parallel-size`` of them), None: CPU."""
    from ray import serve

    from jaxserve.distributed.frontend import ingress_class
    from jaxserve.distributed.kv_transfer import PrefillReplica
    from jaxserve.distributed.replica import EngineReplica

    config = EngineConfig.from_cli(argparse.Namespace(**settings))
    engine_settings = {**settings, "data_parallel_size": 1, "prefill_replicas": 0, "decode_replicas": 0}
    options = _actor_options(accelerator, config.tensor_parallel_size, replica_cpus)
    replica_deployment = serve.deployment(EngineReplica, max_ongoing_requests=1024, health_check_period_s=2,
                                          health_check_timeout_s=30, graceful_shutdown_timeout_s=5)
    prefill = None
    if config.prefill_replicas:
        prefill = serve.deployment(PrefillReplica, name="prefill", num_replicas=config.prefill_replicas,
                                   max_ongoing_requests=1024, ray_actor_options=options).bind(engine_settings)
    replicas = {name: replica_deployment.options(name=name, num_replicas=1, ray_actor_options=options)
                .bind(engine_settings, name, prefill) for name in replica_names(config)}
    front = serve.deployment(ingress_class(), name="frontend", num_replicas=1,
                             max_ongoing_requests=4096,
                             ray_actor_options={"num_cpus": 0, "runtime_env": options["runtime_env"]})
    return front.bind(replicas, {"model": config.model, "page_size": config.page_size,
                                 "replica_router": config.replica_router,
                                 "prefill_replicas": config.prefill_replicas}, prefill)


# Seconds Ray Serve's controller waits for its HTTP proxy to report ready, per check (3 misses and
# it kills the proxy). Ray's default, 5, is too short on a host busy loading models: the proxy's
# process did not even start in 15 s on a 2-core machine compiling a model beside it.
PROXY_READY_CHECK_TIMEOUT_S = "30"


def tolerate_busy_hosts() -> None:
    """Give Serve's proxy ``PROXY_READY_CHECK_TIMEOUT_S`` per readiness check in a Ray cluster
    this process starts next (``ray.init`` without an address; the cluster's processes read
    it from this environment). A value already set is kept."""
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", PROXY_READY_CHECK_TIMEOUT_S)


def start(settings: dict, *, route_prefix: str = "/", name: str = APP_NAME, replica_cpus: float = 1.0) -> None:
    """Run the application on the connected Ray cluster (``ray.init`` done) and wait until it is up."""
    import ray
    from ray import serve

    resources = ray.cluster_resources()
    accelerator = next((kind for kind in ("GPU", "TPU") if resources.get(kind, 0) >= 1), None)
    serve.start(http_options={"host": settings["host"], "port": settings["port"]})
    serve.run(build_application(settings, accelerator=accelerator, replica_cpus=replica_cpus), name=name,
              route_prefix=route_prefix, blocking=False)


def main(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    settings = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    try:
        EngineConfig.from_cli(args)
    except ValueError as e:
        print(f"jaxserve serve: {e}", file=sys.stderr)
        return 2
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)   # stop the replicas (and a cluster we started) on SIGTERM too
    tolerate_busy_hosts()
    ray.init(address=args.ray_address, runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT}}, log_to_driver=True)
    try:
        start(settings)
        log.info("serving %s on http://%s:%d with replicas %s", args.model, args.host, args.port,
                 ", ".join(replica_names(EngineConfig.from_cli(args))))
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()
