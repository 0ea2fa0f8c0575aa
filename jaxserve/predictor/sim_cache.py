"""Learned-length predictions for the simulator: computed once per (probe,
trace) with the probe's model and cached as JSON next to the probe.

``DIR/sim-predictions.json`` = ``{"key": ..., "predictions": {request id:
[tokens or null per segment]}}``; the key is the trace file's digest plus a
digest of the probe's parameters, so a retrained probe or another trace
recomputes. Token-form requests get no entry (the predictor answers them with
its per-class running mean). ``attach`` puts the lists on trace entries, where
``scheduler.predictors.LearnedPredictor`` reads them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxserve.predictor.checkpoint import ProbeCheckpointError, load_probe
from jaxserve.predictor.probe import probe_predict
from jaxserve.replay.trace import TraceEntry
from scheduler.predictors import LEARNED_SEGMENT_LENS, PREDICTION_CLASS

CACHE_FILE = "sim-predictions.json"


def _probe_digest(params: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(k.encode())
        h.update(np.ascontiguousarray(params[k], np.float32).tobytes())
    return h.hexdigest()[:16]


def trace_predictions(checkpoint: str | Path, model: str | None = None, trace: str | Path | None = None,
                      progress: bool = True) -> dict[str, list[float | None]]:
    """``{request id: [predicted tokens per segment]}`` for the text-form requests of ``trace``,
    read from the cache or computed with ``model`` (which must be the probe's model; None:
    the model name the probe recorded) and cached."""
    from jaxserve.predictor.train import trace_digest
    ckpt = Path(checkpoint).expanduser()
    params, meta = load_probe(ckpt)
    key = f"{trace_digest(trace)}|{_probe_digest(params)}"
    path = ckpt / CACHE_FILE
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
            if cached.get("key") == key:
                return cached["predictions"]
        except (OSError, ValueError, AttributeError) as e:
            raise ProbeCheckpointError(f"prediction cache {path} is corrupt ({e}); delete it to recompute") from e
    from jaxserve.predictor.features import load_served_model
    from jaxserve.predictor.train import cached_examples
    served = load_served_model(model or meta["model"]["name"])
    params, meta = load_probe(ckpt, served.identity)
    ex, _ = cached_examples(served, trace, ckpt, progress, max_context=meta["summary"].get("max_context"))
    bins = np.asarray(probe_predict({k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(ex.features)))
    lengths = np.asarray(params["bin_tokens"])[bins]
    out: dict[str, list[float | None]] = {}
    counts: dict[str, int] = {}
    for rid in ex.request_ids:
        counts[str(rid)] = counts.get(str(rid), 0) + 1
    for rid, seg, n in zip(ex.request_ids, ex.segments, lengths):
        out.setdefault(str(rid), [None] * counts[str(rid)])[int(seg)] = float(n)
    path.write_text(json.dumps({"key": key, "model": meta["model"], "predictions": out}))
    return out


def attach(entries: Sequence[TraceEntry], predictions: dict[str, list[float | None]]) -> list[TraceEntry]:
    """Entries with ``predictions[LEARNED_SEGMENT_LENS]`` (when the cache has the request) and
    ``predictions["class"]`` (the entry's kind, for the running-mean fallback)."""
    out = []
    for e in entries:
        extra = {PREDICTION_CLASS: e.kind}
        per_segment = predictions.get(e.request_id)
        if per_segment is not None:
            if len(per_segment) != len(e.segments):
                raise ValueError(f"cached predictions for request {e.request_id!r} have {len(per_segment)} "
                                 f"segments, the trace has {len(e.segments)}: stale cache?")
            extra[LEARNED_SEGMENT_LENS] = list(per_segment)
        out.append(dataclasses.replace(e, predictions={**e.predictions, **extra}))
    return out


def learned_entries(trace: str | Path | None, spec: str) -> list[TraceEntry]:
    """The trace for a simulated replay with ``--predictor learned:DIR``: text segments
    counted with the probe model's tokenizer (so the trace's lengths and the predictions
    are in the same tokens), with the cached predictions attached."""
    from jaxserve.model_source import load_tokenizer, resolve_model
    from jaxserve.predictor.serving import learned_checkpoint
    from jaxserve.replay.trace import load_trace
    checkpoint = learned_checkpoint(spec)
    _, meta = load_probe(checkpoint)
    tok = load_tokenizer(resolve_model(meta["model"]["name"]))
    entries = load_trace(trace, lambda text: tok.encode(text, add_special_tokens=False))
    return attach(entries, trace_predictions(checkpoint, None, trace))
