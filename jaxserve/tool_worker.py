"""Run a CPU-bound tool function in a separate, bounded worker process.

A thread cannot be stopped and holds the GIL while it computes (a big-integer
power stalls every thread of the server), so the built-in calculator runs in a
child process instead: ``IsolatedFunction.call(arg, timeout_s)`` sends the
argument over a pipe, waits at most ``timeout_s`` seconds (without the GIL),
and kills the child when it runs over; the next call starts a fresh one. The
child caps its own address space (``memory_bytes``) and refuses results longer
than ``max_result_chars`` before sending them back.

Workers are fresh interpreters (``python -c`` importing this module: no fork of
a process holding JAX threads) that import only this module and the function's
module. Not ``multiprocessing``'s ``spawn``: it re-imports the parent's main
script in the child, which runs a script's top-level code (a second model
load) when the script has no ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection

log = logging.getLogger("jaxserve")


class ToolError(Exception):
    """An error meant for the model: its text becomes the call's result verbatim
    (any other exception from a tool is reported to the model only generically)."""


class ToolTimeout(ToolError):
    """The worker ran past its time limit and was killed."""


def _worker_main(conn, module: str, name: str, max_result_chars: int, memory_bytes: int | None) -> None:
    """Child process: ``(arg) -> ("ok", text) | ("tool_error", message) | ("error", type name)``, forever."""
    if memory_bytes:
        try:   # room for memory_bytes more than the child already maps (the interpreter and its imports)
            import os
            import resource
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (mapped + memory_bytes, mapped + memory_bytes))
        except (ImportError, ValueError, OSError):  # not on this platform: the time limit still holds
            pass
    fn = getattr(importlib.import_module(module), name)
    while True:
        try:
            arg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            text = str(fn(arg))
            reply = ("ok", text) if len(text) <= max_result_chars else (
                "tool_error", f"result too long ({len(text)} characters; at most {max_result_chars})")
        except ToolError as e:
            reply = ("tool_error", str(e))
        except MemoryError:
            reply = ("tool_error", "the computation needs too much memory")
        except Exception as e:  # noqa: BLE001 - reported to the parent by type only
            reply = ("error", f"{type(e).__name__}: {e}"[:500])
        conn.send(reply)


class IsolatedFunction:
    """``module:name``, a picklable one-argument function returning text, run in up to
    ``workers`` child processes (calls beyond that wait for a free one, within their time limit)."""

    def __init__(self, module: str, name: str, *, workers: int = 2, max_result_chars: int = 10_000,
                 memory_bytes: int | None = 512 * 1024 * 1024) -> None:
        self.module, self.name = module, name
        self.max_result_chars = max_result_chars
        self.memory_bytes = memory_bytes
        self._idle: list[tuple] = []          # (process, parent end of the pipe)
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self.kills = 0                          # workers killed for running over time (for tests, metrics)

    def _start(self) -> tuple:
        parent, child = Pipe()
        # The child finds this package and the function's module where the parent found them.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen([sys.executable, "-c", _WORKER_COMMAND, str(child.fileno()), self.module,
                                 self.name, str(self.max_result_chars), str(self.memory_bytes or 0)],
                                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env)
        child.close()
        return proc, parent

    def call(self, arg, timeout_s: float) -> str:
        """The function's text for ``arg``. ``ToolTimeout`` after ``timeout_s`` seconds (the
        worker is killed), ``ToolError`` for errors meant for the model, ``RuntimeError``
        for anything else (its text is for the log)."""
        if not self._slots.acquire(timeout=timeout_s):
            raise ToolTimeout(f"no free worker within {timeout_s:g} s")
        worker = None
        try:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or worker[0].poll() is not None:   # (exited)
                worker = self._start()
            proc, conn = worker
            conn.send(arg)
            if not conn.poll(timeout_s):
                self._kill(worker)
                worker = None
                raise ToolTimeout(f"took longer than {timeout_s:g} s")
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):   # the child died (e.g. out of memory)
                self._kill(worker)
                worker = None
                raise ToolError("the computation failed (worker exited)") from None
            if status == "ok":
                return payload
            if status == "tool_error":
                raise ToolError(payload)
            raise RuntimeError(payload)
        finally:
            if worker is not None:
                with self._lock:
                    self._idle.append(worker)
            self._slots.release()

    def _kill(self, worker: tuple) -> None:
        self.kills += 1
        _stop(*worker)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for proc, conn in idle:
            _stop(proc, conn)


def _stop(proc: subprocess.Popen, conn: Connection) -> None:
    """Kill a worker and reap it (a few seconds at most)."""
    conn.close()
    proc.kill()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        log.warning("tool worker %d did not exit after a kill", proc.pid)


def worker_entry(argv: list[str]) -> None:
    """A worker process's entry: ``argv`` = FD MODULE NAME MAX_RESULT_CHARS MEMORY_BYTES (0: no cap)."""
    fd, module, name, chars, memory = argv
    _worker_main(Connection(int(fd)), module, name, int(chars), int(memory) or None)


# How a worker starts: imports this module by name (``-m`` would run a second, ``__main__`` copy of
# it, whose ``ToolError`` is not the one tools raise, and warn that the package already imported it).
_WORKER_COMMAND = "import sys; from jaxserve.tool_worker import worker_entry; worker_entry(sys.argv[1:])"
