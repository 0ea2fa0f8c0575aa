"""tools/trace_summary.py: busy time as a union of intervals, and a real jax.profiler
trace read back per line with its costliest events."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import trace_summary  # noqa: E402
from git_export import export_revision  # noqa: E402


def test_busy_time_counts_nested_and_overlapping_events_once():
    assert trace_summary.busy_ns([(0, 10), (2, 5), (8, 15), (20, 21)]) == 16   # [0, 15) and [20, 21)
    assert trace_summary.busy_ns([(5, 6), (0, 1)]) == 2                        # order does not matter
    assert trace_summary.busy_ns([]) == 0


def test_summary_of_a_real_trace_names_the_traced_work(tmp_path, capsys):
    @jax.jit
    def traced_matmul_for_summary(a):
        return (a @ a).sum()

    a = jnp.ones((256, 256), jnp.float32)
    traced_matmul_for_summary(a).block_until_ready()
    with jax.profiler.trace(str(tmp_path / "trace")):
        for _ in range(4):
            traced_matmul_for_summary(a).block_until_ready()
    out = tmp_path / "summary.json"
    assert trace_summary.main([str(tmp_path / "trace"), "--steps", "4", "--top", "50", "--json", str(out)]) == 0
    lines = json.loads(out.read_text())
    assert lines and all(rec["busy_ms"] <= rec["span_ms"] + 1e-9 for rec in lines)
    names = [t["name"] for rec in lines for t in rec["top"]]
    assert any("traced_matmul_for_summary" in name for name in names)
    # --steps divides every figure: the same trace read as one step counts 4x the calls and time.
    whole = trace_summary.summarize(trace_summary.find_xplane(tmp_path / "trace"), top=50)
    per_step = trace_summary.summarize(trace_summary.find_xplane(tmp_path / "trace"), top=50, steps=4)
    calls = [(a["count"], b["count"], a["ms"], b["ms"]) for x, y in zip(whole, per_step)
             for a, b in zip(x["top"], y["top"]) if a["name"].startswith("PjitFunction(traced_matmul")]
    assert calls and all(n == pytest.approx(4 * m) and t == pytest.approx(4 * u) for n, m, t, u in calls)
    assert calls[0][0] >= 4   # at least one host event per call
    assert "busy" in capsys.readouterr().out


def test_busiest_device_stream_ignores_host_and_xla_timelines():
    lines = [{"plane": "/host:CPU", "line": "python3", "busy_ms": 9.0},
             {"plane": "/device:GPU:0", "line": "XLA Modules", "busy_ms": 3.0},
             {"plane": "/device:GPU:0", "line": "Stream #14(Compute)", "busy_ms": 1.4},
             {"plane": "/device:GPU:0", "line": "Stream #15(MemcpyH2D)", "busy_ms": 0.01}]
    assert trace_summary.busiest_device_stream(lines)["line"] == "Stream #14(Compute)"
    assert trace_summary.busiest_device_stream(lines[:2]) is None   # CPU: no device stream


def test_step_time_forward_only_with_device_busy_against_a_baseline(tmp_path):
    """tools/step_time.py on CPU: the forward alone, a traced busy measure (no device stream
    on CPU) and the same run for git revision HEAD, exported beforehand to a folder (as for
    a machine without the repository's history) and named by a path relative to where the
    tool runs, two pairs, each run in a fresh process."""
    root = Path(__file__).resolve().parents[1]
    export_revision("HEAD", tmp_path, ("jaxserve", "kernels", "scheduler", "tools"))
    cmd = [sys.executable, str(root / "tools" / "step_time.py"), "--shape", "llama-small", "--dtype", "float32",
           "--rows", "4", "--context", "32", "--steps", "3", "--forward-only", "--device-busy-steps", "2",
           "--baseline", tmp_path.name, "--pairs", "2"]
    out = subprocess.run(cmd, cwd=tmp_path.parent, capture_output=True, text=True, timeout=600, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    this, base = result["this"], result[tmp_path.name]
    assert this["forward_only"] is True and this["rows"] == 4 and this["ms_per_step"] > 0
    assert this["device_stream"] is None and this["device_share"] is None
    assert base["ms_per_step"] > 0 and len(result["pairs"]) == 2
    assert result["ms_per_step_ratio"] == statistics.median(p["ms_per_step_ratio"] for p in result["pairs"]) > 0


def test_step_time_structured_step():
    """``--structured``: a step under an all-allowed token bitmask (on CPU the one program
    with the mask; accelerators run the forward and the masked sampler apart)."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "tools" / "step_time.py"), "--shape", "llama-small", "--dtype", "float32",
           "--rows", "4", "--context", "32", "--steps", "2"]
    out = subprocess.run([*cmd, "--structured"], cwd=root, capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["structured"] is True and result["forward_only"] is False and result["ms_per_step"] > 0
    both = subprocess.run([*cmd, "--structured", "--forward-only"], cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert both.returncode == 2 and "choose one" in both.stderr
