"""The multi-host step protocol: worker processes run process 0's device work.

All processes of a ``jax.distributed`` job build the same engine (same
checkpoint, same settings, one mesh over every process's devices, the same KV
pool: ``kv_pool_pages`` takes the least free memory of any process) and warm
it up alike. Then process 0 runs the scheduler, the API calls and the server,
and its ``LeaderExecutor`` broadcasts every piece of device work before it
runs it; each worker's ``serve_worker`` loop receives it and runs the same
jitted program on the same inputs, so every collective inside the step has
all its participants.

Messages, each two ``multihost_utils.broadcast_one_to_all`` calls (JAX's own
collectives over the mesh's devices; no other transport):

1. a header, int64 ``[HEADER_LEN]``: ``[op, extra_0, extra_1, n_arrays,
   then (ndim, d0, d1, d2) per array]``;
2. the arrays (skipped when there are none), whose shapes the header gave and
   whose dtypes and pytree structure both sides know per op.

====================  ==========================================  ======================
op                    arrays                                      extras
====================  ==========================================  ======================
FORWARD               ``StepInputs`` (input_ids, meta, logits     token bucket, sequences
                      indices, sampling), as ``prepare`` built
SWAP_OUT / SWAP_IN    handle [n], pages per op [n], device pages  -
                      [sum], host pages [sum] (int32)
RELEASE               -                                           request handle
STOP                  -                                           -
====================  ==========================================  ======================

Stopping: on STOP a worker marks itself as leaving in the key-value store and
leaves the job; process 0 waits for those marks before it may exit, since the
coordination service lives in process 0 and a worker leaving a service that
is gone aborts.

Requests are named by an integer handle that process 0 assigns (the host
copies of swapped pages are keyed by it on every process; each process keeps
its own devices' slices).

Failures: a worker that dies breaks the next collective (gloo: "connection
closed by peer"); one that hangs stops its heartbeat (``liveness``).
``LeaderExecutor.failure`` then says why, every later step raises
``WorkerLostError`` at once, and the server's ``/health`` answers 503. A
worker whose leader is gone exits with an error.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.executor.model import ModelExecutor, StepInputs
from jaxserve.parallel.liveness import HeartbeatWatch, leave_job, wait_for_workers_to_leave
from scheduler import Request, StepPlan, StepResult, SwapOp

log = logging.getLogger("jaxserve")

HEADER_LEN = 64
MAX_ARRAYS = (HEADER_LEN - 4) // 4
FORWARD, SWAP_OUT, SWAP_IN, RELEASE, STOP = 1, 2, 3, 4, 5


class WorkerLostError(RuntimeError):
    """A worker process of the mesh died or stopped answering; no step can run."""


# ---------------------------------------------------------------- messages
def _header(op: int, arrays: list[np.ndarray], extras: tuple[int, int] = (0, 0)) -> np.ndarray:
    if len(arrays) > MAX_ARRAYS:
        raise ValueError(f"a message carries at most {MAX_ARRAYS} arrays, got {len(arrays)}")
    header = np.zeros(HEADER_LEN, np.int64)
    header[:4] = op, extras[0], extras[1], len(arrays)
    for i, a in enumerate(arrays):
        if a.ndim > 3:
            raise ValueError(f"message arrays have at most 3 dimensions, got shape {a.shape}")
        header[4 + 4 * i] = a.ndim
        header[5 + 4 * i:5 + 4 * i + a.ndim] = a.shape
    return header


def send(op: int, tree=(), extras: tuple[int, int] = (0, 0)) -> None:
    """Process 0: broadcast ``op`` with the numpy arrays of ``tree``."""
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
    multihost_utils.broadcast_one_to_all(_header(op, leaves, extras))
    if leaves:
        multihost_utils.broadcast_one_to_all(leaves)


def receive(templates: dict[int, object]) -> tuple[int, object, tuple[int, int]]:
    """A worker: the next ``(op, tree, extras)``; ``templates[op]`` is a pytree of
    that op's structure and dtypes (its shapes are ignored)."""
    header = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(HEADER_LEN, np.int64)))
    op, extras, count = int(header[0]), (int(header[1]), int(header[2])), int(header[3])
    if not count:
        return op, (), extras
    leaves, treedef = jax.tree_util.tree_flatten(templates[op])
    if len(leaves) != count:
        raise RuntimeError(f"protocol mismatch: op {op} carries {count} arrays, this worker expects {len(leaves)} "
                           "(are all processes running the same jaxserve?)")
    shapes = [tuple(int(d) for d in header[5 + 4 * i:5 + 4 * i + int(header[4 + 4 * i])]) for i in range(count)]
    zeros = [np.zeros(s, np.asarray(t).dtype) for s, t in zip(shapes, leaves)]
    values = multihost_utils.broadcast_one_to_all(zeros)
    return op, jax.tree_util.tree_unflatten(treedef, [np.asarray(v) for v in values]), extras


def _forward_tree(inputs: StepInputs):
    return (inputs.input_ids, inputs.meta, inputs.logits_indices, inputs.sampling)


def _swap_tree(ops: list, handle_of) -> tuple[np.ndarray, ...]:
    return (np.array([handle_of(op.request.request_id) for op in ops], np.int32),
            np.array([len(op.device_pages) for op in ops], np.int32),
            np.array([p for op in ops for p in op.device_pages], np.int32),
            np.array([p for op in ops for p in op.host_pages], np.int32))


_SWAP_TEMPLATE = tuple(np.zeros(1, np.int32) for _ in range(4))


@dataclass(frozen=True)
class _WireRequest:
    """What a worker knows of a request: its handle (``request_id`` for the executor's host store)."""

    request_id: int


@dataclass(frozen=True)
class _WireSwapOp:
    request: _WireRequest
    device_pages: list[int] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)

    @property
    def owner(self) -> int:
        """The request's handle (multi-host runs without the prefix cache's host tier)."""
        return self.request.request_id


def _swap_ops(tree) -> list[_WireSwapOp]:
    handles, counts, device_pages, host_pages = tree
    ops, at = [], 0
    for handle, n in zip(handles.tolist(), counts.tolist()):
        ops.append(_WireSwapOp(_WireRequest(handle), device_pages[at:at + n].tolist(), host_pages[at:at + n].tolist()))
        at += n
    return ops


# ------------------------------------------------------------------ leader
class LeaderExecutor(ModelExecutor):
    """Process 0's executor: broadcasts each piece of device work, then runs it.

    Broadcasting starts with ``start_broadcasting`` (after warm-up, which every
    process runs alike on its own). ``failure`` is None while every worker is
    alive, else why not; once set, ``execute`` raises ``WorkerLostError``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.broadcasting = False
        self.failure: str | None = None
        self._handles: dict[str, int] = {}
        self._next_handle = 0
        self._watch: HeartbeatWatch | None = None

    def start_broadcasting(self) -> None:
        self.broadcasting = True
        self._watch = HeartbeatWatch(range(1, jax.process_count()), self._lost)
        self._watch.start()

    def _lost(self, reason: str) -> None:
        if self.failure is None:
            log.error("multi-host: %s", reason)
            self.failure = reason

    def _send(self, op: int, tree=(), extras: tuple[int, int] = (0, 0)) -> None:
        if not self.broadcasting:
            return
        if self.failure is not None:
            raise WorkerLostError(self.failure)
        try:
            send(op, tree, extras)
        except Exception as e:
            self._lost(f"a worker process is gone ({type(e).__name__}: {e})")
            raise WorkerLostError(self.failure) from e

    def _handle(self, request_id: str) -> int:
        if request_id not in self._handles:
            self._handles[request_id] = self._next_handle
            self._next_handle += 1
        return self._handles[request_id]

    def execute(self, plan: StepPlan) -> StepResult:
        if self.failure is not None:
            raise WorkerLostError(self.failure)
        try:
            return super().execute(plan)
        except WorkerLostError:
            raise
        except Exception as e:
            if self.broadcasting and any(w in str(e).lower() for w in ("gloo", "nccl", "connection", "peer")):
                self._lost(f"a collective failed: {e}")
                raise WorkerLostError(self.failure) from e
            raise

    def forward(self, inputs: StepInputs):
        self._send(FORWARD, _forward_tree(inputs), (inputs.token_bucket, inputs.num_seqs))
        return super().forward(inputs)

    def swap_out(self, ops: list[SwapOp]) -> None:
        self._send(SWAP_OUT, _swap_tree(ops, self._handle))
        super().swap_out([_WireSwapOp(_WireRequest(self._handle(op.request.request_id)), op.device_pages,
                                      op.host_pages) for op in ops])

    def swap_in(self, ops: list[SwapOp]) -> None:
        self._send(SWAP_IN, _swap_tree(ops, self._handle))
        super().swap_in([_WireSwapOp(_WireRequest(self._handle(op.request.request_id)), op.device_pages,
                                     op.host_pages) for op in ops])

    def release(self, request: Request) -> None:
        handle = self._handles.pop(request.request_id, None)
        if handle is None:
            return
        self._send(RELEASE, extras=(handle, 0))
        self._host_store.pop(handle, None)

    def host_memory_kind(self, request_id: str, host_page: int) -> str | None:
        handle = self._handles.get(request_id)
        return None if handle is None else super().host_memory_kind(handle, host_page)

    def close(self) -> None:
        """Tell the workers to stop (they exit their loop); stop watching them."""
        if self._watch is not None:
            self._watch.stop()
        if self.broadcasting and self.failure is None:
            try:
                send(STOP)
                wait_for_workers_to_leave(range(1, jax.process_count()))
            except Exception:   # noqa: BLE001 - a worker already gone has nothing to stop
                log.exception("multi-host: STOP not delivered")
        self.broadcasting = False


def executor_class() -> type[ModelExecutor]:
    """``LeaderExecutor`` on process 0 of a multi-process job, else ``ModelExecutor``."""
    return LeaderExecutor if jax.process_count() > 1 and jax.process_index() == 0 else ModelExecutor


# ------------------------------------------------------------------ worker
def serve_worker(executor: ModelExecutor) -> None:
    """A worker process's loop: run each message from process 0 on ``executor``
    until STOP, then leave the ``jax.distributed`` job (``leave_job``). Raises
    when process 0 is gone."""
    templates = {FORWARD: _forward_tree(executor.synthetic_inputs(executor.config.token_buckets[0])),
                 SWAP_OUT: _SWAP_TEMPLATE, SWAP_IN: _SWAP_TEMPLATE}
    while True:
        op, tree, extras = receive(templates)
        if op == FORWARD:
            input_ids, meta, logits_indices, sampling = tree
            executor.forward(StepInputs(extras[0], input_ids, meta, logits_indices, sampling, extras[1]))
        elif op == SWAP_OUT:
            executor.swap_out(_swap_ops(tree))
        elif op == SWAP_IN:
            executor.swap_in(_swap_ops(tree))
        elif op == RELEASE:
            executor.release(_WireRequest(extras[0]))
        elif op == STOP:
            leave_job()
            return
        else:
            raise RuntimeError(f"protocol mismatch: unknown op {op}")
