"""Simulated replicas behind each router, re-send mode, prefix cache on: the
affinity hit rate (follow-ups that re-linked cached pages), mean/p99 TTFT and
E2E, and the simulator's own wall and CPU time (goal: a 64-replica hour in
under 10 minutes).

    python tools/sim_replicas.py --replicas 8 --rate-per-replica 2 --duration 3600
    python tools/sim_replicas.py --replicas 64 --routers affinity --duration 3600
    python tools/sim_replicas.py --replicas 64 --routers affinity --duration 120 --profile-top 25

The bundled multi-API trace, Poisson conversations at ``replicas x
rate-per-replica`` per second (``jaxserve.replay.cluster``). Round robin
sends a follow-up to its predecessor's replica about 1/N of the time.
``--profile-top N`` prints the N most expensive functions of each run
(cProfile, cumulative; the profiler slows the run down, most for small
functions).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.profiles import load_profile  # noqa: E402
from jaxserve.replay.cluster import ROUTERS, run_resend  # noqa: E402
from jaxserve.replay.metrics import aggregate, request_metrics, Slo  # noqa: E402
from jaxserve.replay.simulate import SimConfig, build_scheduler  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402
from jaxserve.replay.workload import WorkloadSpec, make_workload  # noqa: E402
from scheduler import make_policy, make_predictor  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--rate-per-replica", type=float, default=2.0, help="conversations per second per replica")
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--policy", default="infercept")
    ap.add_argument("--profile", default="gptj-6b-a100-40g")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goal-s", type=float, default=600.0)
    ap.add_argument("--profile-top", type=int, default=0, help="print the N most expensive functions per run")
    args = ap.parse_args()
    cost = load_profile(args.profile)
    rate = args.replicas * args.rate_per_replica
    workload = make_workload(load_trace(), WorkloadSpec("poisson", rate=rate, duration_s=args.duration,
                                                        seed=args.seed))
    print(f"{args.replicas} replicas, {len(workload)} conversations over {args.duration:g} s "
          f"({rate:g}/s), policy {args.policy}, profile {cost.name}, prefix cache on")
    print(f"{'router':>13} {'requests':>9} {'hit rate':>8} {'same rep':>8} {'TTFT mean':>9} {'TTFT p99':>8} "
          f"{'E2E mean':>8} {'E2E p99':>8} {'recomputed':>11} {'wall s':>7} {'CPU s':>7}")
    slowest = 0.0
    for router in args.routers.split(","):
        schedulers = [build_scheduler(cost, make_policy(args.policy, make_predictor("oracle", args.seed)),
                                      SimConfig(enable_prefix_caching=True)) for _ in range(args.replicas)]
        prof = cProfile.Profile() if args.profile_top else None
        wall, cpu = time.perf_counter(), time.process_time()
        if prof is not None:
            prof.enable()
        result = run_resend(schedulers, workload, router)
        if prof is not None:
            prof.disable()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        slowest = max(slowest, wall)
        agg = aggregate([request_metrics(r) for r in result.requests], result.end_time_s, Slo())
        same = result.follow_ups_same_replica / result.follow_ups if result.follow_ups else 0.0
        print(f"{router:>13} {len(result.requests):>9} {result.affinity_hit_rate:>8.1%} {same:>8.1%} "
              f"{agg['mean_ttft_s']:>9.3f} {agg['p99_ttft_s']:>8.2f} {agg['mean_e2e_s']:>8.2f} "
              f"{agg['p99_e2e_s']:>8.2f} {result.recomputed_tokens:>11} {wall:>7.1f} {cpu:>7.1f}", flush=True)
        print(f"{'':>13} steps {result.num_steps}, of which quiet (run late in one go) {result.quiet_steps} "
              f"({result.quiet_steps / max(result.num_steps, 1):.1%}); quiet steps planned then dropped by an "
              f"arrival {result.quiet_steps_dropped}", flush=True)
        if prof is not None:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile_top)
    print(f"slowest: {slowest:.0f} s wall (goal < {args.goal_s:g} s)")
    return 0 if slowest < args.goal_s else 1


if __name__ == "__main__":
    sys.exit(main())
