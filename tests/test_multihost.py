"""Multi-host on CPU: two processes on loopback, each with 2 forced host devices
(gloo collectives), one TP 4 mesh across them. Process 0 schedules; process 1
runs the steps process 0 broadcasts (``jaxserve.parallel.protocol``).

- The two processes produce the same tokens as TP 4 in one process, with
  Swap forced so KV pages go to host memory and back on both processes.
- Served: killing the worker makes ``/health`` answer 503 and a request fail
  with an error instead of hanging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest_server import ServerProcess, free_port

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "mh_cases.py")


def _env(devices: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false"}
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _run(*args: str, timeout: float = 600) -> None:
    proc = subprocess.run([sys.executable, SCRIPT, *args], env=_env(), cwd=HERE.parent, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mh-llama")
    _run("checkpoint", str(path))
    return path


def test_two_processes_at_tp4_generate_what_one_process_does(checkpoint, tmp_path):
    _run("reference", str(checkpoint), str(tmp_path / "ref.json"))
    address = f"127.0.0.1:{free_port()}"
    worker = subprocess.Popen([sys.executable, SCRIPT, "worker", str(checkpoint), "-", address], env=_env(),
                              cwd=HERE.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _run("leader", str(checkpoint), str(tmp_path / "leader.json"), address)
        assert worker.wait(120) == 0, worker.stderr.read()[-4000:]   # it stopped when process 0 said so
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    ref = json.loads((tmp_path / "ref.json").read_text())
    leader = json.loads((tmp_path / "leader.json").read_text())
    assert (ref["processes"], leader["processes"]) == (1, 2)
    assert ref["mesh_devices"] == leader["mesh_devices"] == 4
    assert leader["swapped_out"] > 0 and leader["swapped_in"] > 0
    assert leader["tokens"] == ref["tokens"]
    assert ref["refused"] == {}
    assert sorted(leader["refused"]) == ["logprobs", "penalties", "structured"]
    assert all("not supported across hosts" in m for m in leader["refused"].values()), leader["refused"]


def test_a_dead_worker_makes_health_503_and_requests_fail(checkpoint, tmp_path):
    args = ["--tensor-parallel-size", "4", "--num-processes", "2", "--coordinator-address",
            f"127.0.0.1:{free_port()}", "--num-pages", "48", "--max-model-len", "96", "--no-warmup",
            "--no-compilation-cache"]
    server = ServerProcess(str(checkpoint), [*args, "--process-id", "0"], env=_env(2), log_path=tmp_path / "p0.log")
    worker = subprocess.Popen(server.cmd[:-2] + ["--process-id", "1"], env=_env(2), cwd=HERE.parent,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server.start().wait_ready(timeout=300)
        body = {"model": checkpoint.name, "prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0}
        ok = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 5
        worker.kill()
        worker.wait()
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health still answers 200 after the worker died"
            time.sleep(0.5)
        failed = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["code"] == "engine_dead"
        assert server.proc.poll() is None   # process 0 outlived its worker to say so
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        server.stop()


def test_processes_started_differently_refuse_and_sigterm_stops_both(checkpoint, tmp_path):
    """A worker started with another page size than process 0's is named and refused by
    both processes (it gave wrong tokens, or hung, with /health at 200); a matched pair
    stopped with SIGTERM (how systemd, docker and Kubernetes stop a server) shuts down as
    with Ctrl-C: process 0 tells the worker to stop and both exit 0 (process 0 died inside
    uvicorn and the worker crashed)."""
    import signal

    def pair(worker_extra: list[str], log: str) -> tuple[ServerProcess, subprocess.Popen]:
        args = ["--tensor-parallel-size", "4", "--num-processes", "2", "--coordinator-address",
                f"127.0.0.1:{free_port()}", "--num-pages", "48", "--max-model-len", "96", "--no-warmup",
                "--no-compilation-cache"]
        server = ServerProcess(str(checkpoint), [*args, "--process-id", "0"], env=_env(2), log_path=tmp_path / log)
        worker = subprocess.Popen(server.cmd[:-2] + ["--process-id", "1", *worker_extra], env=_env(2),
                                  cwd=HERE.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        server.start()
        return server, worker

    server, worker = pair(["--page-size", "8"], "mismatch.log")
    try:
        assert worker.wait(240) == 2
        assert "differ in page_size" in worker.stderr.read()
        assert server.proc.wait(240) == 2 and "differ in page_size" in server.log_tail()
    finally:
        for proc in (worker, server.proc):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    server, worker = pair([], "sigterm.log")
    try:
        server.wait_ready(timeout=300)
        body = {"model": checkpoint.name, "prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(120) == 0, server.log_tail()
        assert worker.wait(120) == 0, worker.stderr.read()[-2000:]
    finally:
        for proc in (worker, server.proc):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
