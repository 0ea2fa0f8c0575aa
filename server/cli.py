"""``jaxserve serve MODEL_DIR|demo``: build the engine, then serve the app with uvicorn.

Every ``--flag`` can also be set with ``JAXSERVE_<FLAG>`` (``jaxserve.cli``
applies them; ``python -m server.cli`` does the same on its own parser).
With ``--num-processes N --process-id I --coordinator-address HOST:PORT`` it
is one process of a multi-host job: process 0 serves, the others follow its
steps (``jaxserve.parallel.protocol``). Server-side tools: the built-in ``calculator`` always, plus Python callables
named with ``--tools name=module:function,...``; they are registered in the
engine (which runs them) and advertised to the model by the app.
With ``--data-parallel-size N`` (or ``--prefill-replicas/--decode-replicas``)
it runs replicas on Ray Serve instead (``jaxserve.distributed.launch``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from jaxserve.cli import refuse
from jaxserve.config import EngineConfig
from server.build import add_app_arguments, build_app, load_tools  # noqa: F401 - load_tools: part of this module's API

log = logging.getLogger("jaxserve.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("server")
    add_app_arguments(parser, net)
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on every route but "
                     "/health and /metrics")
    net.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                     help="largest request body accepted (bytes); more is a 413")
    net.add_argument("--max-upload-bytes", type=int, default=200 * 1024 * 1024,
                     help="largest file POST /v1/files accepts (bytes); more is a 413")
    net.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a connection may take to send a request's headers before it is closed")
    net.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a request may take to send its body (408 after)")
    net.add_argument("--keep-alive-timeout", type=int, default=5,
                     help="seconds an idle keep-alive connection is kept open")
    net.add_argument("--max-connections", type=int, default=1024,
                     help="open connections; one more is answered 503 and closed")
    net.add_argument("--paused-context-ttl", type=float, default=60.0,
                     help="seconds a request paused on a client-side tool call is kept for its follow-up")
    net.add_argument("--response-store", default=None, metavar="DIR",
                     help="keep stored Responses API responses, conversations, files and batches in DIR (an "
                          "SQLite file) across restarts; a running batch runs on (default: in memory only)")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    EngineConfig.add_cli_arguments(parser, serve=True)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from server.connections import guarded_h11_protocol

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.process_id != 0:
        return run_worker(args)
    if args.data_parallel_size > 1 or args.prefill_replicas or args.decode_replicas:
        from jaxserve.distributed.launch import main as serve_replicas   # Ray only on this path
        return serve_replicas(args)
    try:
        protocol = guarded_h11_protocol(args.header_timeout, args.max_connections)
        engine, app = build_app(args)
    except ValueError as e:
        return refuse("serve", e)
    # SIGTERM (systemd, docker, Kubernetes) stops as Ctrl-C does: uvicorn drains the connections, then
    # raises the signal again with the handler it found, this one, so the engine is shut down below
    # (a multi-host engine tells its workers to stop) instead of the process dying in uvicorn.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                    http=protocol, timeout_keep_alive=args.keep_alive_timeout)
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def run_worker(args: argparse.Namespace) -> int:
    """A multi-host worker (``--process-id`` > 0): build the same engine as process 0,
    then run the device work it broadcasts until it stops (``jaxserve.parallel.protocol``)."""
    from jaxserve.engine import LLMEngine
    from jaxserve.parallel.protocol import serve_worker

    try:
        engine = LLMEngine(config=EngineConfig.from_cli(args))
    except ValueError as e:
        return refuse("serve", e)
    log.info("worker process %d: following process 0", args.process_id)
    try:
        serve_worker(engine.executor)
    except Exception as e:   # noqa: BLE001 - process 0 is gone: report and exit non-zero
        print(f"jaxserve serve (worker {args.process_id}): process 0 is gone: {e}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()
    return 0


def _standalone(argv: list[str] | None = None) -> int:
    from jaxserve.cli import apply_env_defaults, check_env_values

    parser = argparse.ArgumentParser(prog="jaxserve serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    apply_env_defaults(parser)
    args = parser.parse_args(argv)
    check_env_values(parser, args)
    return main(args)


if __name__ == "__main__":
    sys.exit(_standalone())
