"""Reproduce the seeds' comparison on the simulator: fcfs (vLLM), infercept, lamps,
augserve on the InferCept workloads with the GPT-J-6B/A100-40GB profile.

    python tools/sim_vs_papers.py --out sim-vs-papers      # ~10 min on 2 cores (40 runs)

For each workload (multi-API ``merged_exp_uniform.json`` and single-API
``diverse_oneapi_merged_exp_uniform.json``) it replays 30-minute Poisson
workloads at each rate (same seed, so every policy sees the same requests),
writes ``<out>/<workload>/results.json``, ``summary.md`` and plots, and prints
the ratios the papers report: LAMPS vs InferCept mean E2E latency and mean
TTFT (LAMPS: −27 % to −85 % E2E), InferCept vs vLLM, and AugServe's goodput
over InferCept's (AugServe: ~3×). ``docs/benchmarks.md`` ("Simulator vs
papers") holds a run of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.replay.experiment import ReplayConfig, simulate, write_outputs  # noqa: E402
from jaxserve.replay.simulate import SimConfig  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402
from scheduler import available_policies, load_profile  # noqa: E402

WORKLOADS = {"multi-api": "merged_exp_uniform.json", "single-api": "diverse_oneapi_merged_exp_uniform.json"}
# Rates up to and past each workload's knee on the GPT-J/A100 profile.
DEFAULT_RATES = {"multi-api": "3,5,6,8,10", "single-api": "5,10,12,14,16"}


def pct(new: float | None, old: float | None) -> str:
    if new is None or old is None or old == 0:
        return "-"
    return f"{(new - old) / old * 100:+.0f}%"


def ratio(new: float | None, old: float | None) -> str:
    if new is None or old is None:
        return "-"
    if old == 0:
        return "inf" if new > 0 else "-"
    return f"{new / old:.2f}x"


def comparison_table(rows: list[dict]) -> str:
    by = {(r["policy"], r["rate"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows})
    lines = ["| rate | E2E fcfs / infercept / lamps (s) | TTFT fcfs / infercept / lamps (s) | "
             "lamps vs infercept E2E | lamps vs infercept TTFT | infercept vs fcfs E2E | "
             "goodput fcfs / infercept / lamps / augserve (req/s) | augserve / infercept goodput |",
             "|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        f, i, l, a = (by.get((p, rate), {}) for p in ("fcfs", "infercept", "lamps", "augserve"))

        def g(row, key, fmt):
            v = row.get(key)
            return "-" if v is None else format(v, fmt)
        lines.append(
            f"| {rate:g} | {g(f, 'mean_e2e_s', '.1f')} / {g(i, 'mean_e2e_s', '.1f')} / {g(l, 'mean_e2e_s', '.1f')} "
            f"| {g(f, 'mean_ttft_s', '.2f')} / {g(i, 'mean_ttft_s', '.2f')} / {g(l, 'mean_ttft_s', '.2f')} "
            f"| {pct(l.get('mean_e2e_s'), i.get('mean_e2e_s'))} | {pct(l.get('mean_ttft_s'), i.get('mean_ttft_s'))} "
            f"| {pct(i.get('mean_e2e_s'), f.get('mean_e2e_s'))} "
            f"| {g(f, 'goodput_req_s', '.2f')} / {g(i, 'goodput_req_s', '.2f')} / {g(l, 'goodput_req_s', '.2f')} "
            f"/ {g(a, 'goodput_req_s', '.2f')} "
            f"| {ratio(a.get('goodput_req_s'), i.get('goodput_req_s'))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="sim-vs-papers")
    ap.add_argument("--profile", default="gptj-6b-a100-40g")
    ap.add_argument("--rates", default=None, help="comma-separated req/s for every workload "
                    f"(default: {DEFAULT_RATES})")
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--policies", default="fcfs,infercept,lamps,augserve")
    ap.add_argument("--step-time-scale", type=float, default=1.0,
                    help="multiply every simulated step and copy time (0.8 / 1.2: the ±20 %% profile band)")
    ap.add_argument("--count", choices=("in-window", "all"), default="in-window",
                    help="latency statistics over requests completed in the window (the papers') or all")
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p in available_policies()]
    cost = load_profile(args.profile)
    for name in args.workloads.split(","):
        rates = [float(r) for r in (args.rates or DEFAULT_RATES[name]).split(",")]
        start = time.perf_counter()
        entries = load_trace(WORKLOADS[name])
        config = ReplayConfig(policies=policies, rates=rates, duration_s=args.duration, seed=args.seed,
                              count=args.count, sim=SimConfig(step_time_scale=args.step_time_scale))
        runs = simulate(entries, cost, config, progress=False)
        out = Path(args.out) / name
        write_outputs(runs, out, title=f"{name}, simulated on {cost.name}")
        rows = json.loads((out / "results.json").read_text())
        print(f"\n## {name} ({WORKLOADS[name]}), {args.duration:g} s Poisson, seed {args.seed}, "
              f"profile {cost.name} x{args.step_time_scale:g}, count {args.count} — "
              f"{time.perf_counter() - start:.0f} s wall\n")
        print(comparison_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
