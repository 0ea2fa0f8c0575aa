"""OpenAI batch files served through the server's app, for ``jaxserve run-batch``
(``server.batch_cli``) and the server's Batch API (``server.batches``).

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
it: the requests whose ``custom_id`` the output holds with an answer below 500
are not run again; lines of the server's failures (5xx, ``error``; an engine
that died answers 503 to the rest) are removed and run again. The exit status
is 1 when any request failed on the server's side, else 0. A request paused on
a client-side tool call ends there (its ``tool_calls`` are in its output); no
follow-up can reach a batch, so its context is not kept. One process: a
multi-host engine serves batches through ``jaxserve serve``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


log = logging.getLogger("jaxserve.server")

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_LISTED_ERRORS = 20   # invalid lines printed before "... and N more"
MAX_RETRY_WAIT_S = 1.0   # the longest wait before a request the app refused with 429 asks again


@dataclass(frozen=True)
class BatchRequest:
    """One line of a batch input file: ``line`` (1-based) in the file, the request's
    ``custom_id``, ``url`` (one of ``BATCH_URLS``) and JSON ``body``."""
    line: int
    custom_id: str
    url: str
    body: dict


def parse_batch(text: str, model_name: str, endpoint: str | None = None) -> tuple[list[BatchRequest], list[str]]:
    """The requests of a batch input file's ``text`` and, for every line that is not a
    valid one, ``"line N: why"``. Blank lines are skipped. ``model_name``: the name
    requests must ask for (the served model's); ``endpoint``: the one ``url`` every line
    must have (a batch of the Batch API's is for one endpoint), None: any of ``BATCH_URLS``."""
    requests, errors, seen = [], [], {}
    # Lines end at "\n" alone: JSON strings may hold U+2028 and the like, which splitlines() splits at.
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        problem = None
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(f"line {number}: not JSON ({e.msg} at column {e.colno})")
            continue
        except RecursionError:
            errors.append(f"line {number}: not JSON this server reads (nested too deeply)")
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
        elif endpoint is not None and url != endpoint:
            problem = f"url is {url!r}, but the batch is for {endpoint!r}"
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


def failed(line: dict) -> bool:
    """Whether an output line is a failure of the server's (a 5xx or an ``error``): run again
    by ``--resume``. A 4xx is the request's own answer, kept."""
    return line.get("error") is not None or not line.get("response") \
        or line["response"].get("status_code", 500) >= 500


def keep_finished(output: Path) -> set[str]:
    """The ``custom_id``s an earlier run wrote to ``output`` and ``--resume`` keeps. Lines of
    the server's failures (``failed``) and a last line cut short (the run was killed while
    writing it) are removed from the file first (a new file renamed over it: a kill never
    leaves less). ``ValueError`` for a line that is not a batch output line."""
    data = output.read_bytes()
    whole = data[:data.rfind(b"\n") + 1]
    kept, done, dropped = [], set(), 0
    for number, raw in enumerate(whole.split(b"\n")[:-1], start=1):
        try:
            line = json.loads(raw)
            custom_id = line["custom_id"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise ValueError(f"--resume: {output} line {number} is not a batch output line") from None
        if failed(line):
            dropped += 1
        else:
            kept.append(raw + b"\n")
            done.add(custom_id)
    if dropped or len(whole) < len(data):
        log.warning("%s: running again %d request(s) the server failed%s", output, dropped,
                    " and dropping a last line cut short" if len(whole) < len(data) else "")
        partial = output.with_name(output.name + ".resume")
        partial.write_bytes(b"".join(kept))
        os.replace(partial, output)
    return done


async def serve_request(app, request: BatchRequest, on_retry: Callable[[], None] = lambda: None,
                        headers: list[tuple[str, str]] = (), scope_extra: dict | None = None) -> dict:
    """``request`` served by ``app``, as a batch output line. A 429 (the app's concurrency
    limit, full of other requests of the batch: this one fans out to more engine requests
    than are free) is asked again, after a wait that doubles up to ``MAX_RETRY_WAIT_S``,
    until served; ``on_retry`` is called at the first. ``headers``: more request headers;
    ``scope_extra``: more ASGI scope entries (a server's batch: its creator's owners,
    ``server.middleware.TRUSTED_OWNERS``)."""
    from jaxserve.distributed.asgi_bridge import call_app

    body = json.dumps(request.body).encode()
    wait = 0.01
    while True:
        head, chunks = None, []
        async for part in call_app(app, "POST", request.url, b"", [("content-type", "application/json"), *headers],
                                   body, scope_extra=scope_extra):
            if head is None:
                head = part
            else:
                chunks.append(part)
        if head is None:
            raise RuntimeError("the app ended the request without an answer")
        if head["status"] != 429:
            break
        if wait == 0.01:
            on_retry()
        await asyncio.sleep(wait)
        wait = min(2 * wait, MAX_RETRY_WAIT_S)
    headers = dict(head["headers"])
    raw = b"".join(chunks)
    try:
        answer = json.loads(raw)
    except json.JSONDecodeError:
        answer = {"error": {"message": raw.decode("utf-8", "replace"), "type": "server_error"}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": head["status"], "request_id": headers.get("x-request-id"), "body": answer},
            "error": None}


def error_line(request: BatchRequest, code: str, message: str) -> dict:
    """The output line of a request that got no HTTP answer (OpenAI's ``error`` lines:
    ``server_error`` when its serving raised, ``batch_expired`` past its batch's window)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id, "response": None,
            "error": {"code": code, "message": message}}


async def run_batch(app, requests: list[BatchRequest], write: Callable[[dict], None],
                    concurrency: int = 256, headers: list[tuple[str, str]] = (),
                    gate: asyncio.Semaphore | None = None, scope_extra: dict | None = None) -> Counter:
    """Serve ``requests`` with ``app`` (started: its lifespan running), ``concurrency`` at a
    time in input order (``headers``, ``scope_extra``: as ``serve_request``'s; ``gate``: a semaphore each
    request also holds while it is served, shared with other batches), calling ``write``
    with each one's output line as it ends. Returns the count of lines by status code
    (``"error"`` for lines that are no HTTP answer) and, under ``"retried"``, of requests
    that were refused for a while (429). A ``write`` that raises stops every worker."""
    statuses: Counter = Counter()
    pending = iter(requests)

    def retried() -> None:
        statuses["retried"] += 1

    async def worker() -> None:
        for request in pending:   # (one iterator shared by the workers: each request is taken once)
            try:
                async with gate or nullcontext():
                    line = await serve_request(app, request, retried, headers, scope_extra)
            except Exception as e:   # noqa: BLE001 - one request's failure is its line, not the batch's end
                log.exception("batch request %s (line %d) failed", request.custom_id, request.line)
                line = error_line(request, "server_error", f"{type(e).__name__}: {e}")
            statuses[line["response"]["status_code"] if line["response"] else "error"] += 1
            write(line)

    try:
        async with asyncio.TaskGroup() as workers:
            for _ in range(min(concurrency, len(requests))):
                workers.create_task(worker())
    except* Exception as group:   # (the first failure, as itself: the others were the workers stopped for it)
        raise group.exceptions[0] from None
    return statuses


def summary(statuses: Counter, total: int, seconds: float, output: Path | None) -> str:
    """The run's closing line: how many of ``total`` requests succeeded, the others by status."""
    ok = statuses.get(200, 0)
    others = ", ".join(f"{n} x {status}" for status, n in sorted(statuses.items(), key=str)
                       if status not in (200, "retried"))
    server_failed = sum(n for status, n in statuses.items() if status == "error"
                        or (status != "retried" and status >= 500))
    return (f"jaxserve run-batch: {ok} of {total} requests succeeded{f' ({others} did not)' if others else ''} "
            f"in {seconds:.1f} s"
            + (f"; {statuses['retried']} waited for room (429) and were retried" if statuses.get("retried") else "")
            + (f"; output: {output}" if output is not None else "")
            + (f"; {server_failed} failed on the server's side: --resume runs them again" if server_failed else ""))
