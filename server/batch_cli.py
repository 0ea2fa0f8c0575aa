"""``jaxserve run-batch MODEL -i requests.jsonl -o results.jsonl``: the command around
``server.batch`` (its docstring says what a batch file is and how it is run)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import TextIO

from jaxserve.cli import refuse as refuse_command
from jaxserve.config import EngineConfig
from server.batch import MAX_LISTED_ERRORS, BatchRequest, keep_finished, parse_batch, run_batch, summary
from server.build import add_app_arguments, build_app, served_model_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    batch = parser.add_argument_group("batch")
    add_app_arguments(parser, batch)
    batch.add_argument("-i", "--input", required=True, help="batch input file (JSONL; '-': standard input)")
    batch.add_argument("-o", "--output", required=True, help="batch output file (JSONL; '-': standard output)")
    batch.add_argument("--resume", action="store_true",
                       help="continue an existing output: run the requests it does not hold, and again those "
                            "the server failed (5xx)")
    batch.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    # What build_app reads of a server's flags, fixed for a batch: no key, no store, no follow-ups.
    parser.set_defaults(api_key=None, response_store=None, paused_context_ttl=0.0, max_body_bytes=2**62,
                        body_timeout=3600.0, max_upload_bytes=0)
    EngineConfig.add_cli_arguments(parser)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def refuse(message: str) -> int:
        return refuse_command("run-batch", message)

    try:
        text = sys.stdin.read() if args.input == "-" else Path(args.input).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        return refuse(f"--input: {e}")
    requests, errors = parse_batch(text, served_model_name(args))
    if errors:
        listed = "\n  ".join(errors[:MAX_LISTED_ERRORS])
        more = f"\n  ... and {len(errors) - MAX_LISTED_ERRORS} more" if len(errors) > MAX_LISTED_ERRORS else ""
        return refuse(f"{args.input}: {len(errors)} invalid line(s), nothing was run:\n  {listed}{more}")
    output = None if args.output == "-" else Path(args.output)
    done: set[str] = set()
    if output is None:
        if args.resume:
            return refuse("--resume continues an output file, not standard output")
    elif not output.parent.is_dir():
        return refuse(f"--output: no directory {output.parent}")
    elif output.is_dir():
        return refuse(f"--output {output} is a directory: name a file")
    elif output.exists() and output.stat().st_size:
        if not args.resume:
            return refuse(f"--output {output} exists: pass --resume to continue it, or remove it")
        try:
            done = keep_finished(output)
        except ValueError as e:   # not a batch output
            return refuse(str(e))
        except OSError as e:   # unreadable, or not rewritable
            return refuse(f"--output {output}: {e}")
    todo = [r for r in requests if r.custom_id not in done]
    if done:
        print(f"jaxserve run-batch: resuming: {len(requests) - len(todo)} of {len(requests)} requests are "
              f"already in {output}", file=sys.stderr)
    try:
        engine, app = build_app(args)
    except ValueError as e:
        return refuse(str(e))
    start = time.perf_counter()
    try:
        with (output.open("a", encoding="utf-8") if output is not None else nullcontext(sys.stdout)) as sink:
            statuses = asyncio.run(_run(app, todo, sink, args.max_concurrent_requests))
    except OSError as e:   # the output could not be written (disk full, a closed pipe)
        print(f"jaxserve run-batch: writing the output failed: {e}; --resume continues", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()
    print(summary(statuses, len(todo), time.perf_counter() - start, output), file=sys.stderr)
    return 1 if any(status == "error" or status >= 500 for status in statuses if status != "retried") else 0


async def _run(app, requests: list[BatchRequest], sink: TextIO, concurrency: int) -> Counter:
    """Start ``app``'s lifespan, serve ``requests`` with a progress bar, stop it."""
    from tqdm.auto import tqdm

    from jaxserve.distributed.asgi_bridge import Lifespan

    lifespan = Lifespan(app)
    await lifespan.start()
    try:
        with tqdm(total=len(requests), desc="run-batch", unit="req", file=sys.stderr,
                  disable=not requests) as bar:
            def write(line: dict) -> None:
                sink.write(json.dumps(line) + "\n")
                sink.flush()
                bar.update()
            return await run_batch(app, requests, write, concurrency)
    finally:
        await lifespan.stop()
