"""The simulator's prefix cache across requests: page names, re-send mode,
Mooncake traces and their cache bounds, simulated replicas and routers (CPU, no JAX)."""

import json

import pytest

from jaxserve.replay.cluster import Conversation, Router, run_resend
from jaxserve.replay.experiment import ReplayConfig, simulate
from jaxserve.replay.mooncake import cache_bounds, to_jsonl
from jaxserve.replay.page_keys import PageNamer
from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation
from jaxserve.replay.trace import TraceEntry, TraceError, load_trace
from jaxserve.replay.workload import WorkloadItem, WorkloadSpec, make_workload
from jaxserve.profiles import LLAMA3_8B_H100, load_profile
from scheduler import BUILTIN_PROFILES, Segment, make_policy, make_predictor

COST = BUILTIN_PROFILES["gptj-6b-a100-40g"]


def scheduler(cache: bool, policy: str = "infercept", **sim):
    return build_scheduler(COST, make_policy(policy, make_predictor("oracle")),
                           SimConfig(enable_prefix_caching=cache, **sim))


def entry(rid, prompt, segments, arrival=None, block_ids=None):
    """segments: [(completion, api_s, returned)], the last one (completion, None, 0)."""
    segs = tuple(Segment(c, "qa" if t is not None else None, t, n) for c, t, n in segments)
    return TraceEntry(rid, prompt, segs, arrival, "qa", block_ids=block_ids)


# ---------------------------------------------------------------- page names
def test_block_names_share_exactly_the_common_chain():
    namer = PageNamer(16)
    a = namer.blocks([1, 2, 3], 1200, 1300)          # 75 input pages (the last block partial), 81 in all
    b = namer.blocks([1, 2, 9], 1100, 1100)
    c = namer.blocks([5, 2, 3], 1100, 1100)          # block 2 after another prefix: another block
    assert len(a) == 1300 // 16 and len(b) == 1100 // 16
    assert a[:64] == b[:64] and a[64] != b[64]
    assert not set(a) & set(c)
    assert len(set(a)) == len(a)                      # generated pages are fresh
    with pytest.raises(ValueError, match="divide"):
        PageNamer(24)


def test_conversation_segments_list_one_set_of_names():
    e = entry("c", 100, [(20, 1.0, 10), (30, None, 0)])
    conv = Conversation(WorkloadItem("x", 0.0, e))
    first, second = conv.next_request(0.0), conv.next_request(5.0)
    assert (first.prompt_len, first.max_tokens) == (100, 20)
    assert (second.prompt_len, second.max_tokens) == (130, 30)
    assert conv.total_tokens == 160 and conv.index == 2 == conv.num_segments


# ---------------------------------------------------------------- re-send mode
def test_resend_refuses_a_conversation_larger_than_a_replica_pool():
    """Its last turn re-sends the whole conversation, which no replica could hold."""
    fits = WorkloadItem("fits", 0.0, entry("a", 100, [(20, 1.0, 10), (30, None, 0)]))
    big = WorkloadItem("big", 0.5, entry("b", 100, [(20, 1.0, 500), (30, None, 0)]))
    small = [scheduler(True, num_device_pages=20), scheduler(True, num_device_pages=40)]
    run_resend(small, [fits])
    with pytest.raises(ValueError, match="'big' needs 41 KV pages .* only 20"):
        run_resend(small, [fits, big])


def test_resend_cache_cuts_recomputed_tokens_and_ttft(multi_workload):
    results = {}
    for cache in (False, True):
        results[cache] = run_resend([scheduler(cache, num_device_pages=1500)], multi_workload)
    off, on = results[False], results[True]
    assert len(off.requests) == len(on.requests) == sum(len(w.entry.segments) for w in multi_workload)
    assert all(r.finish_reason == "length" for r in on.requests)
    assert sum(r.num_cached_tokens for r in off.requests) == 0
    cached = sum(r.num_cached_tokens for r in on.requests)
    assert cached > 0 and on.follow_up_hits > 0.5 * on.follow_ups
    assert off.recomputed_tokens > 0
    assert on.recomputed_tokens < 0.2 * off.recomputed_tokens

    def mean_ttft(res):
        return sum(r.first_token_time - r.arrival_time for r in res.requests) / len(res.requests)
    assert mean_ttft(on) < mean_ttft(off)


@pytest.fixture(scope="module")
def multi_workload():
    return make_workload(load_trace(), WorkloadSpec("poisson", rate=3.0, num_requests=40, seed=1))


def test_one_replica_resend_loop_matches_the_core_loop():
    """Single-segment conversations: re-send on one replica is run_simulation, step for step."""
    entries = [entry(f"e{i}", 50 + 37 * i, [(5 + i % 7, None, 0)]) for i in range(12)]
    workload = make_workload(entries, WorkloadSpec("poisson", rate=40.0, num_requests=30, seed=0))
    a = run_resend([scheduler(True)], workload)
    reqs = [w.to_request() for w in workload]
    b = run_simulation(scheduler(True), reqs)
    assert a.num_steps == b.num_steps
    times = {r.request_id.rpartition("/")[0]: (r.first_token_time, r.finish_time) for r in a.requests}
    assert times == {r.request_id: (r.first_token_time, r.finish_time) for r in b.requests}


def test_replay_rows_report_token_totals(multi_workload):
    entries = load_trace()
    config = ReplayConfig(policies=["infercept"], rates=[3.0], num_requests=20, mode="resend",
                          prefix_cache=(False, True))
    rows = [r.row for r in simulate(entries, COST, config, progress=False)]
    assert [r["prefix_cache"] for r in rows] == [False, True]
    for r in rows:
        assert r["prompt_tokens"] > 0 and r["recomputed_tokens"] >= 0
    assert rows[0]["cached_prompt_tokens"] == 0 < rows[1]["cached_prompt_tokens"] <= rows[1]["prompt_tokens"]
    assert rows[1]["recomputed_tokens"] < rows[0]["recomputed_tokens"]
    with pytest.raises(ValueError, match="re-send"):
        ReplayConfig(policies=["fcfs"], rates=[1.0], num_requests=1, replicas=2)
    with pytest.raises(ValueError, match="router"):
        ReplayConfig(policies=["fcfs"], rates=[1.0], num_requests=1, mode="resend", routers=("random",))


# ---------------------------------------------------------------- replicas
def test_affinity_sends_a_follow_up_to_the_replica_holding_its_prefix():
    # Ten two-turn conversations, the API call long enough that all first turns are done first.
    entries = [entry(f"c{i}", 300 + 16 * i, [(8, 2.0, 5), (4, None, 0)]) for i in range(10)]
    workload = [WorkloadItem(f"w{i}", 0.05 * i, e) for i, e in enumerate(entries)]
    rates = {}
    for router in ("round_robin", "affinity"):
        res = run_resend([scheduler(True) for _ in range(4)], workload, router, check_invariants=True)
        assert res.follow_ups == 10 and all(n > 0 for n in res.requests_by_replica)
        rates[router] = (res.affinity_hit_rate, res.follow_ups_same_replica)
    assert rates["affinity"] == (1.0, 10)
    assert rates["round_robin"][0] < 1.0


def test_least_loaded_router_spreads_and_rotates_ties():
    router = Router("least_loaded")
    class FakeReplica:   # what the router reads of a replica
        def __init__(self, n):
            self.live = dict.fromkeys(range(n))

        load = property(lambda self: len(self.live))
    replicas = [FakeReplica(n) for n in (0, 0, 2)]
    picks = [router._least_loaded(replicas) for _ in range(4)]
    assert picks == [0, 1, 0, 0]   # ties in rotation: starting at 0, 1, 2, 0
    replicas[0].live.update(a=1, b=2, c=3)   # a replica's load is read live, every time
    assert [router._least_loaded(replicas) for _ in range(3)] == [1, 1, 1]
    assert router._least_loaded(replicas, among=[0, 2]) == 2
    with pytest.raises(ValueError, match="router"):
        Router("random")


# ---------------------------------------------------------------- Mooncake
MOONCAKE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2, 3]},
    {"timestamp": 500, "input_length": 1600, "output_length": 20, "hash_ids": [1, 2, 4, 5]},
    {"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
    {"timestamp": 2000, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
]


def test_mooncake_reader(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text(to_jsonl(MOONCAKE))
    entries = load_trace(path)
    assert [e.prompt_len for e in entries] == [1100, 1600, 600, 1024]
    assert [e.arrival_time for e in entries] == [0.0, 0.5, 1.5, 2.0]
    assert entries[1].block_ids == (1, 2, 4, 5) and entries[1].segments[0].num_tokens == 20
    assert not entries[0].segments[0].has_api_call


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]', "line 2: not valid JSON"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "line 2: missing field"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "line 2: field 'timestamp'"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "line 2: field 'input_length'"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "line 2: 'hash_ids' has 1"),
    ('{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": ["a"]}', "line 2: field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1], "x": 1}', "line 2: unknown"),
])
def test_mooncake_reader_names_file_and_line_of_bad_input(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(MOONCAKE[0]) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message) as e:
        load_trace(path)
    assert str(path) in str(e.value)


def test_cache_bounds_on_a_hand_made_trace(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text(to_jsonl(MOONCAKE))
    entries = load_trace(path)
    # Infinite: request 2 reuses blocks 1,2 (1024 tokens); request 4 reuses 1,2 (all its 1024).
    big = cache_bounds(entries, 100 * 512)
    assert (big.input_tokens, big.infinite_tokens, big.lru_tokens) == (4324, 2048, 2048)
    # LRU of 4 blocks: request 2 hits 1,2 and leaves [1,2,4,5]; request 3 leaves [4,5,7,8],
    # so request 4 finds nothing.
    small = cache_bounds(entries, 4 * 512)
    assert small.lru_tokens == 1024 and small.infinite_tokens == 2048
    assert small.lru_share <= small.infinite_share
    assert cache_bounds(entries, 0).lru_tokens == 0


def test_mooncake_replay_shares_prefixes_and_stays_under_the_bound(tmp_path):
    records = []
    for conv in range(6):            # six conversations of three turns, each turn re-using the last
        ids = [1000 * conv + b for b in range(4)]
        for turn in range(3):
            records.append({"timestamp": 4000 * turn + 300 * conv, "input_length": len(ids) * 512 - 100,
                            "output_length": 16, "hash_ids": list(ids)})
            ids = ids + [1000 * conv + 100 + 10 * turn + b for b in range(2)]
    path = tmp_path / "mc.jsonl"
    path.write_text(to_jsonl(sorted(records, key=lambda r: r["timestamp"])))
    entries = load_trace(path)
    config = ReplayConfig(policies=["fcfs"], rates=[None], arrival="trace", prefix_cache=(False, True),
                          sim=SimConfig(num_device_pages=4096, check_invariants=True))
    off, on = (r.row for r in simulate(entries, COST, config, progress=False))
    assert off["cached_prompt_tokens"] == 0
    assert on["cached_prompt_tokens"] > 0
    assert on["recomputed_tokens"] < off["recomputed_tokens"]
    assert 0 < on["cached_share"] <= on["bound_infinite_share"] + 1e-9
    assert on["bound_lru_share"] <= on["bound_infinite_share"]


def test_llama3_profile_is_built_in():
    cost = load_profile("llama3-8b-h100")
    assert cost is LLAMA3_8B_H100
    assert cost.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert 400_000 < cost.device_kv_bytes // cost.bytes_per_token < 500_000
    assert cost.meta["max_model_len"] == 131072
    assert 0.005 < cost.t_fwd(1) < 0.008            # a decode step of an 8B model: ~6 ms of weights
    with pytest.raises(ValueError, match="llama3-8b-h100"):
        load_profile("no-such-profile")


# ---------------------------------------------------------------- CLI
def _cli(argv):
    import argparse

    from jaxserve.replay import cli as replay_cli

    parser = argparse.ArgumentParser()
    replay_cli.add_arguments(parser)
    return replay_cli.main(parser.parse_args(argv))


def test_cli_resend_on_replicas_writes_rows_per_cache_and_router(tmp_path):
    out = tmp_path / "out"
    rc = _cli(["--mode", "resend", "--sim-cache", "both", "--replicas", "2", "--routers", "round_robin,affinity",
               "--policies", "fcfs", "--rate", "4", "--num-requests", "20", "--out", str(out), "--quiet", "--no-plots"])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())
    assert [(r["prefix_cache"], r["router"]) for r in rows] == [
        (False, "round_robin"), (False, "affinity"), (True, "round_robin"), (True, "affinity")]
    for r in rows:
        assert r["mode"] == "resend" and r["replicas"] == 2 and sum(r["requests_by_replica"]) == r["requests"]
        assert r["prompt_tokens"] > 0 and r["recomputed_tokens"] >= 0
    assert rows[3]["affinity_hit_rate"] >= rows[2]["affinity_hit_rate"]
    assert "| cache" in (out / "summary.md").read_text()


def test_cli_mooncake_with_the_llama3_profile(tmp_path, capsys):
    trace = tmp_path / "mc.jsonl"
    trace.write_text(to_jsonl(MOONCAKE))
    out = tmp_path / "out"
    assert _cli([str(trace), "--arrival", "trace", "--profile", "llama3-8b-h100", "--sim-cache", "on",
                 "--policies", "fcfs", "--out", str(out), "--quiet", "--no-plots"]) == 0
    (row,) = json.loads((out / "results.json").read_text())
    # request 2 re-links blocks 1, 2; request 4 all but its last page (one token is always computed)
    assert row["profile"] == "llama3-8b-h100" and row["cached_prompt_tokens"] == 1024 + 1008
    assert row["bound_infinite_share"] == pytest.approx(2048 / 4324)
    assert _cli([str(trace), "--arrival", "trace", "--token-scale", "0.5", "--out", str(out), "--quiet"]) == 2
    assert _cli(["--mode", "resend", "--replicas", "2", "--model", "demo", "--out", str(out), "--quiet"]) == 2
    assert "--replicas: only the simulator reads it, not the real engine; drop it or --model" in capsys.readouterr().err
