"""The probe: standardise the final-norm hidden state of the last prompt token,
then a one-hidden-layer MLP (or a linear map when ``hidden == 0``) to
``NUM_BINS`` logits. Pure ``jnp`` on a plain dict of arrays, so the same
function runs in training and inside the engine's jitted step.

Parameters (H = model hidden size, M = probe hidden width):
``mean [H]``, ``scale [H]`` (1/std of the training features), then
``w1 [H, M]``, ``b1 [M]``, ``w2 [M, NUM_BINS]``, ``b2 [NUM_BINS]`` (MLP) or
``w2 [H, NUM_BINS]``, ``b2`` (linear), and ``bin_tokens [NUM_BINS]``, the
length each bin reads back as.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.predictor.bins import NUM_BINS

ProbeParams = dict[str, jax.Array]


def init_probe(key: jax.Array, features: np.ndarray, hidden: int, bin_tokens: np.ndarray) -> ProbeParams:
    """Fresh parameters; the standardisation is fitted to ``features [N, H]``."""
    h = features.shape[1]
    mean = features.mean(axis=0)
    scale = 1.0 / (features.std(axis=0) + 1e-6)
    k1, k2 = jax.random.split(key)
    params = {"mean": jnp.asarray(mean, jnp.float32), "scale": jnp.asarray(scale, jnp.float32),
              "bin_tokens": jnp.asarray(bin_tokens, jnp.float32)}
    width_in = h
    if hidden:
        params["w1"] = jax.random.normal(k1, (h, hidden), jnp.float32) * (2.0 / h) ** 0.5
        params["b1"] = jnp.zeros((hidden,), jnp.float32)
        width_in = hidden
    params["w2"] = jax.random.normal(k2, (width_in, NUM_BINS), jnp.float32) * (1.0 / width_in) ** 0.5
    params["b2"] = jnp.zeros((NUM_BINS,), jnp.float32)
    return params


def probe_logits(params: ProbeParams, hidden_states: jax.Array) -> jax.Array:
    """``hidden_states [..., H]`` (float32) -> bin logits ``[..., NUM_BINS]``."""
    x = (hidden_states - params["mean"]) * params["scale"]
    if "w1" in params:
        x = jax.nn.relu(x @ params["w1"] + params["b1"])
    return x @ params["w2"] + params["b2"]


def probe_predict(params: ProbeParams, hidden_states: jax.Array) -> jax.Array:
    """Predicted bin (int32 ``[...]``) of each hidden state: the arg-max class."""
    return jnp.argmax(probe_logits(params, hidden_states), axis=-1).astype(jnp.int32)


def trainable(params: ProbeParams) -> ProbeParams:
    """The parameters the optimiser updates (not the fitted standardisation or read-back table)."""
    return {k: v for k, v in params.items() if k not in ("mean", "scale", "bin_tokens")}
