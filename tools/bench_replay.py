"""Wall time of a simulated replay per policy (goal: < 60 s for 30 minutes at rate 5).

    python tools/bench_replay.py                       # every policy, 1800 s at 5 req/s
    python tools/bench_replay.py --policies lamps --rate 8 --profile-top 15

Runs the bundled multi-API InferCept trace through ``run_simulation`` with the
GPT-J/A100 profile and prints, per policy: wall seconds, simulated steps,
steps per wall second and the run's mean E2E latency (so a speed-up that
changes behaviour shows). ``--profile-top N`` prints the N most expensive
functions of each run (cProfile, cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.replay.metrics import request_metrics  # noqa: E402
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402
from jaxserve.replay.workload import WorkloadSpec, make_workload  # noqa: E402
from scheduler import available_policies, load_profile, make_policy, make_predictor  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="trace file (default: bundled multi-API)")
    ap.add_argument("--profile", default="gptj-6b-a100-40g")
    ap.add_argument("--policies", default=",".join(available_policies()))
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goal-s", type=float, default=60.0)
    ap.add_argument("--profile-top", type=int, default=0)
    args = ap.parse_args()

    cost = load_profile(args.profile)
    entries = load_trace(args.trace)
    workload = make_workload(entries, WorkloadSpec("poisson", rate=args.rate, duration_s=args.duration,
                                                   seed=args.seed))
    print(f"{len(workload)} requests over {args.duration:g} s at {args.rate:g} req/s, profile {cost.name}")
    print(f"{'policy':>14} {'wall s':>8} {'steps':>8} {'steps/s':>9} {'sim end s':>10} {'E2E mean s':>11}  goal")
    worst = 0.0
    for name in args.policies.split(","):
        requests = [w.to_request() for w in workload]
        sched = build_scheduler(cost, make_policy(name, make_predictor("oracle", args.seed)), SimConfig())
        prof = cProfile.Profile() if args.profile_top else None
        start = time.perf_counter()
        if prof:
            prof.enable()
        result = run_simulation(sched, requests)
        if prof:
            prof.disable()
        wall = time.perf_counter() - start
        worst = max(worst, wall)
        e2e = [m.e2e_s for m in map(request_metrics, requests) if m.completed]
        ok = "ok" if wall < args.goal_s else "SLOW"
        print(f"{name:>14} {wall:8.1f} {result.num_steps:8d} {result.num_steps / wall:9.0f} "
              f"{result.end_time_s:10.0f} {sum(e2e) / len(e2e):11.2f}  {ok}", flush=True)
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile_top)
    print(f"slowest: {worst:.1f} s (goal < {args.goal_s:g} s)")
    return 0 if worst < args.goal_s else 1


if __name__ == "__main__":
    sys.exit(main())
