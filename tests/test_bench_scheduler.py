"""tools/bench_scheduler.py's ``--phases``: where a ``schedule()`` call's time goes; tools/bench_fanout.py's counts."""

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


def test_bench_fanout_counts_the_prompt_tokens_each_round_computes():
    """tools/bench_fanout.py on the demo model (16-token pages): 3 copies of a 40-token
    prompt compute it once plus the last 8 tokens for each other copy."""
    import argparse
    import bench_fanout
    args = argparse.Namespace(model="demo", copies=3, prompt_len=40, max_tokens=2, budget=256, rounds=1,
                              dtype="float32", seed=0)
    row = bench_fanout.run(args)
    assert row["computed"] == [40 + 2 * 8] and row["agree"] and len(row["seconds"]) == 1
