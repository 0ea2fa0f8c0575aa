"""Shared fixtures: tiny random Hugging Face checkpoints written with ``save_pretrained``."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# XLA compiles hundreds of small step programs in this suite, and LLVM's optimization of their
# machine code is most of each compile: at optimization level 0 the suite ran in 13 min 21 s from
# a cold compilation cache on 2 cores, against 17 min 23 s at XLA's default (docs/benchmarks.md,
# "The whole suite in two workers"). The programs (HLO) are the same, only their machine code is
# less optimized: every parity and exactness test passes either way, and timed goals are measured
# by tools/, never here. Processes the tests start inherit it. JAXSERVE_TEST_XLA_OPTIMIZE=1 keeps
# XLA's default: set it when running tests on a GPU (tools/gpu_validate.py's device tests do), where
# the level reaches the kernels too.
# A level already in XLA_FLAGS is left as it is.
if (os.environ.get("JAXSERVE_TEST_XLA_OPTIMIZE") != "1"
        and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# The test modules that take longest with a cold compilation cache (CI's case; cold run of
# 2026-11-26, docs/benchmarks.md "The whole suite in two workers"), longest first. The test
# command runs modules whole in two workers (``-n 2 --dist loadfile``) in collection order, so
# these go first and the workers finish together instead of one running the last long module alone.
SLOWEST_MODULES = ("test_real_model.py", "test_engine_parity.py", "test_api_calls.py", "test_tensor_parallel.py",
                   "test_server.py", "test_replicas.py", "test_gpu_validate.py", "test_trace_summary.py",
                   "test_multihost.py", "test_prefix_cache_engine.py", "test_structured.py", "test_policies_engine.py",
                   "test_hardening_server.py")


def pytest_collection_modifyitems(items: list) -> None:
    """Slowest modules first (``SLOWEST_MODULES``); every other module, and the order
    within a module, as collected."""
    rank = {name: i for i, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.25, bos_token_id=0, eos_token_id=None, pad_token_id=0)


def build_hf_model(kind: str, **shape):
    """A tiny random transformers model of family ``kind`` (llama, mistral, qwen2, qwen3);
    ``shape`` overrides entries of ``TINY`` (e.g. more attention heads).

    Weights use a wide init so greedy decoding has clear top-1 margins; Qwen2's
    q/k/v biases and Qwen3's per-head q/k norm weights are randomised so they
    matter. Qwen3's heads are wider than ``hidden_size / heads``, as in the real
    models (head_dim 128 at hidden 1024, 16 heads).
    """
    import torch
    import transformers as tf

    torch.manual_seed({"llama": 0, "mistral": 1, "qwen2": 2, "qwen3": 3}[kind])
    tiny = {**TINY, **shape}
    if kind == "llama":
        cfg = tf.LlamaConfig(**tiny, tie_word_embeddings=True,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "mistral":
        cfg = tf.MistralConfig(**tiny, tie_word_embeddings=False, sliding_window=None,
                               head_dim=tiny.get("head_dim", 16))
        model = tf.MistralForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**tiny, tie_word_embeddings=False, use_sliding_window=False)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**tiny, tie_word_embeddings=True, use_sliding_window=False,
                             head_dim=tiny.get("head_dim", 32))
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """``{kind: (torch model, checkpoint dir)}`` for llama, mistral, qwen2 and qwen3."""
    out = {}
    for kind in ("llama", "mistral", "qwen2", "qwen3"):
        model = build_hf_model(kind)
        path = tmp_path_factory.mktemp(f"hf-{kind}")
        model.save_pretrained(path)
        out[kind] = (model, path)
    return out


@pytest.fixture(scope="session")
def tool_checkpoint(tmp_path_factory):
    """``(checkpoint dir, conversations)``: a tiny model trained to call tools (see conftest_server).
    Trained once per test run (~45 s): pytest-xdist's workers share the run's base temporary
    directory, and the first worker to need it trains it there while the others wait on a lock."""
    from filelock import FileLock

    from conftest_server import tool_conversations, train_tool_checkpoint
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "tool-model"
    with FileLock(f"{path}.lock"):
        if not (path / "model.safetensors").is_file():
            train_tool_checkpoint(path)
    return path, tool_conversations()
