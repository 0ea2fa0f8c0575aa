"""Trace replay: trace loading and validation, workloads, the simulator, metrics, CLI (CPU, no JAX)."""

import argparse
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from jaxserve.replay import cli as replay_cli
from jaxserve.replay.metrics import Slo, aggregate, request_metrics
from jaxserve.replay.experiment import ReplayConfig, simulate, write_outputs
from jaxserve.core import SimClock
from jaxserve.executor.sim import SimExecutor
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation
from jaxserve.replay.trace import (TraceError, bundled_trace_path, entries_to_jsonl, load_trace,
                                   parse_infercept, parse_jsonl, scale_entries)
from jaxserve.replay.workload import WorkloadSpec, arrival_times, make_workload
from scheduler import (BUILTIN_PROFILES, ApiCallRecord, Handling, Request, StepPlan, SwapOp,
                       available_policies, make_policy, make_predictor)

COST = BUILTIN_PROFILES["gptj-6b-a100-40g"]


@pytest.fixture(scope="module")
def multi():
    return load_trace()


@pytest.fixture(scope="module")
def single():
    return load_trace("diverse_oneapi_merged_exp_uniform.json")


# ------------------------------------------------------------------ traces
def test_bundled_multi_api_trace(multi):
    assert len(multi) == 397
    assert sum(e.num_api_calls for e in multi) == 1841
    assert sum(1 for e in multi if e.segments[-1].has_api_call) == 184
    kinds = {e.kind for e in multi}
    assert kinds == {"math", "qa", "ve", "chat", "tts", "image"}
    call_types = {s.api_type for e in multi for s in e.segments if s.has_api_call}
    assert call_types == {"math", "qa", "ve", "chat", "tts", "image"}
    first = next(e for e in multi if e.request_id == "0a84bcdff8434b23971032489f44b90a")
    assert first.prompt_len == 392 and first.kind == "math"
    assert [s.num_tokens for s in first.segments] == [127, 47, 48, 82, 76]
    assert [s.num_returned_tokens for s in first.segments] == [21, 23, 23, 22, 0]
    assert first.segments[-1].api_type is None
    assert first.max_tokens == min(2048, 127 + 47 + 48 + 82 + 76 + 21 + 23 + 23 + 22)
    # api_token_length == -2 (a cap artefact) is read as 0 returned tokens
    capped = next(e for e in multi if e.request_id == "7_2")
    assert capped.segments[5].num_returned_tokens == 0
    # VE: exact 1,973-token prompt; text form with the TTS canned return
    assert all(e.prompt_len == 1973 for e in multi if e.kind == "ve")
    tts = next(e for e in multi if e.request_id == "0_1")
    assert tts.segments[0].api_type == "tts" and tts.segments[1].api_type == "chat"


def test_bundled_single_api_trace(single, multi):
    assert len(single) == 397
    assert all(e.num_api_calls == 1 and not e.segments[-1].has_api_call for e in single)
    assert {e.request_id for e in single} == {e.request_id for e in multi}
    assert bundled_trace_path("diverse_oneapi_merged_exp_uniform.json").is_file()
    with pytest.raises(ValueError, match="no bundled trace"):
        bundled_trace_path("nope.json")


def test_text_form_uses_tokenizer_or_four_chars_per_token():
    data = {"c": [{"prompt": "a b c d e", "completion": "x y", "api_token": "Generate an image about this. ",
                   "api_time": 2.0},
                  {"prompt": "ignored", "completion": "done now"}]}
    by_chars = parse_infercept(data)[0]
    assert by_chars.prompt_len == math.ceil(9 / 4)
    assert [s.num_tokens for s in by_chars.segments] == [1, 2]
    assert by_chars.segments[0].num_returned_tokens == math.ceil(len("Generate an image about this. ") / 4)
    by_words = parse_infercept(data, tokenizer=str.split)[0]
    assert by_words.prompt_len == 5
    assert [s.num_tokens for s in by_words.segments] == [2, 2]
    assert by_words.segments[0].num_returned_tokens == 5
    assert by_words.segments[0].api_type == "image" and by_words.kind == "image"


def test_jsonl_round_trip_and_fields(tmp_path, multi):
    path = tmp_path / "t.jsonl"
    path.write_text(entries_to_jsonl(multi[:20]))
    back = load_trace(path)
    assert [(e.request_id, e.prompt_len, e.segments) for e in back] == \
           [(e.request_id, e.prompt_len, e.segments) for e in multi[:20]]
    line = {"id": "r1", "arrival_time": 1.5, "api_type": "search", "predictions": {"output_len": 9},
            "segments": [{"prompt_tokens": 10, "completion_tokens": 3, "api_time": 0.5, "api_token_length": 4},
                         {"completion_tokens": 6}]}
    (e,) = parse_jsonl(json.dumps(line) + "\n\n")
    assert e.arrival_time == 1.5 and e.kind == "search" and e.predictions == {"output_len": 9}
    assert e.segments[0].api_type == "search" and e.segments[0].api_duration_s == 0.5
    req = e.to_request("x", 2.0)
    assert req.ignore_eos and req.predictions == {"output_len": 9} and req.max_tokens == 13


def _seg(**kw):
    base = {"prompt_tokens": 10, "completion_tokens": 3, "api_time": 0.5, "api_token_length": 2}
    base.update(kw)
    return {k: v for k, v in base.items() if v is not None}


BAD_JSON = [
    ({"r": []}, "'r'.*non-empty list"),
    ({"r": "x"}, "'r'.*non-empty list"),
    ({"r": [3]}, "'r' segment 0.*expected an object"),
    ({"r": [_seg(completion_tokens=None)]}, "'r' segment 0.*missing field 'completion_tokens'"),
    ({"r": [_seg(prompt_tokens=None)]}, "'r' segment 0.*missing field 'prompt_tokens'"),
    ({"r": [_seg(completion_tokens=-1)]}, "'r' segment 0.*'completion_tokens' must be a non-negative"),
    ({"r": [_seg(completion_tokens=2.5)]}, "'r' segment 0.*'completion_tokens'"),
    ({"r": [_seg(completion_tokens=True)]}, "'r' segment 0.*'completion_tokens'"),
    ({"r": [_seg(api_token_length=-3)]}, "'r' segment 0.*'api_token_length'"),
    ({"r": [_seg(api_time=-0.1)]}, "'r' segment 0.*'api_time' must be a number of seconds from 0"),
    ({"r": [_seg(api_time="1")]}, "'r' segment 0.*'api_time'"),
    ({"r": [_seg(api_token_length=None)]}, "'r' segment 0.*missing field 'api_token_length'"),
    ({"r": [_seg(api_time=None)]}, "'r' segment 0.*missing field 'api_time'"),
    ({"r": [_seg(colour=1)]}, "'r' segment 0.*unknown field.*colour"),
    ({"r": [_seg(api_time=None, api_token_length=None), _seg()]}, "'r' segment 0.*only the last segment"),
    ({"r": [_seg(prompt_tokens=0)]}, "'r' segment 0.*at least one token"),
    ({"r": [_seg(api_type=3)]}, "'r' segment 0.*'api_type' must be a string"),
    ({"t": [{"prompt": "hi", "completion": 5}]}, "'t' segment 0.*'completion' must be a string"),
    ({"t": [{"prompt": "hi", "completion": "x", "api_time": 1.0}]}, "'t' segment 0.*missing field 'api_token'"),
    ({"t": [{"prompt": "hi", "completion": "x", "prompt_tokens": 3}]}, "'t' segment 0.*unknown field"),
    ({}, "non-empty JSON object"),
    ([1, 2], "non-empty JSON object"),
]


@pytest.mark.parametrize("data,match", BAD_JSON)
def test_bad_infercept_trace_names_request_and_field(tmp_path, data, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_trace(path)


GOOD_LINE = {"id": "q", "segments": [_seg(), {"completion_tokens": 2}]}
BAD_JSONL = [
    ('{"segments": []}', "line 1: missing field 'id'"),
    ('{"id": "q"}', "'q': missing field 'segments'"),
    ('{"id": "q", "segments": [], "extra": 1}', "'q': unknown field.*extra"),
    ('{"id": "q", "arrival_time": -1, "segments": []}', "'q': field 'arrival_time'"),
    ('{"id": "q", "predictions": [1], "segments": []}', "'q': field 'predictions'"),
    ('{"id": "q", "api_type": 7, "segments": []}', "'q': field 'api_type'"),
    (json.dumps(GOOD_LINE) + "\n" + json.dumps(GOOD_LINE), "line 2: request 'q': duplicate id"),
    (json.dumps(GOOD_LINE) + "\n{not json", "line 2: not valid JSON"),
    (json.dumps({"id": "q", "segments": [_seg(completion_tokens=-5)]}), "'q' segment 0.*completion_tokens"),
    (json.dumps({**GOOD_LINE, "predictions": {"api_duration_s": "x"}}), r"'q': field 'predictions.api_duration_s'"),
    (json.dumps({**GOOD_LINE, "predictions": {"output_len": -1}}), r"'q': field 'predictions.output_len'"),
    (json.dumps({"id": "q", "segments": [_seg(api_time=1e308), {"completion_tokens": 2}]}),
     "'q' segment 0: field 'api_time' must be a number of seconds from 0 to 1e"),
    ('{"timestamp": 0, "output_length": 5, "hash_ids": [1]}', r"line 1: missing field\(s\) \['input_length'\]"),
]


@pytest.mark.parametrize("text,match", BAD_JSONL)
def test_bad_jsonl_trace_names_request_and_field(tmp_path, text, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_unreadable_traces(tmp_path):
    (tmp_path / "empty.json").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_trace(tmp_path / "empty.json")
    (tmp_path / "broken.json").write_text("{\n  \"a\": [")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_trace(tmp_path / "broken.json")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.json")
    with pytest.raises(TraceError):  # TraceError is the ValueError raised above
        parse_jsonl("\n\n")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(TraceError, match="binary.json: not UTF-8 text"):
        load_trace(tmp_path / "binary.json")


# ---------------------------------------------------------------- workloads
def test_workload_same_seed_identical_other_seed_differs(multi):
    spec = WorkloadSpec("poisson", rate=4.0, duration_s=300.0, seed=7)
    a, b = make_workload(multi, spec), make_workload(multi, spec)
    assert a == b
    c = make_workload(multi, WorkloadSpec("poisson", rate=4.0, duration_s=300.0, seed=8))
    assert [w.request_id for w in a] != [w.request_id for w in c]
    assert len({w.request_id for w in a}) == len(a)            # sampled with replacement, unique ids
    assert all(0 <= w.arrival_time < 300 for w in a)
    assert abs(len(a) - 1200) < 5 * math.sqrt(1200)
    # the entry sequence does not depend on the rate (same seed)
    d = make_workload(multi, WorkloadSpec("poisson", rate=8.0, num_requests=50, seed=7))
    assert [w.entry.request_id for w in d] == [w.entry.request_id for w in a[:50]]


def test_gamma_arrivals_have_the_requested_rate_and_burstiness():
    spec = WorkloadSpec("gamma", rate=5.0, cv=2.0, num_requests=40_000, seed=1)
    gaps = np.diff(arrival_times(spec), prepend=0.0)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.05)
    poisson = np.diff(arrival_times(WorkloadSpec("poisson", rate=5.0, num_requests=40_000, seed=1)))
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)


def test_trace_arrivals_and_bad_specs(multi):
    entries = parse_jsonl("\n".join(json.dumps({"id": f"r{i}", "arrival_time": t, "segments": [_seg(),
                                                {"completion_tokens": 1}]})
                                    for i, t in enumerate([3.0, 1.0, 2.0])))
    wl = make_workload(entries, WorkloadSpec("trace", num_requests=2))
    assert [(w.request_id, w.arrival_time) for w in wl] == [("r1", 1.0), ("r2", 2.0)]
    with pytest.raises(ValueError, match="arrival_time"):
        make_workload(multi, WorkloadSpec("trace"))
    for kwargs in ({"rate": None, "num_requests": 3}, {"rate": 1.0}, {"rate": 1.0, "num_requests": 3,
                   "duration_s": 3.0}, {"rate": -1.0, "num_requests": 3}):
        with pytest.raises(ValueError):
            WorkloadSpec("poisson", **kwargs)
    with pytest.raises(ValueError, match="arrival"):
        WorkloadSpec("uniform", rate=1.0, num_requests=1)


# --------------------------------------------------------------- simulator
def _small_entries(multi, n=40, scale=0.1):
    return scale_entries(multi[:: max(1, len(multi) // n)][:n], scale)


@pytest.mark.parametrize("policy", available_policies())
def test_sim_completes_every_request_with_all_pages_free(multi, policy):
    entries = _small_entries(multi)
    workload = make_workload(entries, WorkloadSpec("poisson", rate=20.0, num_requests=60, seed=3))
    requests = [w.to_request() for w in workload]
    # A small pool (~6 requests' worth) forces preemption, eviction and host-pool fallback.
    sched = build_scheduler(COST, make_policy(policy, make_predictor("oracle")),
                            SimConfig(page_size=8, num_device_pages=160, num_host_pages=40,
                                      max_num_batched_tokens=64, check_invariants=True))
    result = run_simulation(sched, requests, check_invariants=True)
    assert all(r.finish_time is not None and r.finish_reason in ("length", "stop") for r in requests)
    assert not sched.has_unfinished()
    assert sched.kv.num_free_device == sched.device_pool.num_pages
    assert sched.kv.num_free_host == sched.host_pool.num_pages
    for w, r in zip(sorted(workload, key=lambda w: w.arrival_time), result.requests):
        assert r.num_generated == w.entry.output_len
        assert len(r.api_calls) == w.entry.num_api_calls
        assert r.first_token_time >= r.arrival_time and r.finish_time >= r.first_token_time
    assert result.busy_time_s <= result.end_time_s


@pytest.mark.parametrize("handling", [Handling.PRESERVE, Handling.DISCARD, Handling.SWAP])
def test_sim_forced_handling(multi, handling):
    requests = [w.to_request() for w in make_workload(_small_entries(multi, 20),
                                                       WorkloadSpec("poisson", rate=10.0, num_requests=30))]
    sched = build_scheduler(COST, make_policy("infercept"),
                            SimConfig(page_size=8, num_device_pages=400, num_host_pages=400, handling=handling))
    result = run_simulation(sched, requests, check_invariants=True)
    used = {c.handling for r in requests for c in r.api_calls}
    assert used == {handling}
    assert (result.swapped_tokens > 0) == (handling == Handling.SWAP)
    assert sched.kv.num_free_device == sched.device_pool.num_pages


def test_sim_step_time_hides_swap_behind_the_forward():
    ex = SimExecutor(COST, 16, SimClock())
    r = Request("r", 0.0, prompt_len=4, max_tokens=1)
    plan = StepPlan()
    plan.chunks = []
    assert ex.step_time(plan) == (0.0, 0.0, 0)
    small = StepPlan(swap_out=[SwapOp(r, [0], [0])])            # 16 tokens, no forward
    dt, stall, tokens = ex.step_time(small)
    assert tokens == 16 and dt == pytest.approx(COST.t_swap(16)) and stall == pytest.approx(dt)
    from scheduler import ScheduledChunk
    fwd = StepPlan(chunks=[ScheduledChunk(r, 0, 300, True)], swap_in=[SwapOp(r, [1], [1])])
    dt, stall, _ = ex.step_time(fwd)                             # copy hidden by a 300-token forward
    assert dt == pytest.approx(COST.t_fwd(300, 300)) and stall == 0.0   # the chunk reads its 300 tokens
    big = StepPlan(chunks=[ScheduledChunk(r, 0, 1, True)], swap_in=[SwapOp(r, list(range(200)), list(range(200)))])
    dt, stall, _ = ex.step_time(big)
    assert dt == pytest.approx(COST.t_swap(3200)) and stall == pytest.approx(COST.t_swap(3200) - COST.t_fwd(1, 1))


def test_sim_pool_sized_from_profile():
    c = SimConfig().resolve(COST)
    assert c.num_device_pages == COST.device_kv_bytes // (COST.bytes_per_token * 16)
    assert c.num_host_pages == COST.host_kv_bytes // (COST.bytes_per_token * 16)
    assert c.max_num_batched_tokens == COST.max_num_batched_tokens
    assert c.swap_budget_tokens % 16 == 0
    assert COST.t_swap(c.swap_budget_tokens) <= COST.t_fwd(c.max_num_batched_tokens)


def test_sim_jumps_the_clock_over_api_waits_and_reports_stalls():
    req = Request("a", 5.0, prompt_len=10, max_tokens=3,
                  segments=[__import__("scheduler").Segment(1, "chat", 100.0, 4),
                            __import__("scheduler").Segment(2)])
    sched = build_scheduler(COST, make_policy("infercept"), SimConfig(page_size=16))
    result = run_simulation(sched, [req])
    assert req.first_token_time == pytest.approx(5.0 + COST.t_fwd(10, 10))
    call = req.api_calls[0]
    assert call.return_time - call.call_time == pytest.approx(100.0)
    assert req.finish_time > 105.0 and result.num_steps <= 6



def test_a_request_larger_than_the_pool_is_refused_up_front():
    """A context the whole device pool cannot hold could never run: alone the run stalled, and
    beside other requests the scheduler preempted everything forever (the replay never ended)."""
    for others in ([], [Request(f"s{i}", 0.1 * i, prompt_len=20, max_tokens=5) for i in range(3)]):
        big = Request("big", 0.0, prompt_len=150, max_tokens=5,
                      segments=[__import__("scheduler").Segment(3, "qa", 1.0, 20), __import__("scheduler").Segment(2)])
        sched = build_scheduler(COST, make_policy("fcfs"), SimConfig(page_size=16, num_device_pages=10))
        with pytest.raises(ValueError, match=r"'big' needs 11 KV pages \(175 tokens of context\).* only 10"):
            run_simulation(sched, [big, *others])


# ------------------------------------------------------------------ metrics
def test_request_metrics_and_goodput():
    r = Request("m", 10.0, prompt_len=5, max_tokens=5)
    r.first_scheduled_time, r.first_token_time, r.finish_time = 10.5, 11.0, 30.0
    r.finish_reason, r.num_generated = "length", 5
    r.api_calls.append(ApiCallRecord("qa", Handling.SWAP, call_time=12.0, return_time=20.0))
    m = request_metrics(r, "qa")
    assert m.e2e_s == 20.0 and m.ttft_s == 1.0 and m.queueing_s == 0.5 and m.api_s == 8.0
    assert m.norm_latency_s == pytest.approx((20.0 - 8.0) / 5)
    assert m.tpot_s == pytest.approx((20.0 - 1.0 - 8.0) / 4)
    agg = aggregate([m], duration_s=10.0, slo=Slo(ttft_s=1.5, norm_latency_s=3.0))
    assert agg["goodput_req_s"] == pytest.approx(0.1) and agg["handling_counts"]["swap"] == 1
    assert aggregate([m], 10.0, Slo(ttft_s=0.5))["goodput_req_s"] == 0.0
    assert Slo.from_step_time(0.02).norm_latency_s == pytest.approx(0.2)


# --------------------------------------------------------- runner and CLI
def _config(**kw):
    base = dict(policies=["fcfs", "infercept"], rates=[4.0], num_requests=40, seed=5,
                sim=SimConfig(page_size=16, num_device_pages=300))
    base.update(kw)
    return ReplayConfig(**base)


def test_same_seed_gives_byte_identical_results(tmp_path, multi):
    entries = scale_entries(multi, 0.2)
    for name in ("a", "b"):
        write_outputs(simulate(entries, COST, _config(), progress=False), tmp_path / name, plots=False)
    a = (tmp_path / "a" / "results.json").read_bytes()
    assert a == (tmp_path / "b" / "results.json").read_bytes()
    assert (tmp_path / "a" / "summary.md").read_bytes() == (tmp_path / "b" / "summary.md").read_bytes()
    write_outputs(simulate(entries, COST, _config(seed=6), progress=False), tmp_path / "c", plots=False)
    assert a != (tmp_path / "c" / "results.json").read_bytes()


def _cli_args(argv):
    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_end_to_end_writes_results_summary_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    rc = replay_cli.main(_cli_args(["--policies", "fcfs,infercept,lamps" if "lamps" in available_policies()
                                    else "fcfs,infercept", "--rates", "2,6", "--num-requests", "50",
                                    "--token-scale", "0.5", "--seed", "1", "--out", str(out), "--quiet"]))
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 2 * (3 if "lamps" in available_policies() else 2)
    for row in rows:
        for key in ("policy", "rate", "requests", "completed", "mean_e2e_s", "p50_e2e_s", "p99_e2e_s",
                    "mean_ttft_s", "p99_ttft_s", "mean_norm_latency_s", "throughput_req_s", "goodput_req_s",
                    "preemptions", "handling_counts", "mean_tpot_s", "mean_queueing_s"):
            assert key in row, key
        assert row["requests"] == row["completed"] == 50
    assert "| policy" in (out / "summary.md").read_text()
    for png in ("latency_vs_rate.png", "e2e_cdf.png", "kv_occupancy.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "E2E mean" in capsys.readouterr().out


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    for argv in (["--policies", "nope"], ["--rate", "1", "--rates", "1,2"], ["--rates", "0"],
                 ["--predictor", "psychic"], ["--num-requests", "3", "--duration", "3"],
                 [str(tmp_path / "missing.json")], ["--arrival", "trace"]):
        assert replay_cli.main(_cli_args(argv + ["--out", str(tmp_path), "--quiet", "--no-plots"])) == 2, argv
    assert "jaxserve replay:" in capsys.readouterr().err
    # options that were silently ignored or ran to a meaningless result
    for argv, message in ((["--cv", "2"], "--cv sets the gaps of --arrival gamma"),
                          (["--arrival", "gamma", "--cv", "0"], "--cv must be between 0.01 and 100"),
                          (["--arrival", "gamma", "--cv", "1e-200"], "--cv must be between"),
                          (["--token-scale", "inf"], "--token-scale must be a finite number > 0"),
                          (["--rate", "2", "--duration", "inf"], "--duration must be a finite number > 0"),
                          (["--rate", "inf", "--num-requests", "3"], "--rate must be a finite number > 0"),
                          (["--rates", "1,inf"], "--rates must be finite numbers > 0"),
                          (["--api-time-scale", "inf"], "--api-time-scale must be a finite number >= 0"),
                          (["--batch-share", "1.5"], "--batch-share must be a fraction"),
                          (["--rate", "1", "--duration", "0.001"], "no request arrives within 0.001 s"),
                          (["--mode", "resend", "--prefill-decode-split"], "requests mode only"),
                          (["--model", "demo", "--horizon", "5"], "--horizon: only the simulator reads it, not the real engine"),
                          (["--routers", "affinity"], "with one replica there is nothing to route"),
                          (["--horizon", "-1"], "--horizon must be"), (["--horizon", "0"], "--horizon must be"),
                          (["--slo-ttft", "-1"], "--slo-ttft must be"),
                          (["--slo-norm-latency", "nan"], "--slo-norm-latency must be")):
        assert replay_cli.main(_cli_args(argv + ["--out", str(tmp_path), "--quiet", "--no-plots"])) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_cli_refuses_an_out_it_cannot_write_before_running(tmp_path, capsys):
    """An ``--out`` that is a file, under a file, or holding a directory where an output
    file goes: refused in one line before the runs (it was a traceback after them)."""
    (tmp_path / "afile").write_text("")
    (tmp_path / "od" / "summary.md").mkdir(parents=True)
    run = ["--policies", "fcfs", "--rate", "2", "--num-requests", "3", "--quiet", "--no-plots"]
    for out, message in ((tmp_path / "afile", "is a file, not a directory"),
                         (tmp_path / "afile" / "sub", "is a file, not a directory"),
                         (tmp_path / "od", "is a directory; the replay writes a file there")):
        assert replay_cli.main(_cli_args(run + ["--out", str(out)])) == 2, out
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_cli_loads_a_tokenizer_only_for_text_and_names_one_it_cannot_load(tmp_path, capsys):
    bad = ["--tokenizer", str(tmp_path / "no-such-tokenizer"), "--out", str(tmp_path), "--quiet", "--no-plots",
           "--policies", "fcfs", "--rate", "2", "--num-requests", "3"]
    token_trace = tmp_path / "tokens.jsonl"
    token_trace.write_text(json.dumps({"id": "n", "segments": [{"prompt_tokens": 9, "completion_tokens": 4}]}) + "\n")
    assert replay_cli.main(_cli_args([str(token_trace), *bad])) == 0   # no text: the tokenizer is never loaded
    text_trace = tmp_path / "text.jsonl"
    text_trace.write_text(json.dumps({"id": "t", "segments": [{"prompt": "hello there", "completion": "hi"}]}) + "\n")
    assert replay_cli.main(_cli_args([str(text_trace), *bad])) == 2
    err = capsys.readouterr().err
    assert "--tokenizer" in err and "cannot be loaded" in err, err


def test_step_model_linear_and_measured_buckets():
    from dataclasses import replace

    assert COST.t_step(100) == pytest.approx(COST.t_fwd(100) + COST.step_overhead_s)
    assert COST.resolved_step_model == "linear"                   # no measured table
    with pytest.raises(ValueError, match="no measured step times"):
        COST.timed("buckets")
    measured = replace(COST, step_overhead_s=0.0, meta={"step_times_s": {"8": 0.002, "16": 0.004, "32": 0.01}})
    assert measured.resolved_step_model == "buckets"
    assert [measured.t_step(n) for n in (0, 1, 8, 9, 16, 32)] == [0.0, 0.002, 0.002, 0.004, 0.004, 0.01]
    assert measured.t_step(40) == pytest.approx(0.01 + 8 * COST.fwd_per_token_s)
    assert measured.timed("linear").t_step(40) == pytest.approx(COST.fwd_base_s + 40 * COST.fwd_per_token_s)
    with pytest.raises(ValueError, match="step model"):
        COST.timed("cubic")


@pytest.mark.parametrize("change, message", [({"fwd_base_s": "abc"}, "fwd_base_s must be a finite number >= 0"),
                                             ({"fwd_base_s": -1.0}, "fwd_base_s must be a finite number >= 0"),
                                             ({"bytes_per_token": 0}, "bytes_per_token must be an integer >= 1"),
                                             ({"saturation_tokens": float("nan")}, "saturation_tokens must be"),
                                             ({"meta": {"step_times_s": {"8": -1}}}, "step_times_s must hold"),
                                             ({"nonsense": 1}, "unknown keys")])
def test_a_cost_profile_with_a_bad_value_is_refused_naming_the_file_and_field(tmp_path, change, message):
    """A profile file's values were used as given: a string was a ``TypeError``, a zero
    ``bytes_per_token`` a ``ZeroDivisionError``, a negative time ran to negative steps."""
    from dataclasses import asdict

    from jaxserve.profiles import load_profile

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**asdict(COST), **change}))
    with pytest.raises(ValueError, match=message) as e:
        load_profile(str(path))
    assert str(path) in str(e.value)


def test_step_time_adds_host_overhead_and_scales():
    from dataclasses import replace

    measured = replace(COST, step_overhead_s=0.0005, meta={"step_times_s": {"8": 0.002, "16": 0.004}})
    assert measured.t_step(5) == pytest.approx(0.0025)
    assert measured.timed(step_time_scale=1.1).t_step(12) == pytest.approx(1.1 * 0.0045)
    assert measured.timed(step_time_scale=2.0).t_swap(1000) == pytest.approx(2 * measured.t_swap(1000))
    assert measured.t_step(0) == 0.0                               # no forward, no overhead
    with pytest.raises(ValueError, match="scale"):
        measured.timed(step_time_scale=0.0)


def test_sim_serial_swaps_add_to_the_forward():
    """A profile of an engine that copies before the forward (swap_overlaps_forward
    false, as ``jaxserve profile`` records jaxserve's) pays forward + copy."""
    from dataclasses import replace

    from scheduler import ScheduledChunk
    serial = replace(COST, swap_overlaps_forward=False)
    ex = SimExecutor(serial, 16, SimClock())
    r = Request("r", 0.0, prompt_len=4, max_tokens=1)
    plan = StepPlan(chunks=[ScheduledChunk(r, 0, 300, True)], swap_in=[SwapOp(r, [1], [1])])
    dt, stall, tokens = ex.step_time(plan)
    assert tokens == 16 and dt == pytest.approx(serial.t_fwd(300, 300) + serial.t_swap(16))
    assert stall == pytest.approx(serial.t_swap(16))


def test_step_tally_groups_steps_by_power_of_two_bucket():
    from jaxserve.core import StepTally
    tally = StepTally()
    for n, s in [(1, 0.001), (2, 0.003), (300, 0.05), (512, 0.07), (0, 0.002)]:
        tally.add(n, s)
    assert tally.as_row() == {"0": {"steps": 1, "mean_s": 0.002}, "1": {"steps": 1, "mean_s": 0.001},
                              "2": {"steps": 1, "mean_s": 0.003},
                              "512": {"steps": 2, "mean_s": pytest.approx(0.06)}}


def test_sim_prefix_cache_soft_discard_recomputes_less(multi):
    entries = _small_entries(multi, 20)
    results = {}
    for cache in (False, True):
        requests = [w.to_request() for w in make_workload(entries, WorkloadSpec("poisson", rate=10.0,
                                                                                 num_requests=30, seed=1))]
        sched = build_scheduler(COST, make_policy("infercept"),
                                SimConfig(page_size=8, num_device_pages=400, num_host_pages=400,
                                          handling=Handling.DISCARD, enable_prefix_caching=cache))
        results[cache] = run_simulation(sched, requests, check_invariants=True)
        assert sched.kv.num_free_device == sched.device_pool.num_pages
        assert all(r.finish_reason in ("length", "stop") for r in requests)
    off, on = results[False], results[True]
    assert off.cached_tokens == 0 and off.recomputed_tokens > 0
    # a roomy pool evicts nothing: every full page of a discarded context is re-linked on return
    assert on.cached_tokens > 0 and on.recomputed_tokens < off.recomputed_tokens


def test_a_batch_share_runs_in_class_1_and_results_report_each_classs_latency(tmp_path, multi, capsys):
    """``--batch-share``: that share of the arrivals (by seed) is class 1, the rest keep the
    entry's class (a JSONL trace's ``priority``); every path builds its requests in the
    item's class; results give each class's latencies, and under fcfs at load the
    interactive class's TTFT is below the batch class's and below the one-class run's."""
    items = make_workload(multi, WorkloadSpec("poisson", rate=4.0, num_requests=2000, seed=3, batch_share=0.25))
    share = sum(w.priority == 1 for w in items) / len(items)
    assert 0.22 < share < 0.28 and {w.to_request().priority for w in items} == {0, 1}
    assert [w.priority for w in items] == [w.priority for w in make_workload(
        multi, WorkloadSpec("poisson", rate=4.0, num_requests=2000, seed=3, batch_share=0.25))]
    with pytest.raises(ValueError, match="batch share"):
        WorkloadSpec("poisson", rate=1.0, num_requests=1, batch_share=1.5)
    ranked = [replace(multi[0], priority=2), multi[1]]
    (tmp_path / "t.jsonl").write_text(entries_to_jsonl(ranked))
    back = load_trace(tmp_path / "t.jsonl")
    assert [e.priority for e in back] == [2, 0]
    kept = make_workload(back, WorkloadSpec("poisson", rate=1.0, num_requests=20))
    assert {(w.entry.request_id, w.to_request().priority) for w in kept} == \
        {(back[0].request_id, 2), (back[1].request_id, 0)}
    (tmp_path / "bad.jsonl").write_text('{"id": "x", "priority": 1.5, "segments": [{"prompt_tokens": 3, '
                                        '"completion_tokens": 2}]}\n')
    with pytest.raises(TraceError, match="'priority' must be an integer"):
        load_trace(tmp_path / "bad.jsonl")

    rows = {}
    for share in (0.0, 0.5):
        out = tmp_path / f"share{share}"
        assert replay_cli.main(_cli_args(["--policies", "fcfs", "--rate", "4", "--duration", "120",
                                          "--batch-share", str(share), "--out", str(out), "--quiet",
                                          "--no-plots"])) == 0
        rows[share] = json.loads((out / "results.json").read_text())[0]
    assert "completed_class0" not in rows[0.0]
    mixed = rows[0.5]
    assert mixed["completed_class0"] + mixed["completed_class1"] == mixed["completed"]
    assert mixed["mean_ttft_s_class0"] < mixed["mean_ttft_s_class1"]
    assert mixed["mean_ttft_s_class0"] < rows[0.0]["mean_ttft_s"]
    assert "TTFT mean s, class 1" in capsys.readouterr().out
    # re-send mode, two replicas: each turn is a request in its conversation's class
    resend = simulate(scale_entries(multi, 0.2), COST, _config(mode="resend", replicas=2, batch_share=0.5,
                                                               prefix_cache=(True,)), progress=False)
    write_outputs(resend, tmp_path / "resend", plots=False)
    [row] = [r for r in json.loads((tmp_path / "resend" / "results.json").read_text()) if r["policy"] == "fcfs"]
    assert row["completed_class0"] > 0 and row["completed_class1"] > 0
