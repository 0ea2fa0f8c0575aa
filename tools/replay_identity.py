"""Whether simulated replays give the same results as another git revision: a
digest of every request's timing marks and the run's totals, per case, for
this checkout and for ``--baseline REV`` (its ``jaxserve/`` and ``scheduler/``
exported from git and run in a subprocess), side by side.

    python tools/replay_identity.py --baseline 75e8494 [--policies infercept,lamps,fcfs]
        [--rate 10] [--duration 40] [--replicas 8] [--replica-duration 60] [--metrics]

Cases: each policy on the bundled multi-API trace (Poisson, seed 0), with the
prefix cache off and a roomy pool, and on with a 600-page pool (preemption and
eviction); and re-send mode on ``--replicas`` replicas behind the affinity and
least-loaded routers (infercept, prefix cache on), and behind the affinity
router with lamps and a 600-page pool. A change that is meant to be a pure
speed-up must print ``same`` on every row; ``--metrics`` also prints what a
change that is not one moved (means per request, both builds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SRC = sys.argv[sys.argv.index("--src") + 1] if "--src" in sys.argv else str(REPO)
sys.path.insert(0, _SRC)

from git_export import export_revision  # noqa: E402
from jaxserve.profiles import load_profile  # noqa: E402
from jaxserve.replay.cluster import run_resend  # noqa: E402
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402
from jaxserve.replay.workload import WorkloadSpec, make_workload  # noqa: E402
from scheduler import make_policy, make_predictor  # noqa: E402

MARKS = ("first_scheduled_time", "first_token_time", "finish_time", "num_generated", "num_cached_tokens",
         "max_computed_tokens", "num_preemptions", "finish_reason")


def _case_result(requests, totals, recomputed: int, preemptions: int) -> dict:
    """The case's digest, and its means (seconds, over the requests that ended) and counts
    for ``--metrics``."""
    text = repr([tuple(getattr(r, f) for f in MARKS)
                 + tuple((c.call_time, c.return_time, c.resume_time, str(c.handling)) for c in r.api_calls)
                 for r in requests]) + repr(totals)
    ended = [r for r in requests if r.finish_time is not None and r.first_token_time is not None]
    n = max(1, len(ended))
    return {"digest": hashlib.sha256(text.encode()).hexdigest()[:16],
            "e2e_s": sum(r.finish_time - r.arrival_time for r in ended) / n,
            "ttft_s": sum(r.first_token_time - r.arrival_time for r in ended) / n,
            "recomputed": recomputed, "preemptions": preemptions}


def digests(args: argparse.Namespace) -> dict[str, dict]:
    """``{case: _case_result(...)}`` for this interpreter's ``jaxserve``/``scheduler``."""
    cost = load_profile("gptj-6b-a100-40g")
    trace = load_trace()
    out = {}
    for policy in args.policies.split(","):
        for cache, pages in ((False, None), (True, 600)):
            workload = make_workload(trace, WorkloadSpec("poisson", rate=args.rate, duration_s=args.duration, seed=0))
            sched = build_scheduler(cost, make_policy(policy, make_predictor("oracle", 0)),
                                    SimConfig(enable_prefix_caching=cache, num_device_pages=pages))
            res = run_simulation(sched, [w.to_request() for w in workload])
            out[f"{policy} cache={'on' if cache else 'off'} pages={pages or 'profile'}"] = _case_result(
                res.requests, (res.end_time_s, res.num_steps, res.busy_time_s, res.recomputed_tokens,
                               res.num_preemptions), res.recomputed_tokens, res.num_preemptions)
    for router, policy, pages in (("affinity", "infercept", None), ("least_loaded", "infercept", None),
                                  ("affinity", "lamps", 600)):
        workload = make_workload(trace, WorkloadSpec("poisson", rate=2.0 * args.replicas,
                                                     duration_s=args.replica_duration, seed=0))
        schedulers = [build_scheduler(cost, make_policy(policy, make_predictor("oracle", 0)),
                                      SimConfig(enable_prefix_caching=True, num_device_pages=pages))
                      for _ in range(args.replicas)]
        res = run_resend(schedulers, workload, router)
        name = f"{args.replicas} replicas {router}" + ("" if policy == "infercept" else f" {policy} pages={pages}")
        out[name] = _case_result(
            res.requests, (res.end_time_s, res.num_steps, res.busy_time_s, res.batched_tokens,
                           res.recomputed_tokens, res.follow_up_hits, res.requests_by_replica),
            res.recomputed_tokens, res.num_preemptions)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", metavar="REV", help="git revision to compare with")
    ap.add_argument("--policies", default="fcfs,infercept,lamps,augserve,continuum,sjf,autellix,prophet")
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--duration", type=float, default=40.0)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--replica-duration", type=float, default=60.0)
    ap.add_argument("--metrics", action="store_true",
                    help="also print each case's mean E2E and TTFT, recomputed tokens and preemptions")
    ap.add_argument("--src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ours = digests(args)
    if args.json:
        print(json.dumps(ours))
        return 0
    theirs = _baseline(args) if args.baseline else {}
    print(f"{'case':<44}{'this checkout':>18}{args.baseline or '':>18}")
    differ = 0
    for case, row in ours.items():
        base = theirs.get(case, {}).get("digest")
        verdict = "" if base is None else ("  same" if base == row["digest"] else "  DIFFERENT")
        differ += base is not None and base != row["digest"]
        print(f"{case:<44}{row['digest']:>18}{base or '':>18}{verdict}")
    if args.metrics:
        print(f"\n{'case':<44}{'mean E2E s':>22}{'mean TTFT s':>22}{'recomputed tokens':>26}{'preemptions':>14}"
              + ("   (this checkout / baseline)" if theirs else ""))
        for case, row in ours.items():
            base = theirs.get(case)
            cells = [(f"{row[k]:.3f}" if isinstance(row[k], float) else f"{row[k]:,}")
                     + ((f" / {base[k]:.3f}" if isinstance(base[k], float) else f" / {base[k]:,}") if base else "")
                     for k in ("e2e_s", "ttft_s", "recomputed", "preemptions")]
            print(f"{case:<44}{cells[0]:>22}{cells[1]:>22}{cells[2]:>26}{cells[3]:>14}")
    return 1 if differ else 0


def _baseline(args: argparse.Namespace) -> dict[str, dict]:
    """The digests of revision ``args.baseline``, its packages exported to a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="replay-identity-") as src:
        export_revision(args.baseline, src, ("jaxserve", "scheduler"))
        cmd = [sys.executable, __file__, "--src", src, "--json", "--policies", args.policies,
               "--rate", str(args.rate), "--duration", str(args.duration), "--replicas", str(args.replicas),
               "--replica-duration", str(args.replica_duration)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=src, env=dict(os.environ)).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
