"""``tools/gpu_validate.py --interpret --quick`` runs every section on CPU and writes
a report with sane values, so the first accelerator slot can trust it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from scheduler.cost_model import CostModel

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_validate_interpret_writes_every_section(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAXSERVE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_validate.py"), "--out", str(tmp_path),
                           "--interpret", "--quick"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["failed_sections"] == []
    for name in ("backend", "kernels", "device_tests", "attention_bandwidth", "compile", "engine_vs_transformers",
                 "swap_bandwidth", "step_launch", "profile"):
        assert "error" not in report[name], report[name]
        assert f"## {name}" in (tmp_path / "gpu_report.md").read_text()
    assert report["backend"]["backend"] == "cpu" and report["backend"]["interpret"] is True

    kernels = report["kernels"]
    assert kernels["passed"] and {"pallas_gpu", "pallas_tpu"} <= set(kernels["impls"])
    checked = [r for r in kernels["checks"] if r["status"] == "ok"]
    assert {r["impl"] for r in checked} >= {"pallas_gpu", "pallas_tpu", "pallas_mosaic_gpu"}
    # A case outside what a kernel tiles is reported as such, with the kernel's reason.
    assert all(r["note"].startswith("ValueError: impl=") for r in kernels["checks"] if r["status"] == "unsupported")
    assert {r["dtype"] for r in checked} == {"float32", "bfloat16"}
    assert all(0 <= r["max_error"] <= r["tolerance"] for r in checked)
    # Errors are against float64 attention on the host, so the reference is checked too.
    assert "reference" in {r["impl"] for r in checked}
    assert 0 <= kernels["reference_f32_default_precision_error"] <= 1e-4

    tests = report["device_tests"]   # CPU: the kernel-choice tests only (the suite runs the rest)
    assert tests["passed"] and tests["selected"] == "backend_selection" and " passed" in tests["summary"]

    compile_rows = report["compile"]["rows"]
    assert [r["impl"] for r in compile_rows] == ["reference"]   # CPU: the reference is the device's attention
    assert all(r["lower_s"] > 0 and r["compile_s"] > 0 for r in compile_rows)

    bandwidth = report["attention_bandwidth"]
    assert bandwidth["copy_gb_s"] > 0
    ref = [r for r in bandwidth["rows"] if r["impl"] == "reference"]
    assert ref and all(r["gb_s"] > 0 and r["speedup_vs_reference"] == 1.0 for r in ref)

    engine = report["engine_vs_transformers"]
    expected_tokens = engine["num_prompts"] * engine["max_tokens"]
    assert engine["jaxserve"]["tokens"] == engine["transformers"]["tokens"] == expected_tokens
    assert engine["ratio"] > 0
    # The timed pass computes every prompt token (no prefix-cache hit) and compiles nothing.
    assert engine["jaxserve"]["cached_prompt_tokens"] == 0
    assert engine["jaxserve"]["shapes_compiled_while_timed"] == 0

    swap = report["swap_bandwidth"]
    assert swap["swap_round_trip_gb_s"] > 0 and swap["copy_d2h_gb_s"] > 0 and swap["decode_slowdown"] > 0

    (launch,) = report["step_launch"]["rows"]   # CPU: the default variant only
    assert launch["variant"] == "default" and "error" not in launch, launch
    assert 0 < launch["dispatch_ms"] <= launch["ms_per_step"] and 0 < launch["dispatch_share"] <= 1
    assert launch["forward_only"] is False and launch["device_share"] is None   # --interpret traces no steps
    assert launch["cuda_graphs"] is False and report["step_launch"]["passed"] is True

    profile = CostModel.load(report["profile"]["path"])
    assert profile.fwd_per_token_s > 0 and profile.swap_bandwidth_bytes_s > 0
    assert profile.meta["backend"] == "cpu"


def test_device_tests_section_keeps_the_failures(tmp_path, monkeypatch):
    """A failing device test leaves its summary and assertion in the report (on the H200 a
    run cut at its time limit kept only a row of F's)."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("gpu_validate_under_test", ROOT / "tools" / "gpu_validate.py")
    gpu_validate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_validate)
    failing = tmp_path / "test_device_choice.py"
    failing.write_text("def test_backend_selection_is_wrong():\n    assert 'pallas_gpu' == 'reference'\n\n\n"
                       "def test_backend_selection_compiles_at_the_default_level():   # not the suite's level 0\n"
                       "    import os\n    assert os.environ['JAXSERVE_TEST_XLA_OPTIMIZE'] == '1'\n")
    monkeypatch.setattr(gpu_validate, "DEVICE_TESTS", (str(failing),))
    body = gpu_validate.section_device_tests(SimpleNamespace(interpret=True))
    assert body["passed"] is False and body["returncode"] == 1
    assert "1 failed, 1 passed" in body["summary"]
    assert "assert 'pallas_gpu' == 'reference'" in body["output_tail"]
    assert "```" in gpu_validate.render_markdown({"device_tests": body})


def test_step_launch_records_a_variant_that_fails(monkeypatch):
    """A variant whose child fails (here: XLA refuses its flags) is a row with the child's
    error, the other variants still run, and the section reports ``passed: false`` (on the
    H200 every Mosaic GPU variant failed while the section printed "done")."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("gpu_validate_launch", ROOT / "tools" / "gpu_validate.py")
    gpu_validate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_validate)
    monkeypatch.setitem(gpu_validate.STEP_VARIANTS, "default", ("--xla_no_such_flag_here=1", []))
    body = gpu_validate.section_step_launch(SimpleNamespace(interpret=True))
    (row,) = body["rows"]
    assert row["variant"] == "default" and "xla_no_such_flag_here" in row["error"]
    assert body["passed"] is False
