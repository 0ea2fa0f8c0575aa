"""Sweep AugServe's α (eq. 26) and β_high (eq. 32) on the simulator against InferCept.

    python tools/fidelity_sweep.py --rate 5 --alphas 0,1,10,100,1000 --betas 1,2
    python tools/fidelity_sweep.py --rate 5 --alphas 10 --betas 1,1.5,2,4

Runs the bundled multi-API InferCept trace (Poisson arrivals, ``--duration``
seconds, the papers' in-window counting) with ``--profile``; ``infercept`` is
run once on the same workload as the baseline, and every ``augserve`` setting
prints its goodput and mean E2E/TTFT with the ratios to that baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.replay.experiment import ReplayConfig, simulate  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402
from scheduler import load_profile  # noqa: E402


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def run(entries, cost, policy: str, rate: float, duration: float, seed: int, options: dict) -> dict:
    config = ReplayConfig(policies=[policy], rates=[rate], duration_s=duration, seed=seed, policy_options=options)
    (curves,) = simulate(entries, cost, config, progress=False)
    return curves.row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="gptj-6b-a100-40g")
    ap.add_argument("--trace", default=None, help="trace file (default: bundled multi-API)")
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alphas", default="10", help="comma-separated α values, token-seconds per second waited")
    ap.add_argument("--betas", default="2", help="comma-separated β_high values")
    args = ap.parse_args()

    cost = load_profile(args.profile)
    entries = load_trace(args.trace)
    base = run(entries, cost, "infercept", args.rate, args.duration, args.seed, {})
    print(f"profile {cost.name}, rate {args.rate:g} req/s, {args.duration:g} s window, in-window counting")
    print(f"infercept: goodput {base['goodput_req_s']:.3f} req/s, E2E mean {base['mean_e2e_s']:.2f} s, "
          f"TTFT mean {base['mean_ttft_s']:.2f} s, completed {base['completed']}")
    print(f"{'alpha':>8} {'beta_high':>9} {'goodput':>8} {'x infercept':>11} {'E2E s':>8} {'x infercept':>11} "
          f"{'TTFT s':>8} {'done':>5} {'P/D/S':>12}")
    for alpha in _floats(args.alphas):
        for beta in _floats(args.betas):
            row = run(entries, cost, "augserve", args.rate, args.duration, args.seed,
                      {"alpha": alpha, "budget_beta_high": beta})
            mix = row["handling_counts"]
            print(f"{alpha:8g} {beta:9g} {row['goodput_req_s']:8.3f} "
                  f"{row['goodput_req_s'] / max(base['goodput_req_s'], 1e-9):11.2f} {row['mean_e2e_s']:8.2f} "
                  f"{row['mean_e2e_s'] / base['mean_e2e_s']:11.2f} {row['mean_ttft_s']:8.2f} {row['completed']:5d} "
                  f"{mix['preserve']}/{mix['discard']}/{mix['swap']:>4}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
