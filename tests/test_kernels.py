"""Attention kernels and KV page writes (CPU; Pallas kernels in interpret mode).

The reference is checked against a per-sequence float64 numpy attention; each
Pallas kernel is checked against the reference on ragged batches with
shuffled page tables, decode and prefill rows mixed, and padding.
Shapes are tiny and reused so every kernel compiles only a few times.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import pallas_gpu, pallas_tpu

PAGE_SIZE = 16  # The GPU kernel needs >= 16 (tl.dot); shared by all tests.
PALLAS_IMPLS = ("pallas_gpu", "pallas_tpu")
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@dataclass
class Batch:
    """One ragged attention call plus the per-sequence lengths used to build it."""

    args: tuple[jax.Array, ...]  # (q, k_pages, v_pages, page_table, kv_lens, cu_q_lens, num_seqs)
    q_lens: list[int]
    kv_lens: list[int]


def make_batch(
    seed: int,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_tokens: int,
    max_num_seqs: int,
    pages_per_seq: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    dtype=jnp.float32,
) -> Batch:
    """Random batch: shuffled non-contiguous pages, garbage in every unused slot.

    Unused page-table columns are -1, padding rows of ``page_table``/``kv_lens``
    hold huge values and padding query rows hold large numbers, so a kernel
    that reads padding shows up as a mismatch or a NaN.
    """
    rng = np.random.default_rng(seed)
    num_live = len(q_lens)
    assert sum(q_lens) <= num_tokens and num_live <= max_num_seqs
    needed = [-(-n // PAGE_SIZE) for n in kv_lens]
    assert max(needed, default=0) <= pages_per_seq
    num_pages = sum(needed) + 5  # A few pages nobody owns.
    page_ids = rng.permutation(num_pages)
    page_table = np.full((max_num_seqs, pages_per_seq), -1, np.int32)
    page_table[num_live:] = 10**6
    start = 0
    for s, n in enumerate(needed):
        page_table[s, :n] = page_ids[start:start + n]
        start += n
    kv = np.full(max_num_seqs, 10**6, np.int32)
    kv[:num_live] = kv_lens
    cu = np.zeros(max_num_seqs + 1, np.int32)
    cu[1:num_live + 1] = np.cumsum(q_lens)
    cu[num_live + 1:] = cu[num_live]
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_pages = rng.normal(size=shape)
    v_pages = rng.normal(size=shape)
    q = rng.normal(size=(num_tokens, num_q_heads, head_dim))
    q[cu[num_live]:] = 1e4
    args = (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            jnp.asarray(page_table), jnp.asarray(kv), jnp.asarray(cu),
            jnp.asarray([num_live], jnp.int32))
    return Batch(args, list(q_lens), list(kv_lens))


def numpy_attention(batch: Batch, sliding_window=None, soft_cap=None) -> np.ndarray:
    """Dead-simple float64 attention, one sequence and one query at a time."""
    q, k_pages, v_pages, page_table = (np.asarray(x, np.float64) for x in batch.args[:4])
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k_pages.shape[2]
    out = np.zeros_like(q)
    row = 0
    for s, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        pages = page_table[s, :-(-kv_len // PAGE_SIZE)].astype(int)
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kv_len]  # [kv_len, Hkv, D]
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kv_len]
        for j in range(q_len):
            pos = kv_len - q_len + j
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_q_heads):
                logits = k[lo:pos + 1, h // group] @ q[row + j, h] / np.sqrt(head_dim)
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                p = np.exp(logits - logits.max())
                out[row + j, h] = (p / p.sum()) @ v[lo:pos + 1, h // group]
        row += q_len
    return out


@functools.lru_cache(maxsize=None)
def jitted(impl: str, **options):
    """One jitted attention function per (impl, options), shared by all tests."""
    return jax.jit(functools.partial(kernels.ragged_paged_attention, impl=impl,
                                     interpret=impl != "reference", **options))


def assert_close(actual: jax.Array, expected, dtype, num_real_rows: int) -> None:
    actual = np.asarray(actual, np.float32)
    assert np.isfinite(actual).all(), "padding or real rows hold NaN/inf"
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(actual[:num_real_rows],
                               np.asarray(expected, np.float32)[:num_real_rows],
                               rtol=tol, atol=tol)


# Decode rows, a prefill chunk over an empty cache, a chunk continuing a
# cached prefix, lengths 1, one page, a page plus one and several pages.
MIXED = dict(q_lens=[1, 16, 1, 7, 3], kv_lens=[1, 16, 17, 60, 40],
             num_tokens=32, max_num_seqs=8, pages_per_seq=4)

CASES = {
    "mha_f32": dict(num_q_heads=2, num_kv_heads=2, dtype=jnp.float32, options={}),
    "gqa2_bf16": dict(num_q_heads=4, num_kv_heads=2, dtype=jnp.bfloat16, options={}),
    "gqa4_window_softcap_f32": dict(num_q_heads=8, num_kv_heads=2, dtype=jnp.float32,
                                    options=dict(sliding_window=20, soft_cap=2.0)),
    "gqa8_bf16_window": dict(num_q_heads=8, num_kv_heads=1, dtype=jnp.bfloat16,
                             options=dict(sliding_window=5)),
}


def case_batch(name: str, seed: int = 0) -> tuple[Batch, dict]:
    case = CASES[name]
    batch = make_batch(seed, **MIXED, num_q_heads=case["num_q_heads"],
                       num_kv_heads=case["num_kv_heads"], dtype=case["dtype"])
    return batch, case


@pytest.mark.parametrize("options", [{}, dict(sliding_window=20, soft_cap=2.0)],
                         ids=["causal", "window_softcap"])
def test_reference_matches_numpy(options):
    batch = make_batch(1, **MIXED, num_q_heads=4, num_kv_heads=2)
    out = jitted("reference", **options)(*batch.args)
    expected = numpy_attention(batch, **options)
    assert_close(out, expected, jnp.float32, sum(batch.q_lens))
    np.testing.assert_array_equal(np.asarray(out)[sum(batch.q_lens):], 0.0)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_numpy_on_cases(name):
    batch, case = case_batch(name)
    out = jitted("reference", **case["options"])(*batch.args)
    assert_close(out, numpy_attention(batch, **case["options"]), case["dtype"], sum(batch.q_lens))


@pytest.mark.parametrize("impl", PALLAS_IMPLS)
@pytest.mark.parametrize("name", list(CASES))
def test_pallas_matches_reference(impl, name):
    batch, case = case_batch(name)
    expected = jitted("reference", **case["options"])(*batch.args)
    out = jitted(impl, **case["options"])(*batch.args)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert_close(out, expected, case["dtype"], sum(batch.q_lens))


@pytest.mark.parametrize("pages_per_step", [1, 2])
def test_pallas_gpu_small_query_blocks_and_kv_splits(pages_per_step):
    """Several query blocks per sequence, split-KV merge, multi-page tiles."""
    batch, case = case_batch("gqa4_window_softcap_f32", seed=2)
    expected = jitted("reference", **case["options"])(*batch.args)
    out = jax.jit(functools.partial(pallas_gpu.ragged_paged_attention, sm_scale=0.25,
                                    interpret=True, block_q=4, num_kv_splits=3,
                                    pages_per_step=pages_per_step,
                                    **case["options"]))(*batch.args)
    assert_close(out, expected, jnp.float32, sum(batch.q_lens))


def test_pallas_tpu_small_query_blocks():
    batch, case = case_batch("gqa4_window_softcap_f32", seed=3)
    expected = jitted("reference", **case["options"])(*batch.args)
    out = jax.jit(functools.partial(pallas_tpu.ragged_paged_attention, sm_scale=0.25,
                                    interpret=True, block_q=2,
                                    **case["options"]))(*batch.args)
    assert_close(out, expected, jnp.float32, sum(batch.q_lens))


@pytest.mark.parametrize("impl", ("reference",) + PALLAS_IMPLS)
def test_empty_batch_gives_zeros(impl):
    batch = make_batch(4, [], [], num_tokens=32, max_num_seqs=8, pages_per_seq=4,
                       num_q_heads=2, num_kv_heads=2)
    out = jitted(impl)(*batch.args)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("impl,platform", [("pallas_gpu", "cuda"), ("pallas_tpu", "tpu")])
@pytest.mark.parametrize("head_dim", [32, 128])
def test_pallas_kernels_lower_for_their_hardware(impl, platform, head_dim):
    """The kernel body lowers to Triton / Mosaic (no device needed to lower)."""
    batch = make_batch(5, **MIXED, num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
                       dtype=jnp.bfloat16)
    fn = jax.jit(functools.partial(kernels.ragged_paged_attention, impl=impl,
                                   sliding_window=32, soft_cap=30.0))
    text = fn.trace(*batch.args).lower(lowering_platforms=(platform,)).as_text()
    assert "ragged_paged_attention" in text


def test_reference_is_fast_at_engine_sizes():
    """T=512, S=256, 64 pages per sequence: compiles and runs in seconds on CPU."""
    rng = np.random.default_rng(6)
    q_lens = [1] * 200 + [39] * 8
    kv_lens = list(rng.integers(1, 64 * PAGE_SIZE, size=200)) + [1000] * 8
    batch = make_batch(6, q_lens, kv_lens, num_tokens=512, max_num_seqs=256,
                       pages_per_seq=64, num_q_heads=4, num_kv_heads=2)
    fn = jitted("reference")
    jax.block_until_ready(fn(*batch.args))
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*batch.args))
    assert time.perf_counter() - start < 5.0
    assert np.isfinite(np.asarray(out)).all()


def test_default_impl_on_cpu():
    assert jax.default_backend() == "cpu"
    assert kernels.default_impl() == "reference"


# --- write_kv_pages -------------------------------------------------------------

def kv_write_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    num_pages, num_kv_heads, head_dim, num_tokens = 4, 2, 8, 10
    num_slots = num_pages * PAGE_SIZE
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    k_pages, v_pages = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
    new_k = rng.normal(size=(num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    new_v = rng.normal(size=(num_tokens, num_kv_heads, head_dim)).astype(np.float32)
    slots = rng.choice(num_slots, size=num_tokens, replace=False).astype(np.int32)
    slots[[2, 5, 9]] = [-1, num_slots, num_slots + 100]  # Padding tokens.
    expected_k, expected_v = k_pages.copy(), v_pages.copy()
    for t, slot in enumerate(slots):
        if 0 <= slot < num_slots:
            expected_k[slot // PAGE_SIZE, slot % PAGE_SIZE] = new_k[t]
            expected_v[slot // PAGE_SIZE, slot % PAGE_SIZE] = new_v[t]
    args = tuple(jnp.asarray(x) for x in (k_pages, v_pages, new_k, new_v, slots))
    return args, expected_k, expected_v


def test_write_kv_pages_scatters_and_drops_padding():
    args, expected_k, expected_v = kv_write_case()
    k_out, v_out = jax.jit(kernels.write_kv_pages)(*args)
    np.testing.assert_array_equal(np.asarray(k_out), expected_k)
    np.testing.assert_array_equal(np.asarray(v_out), expected_v)


def test_write_kv_pages_donated_reuses_inputs():
    args, expected_k, expected_v = kv_write_case(1)
    k_out, v_out = kernels.write_kv_pages_donated(*args)
    np.testing.assert_array_equal(np.asarray(k_out), expected_k)
    np.testing.assert_array_equal(np.asarray(v_out), expected_v)
    assert args[0].is_deleted() and args[1].is_deleted()


def test_write_then_attend_matches_numpy():
    """Writing a decode token's K/V then attending sees the new token."""
    batch = make_batch(7, [1, 1], [17, 5], num_tokens=2, max_num_seqs=2, pages_per_seq=2,
                       num_q_heads=2, num_kv_heads=1)
    q, k_pages, v_pages, page_table, kv_lens, cu, num_seqs = batch.args
    new = jnp.full((2, 1, 16), 3.0)
    positions = np.array([16, 4])
    table = np.asarray(page_table)
    slots = table[[0, 1], positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    k_pages, v_pages = kernels.write_kv_pages(k_pages, v_pages, new, new,
                                              jnp.asarray(slots, jnp.int32))
    updated = Batch((q, k_pages, v_pages, page_table, kv_lens, cu, num_seqs), [1, 1], [17, 5])
    out = jitted("reference")(*updated.args)
    assert_close(out, numpy_attention(updated), jnp.float32, 2)


# --- validation -----------------------------------------------------------------

def _bad(index: int, value):
    return lambda args: args[:index] + (value,) + args[index + 1:]


VALID_ARGS = make_batch(8, [2, 1], [3, 20], num_tokens=4, max_num_seqs=3, pages_per_seq=2,
                        num_q_heads=4, num_kv_heads=2).args

BAD_ATTENTION_CALLS = {
    "q rank": (_bad(0, VALID_ARGS[0][0]), {}, "q must have rank 3"),
    "q dtype": (_bad(0, VALID_ARGS[0].astype(jnp.int32)), {}, "q must be float32"),
    "q vs k dtype": (_bad(0, VALID_ARGS[0].astype(jnp.bfloat16)), {}, "q dtype"),
    "gqa ratio": (_bad(0, jnp.zeros((4, 3, 16))), {}, "num_q_heads (3) must be a multiple"),
    "head_dim": (_bad(0, jnp.zeros((4, 4, 8))), {}, "head_dim"),
    "v shape": (_bad(2, VALID_ARGS[2][:, :8]), {}, "v_pages shape"),
    "k rank": (_bad(1, VALID_ARGS[1][0]), {}, "k_pages must have rank 4"),
    "page_table dtype": (_bad(3, VALID_ARGS[3].astype(jnp.float32)), {}, "page_table must be int32"),
    "kv_lens length": (_bad(4, VALID_ARGS[4][:2]), {}, "kv_lens length"),
    "cu_q_lens length": (_bad(5, VALID_ARGS[5][:3]), {}, "cu_q_lens length"),
    "num_seqs shape": (_bad(6, jnp.zeros((2,), jnp.int32)), {}, "num_seqs must have shape"),
    "num_seqs rank": (_bad(6, jnp.int32(1)), {}, "num_seqs must have rank 1"),
    "impl": (lambda a: a, dict(impl="cuda"), "impl must be one of"),
    "sliding_window": (lambda a: a, dict(sliding_window=0), "sliding_window"),
    "soft_cap": (lambda a: a, dict(soft_cap=-1.0), "soft_cap"),
    "gpu head_dim": (lambda a: tuple(x[..., :12] if i < 3 else x for i, x in enumerate(a)),
                     dict(impl="pallas_gpu"), "power-of-two head_dim"),
}


@pytest.mark.parametrize("name", list(BAD_ATTENTION_CALLS))
def test_attention_validation_errors(name):
    mutate, options, message = BAD_ATTENTION_CALLS[name]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        jax.jit(functools.partial(kernels.ragged_paged_attention, **options))(*mutate(VALID_ARGS))


KV_ARGS = kv_write_case()[0]

BAD_KV_WRITES = {
    "pages dtype mismatch": (_bad(1, KV_ARGS[1].astype(jnp.bfloat16)), "v_pages dtype"),
    "new_k heads": (_bad(2, KV_ARGS[2][:, :1]), "new_k shape"),
    "new_v dtype": (_bad(3, KV_ARGS[3].astype(jnp.bfloat16)), "new_v dtype"),
    "slot dtype": (_bad(4, KV_ARGS[4].astype(jnp.float32)), "slot_mapping must be int32"),
    "slot length": (_bad(4, KV_ARGS[4][:3]), "slot_mapping length"),
}


@pytest.mark.parametrize("name", list(BAD_KV_WRITES))
def test_kv_write_validation_errors(name):
    mutate, message = BAD_KV_WRITES[name]
    with pytest.raises(ValueError, match=message):
        jax.jit(kernels.write_kv_pages)(*mutate(KV_ARGS))
