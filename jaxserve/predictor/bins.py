"""LAMPS's length bins and accuracy metrics (seed 000, §5 and §6).

Lengths are binned in ``BIN_TOKENS``-token bins, ``NUM_BINS`` of them; the last
bin is open-ended (every length >= ``(NUM_BINS - 1) · BIN_TOKENS``). A bin is
read back as a length by its midpoint, except the open-ended bin, which reads
as the mean length of the training examples that fell into it.

Metrics (seed 000 §6: "Acc-5 and Acc-15 represent the percentage of
predictions that differ from the actual length by no more than 5 words and 15
words"): here in the served model's tokens, with the predicted length the
predicted bin's read-back length. MAE is reported in bins (LAMPS's 3.06) and
in tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

NUM_BINS = 50
BIN_TOKENS = 10


def length_to_bin(lengths: np.ndarray | int) -> np.ndarray:
    """Bin index ``[0, NUM_BINS)`` of each length (tokens)."""
    return np.minimum(np.asarray(lengths) // BIN_TOKENS, NUM_BINS - 1).astype(np.int32)


def bin_lengths(train_lengths: np.ndarray | None = None) -> np.ndarray:
    """float32 ``[NUM_BINS]``: the length (tokens) each bin reads back as."""
    out = (np.arange(NUM_BINS, dtype=np.float32) + 0.5) * BIN_TOKENS
    if train_lengths is not None:
        lengths = np.asarray(train_lengths)
        tail = lengths[length_to_bin(lengths) == NUM_BINS - 1]
        if tail.size:
            out[-1] = float(tail.mean())
    return out


@dataclass(frozen=True)
class LengthMetrics:
    """Accuracy of length predictions over ``n`` examples (fractions in [0, 1])."""

    acc5: float
    acc15: float
    mae_bins: float
    mae_tokens: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)


def length_metrics(pred_bins: np.ndarray, true_lengths: np.ndarray, read_back: np.ndarray) -> LengthMetrics:
    """Metrics of predicted bins against true lengths (tokens); ``read_back`` from ``bin_lengths``."""
    pred_bins = np.asarray(pred_bins, np.int64)
    true_lengths = np.asarray(true_lengths, np.float64)
    if pred_bins.shape != true_lengths.shape or pred_bins.size == 0:
        raise ValueError(f"need equal, non-empty prediction and label arrays, got {pred_bins.shape} and "
                         f"{true_lengths.shape}")
    err = np.abs(read_back[pred_bins] - true_lengths)
    return LengthMetrics(acc5=float(np.mean(err <= 5)), acc15=float(np.mean(err <= 15)),
                         mae_bins=float(np.mean(np.abs(pred_bins - length_to_bin(true_lengths.astype(np.int64))))),
                         mae_tokens=float(err.mean()), n=int(pred_bins.size))
