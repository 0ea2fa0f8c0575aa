"""Wall time of a simulated replay per policy (goal: < 60 s per policy).

    python tools/bench_replay.py                       # every policy, 1800 s at 5 req/s
    python tools/bench_replay.py --policies lamps --rate 8 --profile-top 15
    python tools/gen_mooncake.py --out /tmp/mooncake_hour.jsonl
    python tools/bench_replay.py --trace /tmp/mooncake_hour.jsonl --arrival trace \
        --profile llama3-8b-h100 --sim-cache on --policies fcfs,infercept,lamps

Runs a trace (default: the bundled multi-API InferCept trace, Poisson
arrivals; ``--arrival trace``: the trace's own timestamps) through
``run_simulation`` and prints, per policy: wall seconds, simulated steps,
steps per wall second and the run's mean E2E latency (so a speed-up that
changes behaviour shows); with the prefix cache on, the share of input
tokens served from it, and for a Mooncake trace the trace's two bounds
(every block kept; an LRU of the device pool's size). ``--profile-top N``
prints the N most expensive functions of each run (cProfile, cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.profiles import load_profile  # noqa: E402
from jaxserve.replay.experiment import GridRun  # noqa: E402
from jaxserve.replay.metrics import request_metrics  # noqa: E402
from jaxserve.replay.mooncake import cache_bounds  # noqa: E402
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402
from jaxserve.replay.workload import WorkloadSpec, make_workload  # noqa: E402
from scheduler import available_policies, make_policy, make_predictor  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="trace file (default: bundled multi-API)")
    ap.add_argument("--profile", default="gptj-6b-a100-40g")
    ap.add_argument("--policies", default=",".join(available_policies()))
    ap.add_argument("--arrival", choices=("poisson", "trace"), default="poisson")
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--sim-cache", choices=("off", "on"), default="off", help="model the prefix cache")
    ap.add_argument("--num-host-pages", type=int, default=None, help="host pool (default: the profile's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--goal-s", type=float, default=60.0)
    ap.add_argument("--profile-top", type=int, default=0)
    args = ap.parse_args()

    cost = load_profile(args.profile)
    entries = load_trace(args.trace)
    if args.arrival == "trace":
        spec = WorkloadSpec("trace", duration_s=args.duration, seed=args.seed)
        print_rate = "the trace's timestamps"
    else:
        spec = WorkloadSpec("poisson", rate=args.rate, duration_s=args.duration, seed=args.seed)
        print_rate = f"{args.rate:g} req/s"
    workload = make_workload(entries, spec)
    cache = args.sim_cache == "on"
    config = SimConfig(enable_prefix_caching=cache, num_host_pages=args.num_host_pages).resolve(cost)
    blocks = any(w.entry.block_ids is not None for w in workload)
    print(f"{len(workload)} requests over {args.duration:g} s at {print_rate}, profile {cost.name}, "
          f"prefix cache {args.sim_cache}, {config.num_device_pages} device / {config.num_host_pages} host pages")
    if blocks:
        device_tokens = config.num_device_pages * config.page_size
        b = cache_bounds([w.entry for w in workload], device_tokens)
        print(f"trace bounds: every block kept {b.infinite_share:.1%}, LRU of the device pool "
              f"({b.capacity_tokens:,} tokens) {b.lru_share:.1%}", end="")
        if cache and config.num_host_pages:
            both = cache_bounds([w.entry for w in workload], device_tokens + config.num_host_pages * config.page_size)
            print(f", LRU of device + host pools ({both.capacity_tokens:,} tokens) {both.lru_share:.1%}", end="")
        print()
    print(f"{'policy':>14} {'wall s':>8} {'CPU s':>7} {'steps':>8} {'steps/s':>9} {'sim end s':>10} {'E2E mean s':>11} "
          f"{'cached':>7}  goal")
    worst = 0.0
    for name in args.policies.split(","):
        requests = [w.to_request() for w in workload]
        names = GridRun(None, name, spec, workload, {}, "").page_names(config.page_size) if cache else None
        sched = build_scheduler(cost, make_policy(name, make_predictor("oracle", args.seed)), config)
        prof = cProfile.Profile() if args.profile_top else None
        start, cpu_start = time.perf_counter(), time.process_time()
        if prof:
            prof.enable()
        result = run_simulation(sched, requests, page_names=names)
        if prof:
            prof.disable()
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        worst = max(worst, wall)
        e2e = [m.e2e_s for m in map(request_metrics, requests) if m.completed]
        ok = "ok" if wall < args.goal_s else "SLOW"
        cached = sum(r.num_cached_tokens for r in requests) / sum(r.prompt_len for r in requests)
        print(f"{name:>14} {wall:8.1f} {cpu:7.1f} {result.num_steps:8d} {result.num_steps / wall:9.0f} "
              f"{result.end_time_s:10.0f} {sum(e2e) / len(e2e):11.2f} {cached:7.1%}  {ok}", flush=True)
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile_top)
    print(f"slowest: {worst:.1f} s (goal < {args.goal_s:g} s)")
    return 0 if worst < args.goal_s else 1


if __name__ == "__main__":
    sys.exit(main())
