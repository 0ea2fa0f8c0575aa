"""Cost model and InferCept's memory-waste equations (DESIGN section 6).

Times are seconds, memory is bytes, waste is byte-seconds (memory held idle
multiplied by how long it is held).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable


STEP_MODELS = ("linear", "buckets", "auto")


@dataclass(frozen=True)
class CostModel:
    """How long a step and a copy take on one device: the one cost model that the
    simulated clock and every waste/value equation of the policies read.

    ``T_fwd(n, c) = scale · (forward(n) + fwd_per_context_token_s · c)`` for a
    forward over ``n`` batched query tokens whose attention reads ``c`` cached
    context tokens in all (each chunk reads its request's whole context so far:
    a decode step of ``B`` requests with contexts ``c_j`` reads ``Σ c_j``), and
    ``T_step(n, c) = T_fwd(n, c) + scale · step_overhead_s`` the whole step (0
    for ``n == 0``). ``forward(n)`` per ``step_model``: ``linear``,
    ``fwd_base_s + fwd_per_token_s · n``; ``buckets``, the measured time of the
    smallest power-of-two bucket ``>= n`` in ``meta["step_times_s"]`` (written by
    ``jaxserve profile``; beyond the largest bucket, its time plus
    ``fwd_per_token_s`` per extra token), as the engine pads steps; ``auto``,
    buckets when the profile has them, else linear. ``scale`` is
    ``step_time_scale`` (1 unless asked: a what-if or a sensitivity check; it
    multiplies copies too). ``T_swap(n) = scale · n · bytes_per_token /
    swap_bandwidth_bytes_s`` for a one-way copy of ``n`` tokens' KV.
    ``saturation_tokens`` (S) is the batch size in tokens beyond which a step
    gets slower with no more throughput. ``step_overhead_s`` is the engine's
    host-side time per step outside the forward (scheduling, input building,
    reading back tokens). ``swap_overlaps_forward``: the copies of a step run
    behind its forward (InferCept's layer-pipelined swap, the published
    GPT-J/A100 setting) rather than before it (jaxserve's engine today, which
    ``jaxserve profile`` records).
    """

    fwd_base_s: float
    fwd_per_token_s: float
    saturation_tokens: int
    bytes_per_token: int
    swap_bandwidth_bytes_s: float
    device_kv_bytes: int = 0      # bytes of device memory available for KV
    host_kv_bytes: int = 0        # bytes of host memory for swapped KV
    max_num_batched_tokens: int = 512
    step_overhead_s: float = 0.0
    swap_overlaps_forward: bool = True
    fwd_per_context_token_s: float = 0.0   # seconds per cached context token read per step
    step_model: str = "auto"               # how forward(n) is computed: linear | buckets | auto
    step_time_scale: float = 1.0           # multiplies every step and copy time
    name: str = "unnamed"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("fwd_base_s", "fwd_per_token_s", "step_overhead_s", "fwd_per_context_token_s",
                     "swap_bandwidth_bytes_s"):   # (a bandwidth of 0: no host link, copies never finish)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name, least in (("saturation_tokens", 1), ("bytes_per_token", 1), ("max_num_batched_tokens", 1),
                            ("device_kv_bytes", 0), ("host_kv_bytes", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.step_model not in STEP_MODELS:
            raise ValueError(f"step model must be one of {', '.join(STEP_MODELS)}, got {self.step_model!r}")
        if not 0 < self.step_time_scale < math.inf:
            raise ValueError(f"step time scale must be a finite number > 0, got {self.step_time_scale}")
        try:
            table = sorted((int(k), float(v)) for k, v in ((self.meta or {}).get("step_times_s") or {}).items())
        except (TypeError, ValueError, AttributeError):
            raise ValueError("meta.step_times_s must map token counts to seconds") from None
        if any(not 0 < t < math.inf for _, t in table):
            raise ValueError("meta.step_times_s must hold finite times > 0")
        if self.step_model == "buckets" and not table:
            raise ValueError(f"profile {self.name!r} has no measured step times (meta.step_times_s); "
                             "use the linear step model")
        use = table if self.step_model in ("buckets", "auto") else []
        # Not a field: derived from meta, so asdict/to_json/replace never see it.
        object.__setattr__(self, "_bucket_sizes", [b for b, _ in use])
        object.__setattr__(self, "_bucket_seconds", [t for _, t in use])

    @property
    def resolved_step_model(self) -> str:
        """``buckets`` or ``linear``: what ``step_model`` (maybe ``auto``) came to."""
        return "buckets" if self._bucket_sizes else "linear"

    def timed(self, step_model: str = "auto", step_time_scale: float = 1.0) -> "CostModel":
        """This profile with another step model and scale (validated)."""
        if step_model == self.step_model and step_time_scale == self.step_time_scale:
            return self
        return dataclasses.replace(self, step_model=step_model, step_time_scale=step_time_scale)

    def _forward(self, num_tokens: float) -> float:
        sizes = self._bucket_sizes
        if not sizes:
            return self.fwd_base_s + self.fwd_per_token_s * num_tokens
        i = bisect.bisect_left(sizes, num_tokens)
        if i < len(sizes):
            return self._bucket_seconds[i]
        return self._bucket_seconds[-1] + self.fwd_per_token_s * (num_tokens - sizes[-1])

    def t_fwd(self, num_tokens: float, context_tokens: float = 0.0) -> float:
        """Seconds of the forward over ``num_tokens`` query tokens reading ``context_tokens``."""
        return self._with_context(self._forward(max(0.0, num_tokens)), context_tokens)

    def _with_context(self, forward: float, context_tokens: float) -> float:
        """Scaled seconds of a forward whose token part is ``forward`` (s) reading ``context_tokens``."""
        return self.step_time_scale * (forward + self.fwd_per_context_token_s * max(0.0, context_tokens))

    def t_step(self, num_tokens: float, context_tokens: float = 0.0) -> float:
        """Seconds of a whole step: ``T_fwd(n, c) + scale · step_overhead_s`` (0 for an empty step)."""
        if num_tokens <= 0:
            return 0.0
        return self.t_fwd(num_tokens, context_tokens) + self.step_time_scale * self.step_overhead_s

    def t_step_of_context(self, num_tokens: int) -> Callable[[float], float]:
        """``t_step(num_tokens, c)`` as a function of ``c`` alone (``num_tokens`` > 0), the
        token part computed once: the same arithmetic, so the same floats (decode runs)."""
        forward, overhead = self._forward(max(0.0, num_tokens)), self.step_time_scale * self.step_overhead_s
        scale, per_context = self.step_time_scale, self.fwd_per_context_token_s   # ``_with_context``, inlined
        # (``c if c > 0 else 0.0`` is ``max(0.0, c)`` without a call: once per simulated decode step)
        return lambda c: scale * (forward + per_context * (c if c > 0 else 0.0)) + overhead

    def t_swap(self, num_tokens: float) -> float:
        """Seconds of a one-way copy of ``num_tokens`` tokens' KV over the host link."""
        if self.swap_bandwidth_bytes_s <= 0:
            return math.inf
        return self.step_time_scale * num_tokens * self.bytes_per_token / self.swap_bandwidth_bytes_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        if not isinstance(data, dict):
            raise ValueError("cost profile must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"cost profile has unknown keys {sorted(unknown)}; expected {sorted(known)}")
        missing = {"fwd_base_s", "fwd_per_token_s", "saturation_tokens", "bytes_per_token",
                   "swap_bandwidth_bytes_s"} - set(data)
        if missing:
            raise ValueError(f"cost profile is missing {sorted(missing)}")
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        try:
            data = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"cost profile {path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:   # (TypeError: a field no dataclass field has a place for)
            raise ValueError(f"cost profile {path}: {e}") from None


# The context term of GPT-J 6B on an A100-40GB, from first principles (docs/fidelity.md):
# every step's attention reads each cached token's K and V of every layer once,
# 28 layers x 2 (K, V) x 4096 x 2 bytes (fp16) = 458,752 bytes per token, at the
# A100-40GB's 1.555e12 B/s HBM bandwidth, achieved at 60 % by a vLLM-era paged
# attention kernel (an assumption, stated; docs/fidelity.md gives the ±20 % band).
GPTJ_BYTES_PER_TOKEN = 28 * 2 * 4096 * 2
A100_40G_HBM_BYTES_S = 1.555e12
PAGED_ATTENTION_BANDWIDTH_EFFICIENCY = 0.6
GPTJ_A100_CONTEXT_S_PER_TOKEN = GPTJ_BYTES_PER_TOKEN / (A100_40G_HBM_BYTES_S * PAGED_ATTENTION_BANDWIDTH_EFFICIENCY)

# InferCept's published constants for GPT-J-6B on one A100-40GB, plus the context term.
GPTJ_6B_A100_40G = CostModel(
    fwd_base_s=0.010,
    fwd_per_token_s=0.0463e-3,
    fwd_per_context_token_s=GPTJ_A100_CONTEXT_S_PER_TOKEN,
    saturation_tokens=384,
    bytes_per_token=GPTJ_BYTES_PER_TOKEN,
    swap_bandwidth_bytes_s=25e9,
    device_kv_bytes=int(40e9 * 0.9 - 12.1e9),
    host_kv_bytes=int(64e9),
    max_num_batched_tokens=384,
    name="gptj-6b-a100-40g",
    meta={"source": "InferCept (APISERVE) paper constants; context term = bytes per token / "
                    "(HBM bandwidth x 0.6), docs/fidelity.md", "gpu_memory_utilization": 0.9},
)

# The same machine with the MARS seed's own step-time fit (16.9 ms + 0.041 ms per
# batched token) in place of InferCept's, and the same context term.
GPTJ_6B_A100_40G_MARS = dataclasses.replace(
    GPTJ_6B_A100_40G, fwd_base_s=0.0169, fwd_per_token_s=0.041e-3, name="gptj-6b-a100-40g-mars",
    meta={"source": "MARS seed's step-time fit (16.9 ms + 0.041 ms/token) with the "
                    "gptj-6b-a100-40g context term, docs/fidelity.md", "gpu_memory_utilization": 0.9})

BUILTIN_PROFILES: dict[str, CostModel] = {p.name: p for p in (GPTJ_6B_A100_40G, GPTJ_6B_A100_40G_MARS)}


def load_profile(name_or_path: str) -> CostModel:
    """A built-in profile by name, or a JSON file written by ``jaxserve profile``."""
    if name_or_path in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown cost profile {name_or_path!r}: not a built-in "
                         f"({', '.join(BUILTIN_PROFILES)}) and no such file")
    return CostModel.load(path)


def expected_cached_tokens(context_tokens: int, page_size: int, api_duration_s: float, horizon_s: float) -> int:
    """Tokens of a context released into the prefix cache that are expected
    still cached after ``api_duration_s`` seconds: its full pages if the call
    ends within ``horizon_s`` (how long released pages survive, 0: no cache),
    else the share ``horizon_s / api_duration_s`` of them (the page survives
    if the call ends before the eviction pressure reaches it)."""
    full = context_tokens // page_size * page_size
    if horizon_s <= 0 or full <= 0:
        return 0
    if api_duration_s <= horizon_s:
        return full
    return int(full * horizon_s / api_duration_s)


def waste_preserve(cost: CostModel, context_tokens: int, api_duration_s: float) -> float:
    """WastePreserve = T_API · C_i · M."""
    return api_duration_s * context_tokens * cost.bytes_per_token


def recompute_time(cost: CostModel, tokens: float) -> float:
    """Seconds of a step that recomputes ``tokens`` of one context, ``T_step(n, n)``:
    the waste equations' ``T_fwd``, on the simulated clock's cost model (the chunk's
    attention reads the context it rebuilds)."""
    return cost.t_step(tokens, tokens)


def waste_discard(cost: CostModel, context_tokens: int, other_tokens: int) -> float:
    """WasteDiscard = T_fwd(C_i)·C_i·M + T_fwd(C_i)·C_other·M (recompute in one go)."""
    t = recompute_time(cost, context_tokens)
    return t * (context_tokens + other_tokens) * cost.bytes_per_token


def waste_discard_chunked(cost: CostModel, context_tokens: int, other_tokens: int,
                          running_tokens: int) -> float:
    """Recompute in ``n`` chunks of ``S − running_tokens`` tokens each:
    ``T_fwd(C_i)·C_i·M / 2 + n · T_fwd(C_i/n) · C_other · M``.
    """
    room = max(1, cost.saturation_tokens - running_tokens)
    n = max(1, math.ceil(context_tokens / room))
    m = cost.bytes_per_token
    return (recompute_time(cost, context_tokens) * context_tokens * m / 2
            + n * recompute_time(cost, context_tokens / n) * other_tokens * m)


def waste_swap(cost: CostModel, context_tokens: int, other_tokens: int) -> float:
    """WasteSwap = 2 · T_swap(C_i) · C_batch · M (out and back in; others stall)."""
    return 2 * cost.t_swap(context_tokens) * (context_tokens + other_tokens) * cost.bytes_per_token


# --------------------------------------------------------------- policy values
# The policies' ranking values integrate memory over the time of the steps a
# request will take, each step priced by the same ``T_step(n, c)`` as the
# simulated clock (and, in the real engine, by the loaded/measured profile).


def _context_slope(cost: CostModel) -> float:
    """Seconds a step gains per context token read (``∂T_step/∂c``)."""
    return cost.step_time_scale * cost.fwd_per_context_token_s


def decode_cost(cost: CostModel, context_tokens: float, output_tokens: float) -> tuple[float, float]:
    """``(seconds, token-seconds)`` of decoding ``output_tokens`` one per step from a
    context of ``context_tokens``: step ``k`` is a saturated step that also reads
    the request's own context, ``T_step(S, C + k)``, holding ``C + k + ½`` tokens
    on average. The other requests' context reads are left out: at ranking time
    they are the same for every candidate and not known for the future batch."""
    n = max(0.0, output_tokens)
    if n <= 0:
        return 0.0, 0.0
    c = max(0.0, context_tokens)
    a, b = cost.t_step(cost.saturation_tokens), _context_slope(cost)
    s1 = n * c + n * (n - 1) / 2                                    # Σ (C + k)
    s2 = n * c * c + c * n * (n - 1) + (n - 1) * n * (2 * n - 1) / 6  # Σ (C + k)²
    return a * n + b * s1, a * (n * c + n * n / 2) + b * (s2 + s1 / 2)


def fill_cost(cost: CostModel, start_tokens: float, fill_tokens: float, chunk_tokens: int) -> tuple[float, float]:
    """``(seconds, token-seconds)`` of computing ``fill_tokens`` of KV on top of
    ``start_tokens`` already held (a prefill, a recompute after Discard, the
    returned tokens of an API call), in chunks of ``chunk_tokens`` one per step:
    chunk ``j`` ending at context ``e_j`` takes ``T_step(n_j, e_j)`` (its attention
    reads the context so far) and holds ``e_j − n_j/2`` tokens on average."""
    fill = max(0.0, fill_tokens)
    if fill <= 0:
        return 0.0, 0.0
    ch = max(1, int(chunk_tokens))
    s = max(0.0, start_tokens)
    b = _context_slope(cost)
    full = int(fill // ch)
    rest = fill - full * ch
    seconds = area = 0.0
    if full:
        a = cost.t_step(ch)
        e1 = full * s + ch * full * (full + 1) / 2                        # Σ e_j
        e2 = full * s * s + s * ch * full * (full + 1) + ch * ch * full * (full + 1) * (2 * full + 1) / 6
        seconds += a * full + b * e1
        area += a * (e1 - full * ch / 2) + b * (e2 - ch / 2 * e1)
    if rest > 0:
        end = s + fill
        t = cost.t_step(rest, end)
        seconds += t
        area += t * (end - rest / 2)
    return seconds, area


def swap_ramp_seconds(cost: CostModel, tokens: float, tokens_per_step: int) -> float:
    """Seconds to copy ``tokens`` of KV one way at ``tokens_per_step`` per saturated
    step (``T_step(S)`` each), or at the host link's pace if that is slower."""
    if tokens <= 0:
        return 0.0
    steps = math.ceil(tokens / max(1, tokens_per_step))
    return max(steps * cost.t_step(cost.saturation_tokens), cost.t_swap(tokens))
