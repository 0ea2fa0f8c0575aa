"""Simulator vs real engine on a workload whose outcome does not depend on time
(issue 19, the in-run profile's fcfs miss): every request arrives at once and
makes no API call, so each step's plan depends only on the scheduler's state,
and the two executors must preempt, recompute and batch exactly alike.

The miss it guards: the engine replay ran with the engine's default prefix
cache (on) while the simulator ran the replay's setting (off), so a preempted
or discarded request found its own pages again on the engine and recomputed
them on the simulator (2,373 against 49,925 recomputed tokens for fcfs in the
idle rate-10 run), which loaded the simulated fcfs into 71 preemptions."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.replay.engine_replay import EngineOptions, run_engine  # noqa: E402
from jaxserve.replay.experiment import ReplayConfig, simulate  # noqa: E402
from jaxserve.replay.simulate import SimConfig  # noqa: E402
from jaxserve.replay.trace import TraceEntry  # noqa: E402
from scheduler import BUILTIN_PROFILES, Segment  # noqa: E402

# Ten requests of 40 + 60 tokens at once into 24 pages of 8 tokens (192 tokens):
# the pool holds the prompts but not the answers, so running requests get preempted.
ENTRIES = [TraceEntry(f"r{i}", prompt_len=40, segments=(Segment(60),), arrival_time=0.0) for i in range(10)]
# The swap budget is given: unset, the engine takes its own default (max_num_batched_tokens) and the
# simulator the profile's (what a step hides, 704 tokens here), and the host tier's copy-ins then
# differ (stop 49's preemption order met that: the simulator found a preempted request's pages on
# the host where the engine had had no budget to copy them).
SIM = SimConfig(page_size=8, num_device_pages=24, num_host_pages=24, max_num_batched_tokens=64, max_num_seqs=8,
                swap_budget_tokens=64, check_invariants=True)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_engine_and_simulator_preempt_and_recompute_alike(prefix_cache):
    config = ReplayConfig(policies=["fcfs"], rates=[None], arrival="trace", sim=SIM, prefix_cache=(prefix_cache,))
    (engine,) = run_engine(ENTRIES, config, EngineOptions(EngineConfig(model="demo", max_model_len=128)),
                           progress=False)
    (sim,) = simulate(ENTRIES, BUILTIN_PROFILES["gptj-6b-a100-40g"], config, progress=False)
    e, s = engine.row, sim.row
    assert e["completed"] == s["completed"] == 10
    assert e["prefix_cache"] is s["prefix_cache"] is prefix_cache
    assert e["preemptions"] > 0
    assert (e["preemptions"], e["recomputed_tokens"], e["batched_tokens"], e["steps"]) == \
        (s["preemptions"], s["recomputed_tokens"], s["batched_tokens"], s["steps"])
