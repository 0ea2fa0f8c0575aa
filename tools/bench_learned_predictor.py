"""LAMPS on the simulator with the learned length probe vs the oracle, a noisy
oracle and a blind ranking, side by side in one run (same workload per rate).

    python tools/bench_learned_predictor.py --model demo --checkpoint DIR \\
        [--rates 5,6] [--duration 600] [--out results.json]

The multi-API trace is read with the probe model's tokenizer, so the trace's
text-segment lengths (what ``oracle`` knows) and the probe's predictions are
in the same tokens. Predictors (all with ``lamps``):

- ``learned``: the probe's cached prediction per text segment
  (``jaxserve.predictor.sim_cache``), per-class running mean for token-form
  segments; API durations as ``api-type-mean``;
- ``oracle``: the trace's lengths and durations; ``noisy:0.3``: oracle × (1 + 0.3 z);
- ``blind (class means)``: ``learned`` without probe predictions (per-class
  running means of observed segment lengths: the request's class is known);
- ``blind (global mean)``: ``learned`` with neither predictions nor classes
  (one running mean over all segments) — a ranking that knows no length at all;
- plus ``fcfs`` as the policy-level reference.

Prints mean and p99 E2E per run and ``learned`` / ``oracle`` mean-E2E ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.predictor.features import load_served_model  # noqa: E402
from jaxserve.predictor.sim_cache import attach, trace_predictions  # noqa: E402
from jaxserve.replay.experiment import ReplayConfig, simulate  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402
from scheduler import load_profile  # noqa: E402
from scheduler.predictors import PREDICTION_CLASS  # noqa: E402

TRACE = "merged_exp_uniform.json"
# (policy, predictor, entries: "probe" with the probe's predictions, "class" class only, "none" neither, "trace")
RUNS = [("lamps", "learned", "probe"), ("lamps", "oracle", "trace"), ("lamps", "noisy:0.3", "trace"),
        ("lamps", "learned", "class"), ("lamps", "learned", "none"), ("fcfs", "oracle", "trace")]
LABELS = {"probe": "learned", "class": "blind (class means)", "none": "blind (global mean)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the probe's model ('demo', a directory, a built-in name)")
    ap.add_argument("--checkpoint", required=True, help="probe directory from `jaxserve predictor train`")
    ap.add_argument("--profile", default="gptj-6b-a100-40g")
    ap.add_argument("--rates", default="5,6", help="Poisson rates (req/s), loaded on the GPT-J/A100 profile")
    ap.add_argument("--duration", type=float, default=600.0, help="arrival window (simulated s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write all rows as JSON here")
    args = ap.parse_args()

    served = load_served_model(args.model)
    tok = served.tokenizer
    entries = load_trace(TRACE, lambda text: tok.encode(text, add_special_tokens=False))
    predicted = attach(entries, trace_predictions(args.checkpoint, args.model, TRACE))
    blind = attach(entries, {})
    variants = {"probe": predicted, "class": blind, "trace": predicted,
                "none": [dataclasses.replace(e, predictions={**e.predictions, PREDICTION_CLASS: "all"})
                         for e in blind]}
    cost = load_profile(args.profile)
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    for policy, predictor, variant in RUNS:
        config = ReplayConfig(policies=[policy], rates=rates, duration_s=args.duration, seed=args.seed,
                              predictor=predictor)
        for run in simulate(variants[variant], cost, config, progress=False):
            label = LABELS.get(variant, predictor)
            rows.append({"policy": policy, "predictor": label, "rate": run.row["rate"],
                         "mean_e2e_s": run.row["mean_e2e_s"], "p99_e2e_s": run.row["p99_e2e_s"],
                         "completed": run.row["completed"], "completed_in_window": run.row["completed_in_window"]})
            print(f"{policy:6s} {label:20s} rate {run.row['rate']:g}: mean E2E {run.row['mean_e2e_s']:.2f} s, "
                  f"p99 {run.row['p99_e2e_s']:.2f} s ({run.row['completed']} done)", flush=True)
    print("\n| rate | " + " | ".join(f"{r['policy']} {r['predictor']}" for r in rows if r["rate"] == rates[0])
          + " | learned / oracle mean E2E |")
    print("|---" * (2 + len(RUNS)) + "|")
    for rate in rates:
        rs = [r for r in rows if r["rate"] == rate]
        cells = [f"{r['mean_e2e_s']:.2f} / {r['p99_e2e_s']:.2f}" for r in rs]
        learned = next(r for r in rs if r["predictor"] == "learned")["mean_e2e_s"]
        oracle = next(r for r in rs if r["predictor"] == "oracle" and r["policy"] == "lamps")["mean_e2e_s"]
        print(f"| {rate:g} | " + " | ".join(cells) + f" | {learned / oracle:.3f} |")
    print("\n(mean / p99 E2E seconds, requests completed in the window as the papers count)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
