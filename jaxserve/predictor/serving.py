"""The probe in the live engine: load it for ``--predictor learned:DIR`` and
write its predictions onto requests after the step that computed them.

The probe runs inside the jitted step (``ModelExecutor(length_probe=...)``) on
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
from scheduler.predictors import LEARNED_AT_CALL, LEARNED_FROM, LEARNED_LEN

LEARNED_PREFIX = "learned:"


def learned_checkpoint(spec: str) -> str | None:
    """``"learned:DIR"`` -> ``DIR``; other predictor specs -> ``None``. A bare ``learned`` is an error."""
    if spec == "learned" or spec == LEARNED_PREFIX:
        raise ValueError("predictor 'learned' needs a probe checkpoint: --predictor learned:DIR "
                         "(train one with `jaxserve predictor train`)")
    return spec[len(LEARNED_PREFIX):] if spec.startswith(LEARNED_PREFIX) else None


class LengthProbeHook:
    """Engine side of the learned predictor: the probe's parameters (for the
    executor's step) and the bin -> tokens table. ``train_mean_tokens`` is the
    predictor's answer before any prediction or observation."""

    def __init__(self, directory: str, model, config, model_name: str) -> None:
        self.params, meta = load_probe(directory, model_identity(model, config, model_name))
        self.bin_tokens = np.asarray(self.params["bin_tokens"], np.float64)
        self.train_mean_tokens = float(meta["summary"]["train_mean_tokens"])

    def record(self, chunks: list[ScheduledChunk], bins) -> None:
        """After a step: write the predicted length of the segment each sampled row
        starts — a request's first sampled row (its prefill), and its first after
        each API return (the recompute or resume) — onto ``Request.predictions``.
        ``bins``: int32 ``[S_b]``, the executor's ``last_length_bins``."""
        rows = [i for i, c in enumerate(chunks)
                if c.samples and c.request.predictions.get(LEARNED_AT_CALL) != len(c.request.api_calls)]
        if not rows:
            return
        host = np.asarray(bins)
        for i in rows:
            req = chunks[i].request
            req.predictions[LEARNED_LEN] = float(self.bin_tokens[int(host[i])])
            req.predictions[LEARNED_FROM] = req.num_generated
            req.predictions[LEARNED_AT_CALL] = len(req.api_calls)
