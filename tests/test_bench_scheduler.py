"""tools/bench_scheduler.py's ``--phases``: where a ``schedule()`` call's time goes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_scheduler  # noqa: E402

from scheduler import BUILTIN_PROFILES  # noqa: E402


def test_phases_are_timed_inside_schedule_and_cover_every_phase():
    row = bench_scheduler.bench("infercept", 32, 16, 20, BUILTIN_PROFILES["gptj-6b-a100-40g"], warmup=10,
                                cache="on", phases=True)
    phases = row["phase_us"]
    assert list(phases) == [name.strip("_") for name in bench_scheduler.PHASES]
    assert all(us > 0 for us in phases.values()), phases
    # each phase runs inside schedule()'s own timer, so together they take no longer than it
    assert sum(phases.values()) <= row["mean_us"]
    assert "phase_us" not in bench_scheduler.bench("fcfs", 8, 4, 3, BUILTIN_PROFILES["gptj-6b-a100-40g"], warmup=2)
