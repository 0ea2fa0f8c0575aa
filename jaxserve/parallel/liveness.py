"""Liveness of a multi-host job's worker processes.

Each worker bumps a counter in the ``jax.distributed`` coordination service's
key-value store every ``HEARTBEAT_S`` from the moment it joins the job
(``Heartbeat``, started by ``multihost.init_distributed``); process 0 watches
the counters (``HeartbeatWatch``) and reports a worker whose counter stood
still for ``STALE_S`` seconds of its own clock (clocks of different hosts are
never compared). A worker that exits is caught sooner, by the next
collective failing; this catches one that hangs or whose host is cut off.
"""

from __future__ import annotations

import threading
import time

HEARTBEAT_S = 0.5
STALE_S = 5.0
LEAVE_GRACE_S = 1.0
_HEARTBEAT_KEY = "jaxserve/heartbeat/{}"
_LEAVING_KEY = "jaxserve/leaving/{}"


def _client():
    from jax._src.distributed import global_state
    return global_state.client


class Heartbeat(threading.Thread):
    """A worker's counter in the ``jax.distributed`` key-value store, bumped every ``HEARTBEAT_S``."""

    def __init__(self, process_id: int) -> None:
        super().__init__(name="jaxserve-heartbeat", daemon=True)
        self.key = _HEARTBEAT_KEY.format(process_id)
        self._stop_event = threading.Event()

    def run(self) -> None:
        beat = 0
        while not self._stop_event.wait(HEARTBEAT_S):
            beat += 1
            try:
                _client().key_value_set(self.key, str(beat), allow_overwrite=True)
            except Exception:   # noqa: BLE001 - the coordinator is gone; the step loop will fail
                return

    def stop(self) -> None:
        self._stop_event.set()


class HeartbeatWatch(threading.Thread):
    """Process 0's watch on the workers' heartbeats: ``on_lost(reason)`` once a
    worker's counter has not moved for ``STALE_S`` seconds (process 0's clock)."""

    def __init__(self, workers, on_lost) -> None:
        super().__init__(name="jaxserve-heartbeat-watch", daemon=True)
        self.workers = list(workers)
        self.on_lost = on_lost
        self._stop_event = threading.Event()

    def run(self) -> None:
        seen = {w: (None, time.monotonic()) for w in self.workers}
        while not self._stop_event.wait(HEARTBEAT_S):
            now = time.monotonic()
            for w in self.workers:
                try:
                    value = _client().key_value_try_get(_HEARTBEAT_KEY.format(w))
                except Exception:   # noqa: BLE001 - not written yet (NOT_FOUND)
                    value = None
                last, since = seen[w]
                if value is not None and value != last:
                    seen[w] = (value, now)
                elif now - since > STALE_S:
                    self.on_lost(f"worker process {w} sent no heartbeat for {now - since:.1f} s")
                    return

    def stop(self) -> None:
        self._stop_event.set()


def leave_job() -> None:
    """A worker told to stop: mark itself as leaving, then leave the ``jax.distributed``
    job while process 0 (which hosts the coordination service) waits for it."""
    import jax

    _client().key_value_set(_LEAVING_KEY.format(jax.process_index()), "1", allow_overwrite=True)
    jax.distributed.shutdown()


def wait_for_workers_to_leave(workers, timeout_s: float = 60.0) -> None:
    """Process 0 after STOP: wait for each worker's leaving mark, then ``LEAVE_GRACE_S``
    for its disconnect to reach the service."""
    for w in workers:
        _client().blocking_key_value_get(_LEAVING_KEY.format(w), int(timeout_s * 1000))
    time.sleep(LEAVE_GRACE_S)
