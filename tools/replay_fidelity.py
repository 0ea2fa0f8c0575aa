"""Simulator fidelity: the same workloads on the real engine and on the simulator.

    python tools/replay_fidelity.py --out fidelity          # demo model; ~10 min on 2 CPU cores

1. Measures the cost profile on this machine, in this process, with the
   engine's own shapes (``jaxserve.profiling.measure_profile``) — unless
   ``--profile`` names one — and measures it again after the engine runs, to
   show how much the machine drifted meanwhile.
2. For each seed, runs every policy on ``jaxserve.LLMEngine`` (wall-clock
   arrivals) and on the simulator with identical pools, limits and trace
   entries, twice: on the profile measured before, and on the **in-run
   profile** (``in_run_profile``: the step times the engine actually paid in
   this seed's runs, per token bucket: whole engine steps, host work included)
   — on a shared machine whose speed moves by tens of percent within
   minutes, the second isolates the simulator's model of the engine from the
   machine's drift, and is the headline. The simulator also runs on the in-run
   profile with every step time scaled by ``1 ± --sensitivity``, the band a
   step-time error of that size moves the result in (a well-conditioned
   configuration has a narrow band).
3. Prints the step-time calibration (engine wall time per step vs the
   simulator's step time, bucket by bucket, over the engine's own steps), then
   mean E2E / TTFT per (seed, policy) on both executors, their ratio, the
   band, and whether the policy ranking agrees (goal: same ranking, mean E2E
   within 25 %).

Writes ``<out>/seed<k>/{engine,sim,sim-in-run}/`` (results.json, summary.md),
``<out>/seed<k>/profile-in-run.json``,
``<out>/profile-before.json``, ``<out>/profile-after.json`` and
``<out>/fidelity.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.replay.experiment import ReplayConfig, simulate, write_outputs  # noqa: E402
from jaxserve.replay.simulate import SimConfig  # noqa: E402
from jaxserve.replay.trace import load_trace, scale_entries  # noqa: E402
from scheduler import CostModel, load_profile  # noqa: E402


def measure_here(args: argparse.Namespace) -> CostModel:
    """The cost profile of this machine for the engine shapes the replay uses."""
    from jaxserve import LLMEngine
    from jaxserve.profiling import measure_profile

    engine = LLMEngine(args.model, page_size=16, num_pages=args.num_pages, num_host_pages=args.num_pages,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                       warmup=True)
    try:
        return measure_profile(engine, repeats=7, copy_mib=16, model=args.model, dtype="float32")
    finally:
        engine.shutdown()


def pooled_buckets(engine_rows: list[dict]) -> dict[int, tuple[int, float]]:
    """``{bucket: (steps, seconds)}`` of the engine's steps with a forward, all ``engine_rows`` pooled."""
    pooled: dict[int, list] = {}
    for row in engine_rows:
        for bucket, v in row["steps_by_bucket"].items():
            if int(bucket) == 0:      # swap-only steps: no forward
                continue
            entry = pooled.setdefault(int(bucket), [0, 0.0])
            entry[0] += v["steps"]
            entry[1] += v["steps"] * v["mean_s"]
    return {b: (c, t) for b, (c, t) in sorted(pooled.items())}


def step_calibration(engine_rows: list[dict], cost: CostModel) -> tuple[list[dict], float]:
    """Per token bucket: the engine's steps and mean wall time (all runs pooled) next to
    the simulator's time for that bucket; and Σ simulated / Σ measured over those steps."""
    table, measured, predicted = [], 0.0, 0.0
    for bucket, (count, seconds) in pooled_buckets(engine_rows).items():
        sim_s = cost.t_step(bucket)
        measured += seconds
        predicted += count * sim_s
        table.append({"bucket": bucket, "steps": count, "engine_ms": 1e3 * seconds / count, "sim_ms": 1e3 * sim_s})
    return table, predicted / measured if measured else float("nan")


def in_run_profile(cost: CostModel, engine_rows: list[dict], min_steps: int = 5) -> CostModel:
    """``cost`` with the step costs the engine actually paid in ``engine_rows`` (this
    seed's runs, pooled): each power-of-two bucket's mean wall time of a whole
    ``EngineCore`` step (schedule, forward, update, front end) where the engine ran
    at least ``min_steps`` such steps, else the profile's step for it times the
    ratio measured over the observed buckets; no separate host overhead and no
    context term (the buckets hold both: their steps read the run's own
    contexts, so adding ``fwd_per_context_token_s · c`` would charge the reads
    twice). The machine's speed during the run, not before it."""
    pooled = pooled_buckets(engine_rows)
    seen = {b: t / c for b, (c, t) in pooled.items() if c >= min_steps}
    before = cost.timed("auto")
    ratio = (sum(pooled[b][1] for b in seen) / sum(pooled[b][0] * before.t_step(b) for b in seen)) if seen else 1.0
    table, bucket = {}, 1
    while bucket < 2 * cost.max_num_batched_tokens:
        table[str(bucket)] = seen.get(bucket, ratio * before.t_step(bucket))
        bucket *= 2
    meta = dict(cost.meta, step_times_s=table,
                in_run={"buckets_seen": sorted(seen), "unseen_ratio": ratio,
                        "steps": sum(c for c, _ in pooled.values())})
    return dataclasses.replace(cost, name=f"{cost.name}-in-run", step_model="buckets", step_overhead_s=0.0,
                               fwd_per_context_token_s=0.0, meta=meta)


def ranking(rows: list[dict], key: str) -> list[str]:
    return [r["policy"] for r in sorted(rows, key=lambda r: r[key])]


def ranking_conflicts(rows: list[dict], tie: float) -> list[tuple[str, str]]:
    """Policy pairs the two executors order differently where either separates them by
    more than ``tie`` (relative); pairs within ``tie`` on both count as tied."""
    conflicts = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            de = a["engine_mean_e2e_s"] / b["engine_mean_e2e_s"] - 1
            ds = a["sim_mean_e2e_s"] / b["sim_mean_e2e_s"] - 1
            if de * ds < 0 and max(abs(de), abs(ds)) > tie:
                conflicts.append((a["policy"], b["policy"]))
    return conflicts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fidelity")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--profile", default=None,
                    help="cost profile JSON (default: measure one here, now, with the engine's shapes)")
    ap.add_argument("--trace", default="diverse_oneapi_merged_exp_uniform.json")
    ap.add_argument("--policies", default="fcfs,infercept,lamps")
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seeds", default="0,1", help="one workload per seed")
    ap.add_argument("--token-scale", type=float, default=0.4)
    ap.add_argument("--api-time-scale", type=float, default=0.25)
    ap.add_argument("--num-pages", type=int, default=256, help="device pages (and host pages) of 16 tokens")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--swap-budget-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--step-model", default="auto", choices=("linear", "buckets", "auto"))
    ap.add_argument("--sensitivity", type=float, default=0.07,
                    help="also simulate with step times x(1 - s) and x(1 + s)")
    ap.add_argument("--tie", type=float, default=0.05,
                    help="policies whose mean E2E differ by less than this on both executors rank as tied")
    args = ap.parse_args()
    if not 0 <= args.sensitivity < 1:
        raise SystemExit("--sensitivity must be in [0, 1)")

    from jaxserve.config import EngineConfig
    from jaxserve.replay.engine_replay import EngineOptions, run_engine

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile:
        cost, after = load_profile(args.profile), None
    else:
        cost = measure_here(args)
        cost.save(out / "profile-before.json")
    entries = scale_entries(load_trace(args.trace), args.token_scale, args.api_time_scale)
    sim = SimConfig(page_size=16, num_device_pages=args.num_pages, num_host_pages=args.num_pages,
                    max_num_batched_tokens=args.max_num_batched_tokens, swap_budget_tokens=args.swap_budget_tokens,
                    step_model=args.step_model)
    # Every step shape compiled before each engine's run: no compile stall inside a timed run.
    options = EngineOptions(EngineConfig(model=args.model, max_model_len=args.max_model_len,
                                         warmup_all_shapes=True))
    seeds = [int(s) for s in args.seeds.split(",")]
    scales = {"lo": 1 - args.sensitivity, "hi": 1 + args.sensitivity}

    rows, engine_rows, in_run = [], [], {}
    for seed in seeds:
        config = ReplayConfig(policies=args.policies.split(","), rates=[args.rate], num_requests=args.num_requests,
                              seed=seed, sim=sim)
        engine_runs = run_engine(entries, config, options, cost=cost)
        write_outputs(engine_runs, out / f"seed{seed}" / "engine", title=f"engine, model {args.model}", plots=False)
        calibrated = in_run_profile(cost, [e.row for e in engine_runs])
        calibrated.save(out / f"seed{seed}" / "profile-in-run.json")
        in_run[seed] = calibrated
        cal_config = dataclasses.replace(config, sim=dataclasses.replace(sim, step_model="buckets"))
        sim_runs = simulate(entries, cost, config, progress=False)
        write_outputs(sim_runs, out / f"seed{seed}" / "sim", title=f"simulator, profile {cost.name}", plots=False)
        cal_runs = simulate(entries, calibrated, cal_config, progress=False)
        write_outputs(cal_runs, out / f"seed{seed}" / "sim-in-run", title=f"simulator, profile {calibrated.name}",
                      plots=False)
        band = {name: simulate(entries, calibrated, dataclasses.replace(
                    cal_config, sim=dataclasses.replace(cal_config.sim, step_time_scale=scale)), progress=False)
                for name, scale in scales.items()}
        for i, (e, s, c) in enumerate(zip(engine_runs, sim_runs, cal_runs)):
            er, sr, cr = e.row, s.row, c.row
            engine_rows.append(er)
            lo, hi = sorted((band["lo"][i].row["mean_e2e_s"], band["hi"][i].row["mean_e2e_s"]))
            rows.append({"seed": seed, "policy": e.policy,
                         "engine_mean_e2e_s": er["mean_e2e_s"], "sim_mean_e2e_s": cr["mean_e2e_s"],
                         "sim_over_engine_e2e": cr["mean_e2e_s"] / er["mean_e2e_s"],
                         "sim_band_e2e_s": [min(lo, cr["mean_e2e_s"]), max(hi, cr["mean_e2e_s"])],
                         "sim_before_mean_e2e_s": sr["mean_e2e_s"],
                         "sim_before_over_engine_e2e": sr["mean_e2e_s"] / er["mean_e2e_s"],
                         "engine_mean_ttft_s": er["mean_ttft_s"], "sim_mean_ttft_s": cr["mean_ttft_s"],
                         "engine_preemptions": er["preemptions"], "sim_preemptions": cr["preemptions"],
                         "engine_batched_tokens": er["batched_tokens"], "sim_batched_tokens": cr["batched_tokens"]})
    if not args.profile:
        after = measure_here(args)
        after.save(out / "profile-after.json")

    calibration, work_ratio = step_calibration(engine_rows, cost.timed(args.step_model))
    print(f"\nworkload: {args.trace} x{args.token_scale:g} tokens, x{args.api_time_scale:g} API time, "
          f"{args.num_requests} requests at {args.rate:g} req/s, seeds {args.seeds}, {args.num_pages} pages; "
          f"profile {args.profile or 'measured here'} (step overhead {cost.step_overhead_s * 1e3:.2f} ms)\n")
    print("step time by token bucket, over the engine's steps of all runs (sim: the profile measured before):\n")
    print("| bucket | engine steps | engine ms/step | sim ms/step | sim/engine |" +
          (" profile after ms |" if after else ""))
    print("|---|---|---|---|---|" + ("---|" if after else ""))
    after_timed = after.timed(args.step_model) if after else None
    for c in calibration:
        line = (f"| {c['bucket']} | {c['steps']} | {c['engine_ms']:.2f} | {c['sim_ms']:.2f} | "
                f"{c['sim_ms'] / c['engine_ms']:.2f} |")
        if after_timed:
            c["sim_after_ms"] = 1e3 * after_timed.t_step(c["bucket"])
            line += f" {c['sim_after_ms']:.2f} |"
        print(line)
    print(f"\nsimulated (profile before) / measured busy time over the engine's steps: {work_ratio:.3f}")
    for seed, c in in_run.items():
        print(f"seed {seed} in-run profile: buckets seen {c.meta['in_run']['buckets_seen']}, the others "
              f"x{c.meta['in_run']['unseen_ratio']:.2f} of the profile before")
    print("\nsim = simulator on the in-run profile (headline); before = on the profile measured before the runs\n")
    print(f"| seed | policy | engine E2E s | sim E2E s | sim/engine | sim band (step x1±{args.sensitivity:g}) | "
          "before E2E s | before/engine | engine TTFT s | sim TTFT s | preemptions engine/sim |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = r["sim_band_e2e_s"]
        print(f"| {r['seed']} | {r['policy']} | {r['engine_mean_e2e_s']:.2f} | {r['sim_mean_e2e_s']:.2f} | "
              f"{r['sim_over_engine_e2e']:.2f} | {lo:.2f}–{hi:.2f} | {r['sim_before_mean_e2e_s']:.2f} | "
              f"{r['sim_before_over_engine_e2e']:.2f} | {r['engine_mean_ttft_s']:.3f} | "
              f"{r['sim_mean_ttft_s']:.3f} | {r['engine_preemptions']}/{r['sim_preemptions']} |")
    verdicts = []
    for seed in seeds:
        mine = [r for r in rows if r["seed"] == seed]
        rank_e, rank_s = ranking(mine, "engine_mean_e2e_s"), ranking(mine, "sim_mean_e2e_s")
        conflicts = ranking_conflicts(mine, args.tie)
        verdicts.append({"seed": seed, "rank_engine": rank_e, "rank_sim": rank_s, "strictly_same": rank_e == rank_s,
                         "conflicts": conflicts, "same_ranking_up_to_ties": not conflicts,
                         "e2e_within_25pct": all(abs(r["sim_over_engine_e2e"] - 1) <= 0.25 for r in mine),
                         "before_e2e_within_25pct": all(abs(r["sim_before_over_engine_e2e"] - 1) <= 0.25
                                                        for r in mine)})
        print(f"\nseed {seed}: ranking by mean E2E — engine: {' < '.join(rank_e)}; simulator: {' < '.join(rank_s)}; "
              f"{'same' if rank_e == rank_s else 'different'} strictly, "
              f"{'same' if not conflicts else 'DIFFERENT'} up to ties within {args.tie:.0%}"
              f"{'' if not conflicts else ' (' + ', '.join(f'{a}/{b}' for a, b in conflicts) + ')'}; "
              f"all within 25%: {verdicts[-1]['e2e_within_25pct']} "
              f"(profile before: {verdicts[-1]['before_e2e_within_25pct']})")
    for key, label in (("sim_over_engine_e2e", "in-run profile"), ("sim_before_over_engine_e2e", "profile before")):
        ratios = [r[key] for r in rows]
        print(f"sim/engine mean E2E over all runs, {label}: median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}–{max(ratios):.2f}")
    (out / "fidelity.json").write_text(json.dumps({
        "rows": rows, "verdicts": verdicts, "step_calibration": calibration, "sim_over_engine_busy": work_ratio,
        "profile": args.profile or "measured here", "step_overhead_s": cost.step_overhead_s,
        "in_run_step_times_s": {str(k): c.meta["step_times_s"] for k, c in in_run.items()},
        "args": vars(args)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
