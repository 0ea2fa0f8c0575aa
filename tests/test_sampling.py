"""The sampler's filters against transformers' logits warpers (the reference users know)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from jaxserve.sampling import SamplingArrays, _filter, sample
from jaxserve.sampling_params import SamplingParams

# (temperature, top_k, top_p, min_p) per row: each filter alone, pairs, all three, none
ROWS = [(1.0, 5, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 0, 1.0, 0.05), (1.0, 0, 1.0, 0.3), (0.5, 20, 0.9, 0.1),
        (2.0, 0, 0.95, 0.02), (1.0, 3, 1.0, 0.5), (1.0, 0, 1.0, 0.0)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_top_p_min_p_keep_what_transformers_warpers_keep(seed):
    """Row by row, the tokens left after temperature, top-k, top-p and min-p are the ones
    transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``
    and ``MinPLogitsWarper`` leave (min-p only compares a token's probability with the
    likeliest's, so its place in that chain does not matter), and their values are the
    temperature-scaled logits."""
    logits = np.random.default_rng(seed).normal(0, 3, (len(ROWS), 300)).astype(np.float32)
    temperature, top_k, top_p, min_p = (np.array(column) for column in zip(*ROWS))
    scaled = logits / temperature[:, None]
    ours = np.asarray(_filter(jnp.asarray(scaled), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32),
                              jnp.asarray(min_p, jnp.float32)))
    for row, (t, k, p, m) in enumerate(ROWS):
        warpers = LogitsProcessorList([TemperatureLogitsWarper(t)] + ([TopKLogitsWarper(k)] if k else [])
                                      + ([TopPLogitsWarper(p)] if p < 1 else []) + ([MinPLogitsWarper(m)] if m else []))
        want = warpers(None, torch.tensor(logits[row:row + 1]))[0].numpy()
        kept = np.isfinite(want)
        assert np.array_equal(np.isfinite(ours[row]), kept), (row, np.isfinite(ours[row]).sum(), kept.sum())
        np.testing.assert_allclose(ours[row][kept], want[kept], rtol=1e-6)
        if (k, p, m) != (0, 1.0, 0.0):
            assert kept.sum() < logits.shape[1]   # the filter removed something


def test_a_top_p_too_small_for_float32_keeps_the_likeliest_token():
    """``top_p`` in (0, ~1.2e-38) passes validation but is 0 once flushed on the device: the
    likeliest token is kept all the same (every logit was -inf, and the draw gave token 0)."""
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 3, (2, 50)).astype(np.float32))
    ours = np.asarray(_filter(logits, jnp.zeros(2, jnp.int32), jnp.asarray([1e-40, 0.0], jnp.float32),
                              jnp.zeros(2, jnp.float32)))
    for row in range(2):
        assert np.flatnonzero(np.isfinite(ours[row])).tolist() == [int(np.argmax(logits[row]))]


@pytest.mark.parametrize("top_k", [0, 2])
def test_a_tiny_temperature_is_greedy(top_k):
    """A temperature that passes validation but divides the logits into float32's
    overflow (a logit of 20 over 2e-38 is inf) drew the first inf token, not the best:
    garbage (token 0, "!!!!") with a 200 from the server. Below 1e-5 it is greedy
    (vLLM's threshold); at 1e-5 and above the draw is a real one."""
    logits = jnp.asarray([[-3.0, 12.0, 20.0, 15.0]] * 6, jnp.float32)   # greedy: token 2
    temps = [2e-38, 5e-38, 1e-30, 1e-6, 0.0, 50.0]
    for t in temps:
        SamplingParams(temperature=t)   # all accepted
    rows = len(temps)
    params = SamplingArrays(temperature=jnp.asarray(temps, jnp.float32), top_k=jnp.full(rows, top_k, jnp.int32),
                            top_p=jnp.ones(rows, jnp.float32), min_p=jnp.zeros(rows, jnp.float32),
                            seed=jnp.arange(rows, dtype=jnp.uint32), step=jnp.zeros(rows, jnp.int32))
    drawn = [np.asarray(sample(logits, SamplingArrays(**{**params.__dict__, "step": params.step + n}))) for n in range(40)]
    assert all((d[:5] == 2).all() for d in drawn)
    assert {int(d[5]) for d in drawn} != {2}   # (temperature 50 draws for real: not always the likeliest)
