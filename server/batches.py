"""OpenAI's Files and Batch APIs on the server: ``/v1/files`` and ``/v1/batches``.

A client uploads a batch input file (``POST /v1/files``, ``purpose: "batch"``; the
JSONL of ``jaxserve run-batch``), creates a batch on it (``POST /v1/batches``),
polls it (``GET /v1/batches/{id}``) and downloads its output and error files
(``GET /v1/files/{id}/content``), as with OpenAI's (the official ``openai``
client's ``files`` and ``batches``).

- A batch's file is checked whole when the batch is created (``server.batch.parse_batch``:
  every line a request to the batch's ``endpoint`` for the served model): a bad
  file makes a ``failed`` batch whose ``errors`` name each bad line, and nothing runs.
- Its requests are served by this same app, in-process (``asgi_bridge.call_app``,
  with the creator's ``Authorization``), at most ``concurrency`` at a time, so a
  batch leaves room for interactive requests under ``--max-concurrent-requests``.
  A line that sets neither ``priority`` nor ``service_tier`` (or sets it "auto") runs
  in priority class ``BATCH_PRIORITY``, after interactive requests (class 0), as
  OpenAI's batches do; within it the engine's policy ranks them like any request.
- Output lines (``server.batch.serve_request``'s, OpenAI's format) go to the batch's
  output file when their status is below 400, to its error file otherwise; each file
  exists once it has a line. ``request_counts`` and ``usage`` (the answered lines'
  tokens, summed) follow the run.
- ``POST /v1/batches/{id}/cancel`` stops it: ``cancelling``, then ``cancelled`` with
  the files of what had ended.
- It has its ``completion_window`` (24 hours) from creation (``expires_at``): then
  its lines in flight are cancelled, those not answered go to the error file as
  ``batch_expired``, and it ends ``expired`` (also at once when resumed after a
  restart past its window).

Files and batches are kept in memory, per API key (a key sees only its own), within
``max_bytes`` of file content. With the server's state file (``--response-store``,
``server.state_file``) they are kept there too and outlive a restart: each answered
line of a running batch is written as it ends, and a batch that was running when the
server stopped (a clean stop or a crash) runs on when it starts again, serving only
the lines not yet answered (those in flight at the stop are served again). Without
one, a restart loses them and batches running at shutdown end ``cancelled``.

A batch's lines run as its creator: each is served with its creator's owners (the
hash of the ``Authorization`` header it was created with, per ``user`` its lines
send; ``server.middleware.TRUSTED_OWNERS``), which the state file keeps; the header
itself is never stored. Used from the event loop only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

from server.batch import BATCH_URLS, BatchRequest, error_line, failed, parse_batch, run_batch
from server.errors import APIError
from server.middleware import TRUSTED_OWNERS, owner_of
from server.listing import MAX_FILES_LIMIT, items_page
from server.state_file import StateFile

log = logging.getLogger("jaxserve.server")

FILE_PURPOSES = ("batch",)              # what may be uploaded (outputs are "batch_output")
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}   # OpenAI's only window: seconds from creation to expiry
MAX_FILE_STORE_BYTES = 1 << 30          # all files' content together
MAX_LISTED_BATCH_ERRORS = 100           # a failed batch's ``errors`` name at most this many lines
MAX_ENDED_BATCHES = 1000                # ended batches kept (their files stay until deleted); older ones forgotten
ENDED = ("completed", "failed", "cancelled", "expired")
BATCH_PRIORITY = 1                      # the priority class of a batch's lines that choose none (as "flex")


@dataclass
class StoredFile:
    """One file: its ``data`` and what the API says of it."""
    id: str
    owner: str
    filename: str
    purpose: str
    data: bytes
    created_at: int = field(default_factory=lambda: int(time.time()))
    expires_at: int | None = None   # when it is deleted (Unix seconds; None: kept until deleted)

    def object(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": len(self.data), "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


class FileStore:
    """Files by id, per owner, within ``max_bytes`` of content (an upload past it is a 413;
    deleting files makes room); written to ``state`` too when given (and read back from it).
    A file given an expiry (``expires_after``) is deleted once it passes (when the store is
    next used), unless ``in_use`` names it (a running batch's input: deleted once the batch
    has ended, ``recheck``)."""

    def __init__(self, max_bytes: int = MAX_FILE_STORE_BYTES, state: StateFile | None = None) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._files: OrderedDict[str, StoredFile] = OrderedDict()
        self._state = state
        self._next_expiry: float | None = None   # the earliest ``expires_at`` to act on (None: none)
        self.in_use: Callable[[], Collection[str]] = frozenset   # ids kept past their expiry (``Batches`` sets it)
        for row in state.rows("SELECT id, owner, filename, purpose, data, created_at, expires_at FROM files "
                              "ORDER BY rowid") if state is not None else ():
            self._keep(StoredFile(*row))

    def _keep(self, stored: StoredFile) -> None:
        self._files[stored.id] = stored
        self.num_bytes += len(stored.data)
        if stored.expires_at is not None and (self._next_expiry is None or stored.expires_at < self._next_expiry):
            self._next_expiry = stored.expires_at

    def _drop_expired(self) -> None:
        """Delete the files whose ``expires_at`` has passed."""
        if self._next_expiry is None or time.time() < self._next_expiry:
            return
        now, self._next_expiry, kept = time.time(), None, self.in_use()
        for stored in list(self._files.values()):
            if stored.expires_at is None:
                continue
            if stored.expires_at <= now:
                if stored.id not in kept:
                    self._drop(stored)
            elif self._next_expiry is None or stored.expires_at < self._next_expiry:
                self._next_expiry = stored.expires_at

    def recheck(self) -> None:
        """A file ``in_use`` named may be free now: look for expired files at the next use."""
        self._next_expiry = 0.0

    def _drop(self, stored: StoredFile) -> None:
        del self._files[stored.id]
        self.num_bytes -= len(stored.data)
        if self._state is not None:
            self._state.write("DELETE FROM files WHERE id = ?", stored.id)

    def add(self, owner: str, filename: str, purpose: str, data: bytes, force: bool = False,
            expires_after_s: int | None = None) -> StoredFile:
        """Store ``data`` (deleted ``expires_after_s`` seconds after now when given); past
        ``max_bytes`` a 413, unless ``force`` (a batch's results, which are never dropped:
        the uploads after them are refused until files are deleted)."""
        self._drop_expired()
        if not force and self.num_bytes + len(data) > self.max_bytes:
            raise APIError(413, f"file: the server keeps at most {self.max_bytes} bytes of files and holds "
                           f"{self.num_bytes}; delete files to make room", param="file", code="file_store_full")
        stored = StoredFile(f"file-{uuid.uuid4().hex}", owner, filename, purpose, data)
        if expires_after_s is not None:
            stored.expires_at = stored.created_at + int(expires_after_s)
        self._keep(stored)
        if self._state is not None:
            self._state.write("INSERT INTO files (id, owner, filename, purpose, created_at, data, expires_at) VALUES "
                              "(?, ?, ?, ?, ?, ?, ?)", stored.id, owner, filename, purpose, stored.created_at, data,
                              stored.expires_at)
        return stored

    def get(self, file_id: str, owner: str) -> StoredFile:
        """The file, or a 404 (also for another key's, and for one that expired)."""
        self._drop_expired()
        return _owned(self._files, file_id, owner, "file")

    def delete(self, file_id: str, owner: str) -> dict:
        self._drop(self.get(file_id, owner))
        return {"id": file_id, "object": "file", "deleted": True}

    def page(self, owner: str, purpose: str | None, limit: int, order: str, after: str | None) -> dict:
        self._drop_expired()
        files = [f.object() for f in self._files.values()
                 if f.owner == owner and (purpose is None or f.purpose == purpose)]
        return items_page(files, limit, order, after, "your files", max_limit=MAX_FILES_LIMIT)


@dataclass
class BatchJob:
    """One batch: its OpenAI ``Batch`` fields and, while it runs, its task."""
    id: str
    owner: str
    model: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict | None
    status: str = "validating"
    created_at: int = field(default_factory=lambda: int(time.time()))
    times: dict[str, int] = field(default_factory=dict)   # in_progress_at, completed_at, ... as they happen
    total: int = 0
    completed: int = 0
    failed_count: int = 0
    # tokens of its answered lines, summed (its ``usage``: OpenAI's ``BatchUsage``)
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict] | None = None
    owners: dict[str, str] | None = None   # while it runs: its lines' owners by ``user`` (TRUSTED_OWNERS; not shown)
    window_s: float = COMPLETION_WINDOWS["24h"]   # its completion window's length, seconds
    output_expires_after_s: int | None = None     # its output and error files are deleted this long after made
    usage_known: bool = True   # False: kept by a version that did not count tokens (``usage`` null, as OpenAI's)
    task: asyncio.Task | None = None

    @property
    def expires_at(self) -> int:
        """When its completion window ends (Unix seconds): lines not answered by then expire."""
        return self.created_at + int(self.window_s)

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def count(self, line: dict, bad: bool) -> None:
        """Count an answered output line: as completed or failed, and the tokens its
        answer's ``usage`` reports (chat and completions: ``prompt_tokens``...; the
        Responses API: ``input_tokens``...)."""
        response = line.get("response")   # (``line``: a dict; what it holds is read with care, as kept lines may be old)
        body = response.get("body") if isinstance(response, dict) else None
        if bad:
            self.failed_count += 1
        else:
            self.completed += 1
        usage = body.get("usage") if isinstance(body, dict) else None
        if not isinstance(usage, dict):
            return
        given = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        made = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
        self.input_tokens += _count(usage, "prompt_tokens") or _count(usage, "input_tokens")
        self.cached_tokens += _count(given, "cached_tokens")
        self.output_tokens += _count(usage, "completion_tokens") or _count(usage, "output_tokens")
        self.reasoning_tokens += _count(made, "reasoning_tokens")

    def record(self) -> str:
        """The job as the state file keeps it: its fields but the task (a running job's
        counts are then given back by its answered lines)."""
        return json.dumps({k: getattr(self, k) for k in self.__dataclass_fields__ if k != "task"})

    def become(self, status: str) -> None:
        self.status = status
        self.times[f"{status}_at"] = int(time.time())
        if self.ended:
            self.owners = None   # (no longer needed)

    def object(self) -> dict:
        times = {f"{s}_at": self.times.get(f"{s}_at") for s in
                 ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")}
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "model": self.model,
                "errors": None if self.errors is None else {"object": "list", "data": self.errors},
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.expires_at, **times,
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed_count},
                "usage": None if not self.usage_known else {"input_tokens": self.input_tokens,
                          "input_tokens_details": {"cached_tokens": self.cached_tokens},
                          "output_tokens": self.output_tokens,
                          "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                          "total_tokens": self.input_tokens + self.output_tokens},
                "metadata": self.metadata}


class Batches:
    """The server's batches: created on a stored file, run by ``app`` in-process; kept in
    ``state`` too when given (read back from it: ``resume`` runs on those that were
    running)."""

    def __init__(self, files: FileStore, model_name: str, concurrency: int, state: StateFile | None = None,
                 windows: dict[str, float] = COMPLETION_WINDOWS) -> None:
        """``concurrency``: requests of all batches together in flight at once; ``windows``:
        the ``completion_window`` values accepted, each with its length in seconds."""
        self.files, self.model_name, self.concurrency, self.windows = files, model_name, concurrency, windows
        self.app = None   # set once the app exists (``create_app``): the batches' requests go through it
        self._gate = asyncio.Semaphore(concurrency)
        self._jobs: OrderedDict[str, BatchJob] = OrderedDict()
        self._state = state
        self._stopping = False   # ``close`` was called: with a state file, running batches stay running there
        for batch_id, record in state.rows("SELECT id, job FROM batches ORDER BY rowid") if state is not None else ():
            try:
                fields = json.loads(record)
                fields.setdefault("usage_known", "input_tokens" in fields)   # (a record from before usage was counted)
                self._jobs[batch_id] = BatchJob(**fields)
            except (ValueError, TypeError, AttributeError) as e:   # (not JSON, not an object, unknown fields)
                raise ValueError(f"response store {state.path}: batch {batch_id}: unreadable record "
                                 f"({type(e).__name__}: {e})") from None
        files.in_use = self._inputs_in_use

    def _inputs_in_use(self) -> set[str]:
        """The input files of the batches not ended (kept past their expiry until they end)."""
        return {job.input_file_id for job in self._jobs.values() if not job.ended}

    def resume(self) -> None:
        """Run on the batches the state file held as running (from the event loop, once
        the app serves): each serves the lines it had not answered; one that was being
        cancelled ends ``cancelled`` with what it had."""
        self._stopping = False
        if self._state is None or self._state.closed:   # (no file, or closed by an earlier shutdown: nothing to read)
            return
        for job in [j for j in self._jobs.values() if not j.ended and (j.task is None or j.task.done())]:
            outputs, errors, unreadable = self._answered(job)
            if unreadable:   # (damaged answered lines: this batch fails with the lines it can read; the server starts)
                log.error("batch %s: %d answered line(s) in the response store %s are unreadable", job.id,
                          unreadable, self._state.path)
                job.errors = [{"code": "server_error", "message": f"the server stopped this batch and {unreadable} of "
                               f"the lines it had answered are unreadable: run those lines again", "param": None,
                               "line": None}]
                self._finish(job, outputs, errors, "failed")
                continue
            if job.status == "cancelling":
                self._finish(job, outputs, errors, "cancelled")
                continue
            if job.owners is None and job.status == "in_progress":   # (kept by a version that did not keep them)
                job.errors = [{"code": "server_error", "message": "the server stopped this batch and cannot tell "
                               "who created it: create it again", "param": None, "line": None}]
                self._finish(job, outputs, errors, "failed")
                continue
            try:
                source = self.files.get(job.input_file_id, job.owner)
            except APIError:
                job.errors = [{"code": "server_error", "message": "the batch's input file was deleted before the "
                               "batch ended", "param": None, "line": None}]
                self._finish(job, outputs, errors, "failed")
                continue
            log.warning("batch %s was running when the server stopped: running on after a restart (%d of its "
                        "lines answered before)", job.id, len(outputs) + len(errors))
            self._start(job, source.data, outputs, errors)

    def _answered(self, job: BatchJob) -> tuple[list[bytes], list[bytes], int]:
        """The output and error lines the state file holds for ``job`` (its counts and usage set
        from them), and how many more it holds that are not readable (damaged)."""
        outputs, errors, unreadable = [], [], 0
        job.completed = job.failed_count = job.input_tokens = job.cached_tokens = job.output_tokens = 0
        job.reasoning_tokens, job.usage_known = 0, True   # (counted afresh from its answered lines)
        for bad, line in self._state.rows("SELECT bad, line FROM batch_lines WHERE batch_id = ? ORDER BY rowid",
                                          job.id):
            try:
                answer = json.loads(line)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                unreadable += 1
                continue
            job.count(answer, bool(bad))
            (errors if bad else outputs).append(line)
        return outputs, errors, unreadable

    def _become(self, job: BatchJob, status: str) -> None:
        """``job.become(status)``, kept in the state file."""
        job.become(status)
        self._save(job)
        if job.ended:
            self.files.recheck()   # (its input file may have expired while it ran)

    def _save(self, job: BatchJob) -> None:
        if self._state is not None:
            self._state.write("INSERT INTO batches (id, job) VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET "
                              "job = excluded.job", job.id, job.record())   # (its row keeps its place: creation order)

    def create(self, owner: str, authorization: str | None, input_file_id: str, endpoint: str,
               completion_window: str, metadata: dict | None,
               output_expires_after_s: int | None = None) -> BatchJob:
        """A batch on ``input_file_id``, ``validating`` its file (off the event loop), then
        ``failed`` if it has bad lines, else ``in_progress``; its output and error files are
        deleted ``output_expires_after_s`` after they are made (None: kept). Bad arguments
        are 400s naming them; an unknown file a 404."""
        if endpoint not in BATCH_URLS:
            raise APIError(400, f"endpoint: must be one of {', '.join(BATCH_URLS)}, got {endpoint!r}",
                           param="endpoint")
        if completion_window not in self.windows:
            raise APIError(400, f"completion_window: must be one of {', '.join(self.windows)}, got "
                           f"{completion_window!r}", param="completion_window")
        source = self.files.get(input_file_id, owner)
        if source.purpose != "batch":
            raise APIError(400, f"input_file_id: {input_file_id} was uploaded for {source.purpose!r}, not 'batch'",
                           param="input_file_id")
        job = BatchJob(f"batch_{uuid.uuid4().hex}", owner, self.model_name, endpoint, input_file_id, completion_window,
                       metadata, window_s=self.windows[completion_window],
                       output_expires_after_s=output_expires_after_s)
        self._forget_old()
        self._jobs[job.id] = job
        self._save(job)
        self._start(job, source.data, [], [], authorization or "")
        return job

    def _start(self, job: BatchJob, data: bytes, outputs: list[bytes], errors: list[bytes],
               authorization: str | None = None) -> None:
        """Run ``job`` on its input file's ``data``, its lines ``outputs`` and ``errors``
        answered already, as its creator (``authorization``: its header, for a new batch,
        whose owners are derived from it once its lines are read; None: a resumed one's
        kept owners)."""
        job.task = asyncio.get_running_loop().create_task(self._run(job, data, outputs, errors, authorization))
        job.task.add_done_callback(lambda task: self._settle(job, task))

    def get(self, batch_id: str, owner: str) -> BatchJob:
        """The batch, or a 404 (also for another key's)."""
        return _owned(self._jobs, batch_id, owner, "batch")

    def page(self, owner: str, limit: int, after: str | None) -> dict:
        """Newest first, as OpenAI lists batches."""
        jobs = [j.object() for j in self._jobs.values() if j.owner == owner]
        return items_page(jobs, limit, "desc", after, "your batches")

    async def cancel(self, batch_id: str, owner: str) -> BatchJob:
        """Stop a running batch (its files keep what had ended); an ended one is left as it is."""
        job = self.get(batch_id, owner)
        if job.task is not None and not job.task.done():
            if job.status != "cancelling":   # (a second cancel waits for the first)
                self._become(job, "cancelling")
                job.task.cancel()
            await asyncio.wait({job.task})
        return job

    async def close(self) -> None:
        """Stop every running batch (server shutdown): with a state file they stay running
        there (``resume`` goes on with them), else they end ``cancelled``."""
        self._stopping = True
        running = [j.task for j in self._jobs.values() if j.task is not None and not j.task.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)

    async def _run(self, job: BatchJob, data: bytes, outputs: list[bytes], errors: list[bytes],
                   authorization: str | None) -> None:
        def write(line: dict) -> None:
            bad = failed(line) or line["response"]["status_code"] >= 400
            text = json.dumps(line).encode() + b"\n"
            (errors if bad else outputs).append(text)
            job.count(line, bad)
            if self._state is not None:
                self._state.write("INSERT INTO batch_lines (batch_id, bad, line) VALUES (?, ?, ?)", job.id, bad, text)

        try:
            requests, problems = await asyncio.to_thread(_parse, data, self.model_name, job.endpoint)
            if problems or not requests:
                job.errors = [_line_error(p) for p in problems[:MAX_LISTED_BATCH_ERRORS]] or \
                    [{"code": "empty_file", "message": "the file holds no request", "param": None, "line": None}]
                self._become(job, "failed")
                return
            job.total = len(requests)
            if authorization is not None:   # (a new batch: who its lines are, kept in place of the header)
                users = {r.body["user"] for r in requests if isinstance(r.body.get("user"), str)} | {""}
                job.owners = {user: owner_of(authorization, user) for user in users}
            if outputs or errors:   # (after a restart: the lines answered before it are not served again)
                done = _answered_ids(outputs, errors)
                requests = [r for r in requests if r.custom_id not in done]
            if job.status != "in_progress":
                self._become(job, "in_progress")
            if job.expires_at > time.time():   # (else resumed after its window: no line is served)
                window = asyncio.timeout(job.expires_at - time.time())
                try:
                    async with window:
                        await run_batch(self.app, requests, write, self.concurrency, gate=self._gate,
                                        scope_extra={TRUSTED_OWNERS: job.owners})
                except TimeoutError:
                    if not window.expired():
                        raise   # (not the window's: a failure like any other)
            if job.expires_at <= time.time():   # (the lines in flight at its end were cancelled, as by ``cancel``)
                self._expire(job, requests, outputs, errors)
                return
        except asyncio.CancelledError:
            if not (self._stopping and self._state is not None):   # (else it runs on after the restart)
                self._finish(job, outputs, errors, "cancelled")
            raise
        except Exception as e:   # noqa: BLE001 - a broken run fails its batch, not the server
            log.exception("batch %s failed", job.id)
            job.errors = [{"code": "server_error", "message": f"{type(e).__name__}: {e}", "param": None,
                           "line": None}]
            self._finish(job, outputs, errors, "failed")
        else:
            job.become("finalizing")
            self._finish(job, outputs, errors, "completed")

    def _expire(self, job: BatchJob, requests: list[BatchRequest], outputs: list[bytes],
                errors: list[bytes]) -> None:
        """End ``job`` ``expired``: each of ``requests`` not answered goes to the error file as
        ``batch_expired`` (straight into it: ``_finish`` stores it in one transaction)."""
        done = _answered_ids(outputs, errors)
        late = [r for r in requests if r.custom_id not in done]
        for request in late:
            line = error_line(request, "batch_expired",
                              "This request could not be executed before the completion window expired.")
            errors.append(json.dumps(line).encode() + b"\n")
            job.count(line, True)
        log.warning("batch %s expired: %d of its %d lines not answered in its %s window", job.id, len(late),
                    job.total, job.completion_window)
        self._finish(job, outputs, errors, "expired")

    def _settle(self, job: BatchJob, task: asyncio.Task) -> None:
        """A batch whose task ended without ending it (cancelled before its first step) ends
        now, unless the server is stopping with a state file (it runs on after the restart)."""
        if not job.ended and not (self._stopping and self._state is not None):
            self._become(job, "cancelled" if task.cancelled() else "failed")

    def _forget_old(self) -> None:
        """Drop the oldest ended batches past ``MAX_ENDED_BATCHES`` (their files stay)."""
        ended = [j.id for j in self._jobs.values() if j.ended]
        for batch_id in ended[:max(0, len(ended) - MAX_ENDED_BATCHES + 1)]:
            del self._jobs[batch_id]
            if self._state is not None:
                self._state.write("DELETE FROM batches WHERE id = ?", batch_id)

    def _finish(self, job: BatchJob, outputs: list[bytes], errors: list[bytes], status: str) -> None:
        """Store the run's output and error files (those with lines) and end ``job`` as ``status``
        (in the state file: in one transaction, its answered lines then dropped)."""
        with self._state.transaction() if self._state is not None else nullcontext():
            for lines, attr in ((outputs, "output_file_id"), (errors, "error_file_id")):
                if lines:
                    name = f"{job.id}_{attr.removesuffix('_file_id')}.jsonl"
                    setattr(job, attr, self.files.add(job.owner, name, "batch_output", b"".join(lines), force=True,
                                                      expires_after_s=job.output_expires_after_s).id)
            self._become(job, status)
            if self._state is not None:
                self._state.write("DELETE FROM batch_lines WHERE batch_id = ?", job.id)


def _owned(items: dict, item_id: str, owner: str, kind: str):
    """``items[item_id]`` if ``owner``'s, else a 404 naming ``kind`` (another key's ids are unknown ones)."""
    item = items.get(item_id)
    if item is None or item.owner != owner:
        raise APIError(404, f"no {kind} {item_id!r}", param=f"{kind}_id", code=f"{kind}_not_found")
    return item


def _parse(data: bytes, model_name: str, endpoint: str) -> tuple[list[BatchRequest], list[str]]:
    """``parse_batch`` of a stored file's bytes (UTF-8, a byte-order mark allowed), each
    request in class ``BATCH_PRIORITY`` unless its body chooses one."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return [], [f"line 1: the file is not UTF-8 ({e.reason})"]
    requests, problems = parse_batch(text, model_name, endpoint)
    return [r if r.body.get("priority") is not None or r.body.get("service_tier") not in (None, "auto")
            else replace(r, body={**r.body, "priority": BATCH_PRIORITY}) for r in requests], problems


def _count(fields, name: str) -> int:
    """``fields[name]`` when ``fields`` is a dict and it is a count (an int >= 0), else 0."""
    value = fields.get(name) if isinstance(fields, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _answered_ids(outputs: list[bytes], errors: list[bytes]) -> set[str]:
    """The ``custom_id`` of each output and error line written."""
    return {json.loads(line)["custom_id"] for line in outputs + errors}


def _line_error(problem: str) -> dict:
    """``"line N: why"`` (``parse_batch``) as an entry of a failed batch's ``errors``."""
    head, _, message = problem.partition(": ")
    line = int(head.split()[1]) if head.startswith("line ") and head.split()[1].isdigit() else None
    return {"code": "invalid_request", "message": message or problem, "param": None, "line": line}
