"""Which cost model the engine uses when none is named."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import jax

from scheduler import CostModel, load_profile


def shipped_profile(backend: str) -> CostModel | None:
    """The profile measured with ``jaxserve profile`` on the reference machine of
    ``backend`` and shipped in ``jaxserve/data/profile-<backend>.json``."""
    path = resources.files("jaxserve") / "data" / f"profile-{backend}.json"
    if not path.is_file():
        return None
    return CostModel.from_dict(json.loads(path.read_text()))


def default_cost_model(profile: str | None, kv_bytes_per_token: int, max_num_batched_tokens: int) -> CostModel:
    """The named profile (built-in name or JSON path), else the shipped profile for
    this backend, else the GPT-J/A100 constants; ``bytes_per_token`` always
    comes from the loaded model."""
    if profile is not None:
        cost = load_profile(profile)
    else:
        cost = shipped_profile(jax.default_backend()) or load_profile("gptj-6b-a100-40g")
    return dataclasses.replace(cost, bytes_per_token=kv_bytes_per_token,
                               max_num_batched_tokens=max_num_batched_tokens)
