"""LAMPS under prediction error (seed 000 §6.4, Figure 11), on the simulator.

    python tools/prediction_error_study.py --out pred-error        # ~5 min on 2 cores

Gaussian error is injected into the predicted output lengths and API
durations: ``noisy:P`` predicts ``value · (1 + P·z)``, ``z ~ N(0, 1)`` (σ = P ·
value), for P in 0.05 … 0.5, plus the exact ``oracle``. Each P is one replay of
the multi-API InferCept workload under ``lamps`` at several rates — the same
as ``jaxserve replay --policies lamps --predictor noisy:P --rates ...`` — and
the script writes ``<out>/noisy-P/results.json`` per P, ``<out>/study.json``
(all rows), and ``<out>/prediction_error.png``: median E2E latency and
throughput against rate, one line per P.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from jaxserve.replay.experiment import ReplayConfig, simulate, write_outputs  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402
from scheduler import load_profile  # noqa: E402


def plot(rows: list[dict], path: Path, policy: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = [("p50_e2e_s", "median E2E latency (s)"), ("mean_e2e_s", "mean E2E latency (s)"),
              ("throughput_req_s", "throughput (req/s, completed in window)")]
    predictors = list(dict.fromkeys(r["predictor"] for r in rows))
    for ax, (key, label) in zip(axes, panels):
        for pred in predictors:
            pts = sorted((r["rate"], r[key]) for r in rows if r["predictor"] == pred and r[key] is not None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=pred.replace("noisy:", "error "))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{policy} with noisy predictions of output length and API duration (σ = P · value)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="pred-error")
    ap.add_argument("--trace", default=None, help="default: bundled multi-API trace")
    ap.add_argument("--profile", default="gptj-6b-a100-40g")
    ap.add_argument("--policy", default="lamps")
    ap.add_argument("--errors", default="0.05,0.1,0.3,0.5", help="the P values of noisy:P")
    ap.add_argument("--rates", default="6,8,10")
    ap.add_argument("--duration", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cost = load_profile(args.profile)
    entries = load_trace(args.trace)
    rates = [float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    predictors = ["oracle"] + [f"noisy:{p}" for p in args.errors.split(",")]
    rows: list[dict] = []
    print(f"{'predictor':>12} {'rate':>5} {'p50 E2E s':>10} {'mean E2E s':>11} {'mean TTFT s':>12} {'thru req/s':>11}")
    for pred in predictors:
        config = ReplayConfig(policies=[args.policy], rates=rates, duration_s=args.duration, seed=args.seed,
                              predictor=pred)
        runs = simulate(entries, cost, config, progress=False)
        write_outputs(runs, out / pred.replace(":", "-"), title=f"{args.policy}, predictor {pred}", plots=False)
        for run in runs:
            r = run.row
            rows.append(r)
            print(f"{pred:>12} {r['rate']:5g} {r['p50_e2e_s']:10.2f} {r['mean_e2e_s']:11.2f} "
                  f"{r['mean_ttft_s']:12.3f} {r['throughput_req_s']:11.3f}", flush=True)
    (out / "study.json").write_text(json.dumps(rows, indent=2, sort_keys=True) + "\n")
    plot(rows, out / "prediction_error.png", args.policy)
    print(f"wrote {out / 'study.json'} and {out / 'prediction_error.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
