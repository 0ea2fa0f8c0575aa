"""Simulated replay of the bundled multi-API trace with the prefix cache off,
on device-only (``host_cache=False``: the host pool serves Swap alone), on with
the host tier (the host pool, sized by the profile's ``host_kv_bytes``, shared
with Swap), and on device-only without a host pool (``num_host_pages=0``: no
Swap either), per policy, in one run: recomputed, cached (either tier) and host-tier tokens, mean/p99 E2E, mean
TTFT, preemptions, handlings chosen.

    python tools/sim_host_tier.py RATE NUM_REQUESTS

Each request's pages are named by (request id, page index) (trace requests
carry no token ids): this measures soft discard / preemption / swap-in
re-linking, not sharing between requests. Pure Python (scheduler + simulator).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import statistics  # noqa: E402
import time  # noqa: E402

from jaxserve.replay.trace import load_trace  # noqa: E402
from jaxserve.replay.workload import WorkloadSpec, make_workload  # noqa: E402
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation  # noqa: E402
from scheduler import load_profile, make_policy, make_predictor  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rate", type=float, help="requests per second (Poisson arrivals)")
    ap.add_argument("num_requests", type=int, help="requests drawn from the bundled multi-API trace")
    args = ap.parse_args()
    rate, n = args.rate, args.num_requests
    cost = load_profile("gptj-6b-a100-40g")
    entries = load_trace()
    for policy in ("infercept", "lamps"):
        for mode, cache, host_cache, host_pages in (("off", False, True, None), ("device", True, False, None),
                                                    ("host", True, True, None), ("no-host", True, True, 0)):
            t = time.time()
            spec = WorkloadSpec("poisson", rate=rate, num_requests=n, seed=0)
            reqs = [w.to_request() for w in make_workload(entries, spec)]
            sched = build_scheduler(cost, make_policy(policy, make_predictor("oracle")),
                                    SimConfig(enable_prefix_caching=cache, host_cache=host_cache,
                                              num_host_pages=host_pages))
            res = run_simulation(sched, reqs)
            e2e = sorted(r.finish_time - r.arrival_time for r in reqs)
            ttft = [r.first_token_time - r.arrival_time for r in reqs]
            handlings: dict[str, int] = {}
            for r in reqs:
                for c in r.api_calls:
                    handlings[c.handling.value] = handlings.get(c.handling.value, 0) + 1
            host_hits = sched.kv.cache.host_hit_tokens if sched.kv.cache is not None else 0
            print(f"{policy:<10} cache={mode:<7} recomputed={res.recomputed_tokens:>9} "
                  f"cached={res.cached_tokens:>9} from_host={host_hits:>9} swapped={res.swapped_tokens:>9} E2E mean={statistics.fmean(e2e):7.2f}s "
                  f"p99={e2e[int(0.99 * (len(e2e) - 1))]:7.2f}s TTFT mean={statistics.fmean(ttft):6.3f}s "
                  f"preempt={res.num_preemptions} handlings={handlings} ({time.time() - t:.0f}s wall)", flush=True)


if __name__ == "__main__":
    main()
