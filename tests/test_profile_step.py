"""``tools/profile_step.py`` on the demo model: it profiles the jitted decode step, and
the compiled step donates every KV array and copies no pool-sized array (a step that
copied the pool would cost in proportion to the pool, not to the context)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profile_step_reports_operations_donation_and_the_matmul_floor():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "profile_step.py"), "--model", "demo", "--rows", "4",
                           "--context", "32", "--max-model-len", "256", "--calls", "2", "--floor-calls", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    donated = re.search(r"KV arrays donated \(aliased to an output\): (\d+) of (\d+); pool-sized copies: (\d+)", out)
    assert donated, out
    aliased, total, copies = map(int, donated.groups())
    assert total > 0 and aliased == total and copies == 0
    kinds = re.findall(r"^\s+[\d.]+ ms\s+[\d.]+%\s+x\s*\d+\s+(\S+)", out, re.M)
    assert kinds, out                                   # the trace had per-operation events
    floor = re.search(r"step / floor = ([\d.]+)", out)
    assert floor and float(floor.group(1)) > 0
