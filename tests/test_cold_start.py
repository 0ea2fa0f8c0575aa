"""Cold start and CPU decode: page tables sized by the batch's longest context, lazy
step compilation, a KV pool sized from the engine's limits (CPU) or its memory share
(accelerators), one-sequence decode in 2-token steps on CPU, and the greedy sampler's
fast path."""

from __future__ import annotations

import dataclasses
import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models import ModelConfig
from jaxserve.executor.model import (CPU_KV_BUDGET_BYTES, GIB, ModelExecutorConfig, kv_budget_bytes, kv_pool_pages,
                                     memory_share_problem, min_token_bucket_for)
from jaxserve.sampling import SamplingArrays, sample

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_page_bucket_follows_context_in_powers_of_two():
    cfg = ModelExecutorConfig(page_size=16, num_pages=64, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1000,
                       kv_dtype=jnp.float32, attention_impl="reference")
    assert cfg.pages_per_seq == 63
    assert [cfg.page_bucket(n) for n in (1, 4, 5, 8, 9, 33, 63)] == [4, 4, 8, 8, 16, 63, 63]


def test_short_contexts_use_narrow_page_tables_and_match_padded_tables():
    """A short request's steps compile narrow page tables only, once each, and give
    exactly the tokens of the same engine with every table padded to max_model_len."""
    llm = LLM("demo", page_size=8, num_pages=80, max_model_len=512, max_num_batched_tokens=32)
    runner = llm.engine.executor
    assert runner._step._cache_size() == 1            # warm-up: the first decode shape only
    prompts = [list(range(3, 23)), list(range(40, 45))]
    params = SamplingParams(max_tokens=14, **GREEDY)
    bucketed = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    widths = {w for _, w, _ in runner.step_shapes}
    assert max(widths) <= 8 < runner.config.pages_per_seq   # 34 tokens -> 5 pages -> width 8 of 64
    assert runner._step._cache_size() == len(runner.step_shapes)
    runner.config = dataclasses.replace(runner.config, min_page_bucket=runner.config.pages_per_seq)
    padded = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert {w for _, w, _ in runner.step_shapes} - widths == {runner.config.pages_per_seq}
    assert bucketed == padded


def test_cpu_decode_of_one_sequence_runs_two_token_steps_with_the_tokens_of_eight():
    """On CPU a lone request decodes in 2-token steps (not 8, not 1), and pads nothing
    that changes its tokens: the same engine at a smallest bucket of 8 gives the same ones."""
    assert (min_token_bucket_for("cpu"), min_token_bucket_for("gpu"), min_token_bucket_for("tpu")) == (2, 8, 8)
    llm = LLM("demo", page_size=8, num_pages=64, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)
    runner = llm.engine.executor
    assert runner.config.token_buckets[0] == 2
    prompts, params = [list(range(3, 21))], SamplingParams(max_tokens=12, **GREEDY)
    two = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert {t for t, _, _ in runner.step_shapes} == {32, 2}   # the prefill (18 tokens), then 2-token decodes
    runner.config = dataclasses.replace(runner.config, min_token_bucket=8)
    eight = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert 8 in {t for t, _, _ in runner.step_shapes}
    assert two == eight and len(two[0]) == 12


def test_cpu_kv_pool_is_sized_by_the_engine_limits():
    shape = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf(shape)
    per_page = 16 * 2 * 2 * 2 * 16 * 4   # page_size * (K, V) * layers * kv heads * head_dim * f32 bytes
    assert kv_pool_pages(cfg, 16, jnp.float32, max_model_len=256, max_num_seqs=4) == 4 * 16
    assert kv_pool_pages(cfg, 16, jnp.float32, max_model_len=8192, max_num_seqs=256) == CPU_KV_BUDGET_BYTES // per_page
    deep = ModelConfig.from_hf({**shape, "num_hidden_layers": 4096})   # one sequence alone exceeds the cap
    assert kv_pool_pages(deep, 16, jnp.float32, max_model_len=8192, max_num_seqs=256) == 8192 // 16


def test_an_engine_takes_its_share_of_accelerator_memory_and_a_second_one_its_own():
    """The accounting of ``gpu_memory_utilization`` on a device that reports its memory
    (numbers as JAX reports an H200's: this machine's CPU reports none). Found on an H200:
    a second engine in one process was sized from what the first left, one KV page, and
    failed at its first request."""
    limit, weights = 100 * GIB, 3 * GIB
    # One engine at the default: its share less its weights, the old sizing exactly.
    assert memory_share_problem(limit, 0, 0.9, "gpu:0") is None
    assert kv_budget_bytes(limit, 0, weights, 0.9) == int(0.9 * limit) - weights
    # Two engines at 0.45 each: the second's pool is as large as the first's.
    first = kv_budget_bytes(limit, 0, weights, 0.45)
    held = weights + first
    assert memory_share_problem(limit, held, 0.45, "gpu:0") is None
    assert kv_budget_bytes(limit, held, held + weights, 0.45) == first
    # A second engine asking for the default share is refused before it loads anything.
    assert re.match(r"gpu_memory_utilization=0.9 .* 90.00 GiB, but only 55.00 GiB is free",
                    memory_share_problem(limit, held, 0.9, "gpu:0"))
    # Weights larger than the share leave a negative budget (kv_pool_pages: the error).
    assert kv_budget_bytes(limit, 0, weights, 0.02) < 0


def test_engine_sizes_its_pool_from_its_memory_share_and_refuses_a_share_that_is_taken(monkeypatch):
    """The engine's path through that accounting, with the device's memory report (the one
    thing this CPU cannot give) standing in: 64 MiB of limit, of which ``held`` bytes are
    another engine's. The pool is this engine's half less its weights; asking for more
    than is free fails before any weights load, naming the setting."""
    import jaxserve.executor.model as model_module
    from jaxserve import LLMEngine
    limit, held = 64 * 1024**2, 8 * 1024**2
    monkeypatch.setattr(model_module, "_memory_stats",
                        lambda devices: [(limit, held + sum(a.nbytes for a in jax.live_arrays()) - baseline)])
    gc.collect()   # (as the engine does before it reads the report: garbage of earlier tests would count)
    baseline = sum(a.nbytes for a in jax.live_arrays())
    engine = LLMEngine("demo", max_num_batched_tokens=16, max_num_seqs=2, max_model_len=128, warmup=False,
                       gpu_memory_utilization=0.5)
    try:
        weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.executor.params))
        per_page = engine.config.page_size * engine.executor.kv_bytes_per_token
        assert engine.scheduler.device_pool.num_pages == (limit // 2 - weights) // per_page
        held = limit // 2 + 1
        with pytest.raises(ValueError, match=r"^gpu_memory_utilization=0.5 .* is held already"):
            LLMEngine("demo", gpu_memory_utilization=0.5, warmup=False)
        LLMEngine("demo", gpu_memory_utilization=0.5, num_pages=4, warmup=False).shutdown()   # a set pool: no check
        held = 0   # a share the weights fill: a clear error once they are loaded, not a one-page pool
        with pytest.raises(ValueError, match=r"^gpu_memory_utilization=0.001 .* the weights take .* less than one KV"):
            LLMEngine("demo", gpu_memory_utilization=0.001, warmup=False)
    finally:
        engine.shutdown()


def test_greedy_rows_skip_random_sampling_but_mixed_batches_still_sample():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 50)), jnp.float32)

    def arrays(temps):
        n = len(temps)
        return SamplingArrays(temperature=jnp.asarray(temps, jnp.float32), top_k=jnp.zeros(n, jnp.int32),
                              top_p=jnp.ones(n, jnp.float32), min_p=jnp.zeros(n, jnp.float32),
                              seed=jnp.arange(n, dtype=jnp.uint32),
                              step=jnp.zeros(n, jnp.int32))

    argmax = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(np.asarray(sample(logits, arrays([0, 0, 0, 0]))), argmax)
    draws = {tuple(np.asarray(sample(logits * 0, dataclasses.replace(arrays([0, 5.0, 0, 5.0]),
                                                                    seed=jnp.full(4, s, jnp.uint32)))))
             for s in range(6)}
    assert all(d[0] == 0 and d[2] == 0 for d in draws)      # greedy rows of flat logits: token 0
    assert len({(d[1], d[3]) for d in draws}) > 1            # random rows vary with the seed
