"""Trace replay on the real engine (demo model, CPU): the runner drives LLMEngine
with declared API calls and reports the same metrics as the simulator."""

import json

import pytest

pytest.importorskip("jax")

from jaxserve.replay.engine_runner import EngineOptions, engine_compatible, run_engine  # noqa: E402
from jaxserve.replay.runner import ReplayConfig, write_outputs  # noqa: E402
from jaxserve.replay.sim import SimConfig  # noqa: E402
from jaxserve.replay.trace import load_trace, scale_entries  # noqa: E402


def test_engine_compatible_adds_a_token_after_a_final_call():
    entries = load_trace()
    ends_in_call = next(e for e in entries if e.segments[-1].has_api_call)
    (fixed,) = engine_compatible([ends_in_call])
    assert fixed.segments[:-1] == ends_in_call.segments and fixed.segments[-1].num_tokens == 1
    assert not fixed.segments[-1].has_api_call
    plain = next(e for e in entries if not e.segments[-1].has_api_call)
    assert engine_compatible([plain]) == [plain]


def test_engine_replay_completes_and_reports(tmp_path):
    entries = scale_entries(load_trace("diverse_oneapi_merged_exp_uniform.json")[:40], 0.03, 0.002)
    config = ReplayConfig(policies=["infercept"], rates=[50.0], num_requests=6, seed=2,
                          sim=SimConfig(page_size=16, num_device_pages=64, num_host_pages=64,
                                        max_num_batched_tokens=64, max_num_seqs=8))
    runs = run_engine(entries, config, EngineOptions(model="demo", max_model_len=256), progress=False)
    write_outputs(runs, tmp_path, plots=False)
    (row,) = json.loads((tmp_path / "results.json").read_text())
    assert row["executor"] == "engine" and row["completed"] == row["requests"] == 6
    assert row["api_calls"] == 6 and sum(row["handling_counts"].values()) == 6
    assert row["mean_ttft_s"] > 0 and row["mean_e2e_s"] >= row["mean_ttft_s"]
    assert row["steps"] > 0 and 0 < row["busy_fraction"] <= 1
