"""The simulator's prefix cache off and on, side by side in one run, per policy
and rate: recomputed and cached tokens, mean/p99 E2E and TTFT, and how much
the cache cut recomputation and mean TTFT (issue 20's goal: >= 80 % and >= 50 %
at a loaded rate).

    python tools/sim_prefix_cache.py --mode resend --rates 4,6 --duration 1800
    python tools/sim_prefix_cache.py --mode requests --rates 10 --num-requests 1000

Re-send mode (``jaxserve.replay.cluster``): each segment of the bundled
multi-API trace arrives as a new request carrying the whole conversation, as an
OpenAI client drives an agent. Requests mode: each trace request pauses for its
calls and its pages are its own (soft discard, preemption, swap-in re-link).
Pure Python (scheduler + simulator); GPT-J/A100 profile unless ``--profile``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxserve.profiles import load_profile  # noqa: E402
from jaxserve.replay.experiment import ReplayConfig, simulate  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("resend", "requests"), default="resend")
    ap.add_argument("--policies", default="infercept,lamps")
    ap.add_argument("--rates", default="4,6")
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--num-requests", type=int, default=None, help="a fixed number of arrivals instead")
    ap.add_argument("--profile", default="gptj-6b-a100-40g")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cost = load_profile(args.profile)
    config = ReplayConfig(policies=args.policies.split(","), rates=[float(r) for r in args.rates.split(",")],
                          duration_s=None if args.num_requests else args.duration,
                          num_requests=args.num_requests, seed=args.seed, mode=args.mode, prefix_cache=(False, True),
                          count="all")
    start = time.process_time()
    rows = [r.row for r in simulate(load_trace(), cost, config, progress=False)]
    arrivals = f"{args.num_requests} arrivals" if args.num_requests else f"{args.duration:g} s of arrivals"
    print(f"mode {args.mode}, profile {cost.name}, {arrivals}, seed {args.seed}; "
          f"latencies over every request (the run drains)")
    print(f"{'policy':>10} {'rate':>5} {'cache':>5} {'requests':>8} {'prompt tok':>11} {'cached tok':>11} "
          f"{'recomputed':>11} {'E2E mean':>9} {'E2E p99':>8} {'TTFT mean':>9} {'TTFT p99':>8} {'preempt':>7}")
    for r in rows:
        print(f"{r['policy']:>10} {r['rate']:>5g} {'on' if r['prefix_cache'] else 'off':>5} {r['requests']:>8} "
              f"{r['prompt_tokens']:>11} {r['cached_prompt_tokens']:>11} {r['recomputed_tokens']:>11} "
              f"{r['mean_e2e_s']:>9.2f} {r['p99_e2e_s']:>8.2f} {r['mean_ttft_s']:>9.3f} {r['p99_ttft_s']:>8.2f} "
              f"{r['preemptions']:>7}")
    print("cache on vs off (same workload, same run):")
    for off, on in zip(rows[0::2], rows[1::2]):
        recompute_cut = 1 - on["recomputed_tokens"] / off["recomputed_tokens"] if off["recomputed_tokens"] else 0.0
        ttft_cut = 1 - on["mean_ttft_s"] / off["mean_ttft_s"]
        e2e_cut = 1 - on["mean_e2e_s"] / off["mean_e2e_s"]
        print(f"{off['policy']:>10} @ {off['rate']:g}: recomputed tokens -{recompute_cut:.1%} (goal >= 80 %), "
              f"mean TTFT -{ttft_cut:.1%} (goal >= 50 %), mean E2E -{e2e_cut:.1%}")
    print(f"{time.process_time() - start:.0f} CPU s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
