"""Train and evaluate the probe (optax, cross-entropy over LAMPS's bins).

Features come from ``features.HiddenStateReader`` once per trace and model and
are cached next to the checkpoint (``features.npz``, keyed by the trace's
SHA-256 and the model fingerprint), so ``eval`` and the simulator's
prediction cache do not run the model again.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxserve.predictor.bins import NUM_BINS, LengthMetrics, bin_lengths, length_metrics, length_to_bin
from jaxserve.predictor.dataset import TextRequest, batches, check_enough_requests, load_text_requests, split_requests
from jaxserve.predictor.features import HiddenStateReader, ServedModel
from jaxserve.predictor.probe import ProbeParams, init_probe, probe_logits, probe_predict, trainable
from jaxserve.replay.trace import resolve_trace_path

log = logging.getLogger("jaxserve.predictor")
FEATURES_FILE = "features.npz"


@dataclass
class Examples:
    """Parallel arrays over segments: ``features [N, H]`` float32, ``lengths [N]`` tokens,
    ``request_ids [N]``, ``segments [N]`` (index within its request), ``kinds [N]``."""

    features: np.ndarray
    lengths: np.ndarray
    request_ids: np.ndarray
    segments: np.ndarray
    kinds: np.ndarray

    def select(self, request_ids: set[str]) -> "Examples":
        m = np.isin(self.request_ids, list(request_ids))
        return Examples(self.features[m], self.lengths[m], self.request_ids[m], self.segments[m], self.kinds[m])


def trace_digest(trace: str | Path | None) -> str:
    return hashlib.sha256(resolve_trace_path(trace).read_bytes()).hexdigest()[:16]


def compute_examples(served: ServedModel, requests: list[TextRequest], progress: bool = True,
                     batch_requests: int = 16) -> Examples:
    """Hidden states of every text segment's last prompt token: one forward per
    request's whole context, ``batch_requests`` requests at a time through
    ``HiddenStateReader.read_many`` (padded batches of similar length)."""
    from tqdm import tqdm
    reader = HiddenStateReader(served)
    ordered = sorted(requests, key=lambda r: len(r.token_ids))
    feats: dict[str, np.ndarray] = {}
    with tqdm(total=len(ordered), desc="hidden states", disable=not progress, leave=False) as bar:
        for start in range(0, len(ordered), batch_requests):
            group = ordered[start:start + batch_requests]
            for r, f in zip(group, reader.read_many([(r.token_ids, r.prompt_ends) for r in group])):
                feats[r.request_id] = f
            bar.update(len(group))
    lengths, rids, segs, kinds = [], [], [], []
    for r in requests:
        lengths += r.labels
        rids += [r.request_id] * len(r.labels)
        segs += range(len(r.labels))
        kinds += [r.kind] * len(r.labels)
    return Examples(np.concatenate([feats[r.request_id] for r in requests]), np.asarray(lengths, np.int64),
                    np.asarray(rids), np.asarray(segs), np.asarray(kinds))


def cached_examples(served: ServedModel, trace: str | Path | None, cache_dir: Path | None,
                    progress: bool = True, max_context: int | None = None,
                    split: bool = False) -> tuple[Examples, list[TextRequest]]:
    """``compute_examples`` for ``trace`` (requests up to ``max_context`` tokens), reusing
    ``cache_dir/features.npz`` when it was made from the same trace file, model and
    ``max_context``; writes it when ``cache_dir`` is given. ``split``: the examples will be
    split by request (train, eval): too few requests for that is a ``TraceDataError``
    before any feature is computed."""
    requests = load_text_requests(trace, served.tokenizer, max_context)
    if split:
        check_enough_requests(requests, trace)
    key = f"{trace_digest(trace)}|{served.identity.fingerprint}|{max_context}"
    path = cache_dir / FEATURES_FILE if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                if str(z["key"]) == key:
                    return Examples(z["features"], z["lengths"], z["request_ids"], z["segments"], z["kinds"]), requests
        except (OSError, ValueError, KeyError) as e:
            log.warning("ignoring unreadable feature cache %s (%s)", path, e)
    ex = compute_examples(served, requests, progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, key=np.asarray(key), features=ex.features, lengths=ex.lengths,
                 request_ids=ex.request_ids, segments=ex.segments, kinds=ex.kinds)
    return ex, requests


def fit_probe(train: Examples, val: Examples, *, hidden: int = 256, epochs: int = 200, batch_size: int = 64,
              lr: float = 1e-3, weight_decay: float = 1e-2, seed: int = 0) -> tuple[ProbeParams, dict]:
    """AdamW on cross-entropy; keeps the epoch with the lowest validation MAE (bins).
    Returns ``(params, summary)``."""
    read_back = bin_lengths(train.lengths)
    params = init_probe(jax.random.PRNGKey(seed), train.features, hidden, read_back)
    fixed = {k: v for k, v in params.items() if k not in trainable(params)}
    opt = optax.adamw(lr, weight_decay=weight_decay)
    weights = trainable(params)
    state = opt.init(weights)

    @jax.jit
    def update(weights, state, x, y):
        def loss_fn(w):
            logits = probe_logits({**fixed, **w}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(weights)
        updates, state = opt.update(grads, state, weights)
        return optax.apply_updates(weights, updates), state, loss

    predict = jax.jit(probe_predict)
    y_train = length_to_bin(train.lengths)
    best = (np.inf, 0, weights)
    for epoch in range(epochs):
        for x, y in batches(train.features, y_train, batch_size, seed, epoch):
            weights, state, _ = update(weights, state, jnp.asarray(x), jnp.asarray(y))
        if len(val.lengths):
            pred = np.asarray(predict({**fixed, **weights}, jnp.asarray(val.features)))
            mae = length_metrics(pred, val.lengths, read_back).mae_bins
            if mae < best[0]:
                best = (mae, epoch, weights)
    if len(val.lengths):
        weights = best[2]
    summary = {"epochs": epochs, "best_epoch": int(best[1]), "val_mae_bins": float(best[0]),
               "n_train": int(len(train.lengths)), "n_val": int(len(val.lengths)), "seed": seed,
               "train_mean_tokens": float(train.lengths.mean())}
    return {**fixed, **weights}, summary


def evaluate(params: ProbeParams, test: Examples, train_mean_tokens: float) -> tuple[LengthMetrics, LengthMetrics]:
    """(probe metrics, constant-baseline metrics) on ``test``; the baseline predicts the bin
    of the training mean length for every example."""
    read_back = np.asarray(params["bin_tokens"], np.float32)
    pred = np.asarray(probe_predict({k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(test.features)))
    const = np.full(len(test.lengths), int(length_to_bin(int(round(train_mean_tokens)))), np.int64)
    return length_metrics(pred, test.lengths, read_back), length_metrics(const, test.lengths, read_back)


def split_examples(ex: Examples, requests: list[TextRequest], seed: int) -> dict[str, Examples]:
    """The examples of each request split (``dataset.split_requests``)."""
    return {name: ex.select({r.request_id for r in reqs}) for name, reqs in split_requests(requests, seed).items()}


__all__ = ["Examples", "cached_examples", "fit_probe", "evaluate", "split_examples", "NUM_BINS"]
