"""The probe in the live engine: load it for ``--predictor learned:DIR`` and
write its predictions onto requests after the step that computed them.

The probe runs inside the jitted step (``ModelRunner(length_probe=...)``) on
every sampled row; only rows that end a request's prefill, or the
(re)computation of its context after an API return, are read: there the last
token is the last token of "the conversation so far", which is what the probe
was trained on. The scheduler-side ``scheduler.predictors.LearnedPredictor``
reads the result from ``Request.predictions``.
"""

from __future__ import annotations

import numpy as np

from jaxserve.predictor.checkpoint import load_probe, model_identity
from scheduler import ScheduledChunk
from scheduler.predictors import LEARNED_FROM, LEARNED_LEN

LEARNED_PREFIX = "learned:"


def learned_checkpoint(spec: str) -> str | None:
    """``"learned:DIR"`` -> ``DIR``; other predictor specs -> ``None``. A bare ``learned`` is an error."""
    if spec == "learned" or spec == LEARNED_PREFIX:
        raise ValueError("predictor 'learned' needs a probe checkpoint: --predictor learned:DIR "
                         "(train one with `jaxserve predictor train`)")
    return spec[len(LEARNED_PREFIX):] if spec.startswith(LEARNED_PREFIX) else None


class LengthProbeHook:
    """Engine side of the learned predictor: which requests await a prediction, and
    the bin -> tokens table. ``params`` go to the runner; ``train_mean_tokens`` is the
    predictor's answer before any prediction or observation."""

    def __init__(self, directory: str, model, config, model_name: str) -> None:
        self.params, meta = load_probe(directory, model_identity(model, config, model_name))
        self.bin_tokens = np.asarray(self.params["bin_tokens"], np.float64)
        self.train_mean_tokens = float(meta["summary"]["train_mean_tokens"])
        self.pending: set[str] = set()

    def expect(self, request_id: str, predictions: dict) -> None:
        """Predict ``request_id`` at the next step that ends its context (new request, or an API
        return); until then the predictor falls back to its running means."""
        predictions.pop(LEARNED_LEN, None)
        self.pending.add(request_id)

    def forget(self, request_id: str) -> None:
        self.pending.discard(request_id)

    def record(self, chunks: list[ScheduledChunk], bins) -> None:
        """After a step: write the predicted length of every pending request whose chunk
        ended its context (``chunk.samples``). ``bins``: the runner's ``last_length_bins``."""
        rows = [i for i, c in enumerate(chunks) if c.samples and c.request.request_id in self.pending]
        if not rows:
            return
        host = np.asarray(bins)
        for i in rows:
            req = chunks[i].request
            req.predictions[LEARNED_LEN] = float(self.bin_tokens[int(host[i])])
            req.predictions[LEARNED_FROM] = req.num_generated
            self.pending.discard(req.request_id)
