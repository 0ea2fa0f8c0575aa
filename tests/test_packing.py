"""Step inputs packed into one int32 buffer and cut back out inside a jitted program,
bit for bit; the executor stages a whole step in one transfer."""

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.executor import model as executor_module
from jaxserve.executor.model import StepInputs, step_arrays
from jaxserve.executor.packing import ALIGN_WORDS, pack, unpack
from jaxserve.parallel import protocol


@pytest.fixture(scope="module")
def llm():
    engine = LLM("demo", num_pages=32, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, warmup=False)
    yield engine
    engine.engine.shutdown()


def test_pack_unpack_round_trips_every_bit_under_jit():
    arrays = {
        "ids": np.array([[0, -1, np.iinfo(np.int32).min], [np.iinfo(np.int32).max, 7, 3]], np.int32),
        "temperature": np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 0.7], np.float32),
        "seed": np.array([0, 1, 0xFFFFFFFF, 0x80000000], np.uint32),
        "one": np.array([5], np.int32),
    }
    flat, layout = pack(arrays)
    assert flat.dtype == np.int32 and flat.shape == (4 * ALIGN_WORDS,)
    other_values = {name: np.ones_like(a) for name, a in arrays.items()}
    other_flat, other_layout = pack(other_values)
    assert other_layout == layout and hash(other_layout) == hash(layout)   # static jit argument: shapes decide it
    assert other_flat.tobytes() != flat.tobytes()
    out = jax.jit(unpack, static_argnums=1)(flat, layout)
    assert set(out) == set(arrays)
    for name, want in arrays.items():
        got = np.asarray(out[name])
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), name       # NaN payloads and -0.0 included


def test_every_packed_array_starts_on_a_256_byte_boundary():
    """XLA:GPU passes a slice of the packed buffer on as a view at its offset, and the Mosaic
    GPU kernel refuses an input that is not 256-byte aligned (found on an H200)."""
    arrays = {"a": np.arange(3, dtype=np.int32), "b": np.arange(64, dtype=np.int32) + 100,
              "c": np.arange(65, dtype=np.int32) + 200, "d": np.full((2, 3), 7, np.int32)}
    flat, _ = pack(arrays)
    assert ALIGN_WORDS * 4 == 256
    offsets = {"a": 0, "b": 64, "c": 128, "d": 256}            # 3 -> 64, 64 -> 64, 65 -> 128 words
    assert flat.shape == (256 + 64,)
    for name, a in arrays.items():
        start = offsets[name]
        assert (flat[start:start + a.size] == a.ravel()).all(), name
    assert not flat[3:64].any() and not flat[128 + 65:256].any()   # padding is zero


def test_pack_refuses_arrays_that_are_not_four_bytes_wide():
    with pytest.raises(ValueError, match="'x' is float64"):
        pack({"ok": np.zeros(2, np.int32), "x": np.zeros(2, np.float64)})


def test_every_process_of_a_multi_host_run_packs_the_same_bytes(llm):
    """Workers get a step's inputs through a pytree round trip, which sorts dict keys:
    packing in name order gives them process 0's bytes and layout (so the same program)."""
    executor = llm.engine.executor
    inputs = executor.synthetic_inputs(executor.config.token_buckets[0], context=20)
    leaves, treedef = jax.tree_util.tree_flatten(protocol._forward_tree(inputs))
    input_ids, meta, logits_indices, sampling = jax.tree_util.tree_unflatten(treedef, [np.asarray(v) for v in leaves])
    assert list(meta) != list(inputs.meta)   # the round trip did reorder them
    worker = StepInputs(inputs.token_bucket, input_ids, meta, logits_indices, sampling, inputs.num_seqs)
    (leader_flat, leader_layout), (worker_flat, worker_layout) = pack(step_arrays(inputs)), pack(step_arrays(worker))
    assert worker_layout == leader_layout and worker_flat.tobytes() == leader_flat.tobytes()


def test_a_step_is_staged_in_one_transfer(llm, monkeypatch):
    staged = []
    real = executor_module.put_replicated

    def counting(tree, mesh):
        staged.append(len(jax.tree_util.tree_leaves(tree)))
        return real(tree, mesh)

    monkeypatch.setattr(executor_module, "put_replicated", counting)
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(out.token_ids) == 3
    assert staged and all(n == 1 for n in staged)         # one array per step, not one per input
