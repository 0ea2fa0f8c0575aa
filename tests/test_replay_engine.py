"""Trace replay on the real engine (demo model, CPU): the runner drives LLMEngine
with declared API calls and reports the same metrics as the simulator."""

import json

import pytest

pytest.importorskip("jax")

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.replay.engine_replay import EngineOptions, run_engine  # noqa: E402
from jaxserve.replay.experiment import ReplayConfig, write_outputs  # noqa: E402
from jaxserve.replay.simulate import SimConfig  # noqa: E402
from jaxserve.replay.trace import load_trace, scale_entries  # noqa: E402


def test_a_request_ending_in_an_api_call_ends_when_it_returns():
    from jaxserve import LLM, ApiCall, SamplingParams
    llm = LLM("demo", page_size=8, num_pages=32, max_num_batched_tokens=32, max_model_len=128, warmup=False,
              check_invariants=True)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True),
        api_calls=[[ApiCall(3, 0.01, [8, 9], "a"), ApiCall(6, 0.01, [10], "b")]])[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 6
    assert [c.return_time is not None for c in out.api_calls] == [True, True]
    assert llm.engine.scheduler.kv.num_free_device == 32


def test_engine_replay_completes_and_reports(tmp_path):
    entries = scale_entries(load_trace("diverse_oneapi_merged_exp_uniform.json")[:40], 0.03, 0.002)
    config = ReplayConfig(policies=["infercept"], rates=[50.0], num_requests=6, seed=2,
                          sim=SimConfig(page_size=16, num_device_pages=64, num_host_pages=64,
                                        max_num_batched_tokens=64, max_num_seqs=8))
    runs = run_engine(entries, config, EngineOptions(EngineConfig(model="demo", max_model_len=256)), progress=False)
    write_outputs(runs, tmp_path, plots=False)
    (row,) = json.loads((tmp_path / "results.json").read_text())
    assert row["executor"] == "engine" and row["completed"] == row["requests"] == 6
    assert row["api_calls"] == 6 and sum(row["handling_counts"].values()) == 6
    assert row["mean_ttft_s"] > 0 and row["mean_e2e_s"] >= row["mean_ttft_s"]
    assert row["steps"] > 0 and 0 < row["busy_fraction"] <= 1


def test_engine_resend_replay_serves_earlier_turns_from_the_cache(tmp_path):
    """Re-send mode on the real engine: every later segment arrives as a new request
    carrying the conversation's real token ids; with the cache on the follow-ups
    find the earlier turns' full pages, with it off they recompute them."""
    multi = [e for e in load_trace("merged_exp_uniform.json") if len(e.segments) >= 3][:4]
    entries = scale_entries(multi, 0.05, 0.002)
    config = ReplayConfig(policies=["lamps"], rates=[50.0], num_requests=4, seed=1, mode="resend",
                          prefix_cache=(False, True),
                          sim=SimConfig(page_size=8, num_device_pages=128, num_host_pages=0,
                                        max_num_batched_tokens=64, max_num_seqs=8, check_invariants=True))
    off, on = (r.row for r in run_engine(entries, config, EngineOptions(EngineConfig(model="demo",
                                                                                     max_model_len=512)),
                                         progress=False))
    for row in (off, on):
        assert row["mode"] == "resend" and row["completed"] == row["requests"]
        assert row["follow_ups"] == row["requests"] - 4 > 0
    assert (off["prefix_cache"], on["prefix_cache"]) == (False, True)
    assert off["cached_prompt_tokens"] == 0 and off["affinity_hit_rate"] == 0.0
    assert on["cached_prompt_tokens"] > 0 and on["affinity_hit_rate"] > 0.5
    assert on["recomputed_tokens"] < off["recomputed_tokens"]


def test_a_mooncake_trace_shares_its_blocks_on_the_engine_as_in_the_simulator(tmp_path):
    """A Mooncake request's prompt is its blocks' tokens, drawn per chain of block ids, so
    two requests naming the same first block share its pages in the engine's prefix cache
    as the simulator's names say (the engine drew every prompt afresh: nothing shared);
    re-send mode names them by block too."""
    import dataclasses

    from jaxserve.replay.experiment import simulate
    from scheduler.cost_model import load_profile

    trace = tmp_path / "mc.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": 40, "output_length": 3, "hash_ids": ids}) + "\n"
                             for t, ids in ((0, [7]), (500, [7]), (900, [8]))))
    entries = load_trace(trace)
    sim = SimConfig(page_size=16, num_device_pages=32, num_host_pages=0, max_num_batched_tokens=64, max_num_seqs=8)
    config = ReplayConfig(policies=["fcfs"], rates=[None], arrival="trace", seed=0, prefix_cache=(True,), sim=sim)
    [engine_run] = run_engine(entries, config, EngineOptions(EngineConfig(model="demo", max_model_len=256)),
                              progress=False)
    cost = load_profile("gptj-6b-a100-40g")
    [simulated] = simulate(entries, cost, config, progress=False)
    [resent] = simulate(entries, cost, dataclasses.replace(config, mode="resend"), progress=False)
    assert engine_run.row["cached_prompt_tokens"] == simulated.row["cached_prompt_tokens"] == \
        resent.row["cached_prompt_tokens"] == 32   # the second request's two full pages of block 7


def test_the_engine_caps_generation_as_the_simulator_and_drops_calls_past_the_cap(tmp_path):
    """A request generating more than 2,048 tokens before its API call: the simulator stops
    it at the original driver's cap and never makes the call; the engine's request is the
    same (it generated all 3,000 tokens; then, capped, was refused for a call past the cap)."""
    from jaxserve.replay.engine_replay import _engine_request
    from jaxserve.replay.trace import MAX_TOKENS_CAP, parse_jsonl
    from jaxserve.replay.workload import WorkloadItem

    [entry] = parse_jsonl(json.dumps({"id": "r", "segments": [
        {"prompt_tokens": 8, "completion_tokens": 3000, "api_time": 0.1, "api_token_length": 5},
        {"completion_tokens": 10}]}))
    ids, params, calls = _engine_request(WorkloadItem("r", 0.0, entry, 0), vocab=100, seed=0)
    assert len(ids) == 8 and params.max_tokens == entry.to_request("r", 0.0).max_tokens == MAX_TOKENS_CAP
    assert calls == []
