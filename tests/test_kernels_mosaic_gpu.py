"""The Mosaic GPU attention kernel on CPU: JAX's Mosaic GPU interpreter and CUDA lowering.

The interpreter runs the kernel's TMA copies, barriers, ring slots, masks,
online softmax and split merge (raising on out-of-bounds reads, NaN-filling
fresh shared memory, optionally detecting races); its two matmuls run as
plain dots there (see ``pallas_mosaic_gpu._interpret_matmul``), so the
``wgmma`` calls are covered by lowering the kernel for CUDA. Batches are the
ones ``test_kernels`` uses (ragged decode + prefill rows, shuffled pages,
garbage in padding), in bfloat16 with ``head_dim`` 64, the smallest the
kernel tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

import kernels
from kernels import pallas_mosaic_gpu
from test_kernels import CASES, MIXED, VALID_ARGS, assert_close, jitted, make_batch

IMPL = "pallas_mosaic_gpu"
HEAD_DIM = 64


def mosaic_batch(name: str, seed: int = 0, head_dim: int = HEAD_DIM):
    """``test_kernels.CASES[name]`` (same lengths, heads, options) in bfloat16."""
    case = CASES[name]
    batch = make_batch(seed, **MIXED, num_q_heads=case["num_q_heads"], num_kv_heads=case["num_kv_heads"],
                       head_dim=head_dim, dtype=jnp.bfloat16)
    return batch, case["options"]


@pytest.mark.parametrize("name", list(CASES))
def test_mosaic_gpu_matches_reference(name):
    batch, options = mosaic_batch(name)
    expected = jitted("reference", **options)(*batch.args)
    out = jitted(IMPL, **options)(*batch.args)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert_close(out, expected, jnp.bfloat16, sum(batch.q_lens))
    np.testing.assert_array_equal(np.asarray(out, np.float32)[sum(batch.q_lens):], 0.0)


# Contexts of up to 19 pages: 5 steps of a 64-token tile, so the ring of
# shared-memory slots wraps around (and each of 2 splits still takes several).
LONG = dict(q_lens=[1, 16, 1, 3], kv_lens=[300, 200, 129, 64], num_tokens=32, max_num_seqs=6,
            pages_per_seq=19)


@pytest.mark.parametrize("pages_per_step,num_stages,num_kv_splits,window",
                         [(4, 2, 1, None), (4, 3, 2, 100), (8, 2, 1, None)])
def test_mosaic_gpu_pipeline_ring_and_kv_splits(pages_per_step, num_stages, num_kv_splits, window):
    """Long contexts: the K/V ring wraps, multi-page tiles, the split-KV merge; no data races."""
    batch = make_batch(2, **LONG, num_q_heads=8, num_kv_heads=2, head_dim=HEAD_DIM, dtype=jnp.bfloat16)
    options = dict(sliding_window=window, soft_cap=2.0)
    expected = jitted("reference", **options)(*batch.args)
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    fn = jax.jit(functools.partial(
        pallas_mosaic_gpu.ragged_paged_attention, sm_scale=HEAD_DIM ** -0.5, **options,
        interpret=InterpretGPUParams(detect_races=True), pages_per_step=pages_per_step,
        num_stages=num_stages, num_kv_splits=num_kv_splits))
    out = jax.block_until_ready(fn(*batch.args))
    assert not interpret_pallas_call.get_races().races_found
    assert_close(out, expected, jnp.bfloat16, sum(batch.q_lens))


ON_HOPPER = kernels.default_impl(jnp.bfloat16) == IMPL


@pytest.mark.skipif(not ON_HOPPER, reason="compiling a Mosaic GPU kernel needs a Hopper GPU (CPU: see the "
                                          "interpreter and lowering tests in this file)")
@pytest.mark.parametrize("name", list(CASES) + ["long"])
def test_mosaic_gpu_compiled_matches_reference(name):
    """On an H100/H200: the same cases compiled for real (wgmma, TMA, default splits)."""
    if name == "long":
        batch = make_batch(2, **LONG, num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
        options = dict(sliding_window=100, soft_cap=2.0)
    else:
        batch, options = mosaic_batch(name, head_dim=128)
    expected = jitted("reference", **options)(*batch.args)
    out = jax.jit(functools.partial(kernels.ragged_paged_attention, impl=IMPL, **options))(*batch.args)
    assert_close(out, expected, jnp.bfloat16, sum(batch.q_lens))
    np.testing.assert_array_equal(np.asarray(out, np.float32)[sum(batch.q_lens):], 0.0)


def test_mosaic_gpu_empty_batch_gives_zeros():
    batch = make_batch(4, [], [], num_tokens=32, max_num_seqs=8, pages_per_seq=4,
                       num_q_heads=2, num_kv_heads=2, head_dim=HEAD_DIM, dtype=jnp.bfloat16)
    out = jitted(IMPL)(*batch.args)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)


@pytest.mark.parametrize("head_dim,page_size", [(64, 8), (128, 16), (128, 128), (256, 32)])
def test_mosaic_gpu_lowers_for_cuda(head_dim, page_size):
    """Pallas -> Mosaic GPU lowering (wgmma, TMA, layouts) succeeds without a GPU."""
    num_pages, max_num_seqs, pages_per_seq = 12, 4, 3
    q = jnp.zeros((16, 8, head_dim), jnp.bfloat16)
    pages = jnp.zeros((num_pages, page_size, 2, head_dim), jnp.bfloat16)
    meta = (jnp.zeros((max_num_seqs, pages_per_seq), jnp.int32), jnp.ones((max_num_seqs,), jnp.int32),
            jnp.zeros((max_num_seqs + 1,), jnp.int32), jnp.ones((1,), jnp.int32))
    fn = jax.jit(functools.partial(kernels.ragged_paged_attention, impl=IMPL,
                                   sliding_window=32, soft_cap=30.0))
    text = fn.trace(q, pages, pages, *meta).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


BAD_MOSAIC_CALLS = {
    "float32": (lambda a: a, "needs a bfloat16 or float16 cache"),
    "head_dim 16": (lambda a: tuple(x.astype(jnp.bfloat16) if i < 3 else x for i, x in enumerate(a)),
                    "head_dim a multiple of 64"),
    "page_size 24": (lambda a: (jnp.zeros((4, 4, 64), jnp.bfloat16), jnp.zeros((5, 24, 2, 64), jnp.bfloat16),
                                jnp.zeros((5, 24, 2, 64), jnp.bfloat16)) + a[3:], "page_size in"),
    "group 128": (lambda a: (jnp.zeros((4, 128, 64), jnp.bfloat16), jnp.zeros((5, 16, 1, 64), jnp.bfloat16),
                             jnp.zeros((5, 16, 1, 64), jnp.bfloat16)) + a[3:], "packs a GQA group"),
}


@pytest.mark.parametrize("name", list(BAD_MOSAIC_CALLS))
def test_mosaic_gpu_validation_errors(name):
    mutate, message = BAD_MOSAIC_CALLS[name]
    with pytest.raises(ValueError, match=message):
        jax.jit(functools.partial(kernels.ragged_paged_attention, impl=IMPL))(*mutate(VALID_ARGS))


def test_mosaic_gpu_rejects_untileable_kv_tile_and_smem():
    batch, options = mosaic_batch("mha_f32")
    call = functools.partial(pallas_mosaic_gpu.ragged_paged_attention, sm_scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        call(*batch.args, pages_per_step=3)
    big = (jnp.zeros((4, 2, 256), jnp.bfloat16), jnp.zeros((5, 16, 2, 256), jnp.bfloat16),
           jnp.zeros((5, 16, 2, 256), jnp.bfloat16)) + VALID_ARGS[3:]
    with pytest.raises(ValueError, match="shared memory"):
        call(*big, pages_per_step=16, num_stages=3)


@pytest.mark.parametrize("platform,capability,dtype,triton,want", [
    ("gpu", 9.0, "bfloat16", True, "pallas_mosaic_gpu"),
    ("gpu", 9.0, None, False, "pallas_mosaic_gpu"),
    ("gpu", 9.0, "float32", True, "pallas_gpu"),
    ("gpu", 9.0, "float32", False, "reference"),
    ("gpu", 8.0, "bfloat16", True, "pallas_gpu"),
    ("gpu", 8.6, "bfloat16", False, "reference"),
    ("gpu", 10.0, "bfloat16", True, "pallas_gpu"),
    ("tpu", None, "bfloat16", False, "pallas_tpu"),
    ("cpu", None, "float32", True, "reference"),
])
def test_backend_selection(platform, capability, dtype, triton, want):
    impl, reason = kernels.select_impl(platform, capability, dtype, triton)
    assert impl == want
    assert (reason is None) == (want != "pallas_gpu" and not (platform == "gpu" and want == "reference"))


@pytest.mark.parametrize("capability,dtype,tiling,triton,want,why", [
    (9.0, "bfloat16", (128, 16, 4), True, "pallas_mosaic_gpu", None),
    (9.0, "bfloat16", (16, 16, 2), True, "pallas_gpu", "head_dim a multiple of 64"),
    (9.0, "bfloat16", (64, 24, 2), True, "reference", "page_size in"),
    (9.0, "bfloat16", (80, 16, 2), True, "reference", "power-of-two head_dim"),
    (9.0, "bfloat16", (16, 16, 2), False, "reference", "no Pallas Triton backend"),
    (8.0, "float32", (16, 16, 2), True, "pallas_gpu", "not Hopper"),
])
def test_backend_selection_falls_back_for_shapes_a_kernel_cannot_tile(capability, dtype, tiling, triton, want, why):
    """On a GPU a model whose head_dim / page_size / GQA group a kernel cannot tile gets the
    next kernel that can (found on an H200: a head_dim-16 model failed at its first step)."""
    impl, reason = kernels.select_impl("gpu", capability, dtype, triton, tiling)
    assert impl == want
    assert (reason is None) == (why is None)
    if why:
        assert why in reason


def test_default_impl_on_cpu_with_any_dtype():
    assert kernels.default_impl(jnp.bfloat16) == "reference"
    assert kernels.triton_available() in (True, False)


def _tiny_mosaic_model(model_dir) -> dict:
    """Writes a 3-layer Llama shape to ``model_dir``; returns the engine arguments that run it
    in bfloat16 with random weights and the Mosaic GPU kernel compiled (not interpreted)."""
    import json
    shape = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=128,
                 intermediate_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=HEAD_DIM, max_position_embeddings=256, tie_word_embeddings=True)
    (model_dir / "config.json").write_text(json.dumps(shape))
    return dict(model=str(model_dir), dtype="bfloat16", load_format="dummy", page_size=16, num_pages=32,
                max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, warmup=False,
                attention_impl=IMPL, interpret=False, compilation_cache=False)


def test_engine_step_lowers_one_mosaic_kernel_for_all_layers(tmp_path):
    """Every layer calls the same jitted kernel, so a step program holds it once: on an H200
    lowering it per layer cost ~0.47 s a layer (7.5 s of a 16-layer step's 19.5 s compile)."""
    from jaxserve.engine import LLMEngine
    engine = LLMEngine(**_tiny_mosaic_model(tmp_path))
    runner = engine.executor
    inputs = runner.synthetic_inputs(runner.config.token_buckets[0])
    text = runner.lower_step(inputs, platforms=("cuda",)).as_text()
    engine.shutdown()
    assert sum("stablehlo.custom_call @mosaic_gpu" in line for line in text.splitlines()) == 1


@pytest.mark.skipif(not ON_HOPPER, reason="running a Mosaic GPU kernel compiled needs a Hopper GPU")
def test_mosaic_gpu_compiled_engine_generates(tmp_path):
    """On an H100/H200: whole engine steps (prefill and decode, inputs packed in one array)
    through the compiled kernel, without and with CUDA graphs (``cuda_graphs``), which must
    give the same tokens. The kernel's own tests call it on arrays of their own; this one
    feeds it what the engine's step program hands it (slices of the packed inputs, which
    the kernel refused while they were not 256-byte aligned, found on an H200)."""
    from jaxserve import LLM, SamplingParams
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30)]   # part of a page, one and a bit, two
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = []
    for cuda_graphs in (False, True):
        llm = LLM(**_tiny_mosaic_model(tmp_path), cuda_graphs=cuda_graphs)
        try:
            tokens.append([out.token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=params)])
        finally:
            llm.engine.shutdown()
    assert [len(t) for t in tokens[0]] == [8, 8, 8]
    assert all(0 <= t < 256 for row in tokens[0] for t in row)
    assert tokens[1] == tokens[0]
