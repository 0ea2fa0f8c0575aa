"""Microseconds per ``Scheduler.schedule()`` call, per policy, at a steady state.

For each policy and each waiting-queue size N (default 64, 512, 4096) it
runs a small replay loop (``schedule()`` then ``update()``: API calls pause
and return after their duration, finished requests leave, the waiting queue
is topped back up to N after every step) with ``max_num_seqs`` ``--running``
(default 256): 300 warm-up steps let the running set reach its steady size
(printed as the mean over the timed steps), then ``--steps`` steps are timed,
timing ``schedule()`` (the goal's figure) and, separately, ``update()`` (the
other half of the scheduler's per-step work, so work moved from one to the
other shows). The clock advances by the profile's
``T_fwd(batched tokens)``, and the table reports the scheduling time as a
fraction of that typical step.

    python tools/bench_scheduler.py [--profile gptj-6b-a100-40g|PATH]
        [--policies lamps,augserve] [--waiting 64,512,4096] [--running 256] [--steps 300]
        [--prefix-cache off,on] [--baseline REV] [--clock wall|cpu]

``--baseline REV`` also times the scheduler of git revision ``REV`` (its
``scheduler/`` package, exported to a temporary folder, in a subprocess per
row, run right before the row of this checkout) and prints its median and
this checkout's median as a ratio of it: a before/after in one run.

``--prefix-cache`` runs each row with the prefix cache off and/or on; requests
then carry token ids (one of 8 shared 256-token system prompts + a random
tail; sampled and API-returned tokens are ids too), so the cache hashes,
matches, commits and evicts as in the engine; the last column is the median
against the cache-off row of the same run. Without it, requests carry no
ids (the cache has nothing to do), as before.

Pure Python, no JAX: ``scheduler`` only.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# ``--scheduler-src DIR`` (internal, for ``--baseline``): import ``scheduler`` from DIR instead.
_SRC = sys.argv[sys.argv.index("--scheduler-src") + 1] if "--scheduler-src" in sys.argv else str(REPO)
sys.path.insert(0, _SRC)

from git_export import export_revision  # noqa: E402
from scheduler import (EventKind, PageAllocator, Request, Scheduler, SchedulerConfig, Segment,  # noqa: E402
                       StepResult, available_policies, load_profile, make_policy)

API_TYPES = {"math": (1e-4, 2), "qa": (0.7, 8), "ve": (0.09, 20), "chat": (28.6, 60), "image": (20.0, 40)}


SYSTEM_PROMPTS = [[random.Random(k).randrange(3, 32000) for _ in range(256)] for k in range(8)]


def make_request(rng: random.Random, i: int, now: float, token_ids: bool = False) -> Request:
    segs = []
    for _ in range(rng.randint(0, 3)):
        api = rng.choice(list(API_TYPES))
        mean_s, ret = API_TYPES[api]
        segs.append(Segment(rng.randint(4, 64), api, rng.uniform(0.5, 1.5) * mean_s, rng.randint(0, ret)))
    segs.append(Segment(rng.randint(8, 256)))
    prompt_len = rng.randint(16, 512)
    ids = []
    if token_ids:
        ids = (rng.choice(SYSTEM_PROMPTS) + [rng.randrange(3, 32000) for _ in range(prompt_len)])[:prompt_len]
    return Request(f"b{i}", now, prompt_len=prompt_len, max_tokens=sum(s.num_tokens for s in segs),
                   segments=segs, token_ids=ids)


# ``Scheduler.schedule``'s phases, in call order (``--phases`` times each one).
PHASES = ("_open_plan", "_continue_swaps", "_schedule_running", "_admit_waiting", "_close_plan")


def _time_phases(sched: Scheduler, timer) -> dict[str, list[float]]:
    """Wrap ``sched``'s ``PHASES`` methods (on the instance) so that each call adds its
    seconds to its list; returns the lists (the caller clears them around untimed steps).
    Each phase is timed inside ``schedule()``'s own timer, so the phases sum to a little less
    than it, and the wrappers add a little to it."""
    spent: dict[str, list[float]] = {name: [] for name in PHASES}

    def wrap(method, out):
        def timed(*args, **kwargs):
            t0 = timer()
            try:
                return method(*args, **kwargs)
            finally:
                out.append(timer() - t0)
        return timed
    for name in PHASES:
        setattr(sched, name, wrap(getattr(sched, name), spent[name]))
    return spent


def bench(policy_name: str, num_waiting: int, num_running: int, steps: int, cost, seed: int = 0,
          warmup: int = 300, budget: int = 512, cache: str | None = None, clock: str = "wall",
          phases: bool = False) -> dict:
    """``cache``: None (no token ids, default config), "off" or "on" (token ids, prefix cache off/on).
    ``clock``: "wall" (``time.perf_counter``) or "cpu" (``time.thread_time``: this thread's CPU
    time, which a loaded machine's waits for a core do not inflate). ``phases``: also the mean
    µs per timed step of each of ``schedule()``'s ``PHASES`` (in ``phase_us``)."""
    timer = time.perf_counter if clock == "wall" else time.thread_time
    rng = random.Random(seed)
    ids = cache is not None
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=num_running,
                             swap_budget_tokens=2048, enable_prefix_caching=cache != "off")
    sched = Scheduler(config, make_policy(policy_name), PageAllocator(200_000, 16),
                      PageAllocator(200_000, 16, "host"), cost)
    spent = _time_phases(sched, timer) if phases else None
    now, counter = 0.0, 0
    pending: list[tuple[float, Request, int]] = []

    def top_up() -> None:
        nonlocal counter
        while len(sched.waiting) < num_waiting:
            sched.add_request(make_request(rng, counter, now, ids), now)
            counter += 1

    top_up()
    times, update_times, tokens, running = [], [], [], []
    for step in range(warmup + steps):
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            sched.api_return(item[1], item[2], now, token_ids=[5] * item[2] if ids else None)
        if spent is not None and step == warmup:
            for out in spent.values():
                out.clear()   # the warm-up's calls
        gc.disable()
        t0 = timer()
        plan = sched.schedule(now)
        t1 = timer()
        gc.enable()
        if step >= warmup:
            times.append(t1 - t0)
            tokens.append(plan.num_batched_tokens)
        now += cost.t_fwd(plan.num_batched_tokens)
        result = StepResult(token_ids=[7 + step % 50] * len(plan.chunks) if ids else None)
        gc.disable()
        t0 = timer()
        events = sched.update(plan, result, now)
        t1 = timer()
        gc.enable()
        if step >= warmup:
            update_times.append(t1 - t0)
        for event in events:
            if event.kind is EventKind.API_CALL:   # paused by update(); its segment is behind it now
                r = event.request
                seg = r.segments[r.segment_index - 1]
                pending.append((now + seg.api_duration_s, r, seg.num_returned_tokens))
        if step >= warmup:
            running.append(len(sched.running))
        top_up()
    mean_tokens = statistics.fmean(tokens)
    step_s = cost.t_fwd(mean_tokens)
    med = statistics.median(times)
    return {"policy": policy_name, "waiting": num_waiting, "running": num_running,
            "median_us": med * 1e6, "mean_us": statistics.fmean(times) * 1e6,
            "p99_us": sorted(times)[int(0.99 * (len(times) - 1))] * 1e6,
            "update_us": statistics.median(update_times) * 1e6,
            "step_ms": step_s * 1e3, "fraction": med / step_s, "tokens": mean_tokens,
            "running_mean": statistics.fmean(running),
            **({"phase_us": {name.strip("_"): sum(out) / steps * 1e6 for name, out in spent.items()}}
               if spent is not None else {})}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="gptj-6b-a100-40g", help="built-in profile name or JSON path")
    ap.add_argument("--policies", default=",".join(p for p in available_policies() if p != "mars"))
    ap.add_argument("--waiting", default="64,512,4096")
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--prefix-cache", default=None,
                    help="comma list of off,on: requests carry token ids, cache off/on (default: no ids)")
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="also time git revision REV's scheduler, row by row (before/after in one run)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time schedule() by wall clock or by this thread's CPU time (robust to a loaded machine)")
    ap.add_argument("--phases", action="store_true",
                    help="also print the mean µs per step of each phase of schedule() (open the plan, continue "
                         "swaps, the running batch, admissions, close the plan; the timers add a little)")
    ap.add_argument("--scheduler-src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json-row", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.json_row:   # one row for a --baseline parent: print its result as JSON
        cache = args.prefix_cache if args.prefix_cache else None
        print(json.dumps(bench(args.policies, int(args.waiting), args.running, args.steps,
                               load_profile(args.profile), budget=args.budget, cache=cache, clock=args.clock)))
        return
    if args.phases and args.baseline:
        ap.error("--phases times schedule() with wrappers the baseline would not have: run them apart")
    baseline_dir = _export_scheduler(args.baseline) if args.baseline else None
    caches = args.prefix_cache.split(",") if args.prefix_cache else [None]
    if any(c not in (None, "off", "on") for c in caches):
        ap.error("--prefix-cache takes off, on or off,on")
    cost = load_profile(args.profile)
    sizes = [int(x) for x in args.waiting.split(",")]
    print(f"profile {cost.name}; {args.running} running (max_num_seqs), budget {args.budget} tokens, "
          f"{args.steps} timed steps, {args.clock} clock; python {sys.version.split()[0]}")
    print(f"{'policy':<14}{'waiting':>8}{'cache':>6}{'median µs':>11}{'mean µs':>9}{'p99 µs':>9}"
          f"{'update µs':>10}{'step ms':>9}{'% of step':>10}{'running':>9}{'vs off':>8}"
          + (f"{'base µs':>9}{'vs base':>9}{'base upd':>9}" if baseline_dir else ""))
    for name in args.policies.split(","):
        for n in sizes:
            base = None
            for cache in caches:
                base_row = _baseline_row(baseline_dir, args, name, n, cache) if baseline_dir else None
                r = bench(name, n, args.running, args.steps, cost, budget=args.budget, cache=cache, clock=args.clock,
                          phases=args.phases)
                if cache == "off":
                    base = r["median_us"]
                ratio = f"{r['median_us'] / base:>7.2f}x" if base and cache == "on" else f"{'':>8}"
                print(f"{name:<14}{n:>8}{cache or '-':>6}{r['median_us']:>11.0f}{r['mean_us']:>9.0f}"
                      f"{r['p99_us']:>9.0f}{r['update_us']:>10.0f}{r['step_ms']:>9.1f}{100 * r['fraction']:>9.2f}%"
                      f"{r['running_mean']:>9.0f}{ratio}"
                      + (f"{base_row['median_us']:>9.0f}{r['median_us'] / base_row['median_us']:>8.2f}x"
                         f"{base_row.get('update_us', float('nan')):>9.0f}" if base_row else ""), flush=True)
                if args.phases:
                    print(f"{'':<14}phases µs/step: " + ", ".join(f"{k} {v:.1f}" for k, v in r["phase_us"].items()),
                          flush=True)


def _export_scheduler(rev: str) -> str:
    """Export git revision ``rev``'s ``scheduler/`` package to a temporary folder; returns it."""
    out = tempfile.mkdtemp(prefix="bench-scheduler-base-")
    atexit.register(shutil.rmtree, out, True)   # (runs used to leave one behind each)
    export_revision(rev, out, ("scheduler",))
    return out


def _baseline_row(src: str, args: argparse.Namespace, policy: str, waiting: int, cache: str | None) -> dict:
    """``bench`` of one row with the scheduler exported to ``src``, in a subprocess."""
    cmd = [sys.executable, __file__, "--scheduler-src", src, "--json-row", "--policies", policy,
           "--waiting", str(waiting), "--running", str(args.running), "--steps", str(args.steps),
           "--budget", str(args.budget), "--profile", args.profile, "--clock", args.clock]
    if cache:
        cmd += ["--prefix-cache", cache]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ)).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
