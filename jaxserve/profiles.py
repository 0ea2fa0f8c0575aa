"""Cost profiles: the engine's default, and the long-context ``llama3-8b-h100``.

``load_profile`` finds a profile by name among ``scheduler.BUILTIN_PROFILES``
and ``PROFILES`` here, or reads a JSON file written by ``jaxserve profile``.

``llama3-8b-h100`` is Llama-3-8B (32 layers, hidden 4096, 32 query / 8 KV
heads of 128, MLP 14336, vocabulary 128256, untied head) in bf16 on one
H100 SXM 80 GB, every number derived from first principles in
``docs/fidelity.md`` ("llama3-8b-h100"): weights 16.06 GB read once per
step at 80 % of 3.35 TB/s (the step's floor), 15.0 GFLOP per token at 60 %
of 989 TFLOP/s, 128 KiB of KV per token read at 60 % of HBM bandwidth per
step, the KV pool what 90 % of the card leaves after weights and a 2 GB
activation reserve (~450k tokens), swaps over PCIe Gen5 (50 GB/s achieved).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

from scheduler import BUILTIN_PROFILES, CostModel
from scheduler import load_profile as load_scheduler_profile

# Llama-3-8B shapes.
LLAMA3_8B_LAYERS = 32
LLAMA3_8B_HIDDEN = 4096
LLAMA3_8B_KV_HEADS = 8
LLAMA3_8B_HEAD_DIM = 128
LLAMA3_8B_MLP = 14336
LLAMA3_8B_VOCAB = 128256
BF16_BYTES = 2
_ATTENTION_PARAMS = 2 * LLAMA3_8B_HIDDEN * LLAMA3_8B_HIDDEN + 2 * LLAMA3_8B_HIDDEN * LLAMA3_8B_KV_HEADS * LLAMA3_8B_HEAD_DIM
_LAYER_PARAMS = _ATTENTION_PARAMS + 3 * LLAMA3_8B_HIDDEN * LLAMA3_8B_MLP
LLAMA3_8B_MATMUL_PARAMS = LLAMA3_8B_LAYERS * _LAYER_PARAMS + LLAMA3_8B_VOCAB * LLAMA3_8B_HIDDEN   # + LM head
LLAMA3_8B_PARAMS = LLAMA3_8B_MATMUL_PARAMS + LLAMA3_8B_VOCAB * LLAMA3_8B_HIDDEN                 # + embedding
LLAMA3_8B_KV_BYTES_PER_TOKEN = LLAMA3_8B_LAYERS * 2 * LLAMA3_8B_KV_HEADS * LLAMA3_8B_HEAD_DIM * BF16_BYTES

# One H100 SXM 80 GB (NVIDIA data sheet; 81,559 MiB usable as nvidia-smi reports it).
H100_MEMORY_BYTES = 81_559 * 2**20
H100_HBM_BYTES_S = 3.35e12
H100_BF16_FLOPS = 989.4e12
H100_PCIE_BYTES_S = 50e9            # PCIe Gen5 x16 (64 GB/s), pinned copies achieve ~50
WEIGHT_READ_EFFICIENCY = 0.8        # large contiguous reads
ATTENTION_READ_EFFICIENCY = 0.6     # paged KV reads, as the GPT-J/A100 context term
MATMUL_EFFICIENCY = 0.6             # model FLOPs utilisation of large prefill chunks
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE_BYTES = 2e9      # peak activations of an 8,192-token chunk, rounded up
HOST_KV_BYTES = 256e9               # one eighth of a 2 TB eight-GPU host

_weights_bytes = LLAMA3_8B_PARAMS * BF16_BYTES
_fwd_base_s = _weights_bytes / (H100_HBM_BYTES_S * WEIGHT_READ_EFFICIENCY)
_fwd_per_token_s = 2 * LLAMA3_8B_MATMUL_PARAMS / (H100_BF16_FLOPS * MATMUL_EFFICIENCY)

LLAMA3_8B_H100 = CostModel(
    fwd_base_s=_fwd_base_s,
    fwd_per_token_s=_fwd_per_token_s,
    fwd_per_context_token_s=LLAMA3_8B_KV_BYTES_PER_TOKEN / (H100_HBM_BYTES_S * ATTENTION_READ_EFFICIENCY),
    saturation_tokens=int(round(_fwd_base_s / _fwd_per_token_s)),
    bytes_per_token=LLAMA3_8B_KV_BYTES_PER_TOKEN,
    swap_bandwidth_bytes_s=H100_PCIE_BYTES_S,
    device_kv_bytes=int(H100_MEMORY_BYTES * GPU_MEMORY_UTILIZATION - _weights_bytes - ACTIVATION_RESERVE_BYTES),
    host_kv_bytes=int(HOST_KV_BYTES),
    max_num_batched_tokens=8192,
    swap_overlaps_forward=False,
    name="llama3-8b-h100",
    meta={"source": "first principles: Llama-3-8B shapes, bf16, H100 SXM 80 GB data sheet (docs/fidelity.md)",
          "max_model_len": 131072, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION},
)

PROFILES: dict[str, CostModel] = {LLAMA3_8B_H100.name: LLAMA3_8B_H100}


def profile_names() -> list[str]:
    """Every built-in profile name."""
    return [*BUILTIN_PROFILES, *PROFILES]


def load_profile(name_or_path: str) -> CostModel:
    """A built-in profile (``scheduler``'s or ``PROFILES``) by name, or a JSON file."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    try:
        return load_scheduler_profile(name_or_path)
    except ValueError as e:
        if "unknown cost profile" in str(e):
            raise ValueError(f"unknown cost profile {name_or_path!r}: not a built-in "
                             f"({', '.join(profile_names())}) and no such file") from None
        raise


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
    import jax

    if profile is not None:
        cost = load_profile(profile)
    else:
        cost = shipped_profile(jax.default_backend()) or load_profile("gptj-6b-a100-40g")
    return dataclasses.replace(cost, bytes_per_token=kv_bytes_per_token,
                               max_num_batched_tokens=max_num_batched_tokens)
