"""Tensor parallelism on one host: tokens identical to transformers and logits
within 1e-4 of TP 1 at TP 1, 2, 4 and 8 (llama, mistral, qwen2, qwen3; 8 query heads,
2 KV heads, so TP 4 and 8 repeat KV heads), with a tight pool and with Swap
forced on sharded pages; bad TP degrees are refused before weights load.

The runs need 8 devices, which XLA fixes when JAX starts, so they happen once
in a subprocess (``tests/tp_cases.py``, 8 forced host devices) and the tests
here check what it recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve import LLM, EngineConfig

HERE = Path(__file__).resolve().parent
KINDS = ("llama", "mistral", "qwen2", "qwen3")
TP_DEGREES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "runs.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "tp_cases.py"), str(out)], env=env, cwd=HERE.parent,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_match_transformers_at_every_tp_degree(kind, tp_runs):
    want = tp_runs["references"][kind]
    for tp in TP_DEGREES:
        run = tp_runs["runs"][f"{kind}-tp{tp}"]
        assert run["tokens"] == want, f"{kind} TP {tp}"
        assert run["kv_devices"] == tp
        # 2 KV heads: TP 1 holds both, TP 2 one each, TP 4 and 8 one repeated head each.
        assert run["kv_shard_heads"] == (2 if tp == 1 else 1)
        assert run["free_pages"] == run["num_pages"]


@pytest.mark.parametrize("kind", KINDS)
def test_logits_within_1e_4_of_tp1_at_every_step(kind, tp_runs):
    base = tp_runs["runs"][f"{kind}-tp1"]["logits"]
    assert len(base) >= NEW_STEPS
    for tp in TP_DEGREES[1:]:
        steps = tp_runs["runs"][f"{kind}-tp{tp}"]["logits"]
        assert len(steps) == len(base)
        for ours, ref in zip(steps, base):
            np.testing.assert_allclose(np.array(ours), np.array(ref), atol=1e-4, rtol=0, err_msg=f"TP {tp}")


NEW_STEPS = 12    # tp_cases.NEW_TOKENS: at least one step per generated token


def test_logprobs_within_1e_4_of_tp1_with_vocabulary_sharded_logits(tp_runs):
    """The log-softmax and top-k over logits whose vocabulary is split across devices
    (gathered first), at every TP degree and under preemption."""
    base = tp_runs["runs"]["llama-tp1"]["logprobs"]
    assert len(base) == NEW_STEPS and all(len(top) == 3 for _, _, top in base)
    for name in [f"llama-tp{tp}" for tp in TP_DEGREES[1:]] + ["llama-tp4-tight"]:
        got = tp_runs["runs"][name]["logprobs"]
        assert [r[0] for r in got] == [r[0] for r in base], name
        assert [[t for t, _ in r[2]] for r in got] == [[t for t, _ in r[2]] for r in base], name
        np.testing.assert_allclose([r[1] for r in got], [r[1] for r in base], atol=1e-4, rtol=0, err_msg=name)
        np.testing.assert_allclose([[v for _, v in r[2]] for r in got], [[v for _, v in r[2]] for r in base],
                                   atol=1e-4, rtol=0, err_msg=name)


def test_tight_pool_preempts_and_stays_exact(tp_runs):
    run = tp_runs["runs"]["llama-tp4-tight"]
    assert run["preemptions"] > 0
    assert run["tokens"] == tp_runs["references"]["llama"]
    assert run["free_pages"] == run["num_pages"]


def test_forced_swap_moves_sharded_pages_and_changes_no_token(tp_runs):
    preserved = tp_runs["runs"]["qwen2-tp1-preserve"]
    assert preserved["swapped_out"] == 0
    for tp in (2, 8):
        run = tp_runs["runs"][f"qwen2-tp{tp}-swap"]
        assert run["swapped_out"] > 0 and run["swapped_in"] > 0
        assert run["tokens"] == preserved["tokens"], f"TP {tp}"
        assert run["host_memory_kind"] in ("pinned_host", "unpinned_host")
        assert "'model'" in run["host_chunk_spec"]   # each device keeps its own KV heads' host copy


def test_a_length_probe_saved_on_one_device_serves_above_the_kv_head_count(tp_runs):
    """The probe's model fingerprint is the checkpoint's, not the shards' view (TP 4 over 2 KV
    heads repeats each: the probe was refused as made for another model)."""
    assert tp_runs["probe_tp4"] == "accepted"


def test_tp_degree_that_cannot_shard_is_refused_before_weights_load(tmp_path, hf_checkpoints):
    # A checkpoint with no weight files: a check after loading would fail on the missing files instead.
    config = (hf_checkpoints["llama"][1] / "config.json").read_text()
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the model's num_attention_heads=4"):
        LLM(str(tmp_path), tensor_parallel_size=3, warmup=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 exceeds the 1 available devices"):
        LLM(str(tmp_path), tensor_parallel_size=2, warmup=False)


@pytest.mark.parametrize("settings, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(num_processes=2), "coordinator_address"),
    (dict(num_processes=2, process_id=2, coordinator_address="h:1"), "process_id must be an integer in"),
    (dict(coordinator_address="nohostport"), "coordinator_address must be host:port"),
    (dict(coordinator_address="127.0.0.1:abc"), "coordinator_address must be host:port"),
    (dict(coordinator_address="127.0.0.1:99999"), "coordinator_address must be host:port"),
    (dict(coordinator_address="127.0.0.1:"), "coordinator_address must be host:port"),
    (dict(coordinator_address=":8476"), "coordinator_address must be host:port"),
])
def test_scale_out_settings_are_validated(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)
