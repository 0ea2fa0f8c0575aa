"""Step inputs packed into one int32 buffer and cut back out inside a jitted program,
bit for bit; the executor stages a whole step in one transfer."""

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.executor import model as executor_module
from jaxserve.executor.packing import pack, unpack


def test_pack_unpack_round_trips_every_bit_under_jit():
    arrays = {
        "ids": np.array([[0, -1, np.iinfo(np.int32).min], [np.iinfo(np.int32).max, 7, 3]], np.int32),
        "temperature": np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 0.7], np.float32),
        "seed": np.array([0, 1, 0xFFFFFFFF, 0x80000000], np.uint32),
        "one": np.array([5], np.int32),
    }
    flat, layout = pack(arrays)
    assert flat.dtype == np.int32 and flat.shape == (6 + 7 + 4 + 1,)
    assert hash(layout) == hash(pack(arrays)[1])          # static jit argument: same buckets, same key
    out = jax.jit(unpack, static_argnums=1)(flat, layout)
    assert set(out) == set(arrays)
    for name, want in arrays.items():
        got = np.asarray(out[name])
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes(), name       # NaN payloads and -0.0 included


def test_pack_refuses_arrays_that_are_not_four_bytes_wide():
    with pytest.raises(ValueError, match="'x' is float64"):
        pack({"ok": np.zeros(2, np.int32), "x": np.zeros(2, np.float64)})


def test_a_step_is_staged_in_one_transfer(monkeypatch):
    llm = LLM("demo", num_pages=32, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=64, warmup=False)
    staged = []
    real = executor_module.put_replicated

    def counting(tree, mesh):
        staged.append(len(jax.tree_util.tree_leaves(tree)))
        return real(tree, mesh)

    monkeypatch.setattr(executor_module, "put_replicated", counting)
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0.0))[0]
    llm.engine.shutdown()
    assert len(out.token_ids) == 3
    assert staged and all(n == 1 for n in staged)         # one array per step, not one per input
