"""Probe checkpoints (orbax): the parameters plus a JSON record of the model
they were trained on, so a probe is never applied to another model's hidden
states.

Layout of a checkpoint directory ``DIR``: ``DIR/probe/`` an orbax composite
checkpoint with items ``params`` (the probe's arrays) and ``meta`` (JSON:
``model`` identity, ``probe_hidden``, training summary). Anything else in
``DIR`` (e.g. the simulator's prediction cache) is ignored by ``load_probe``.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from jaxserve.predictor.bins import NUM_BINS
from jaxserve.predictor.probe import ProbeParams

FORMAT_VERSION = 1


class ProbeCheckpointError(ValueError):
    """A probe checkpoint that is missing, corrupt, or belongs to another model; names the path."""


@dataclass(frozen=True)
class ModelIdentity:
    """Which model a probe belongs to.

    ``fingerprint``: a hash of the architecture numbers and of the first
    embedding rows rounded to 1e-3 — equal for the same weights in another
    file format (safetensors, dequantised GGUF), different for other weights.
    """

    name: str
    hidden_size: int
    fingerprint: str


def model_identity(model, config, name: str) -> ModelIdentity:
    """Identity of a loaded ``LlamaForCausalLM`` and its ``ModelConfig``."""
    arch = [config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim]
    emb = np.asarray(model.embed_tokens.embedding[...][:8], np.float32)
    digest = hashlib.sha256(json.dumps(arch).encode())
    digest.update(np.round(emb, 3).astype(np.float32).tobytes())
    return ModelIdentity(name=name, hidden_size=int(config.hidden_size), fingerprint=digest.hexdigest()[:16])


def _ocp():
    import logging

    import orbax.checkpoint as ocp
    logging.getLogger("absl").setLevel(logging.WARNING)   # (orbax logs a dozen INFO lines per save or restore)
    return ocp


def _is_late_read_on_a_closed_loop(unraisable) -> bool:
    """Whether ``unraisable`` (``sys.unraisablehook``'s argument) is tensorstore
    reporting a read that finished after orbax closed the event loop of a
    failed restore: ``RuntimeError('Event loop is closed')`` raised by
    ``call_soon_threadsafe`` (the other reads of a damaged checkpoint land
    after the first error ended the restore)."""
    if unraisable.exc_type is not RuntimeError or str(unraisable.exc_value) != "Event loop is closed":
        return False
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return bool(frames) and frames[0].name == "call_soon_threadsafe"


def _drop_late_reads_of_failed_restores() -> None:
    """Keep those late reads' tracebacks off stderr (once per process): the
    restore's failure is already reported, as one ``ProbeCheckpointError``.
    Every other unraisable exception goes to the hook that was there before."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_late_reads", False):
        return

    def hook(unraisable) -> None:
        if not _is_late_read_on_a_closed_loop(unraisable):
            previous(unraisable)
    hook.drops_late_reads = True
    sys.unraisablehook = hook


def save_probe(directory: str | Path, params: ProbeParams, identity: ModelIdentity, probe_hidden: int,
               summary: dict) -> Path:
    """Write ``params`` and their model identity under ``directory/probe`` (replacing an old one)."""
    ocp = _ocp()
    path = Path(directory).expanduser().resolve() / "probe"
    meta = {"format_version": FORMAT_VERSION, "model": asdict(identity), "probe_hidden": int(probe_hidden),
            "num_bins": NUM_BINS, "summary": summary}
    arrays = {k: np.asarray(v) for k, v in params.items()}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(path, ocp.args.Composite(params=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
                   force=True)
    return path


def load_probe(directory: str | Path, identity: ModelIdentity | None = None) -> tuple[ProbeParams, dict]:
    """Read a probe; with ``identity``, refuse one trained on another model.

    Returns ``(params as numpy arrays, meta)``. Raises ``ProbeCheckpointError``
    naming the path when the directory is missing, unreadable or inconsistent,
    or when it belongs to another model.
    """
    ocp = _ocp()
    path = Path(directory).expanduser().resolve() / "probe"
    if not path.is_dir():
        raise ProbeCheckpointError(f"no probe checkpoint at {path} (train one with `jaxserve predictor train`)")
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
            restored = ckptr.restore(path, ocp.args.Composite(params=ocp.args.StandardRestore(),
                                                              meta=ocp.args.JsonRestore()))
        params, meta = dict(restored["params"]), dict(restored["meta"])
    except Exception as e:  # orbax raises many kinds for damaged files
        _drop_late_reads_of_failed_restores()
        raise ProbeCheckpointError(f"probe checkpoint {path} is corrupt or unreadable: "
                                   f"{type(e).__name__}: {e}") from e
    _check_consistent(path, params, meta)
    if identity is not None:
        want = meta["model"]
        if want["hidden_size"] != identity.hidden_size or want["fingerprint"] != identity.fingerprint:
            raise ProbeCheckpointError(
                f"probe checkpoint {path} was trained on model {want['name']!r} (hidden size "
                f"{want['hidden_size']}, fingerprint {want['fingerprint']}), not on {identity.name!r} "
                f"(hidden size {identity.hidden_size}, fingerprint {identity.fingerprint})")
    return {k: np.asarray(v, np.float32) for k, v in params.items()}, meta


def _check_consistent(path: Path, params: dict, meta: dict) -> None:
    """Shapes agree with the recorded hidden size and bin count; every parameter is
    finite, and the summary's ``train_mean_tokens`` (the predictor's answer before any
    prediction) a finite number >= 0: a NaN there would surface only mid-serving, as a
    failed step when a policy first ranks by it."""
    try:
        h = int(meta["model"]["hidden_size"])
        ok = meta.get("format_version") == FORMAT_VERSION and params["mean"].shape == (h,) \
            and params["scale"].shape == (h,) and params["bin_tokens"].shape == (NUM_BINS,) \
            and params["w2"].shape[1] == NUM_BINS and params["b2"].shape == (NUM_BINS,) \
            and params["w2"].shape[0] == (params["w1"].shape[1] if "w1" in params else h)
        if "w1" in params:
            ok = ok and params["w1"].shape[0] == h
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ProbeCheckpointError(f"probe checkpoint {path} is incomplete: missing {e}") from e
    if not ok:
        raise ProbeCheckpointError(f"probe checkpoint {path} is inconsistent: parameter shapes do not match "
                                   f"its recorded hidden size / {NUM_BINS} bins")
    for name, value in params.items():
        if not np.isfinite(np.asarray(value, np.float64)).all():
            raise ProbeCheckpointError(f"probe checkpoint {path} is corrupt: parameter {name!r} holds NaN or "
                                       f"infinite values")
    summary = meta.get("summary")
    mean = summary.get("train_mean_tokens") if isinstance(summary, dict) else None
    if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not math.isfinite(mean) or mean < 0:
        raise ProbeCheckpointError(f"probe checkpoint {path} is incomplete: summary.train_mean_tokens must be "
                                   f"a finite number >= 0, got {mean!r}")
