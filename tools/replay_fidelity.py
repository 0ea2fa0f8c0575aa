"""Simulator fidelity: the same workload on the real engine and on the simulator.

    python tools/replay_fidelity.py --out fidelity        # demo model; ~8 min on 2 CPU cores

Runs the workload once per policy on ``jaxserve.LLMEngine`` (wall-clock
arrivals) and once on ``SimExecutor`` with a cost profile measured on this
machine by ``jaxserve profile`` (default: the shipped profile of this JAX
backend, ``jaxserve/data/profile-<backend>.json``), with identical pools and
limits, and the same trace entries. Prints
mean E2E latency and TTFT per policy on both, their ratio, and whether the
policy ranking agrees (goal: same ranking, mean E2E within 25 %). Writes
``<out>/engine/`` and ``<out>/sim/`` (results.json, summary.md) and
``<out>/fidelity.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.replay.engine_runner import EngineOptions, run_engine  # noqa: E402
from jaxserve.replay.plots import RunCurves  # noqa: E402
from jaxserve.replay.runner import ReplayConfig, simulate, write_outputs  # noqa: E402
from jaxserve.replay.sim import SimConfig  # noqa: E402
from jaxserve.replay.trace import load_trace, scale_entries  # noqa: E402
from scheduler import load_profile  # noqa: E402


def default_profile() -> str:
    import jax

    path = Path(__file__).resolve().parent.parent / "jaxserve" / "data" / f"profile-{jax.default_backend()}.json"
    if not path.is_file():
        raise SystemExit(f"no shipped profile {path}; run `jaxserve profile --out FILE` and pass --profile FILE")
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fidelity")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--profile", default=None, help="cost profile JSON measured on this machine")
    ap.add_argument("--trace", default="diverse_oneapi_merged_exp_uniform.json")
    ap.add_argument("--policies", default="fcfs,infercept,lamps")
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--num-requests", type=int, default=150)
    ap.add_argument("--token-scale", type=float, default=0.4)
    ap.add_argument("--api-time-scale", type=float, default=0.25)
    ap.add_argument("--num-pages", type=int, default=96)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--swap-budget-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="engine context window (the shipped CPU profile was measured at 1024)")
    ap.add_argument("--step-model", default="linear", choices=("linear", "buckets", "auto"))
    ap.add_argument("--reuse-engine", action="store_true",
                    help="take the engine side from <out>/engine/results.json of an earlier run")
    args = ap.parse_args()

    profile = args.profile or default_profile()
    cost = load_profile(profile)
    entries = scale_entries(load_trace(args.trace), args.token_scale, args.api_time_scale)
    sim = SimConfig(page_size=16, num_device_pages=args.num_pages, num_host_pages=args.num_pages,
                    max_num_batched_tokens=args.max_num_batched_tokens, swap_budget_tokens=args.swap_budget_tokens,
                    step_model=args.step_model)
    config = ReplayConfig(policies=args.policies.split(","), rates=[args.rate], num_requests=args.num_requests,
                          seed=args.seed, sim=sim)
    out = Path(args.out)
    if args.reuse_engine:
        saved = json.loads((out / "engine" / "results.json").read_text())
        engine_runs = [RunCurves(r["policy"], r["rate"], r) for r in saved]
    else:
        options = EngineOptions(model=args.model, max_model_len=args.max_model_len)
        engine_runs = run_engine(entries, config, options, cost=cost)
        write_outputs(engine_runs, out / "engine", title=f"engine, model {args.model}", plots=False)
    sim_runs = simulate(entries, cost, config, progress=False)
    write_outputs(sim_runs, out / "sim", title=f"simulator, profile {cost.name}", plots=False)

    rows = []
    print(f"\nsimulator step model: {sim_runs[0].row['step_model']}")
    print(f"workload: {args.trace} x{args.token_scale:g} tokens, x{args.api_time_scale:g} API time, "
          f"{args.num_requests} requests at {args.rate:g} req/s, {args.num_pages} pages; profile {cost.name}\n")
    print("| policy | engine E2E s | sim E2E s | sim/engine | engine TTFT s | sim TTFT s | "
          "engine step ms | sim step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for e, s in zip(engine_runs, sim_runs):
        er, sr = e.row, s.row
        ratio = sr["mean_e2e_s"] / er["mean_e2e_s"]
        rows.append({"policy": e.policy, "engine_mean_e2e_s": er["mean_e2e_s"], "sim_mean_e2e_s": sr["mean_e2e_s"],
                     "sim_over_engine_e2e": ratio, "engine_mean_ttft_s": er["mean_ttft_s"],
                     "sim_mean_ttft_s": sr["mean_ttft_s"], "engine_mean_step_s": er["mean_step_s"],
                     "sim_mean_step_s": sr["mean_step_s"]})
        print(f"| {e.policy} | {er['mean_e2e_s']:.2f} | {sr['mean_e2e_s']:.2f} | {ratio:.2f} | "
              f"{er['mean_ttft_s']:.3f} | {sr['mean_ttft_s']:.3f} | {er['mean_step_s'] * 1e3:.1f} | "
              f"{sr['mean_step_s'] * 1e3:.1f} |")
    rank_engine = [r["policy"] for r in sorted(rows, key=lambda r: r["engine_mean_e2e_s"])]
    rank_sim = [r["policy"] for r in sorted(rows, key=lambda r: r["sim_mean_e2e_s"])]
    within = all(abs(r["sim_over_engine_e2e"] - 1) <= 0.25 for r in rows)
    print(f"\nranking by mean E2E — engine: {' < '.join(rank_engine)}; simulator: {' < '.join(rank_sim)}; "
          f"{'same' if rank_engine == rank_sim else 'DIFFERENT'}; mean E2E within 25%: {within}")
    (out / "fidelity.json").write_text(json.dumps({"rows": rows, "rank_engine": rank_engine, "rank_sim": rank_sim,
                                                   "same_ranking": rank_engine == rank_sim,
                                                   "e2e_within_25pct": within, "profile": profile,
                                                   "args": vars(args)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
