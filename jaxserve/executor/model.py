"""The model executor: the device side of a step (DESIGN section 3, step 3).

``ModelExecutor.execute(plan) -> StepResult`` applies a ``StepPlan``: page
copies between device and host (swap), then one jitted forward + sample over
the ragged batch. It owns the model parameters and the KV page arrays.

Shapes are padded to power-of-two buckets of T (tokens) so a bounded number
of programs is compiled; the KV arrays are donated to every program that
changes them, so no step copies the cache.

Everything lives on a device mesh (``jaxserve.parallel``): one device, or a
tensor-parallel ``"model"`` axis over which the parameters, the KV pages and
their host copies are split; step inputs are replicated and the sampled
tokens come back replicated, so every shard (and every process) sees the
same token.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.executor.packing import Layout, pack, unpack
from jaxserve.models import AttentionMetadata, ModelConfig
from jaxserve.outputs import TokenLogprob
from jaxserve.parallel.mesh import make_mesh
from jaxserve.parallel.sharding import (chunk_sharding, host_chunk_sharding, kv_pages_sharding, put_replicated,
                                        replicated, to_host)
from jaxserve.predictor.probe import probe_predict
from jaxserve.logit_adjust import step_adjustments
from jaxserve.sampling import (LogitAdjustments, SamplingArrays, adjust_logits, sample, sample_masked,
                              token_logprobs)
from jaxserve.sampling_params import MAX_LOGPROBS
from kernels import compute_capability
from scheduler import CACHE_OWNER, Request, ScheduledChunk, StepPlan, StepResult, SwapOp

log = logging.getLogger("jaxserve")


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def min_token_bucket_for(platform: str) -> int:
    """Smallest token bucket (padded tokens per step) for a backend (``jax.default_backend()``).

    On CPU a step's products cost in proportion to the padded rows, so a decode of one
    or two sequences runs in a 2-token step: SmolLM2-135M float32 decodes 1.5x more
    tokens per CPU second than in 8-token steps (``tools/decode_context.py``,
    docs/benchmarks.md). Not 1: in a 1-token program XLA CPU copies the whole KV pool
    (the one-slot write is not done in place) and the transposed embedding every step,
    slower than 8 rows and in proportion to the pool. On GPU/TPU a step of 8 rows
    costs what one of 2 does, so smaller buckets would only add programs to compile."""
    return 2 if platform == "cpu" else 8


def cuda_graphs_for(device, asked: bool | None) -> bool:
    """Whether the step programs are compiled as CUDA graphs (``step_compiler_options``):
    ``asked`` when given (``EngineConfig.cuda_graphs``), else on NVIDIA GPUs (a GPU
    ``jax.Device`` with a CUDA compute capability; not ROCm, never tried). On an H200
    a 1B decode step took 0.91x the time with them (three fresh-process pairs at 32
    rows, 0.94x at 128; docs/benchmarks.md, fourth GPU session), same tokens as without."""
    if asked is not None:
        return asked
    return device.platform == "gpu" and compute_capability(device) is not None


# XLA:GPU's command buffers (CUDA graphs) for every kind of command a step program issues: fusions,
# GEMMs, cuDNN, custom calls (the Pallas attention kernels), conditionals (the sampler's) and loops.
CUDA_GRAPH_COMMANDS = "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,CONDITIONAL,WHILE"


def step_compiler_options(platform: str, cuda_graphs: bool) -> dict[str, str | int] | None:
    """XLA compiler options of the step programs: with ``cuda_graphs`` on a GPU (XLA:GPU;
    tried on CUDA only), command buffers for every command kind, conditionals and loops
    included, however short the graph (``xla_gpu_graph_min_graph_size`` 1). XLA's defaults
    already put part of a step in command buffers; on an H200 the host's share of a 1B
    decode step was about half of it (docs/benchmarks.md). None elsewhere, and without
    ``cuda_graphs``: XLA's defaults."""
    if not cuda_graphs or platform != "gpu":
        return None
    return {"xla_gpu_enable_command_buffer": CUDA_GRAPH_COMMANDS, "xla_gpu_graph_min_graph_size": 1}


@dataclass(frozen=True)
class ModelExecutorConfig:
    page_size: int
    num_pages: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    kv_dtype: jnp.dtype
    attention_impl: str
    interpret: bool = False
    min_token_bucket: int = 8   # smallest token bucket compiled (see ``min_token_bucket_for``)
    min_page_bucket: int = 4    # narrowest page-table width compiled (pages per sequence)
    keep_logits: bool = False   # keep the last step's [S, vocab] logits (tests, debugging); costs memory
    cuda_graphs: bool = False   # GPU: step programs as CUDA graphs (``step_compiler_options``)

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    def page_bucket(self, pages: int) -> int:
        """Page-table width (pages per sequence) a step whose longest sequence spans
        ``pages`` pages is padded to: the next power of two, at least ``min_page_bucket``,
        at most ``pages_per_seq``. Attention reads only these columns, so a step costs
        in proportion to the batch's longest context, not to ``max_model_len``."""
        return min(self.pages_per_seq, max(self.min_page_bucket, next_power_of_two(pages)))

    @property
    def token_buckets(self) -> list[int]:
        top = next_power_of_two(self.max_num_batched_tokens)
        b, out = min(self.min_token_bucket, top), []
        while b <= top:
            out.append(b)
            b *= 2
        return out

    def seq_bucket(self, token_bucket: int) -> int:
        return min(token_bucket, next_power_of_two(self.max_num_seqs))


@dataclass
class StepInputs:
    """Host-side arrays for one step (padded) and which chunk rows sample.

    Row ``i < num_seqs`` of the logits is chunk ``i``'s last token (the one that
    samples); the sampling settings cover the first ``S_b`` rows, which the sampler
    reads. Prompt tokens scored for ``SamplingParams.prompt_logprobs`` take rows
    after those: ``scored`` lists ``(chunk index, first row, rows)``, and
    ``given[row]`` is the prompt token whose log-probability that row gives
    (-1 on the sampled rows: their sampled token's). ``adjust``: the sampled rows'
    logit adjustments (``jaxserve.logit_adjust.step_adjustments``), None when no row has any."""

    token_bucket: int
    input_ids: np.ndarray
    meta: dict[str, np.ndarray]
    logits_indices: np.ndarray
    sampling: dict[str, np.ndarray]
    num_seqs: int
    given: np.ndarray | None = None
    scored: list[tuple[int, int, int]] = field(default_factory=list)
    adjust: dict[str, np.ndarray] | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """What the step program is compiled for: (token bucket, page-table width, logits rows)."""
        return self.token_bucket, self.meta["page_table"].shape[1], len(self.logits_indices)


def at_highest_precision(fn: Callable) -> Callable:
    """``fn`` traced with every matrix product at full precision
    (``jax.default_matmul_precision("highest")``)."""
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)
    return traced


def _prompt_positions(chunk: ScheduledChunk) -> tuple[int, int]:
    """``(lo, hi)``: the places ``p`` in ``[lo, hi)`` of ``chunk`` (of a request that
    scores its prompt: ``SamplingParams.prompt_logprobs``) whose logits score prompt
    token ``p + 1``, those not scored yet (a recomputed chunk scores nothing twice);
    ``lo >= hi`` when none."""
    request = chunk.request
    scored = request.prompt_logprobs
    if len(scored) >= request.prompt_len:
        return 0, 0
    return max(chunk.start, len(scored) - 1), min(chunk.start + chunk.num_tokens, request.prompt_len - 1)


def step_arrays(inputs: StepInputs, sampling: bool = True) -> dict[str, np.ndarray]:
    """The small arrays of a step, by name, as ``_stage`` packs them (with the sampling
    settings unless ``sampling`` is False)."""
    arrays = {"input_ids": inputs.input_ids, "logits_indices": inputs.logits_indices, **inputs.meta}
    if sampling:
        arrays.update(inputs.sampling)
    return arrays


def _sampling_arrays(arrays: dict[str, jax.Array]) -> SamplingArrays:
    """The sampling settings among unpacked step arrays."""
    return SamplingArrays(**{f.name: arrays[f.name] for f in fields(SamplingArrays)})


def _sample_packed(logits: jax.Array, bitmask: jax.Array | None, packed: jax.Array, layout: Layout) -> jax.Array:
    """``sample`` of the sampled rows (the first ``S_b``; ``StepInputs``) with the sampling settings
    packed in one array: after their logit adjustments when the packed arrays hold them
    (``StepInputs.adjust``), under ``bitmask`` when given."""
    arrays = unpack(packed, layout)
    sampling = _sampling_arrays(arrays)
    rows = logits[:sampling.temperature.shape[0]]
    if "adjust_ids" in arrays:
        rows = adjust_logits(rows, LogitAdjustments(*(arrays[f"adjust_{f.name}"] for f in fields(LogitAdjustments))))
    return sample(rows, sampling) if bitmask is None else sample_masked(rows, bitmask, sampling)


class ModelExecutor:
    """Owns the model parameters and the KV cache on the device; runs steps.

    ``dispatch_s`` and ``device_wait_s`` accumulate the seconds spent inside
    the jitted call (on CPU this includes the compute) and waiting for the
    sampled tokens; ``last_logits`` is the last step's float32
    ``[rows, vocab]`` logits when ``keep_logits``. ``length_probe``
    (``jaxserve.predictor.serving.LengthProbeHook``): the learned length probe,
    run inside the step on every sampled row's final hidden state; its bins
    land in ``last_length_bins`` and its predictions on the requests.
    """

    def __init__(self, model: nnx.Module, model_config: ModelConfig, config: ModelExecutorConfig,
                 length_probe=None, mesh: Mesh | None = None) -> None:
        """``model``'s parameters already laid out on ``mesh`` (``load_model(mesh=...)``);
        ``mesh`` None: the first device. ``model_config`` as the shards see it."""
        self.model_config = model_config
        self.config = config
        self.mesh = mesh if mesh is not None else make_mesh(1, jax.devices()[:1])
        self.length_probe = length_probe
        self.length_probe_params = None if length_probe is None else \
            put_replicated({k: np.asarray(v) for k, v in length_probe.params.items()}, self.mesh)
        self.last_length_bins = None   # int32 [S_b] device array of the last step (with a probe)
        self.graphdef, params = nnx.split(model)
        # Flatten once: passing the nnx State pytree to every call costs ~1 ms of host time per step.
        self.params, self._params_treedef = jax.tree_util.tree_flatten(params)
        c = model_config
        self.replicated = replicated(self.mesh)
        self.device_sharding = kv_pages_sharding(self.mesh)
        self.host_sharding = host_chunk_sharding(self.mesh)
        self.chunk_sharding = chunk_sharding(self.mesh, self.device_sharding.memory_kind)
        shape = (config.num_pages, config.page_size, c.num_key_value_heads, c.head_dim)
        # Made in place, each device its own KV heads, and committed to the device sharding from the
        # start: the swap-in scatter returns the pool with this sharding, and a pool whose sharding
        # changed would recompile every step bucket.
        kv_shardings = [(self.device_sharding, self.device_sharding)] * c.num_hidden_layers
        self.kv = jax.jit(lambda: [(jnp.zeros(shape, config.kv_dtype), jnp.zeros(shape, config.kv_dtype))
                                   for _ in range(c.num_hidden_layers)], out_shardings=kv_shardings)()
        # A float32 model multiplies in IEEE float32, as transformers does: at DEFAULT precision
        # XLA:GPU may use TF32 (10-bit mantissa) for float32 dots, which moves logits by ~1e-3.
        traced = at_highest_precision if config.kv_dtype == jnp.float32 else (lambda fn: fn)
        # Step inputs arrive packed in one array (``jaxserve.executor.packing``); its layout is static.
        platform = self.mesh.devices.flat[0].platform
        options = step_compiler_options(platform, config.cuda_graphs)
        if config.cuda_graphs and options is None:
            log.warning("cuda_graphs is for GPUs: ignored on %s", platform)
        self._step = jax.jit(traced(self._step_fn), donate_argnums=(1,), static_argnums=(3,),
                             compiler_options=options)
        self._forward = jax.jit(traced(self._forward_fn), donate_argnums=(1,),   # structured output: sample apart
                                static_argnums=(3,), compiler_options=options)
        # Sampling apart from the forward: a structured-output mask filled while the device computes,
        # or logit adjustments (one small program per row and entry bucket, after ``_forward``).
        self._sample = jax.jit(_sample_packed, static_argnums=(3,), compiler_options=options)
        # Log-probabilities: a small program of their own over the step's logits, so a request that
        # asks compiles one program per row bucket, never a variant of every step shape mid-serving.
        self._logprobs = jax.jit(token_logprobs, static_argnums=(2,), compiler_options=options)
        # Structured output on CPU: the mask is filled before one step program. A second program per
        # step costs more there (a dispatch, the XLA thread pool woken again) than filling while the
        # forward runs saves (docs/benchmarks.md, structured output); accelerators overlap the two.
        self.overlap_mask_fill = self.mesh.devices.flat[0].platform != "cpu"
        self._gather = jax.jit(_gather_pages, out_shardings=self.chunk_sharding)
        self._scatter = jax.jit(_scatter_pages, donate_argnums=(0,), out_shardings=kv_shardings)
        # request id -> host page -> (host chunk, row in it): the host copies of swapped-out pages.
        self._host_store: dict[str, dict[int, tuple[jax.Array, int]]] = {}
        self.dispatch_s = 0.0
        self.device_wait_s = 0.0
        self.last_logits = None
        # (token bucket, page-table width, logits rows) run so far: one step program each
        self.step_shapes: set[tuple[int, int, int]] = set()
        # Structured output (``jaxserve.structured.StructuredDecoding``, set by the engine): gives the
        # token bitmask of a batch's constrained rows; None, or no constrained row: the plain step.
        self.constraints = None

    # ------------------------------------------------------------------- step
    def execute(self, plan: StepPlan) -> StepResult:
        """Swap-outs, swap-ins, then the forward + sample over ``plan.chunks``.
        Token ids come from each chunk's ``Request.token_ids``; sampling from its
        ``sampling_params`` and ``seed``."""
        if plan.swap_out:
            self.swap_out(plan.swap_out)
        if plan.swap_in:
            self.swap_in(plan.swap_in)
        if not plan.chunks:
            return StepResult()
        inputs = self.prepare(plan.chunks)
        start = time.perf_counter()
        fill = self.constraints and self.constraints.bitmask_fn(   # rows that sample a token only
            [c.request.grammar if c.samples else None for c in plan.chunks], len(inputs.sampling["temperature"]))
        device_tokens, logits = self.forward_sampled(inputs, fill or None)
        self.last_logits = logits if self.config.keep_logits else None
        with_logprobs = any(c.request.logprobs is not None for c in plan.chunks if c.samples)
        logprob_arrays = None
        if with_logprobs or inputs.scored:
            given = None if inputs.given is None else put_replicated(inputs.given, self.mesh)
            logprob_arrays = self._logprobs(logits, device_tokens, MAX_LOGPROBS, given)
        waited = time.perf_counter()
        tokens = to_host(device_tokens)
        logprobs = prompt_logprobs = None
        if logprob_arrays is not None:
            logprob_arrays = tuple(np.asarray(a) for a in jax.device_get(logprob_arrays))
            logprobs = self._logprob_records(plan.chunks, tokens.tolist(), logprob_arrays) if with_logprobs else None
            prompt_logprobs = self._prompt_records(plan.chunks, inputs, logprob_arrays) if inputs.scored else None
        self.dispatch_s += waited - start
        self.device_wait_s += time.perf_counter() - waited
        if self.length_probe is not None:   # before update(): the predictions are for the segment this row starts
            self.length_probe.record(plan.chunks, self.last_length_bins)
        return StepResult(token_ids=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _records(token_ids: list[int], arrays: tuple[np.ndarray, np.ndarray, np.ndarray], rows: slice,
                 k: int) -> list[TokenLogprob]:
        """A ``TokenLogprob`` for each of ``rows`` of the step's ``token_logprobs`` ``arrays``
        (its token from ``token_ids``, in order), with ``k`` alternatives."""
        values, top_ids, top_values = arrays
        top = zip(top_ids[rows, :k].tolist(), top_values[rows, :k].tolist())
        return [TokenLogprob(t, v, tuple(zip(a, b))) for t, v, (a, b) in zip(token_ids, values[rows].tolist(), top)]

    def _logprob_records(self, chunks: list[ScheduledChunk], tokens: list[int],
                         arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[TokenLogprob | None]:
        """``StepResult.logprobs``: a ``TokenLogprob`` for each chunk that samples for a
        request keeping them, with as many alternatives as it asked."""
        records: list[TokenLogprob | None] = [None] * len(chunks)
        for i, c in enumerate(chunks):
            if c.samples and c.request.logprobs is not None:
                records[i] = self._records([tokens[i]], arrays, slice(i, i + 1), c.request.sampling_params.logprobs)[0]
        return records

    def _prompt_records(self, chunks: list[ScheduledChunk], inputs: StepInputs,
                        arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[list[TokenLogprob]]:
        """``StepResult.prompt_logprobs``: for each chunk, a ``TokenLogprob`` per prompt token
        it scored (``inputs.scored``), in order."""
        records: list[list[TokenLogprob]] = [[] for _ in chunks]
        for i, row, n in inputs.scored:
            records[i] = self._records(inputs.given[row:row + n].tolist(), arrays, slice(row, row + n),
                                       chunks[i].request.sampling_params.prompt_logprobs)
        return records

    def release(self, request: Request) -> None:
        """Forget the host copies of an ended request's swapped-out pages."""
        self._host_store.pop(request.request_id, None)

    # ----------------------------------------------------------------- forward
    def _model_fn(self, params, kv, arrays: dict[str, jax.Array]):
        """The model over the ragged batch described by the unpacked step ``arrays``
        (``_stage``): ``(logits [R, V], kv, length bins int32 [S_b] or None)``, R the logits rows
        (``StepInputs.shape``)."""
        model = nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._params_treedef, params))
        input_ids, logits_indices = arrays["input_ids"], arrays["logits_indices"]
        meta = AttentionMetadata(**{f.name: arrays[f.name] for f in fields(AttentionMetadata)})
        if self.length_probe_params is None:
            logits, kv = model(input_ids, kv, meta, logits_indices, interpret=self.config.interpret)
            bins = None
        else:
            logits, kv, hidden = model(input_ids, kv, meta, logits_indices, interpret=self.config.interpret,
                                       return_hidden=True)
            bins = probe_predict(self.length_probe_params, hidden[:meta.kv_lens.shape[0]])   # the sampled rows
        # Gathered from the vocabulary shards: every shard samples the same token from the same logits.
        logits = jax.lax.with_sharding_constraint(logits, self.replicated)
        kv = jax.lax.with_sharding_constraint(kv, [(self.device_sharding, self.device_sharding)] * len(kv))
        return logits, kv, bins

    def _forward_fn(self, params, kv, packed: jax.Array, layout: Layout):
        """``_model_fn`` over the packed step inputs."""
        return self._model_fn(params, kv, unpack(packed, layout))

    def _step_fn(self, params, kv, packed: jax.Array, layout: Layout, bitmask: jax.Array | None = None):
        """Forward + sample over the packed step inputs; under ``bitmask`` (int32 ``[S_b,
        ceil(V / 32)]``) when given (a second compiled variant of the same program). The
        logits come back too (the sampler reads them from memory anyway): kept with
        ``keep_logits``, read by the log-probabilities program, else dropped at once."""
        arrays = unpack(packed, layout)
        logits, kv, bins = self._model_fn(params, kv, arrays)
        sampling = _sampling_arrays(arrays)
        rows = logits[:sampling.temperature.shape[0]]   # the sampled rows (rows after them score prompt tokens)
        tokens = sample(rows, sampling) if bitmask is None else sample_masked(rows, bitmask, sampling)
        return tokens, logits, kv, bins

    def _stage(self, inputs: StepInputs, sampling: bool = True) -> tuple[jax.Array, Layout]:
        """``step_arrays(inputs, sampling)`` packed and copied to the mesh in one transfer:
        ``(packed device array, layout)``. (A structured-output bitmask, up to megabytes a
        step, travels on its own: packing would copy it once more on the host.)"""
        flat, layout = pack(step_arrays(inputs, sampling))
        return put_replicated(flat, self.mesh), layout

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """Build padded host arrays for ``chunks`` (token ids from each request's
        context; sampling from its ``sampling_params``, ``seed`` and generated count)."""
        cfg = self.config
        num_tokens = sum(c.num_tokens for c in chunks)
        t_b = next((b for b in cfg.token_buckets if b >= num_tokens), None)
        if t_b is None:
            raise ValueError(f"step has {num_tokens} tokens, more than max_num_batched_tokens={cfg.max_num_batched_tokens}")
        s_b = cfg.seq_bucket(t_b)
        if len(chunks) > s_b:
            raise ValueError(f"step has {len(chunks)} sequences, more than the bucket allows ({s_b})")
        to_score = [(i, lo, hi) for i, c in enumerate(chunks) if c.request.prompt_logprobs is not None
                    for lo, hi in [_prompt_positions(c)] if lo < hi]   # (no call per chunk in the common step)
        # Logits rows: S_b; a step that scores prompt tokens has room for every token of its bucket
        # after them (one more variant per step shape, compiled only when a step scores).
        r_b = s_b + t_b if to_score else s_b
        ps = cfg.page_size
        input_ids = np.zeros(t_b, np.int32)
        positions = np.zeros(t_b, np.int32)
        slots = np.full(t_b, -1, np.int32)
        longest = max((-(-(c.start + c.num_tokens) // ps) for c in chunks), default=1)
        page_table = np.zeros((s_b, cfg.page_bucket(longest)), np.int32)
        kv_lens = np.zeros(s_b, np.int32)
        cu = np.zeros(s_b + 1, np.int32)
        logits_idx = np.zeros(r_b, np.int32)
        temp = np.zeros(s_b, np.float32)
        top_k = np.zeros(s_b, np.int32)
        top_p = np.ones(s_b, np.float32)
        min_p = np.zeros(s_b, np.float32)
        seed = np.zeros(s_b, np.uint32)
        step = np.zeros(s_b, np.int32)
        t = 0
        adjusting = []   # chunks of requests with logit adjustments
        for i, ch in enumerate(chunks):
            request = ch.request
            context = request.token_ids
            pages = request.device_pages
            n, start = ch.num_tokens, ch.start
            end = start + n
            if n == 1:  # decode: scalar fast path
                input_ids[t] = context[start]
                positions[t] = start
                slots[t] = pages[start // ps] * ps + start % ps
            else:
                input_ids[t:t + n] = context[start:end]
                pos = np.arange(start, end, dtype=np.int32)
                positions[t:t + n] = pos
                slots[t:t + n] = np.asarray(pages, np.int32)[pos // ps] * ps + pos % ps
            used = -(-end // ps)   # pages past the context are never read
            page_table[i, :used] = pages[:used]
            kv_lens[i] = end
            t += n
            cu[i + 1] = t
            logits_idx[i] = t - 1
            params = request.sampling_params
            temp[i], top_k[i], top_p[i], min_p[i] = params.temperature, params.top_k, params.top_p, params.min_p
            seed[i], step[i] = request.seed, request.num_generated - request.turn_start
            if request.logit_adjuster is not None:
                adjusting.append(i)
        cu[len(chunks) + 1:] = t
        given, scored = None, []
        if to_score:   # each scored place's logits row (after the sampled ones: nothing samples from it)
            given = np.full(r_b, -1, np.int32)
            row = len(chunks)
            for i, lo, hi in to_score:
                c = chunks[i]
                logits_idx[row:row + hi - lo] = cu[i] + np.arange(lo - c.start, hi - c.start, dtype=np.int32)
                given[row:row + hi - lo] = c.request.token_ids[lo + 1:hi + 1]
                scored.append((i, row, hi - lo))
                row += hi - lo
        meta = dict(positions=positions, slot_mapping=slots, page_table=page_table, kv_lens=kv_lens,
                    cu_q_lens=cu, num_seqs=np.array([len(chunks)], np.int32))
        sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step)
        adjusted = []   # (sampled row, its entries)
        for i in adjusting:
            c = chunks[i]
            request, adjuster = c.request, c.request.logit_adjuster
            if c.samples and adjuster.active(request.num_generated):
                adjusted.append((i, adjuster.entries(request.token_ids, c.start + c.num_tokens,
                                                     request.output_token_ids)))
        return StepInputs(t_b, input_ids, meta, logits_idx, sampling, len(chunks), given, scored,
                          step_adjustments(adjusted) if adjusted else None)

    def forward(self, inputs: StepInputs, bitmask: np.ndarray | None = None) -> tuple[jax.Array, jax.Array]:
        """Run the forward + sampler (under ``bitmask`` when given); returns device arrays
        ``(tokens [S_b], logits [R, V])`` (R: ``StepInputs.shape``)."""
        self.step_shapes.add(inputs.shape)
        packed, layout = self._stage(inputs)
        if bitmask is not None:
            bitmask = put_replicated(bitmask, self.mesh)
        tokens, logits, self.kv, self.last_length_bins = self._step(self.params, self.kv, packed, layout, bitmask)
        return tokens, logits

    def lower_step(self, inputs: StepInputs, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """The step program for ``inputs``'s shapes, traced and lowered (Pallas kernels
        are built here) for this backend or for ``platforms`` (e.g. ``("cuda",)`` on a
        machine without a GPU), bypassing the jit cache; nothing runs."""
        packed, layout = self._stage(inputs)
        return self._step.trace(self.params, self.kv, packed, layout).lower(lowering_platforms=platforms)

    def compile_seconds(self, inputs: StepInputs) -> tuple[float, float]:
        """``(lower_s, compile_s)``: seconds to ``lower_step(inputs)``, then to compile the
        result to the device (a read from the persistent compilation cache, when that is
        on and has it). Every call pays both again."""
        start = time.perf_counter()
        lowered = self.lower_step(inputs)
        lowered_at = time.perf_counter()
        lowered.compile()
        return lowered_at - start, time.perf_counter() - lowered_at

    def forward_sampled(self, inputs: StepInputs, fill_bitmask: Callable[[], np.ndarray] | None = None
                        ) -> tuple[jax.Array, jax.Array]:
        """The step as ``execute`` runs it: ``forward`` under the token bitmask ``fill_bitmask()``
        (int32 ``[S_b, ceil(V / 32)]``) when given, after ``inputs.adjust``'s logit adjustments.
        Returns device arrays ``(tokens [S_b], logits [R, V])``.

        - Adjustments: the fused step program (compiled for every step shape already) runs
          greedy, the cheap branch of its sampler, whose tokens are not used, for the logits;
          then the sampler program with the adjustments (and the mask): only that small
          program compiles, per row and entry bucket.
        - A mask on an accelerator (``overlap_mask_fill``): the forward alone is dispatched,
          the mask is filled while the device computes (dispatch is asynchronous), then the
          sampler program runs.
        - Otherwise one step program (a mask filled first: on CPU a second program costs
          more than the overlap saves)."""
        if inputs.adjust is not None:
            greedy = {**inputs.sampling, "temperature": np.zeros_like(inputs.sampling["temperature"])}
            _, logits = self.forward(replace(inputs, sampling=greedy))
            return self._sample_logits(logits, inputs, fill_bitmask), logits
        if fill_bitmask is not None and self.overlap_mask_fill:
            logits = self.forward_logits(inputs)
            return self._sample_logits(logits, inputs, fill_bitmask), logits
        return self.forward(inputs) if fill_bitmask is None else self.forward(inputs, fill_bitmask())

    def _sample_logits(self, logits: jax.Array, inputs: StepInputs,
                       fill_bitmask: Callable[[], np.ndarray] | None) -> jax.Array:
        """The sampler program over a step's ``logits``: ``inputs``' sampling settings and
        adjustments staged in one transfer, under ``fill_bitmask()`` when given."""
        flat, layout = pack({**inputs.sampling, **(inputs.adjust or {})})
        bitmask = None if fill_bitmask is None else fill_bitmask()
        bitmask, packed = put_replicated((bitmask, flat), self.mesh)
        return self._sample(logits, bitmask, packed, layout)

    def forward_logits(self, inputs: StepInputs) -> jax.Array:
        """Dispatch the forward alone (no sampler); returns the device array ``logits
        [R, V]`` float32 (R: ``StepInputs.shape``)."""
        self.step_shapes.add(inputs.shape)
        packed, layout = self._stage(inputs, sampling=False)
        logits, self.kv, self.last_length_bins = self._forward(self.params, self.kv, packed, layout)
        return logits

    def synthetic_inputs(self, token_bucket: int, context: int | None = None) -> StepInputs:
        """A full batch for ``token_bucket`` that writes nothing to the cache: as many
        one-token sequences as the bucket has rows, each attending over ``context``
        tokens (default ``min(token_bucket, max_model_len)``), its page table as wide as
        ``prepare`` makes it for that context. Used to compile and to time steps."""
        cfg = self.config
        t_b, s_b = token_bucket, cfg.seq_bucket(token_bucket)
        context = min(t_b if context is None else context, cfg.max_model_len)
        used = -(-context // cfg.page_size)
        page_table = np.zeros((s_b, cfg.page_bucket(used)), np.int32)
        page_table[:, :used] = np.arange(used, dtype=np.int32) % cfg.num_pages
        meta = dict(positions=np.arange(t_b, dtype=np.int32) % cfg.max_model_len,
                    slot_mapping=np.full(t_b, -1, np.int32),
                    page_table=page_table, kv_lens=np.full(s_b, context, np.int32),
                    cu_q_lens=np.minimum(np.arange(s_b + 1, dtype=np.int32), t_b), num_seqs=np.array([s_b], np.int32))
        sampling = dict(temperature=np.zeros(s_b, np.float32), top_k=np.zeros(s_b, np.int32),
                        top_p=np.ones(s_b, np.float32), min_p=np.zeros(s_b, np.float32), seed=np.zeros(s_b, np.uint32),
                        step=np.zeros(s_b, np.int32))
        return StepInputs(t_b, np.zeros(t_b, np.int32), meta, np.arange(s_b, dtype=np.int32), sampling, s_b)

    def warmup(self, swap_pages: int = 0, all_buckets: bool = False, all_shapes: bool = False) -> None:
        """Compile what the engine runs first: the decode step (smallest token bucket,
        narrowest page table) and the swap gather/scatter for every power-of-two op size
        up to ``swap_pages``. Other step shapes compile on first use (from the persistent
        compilation cache when it has them); ``all_buckets`` compiles every token bucket
        at the narrowest width now (profiling, benchmarks); ``all_shapes`` every token
        bucket at every page-table width (timed replays: nothing compiles mid-run)."""
        cfg = self.config
        buckets = cfg.token_buckets if all_buckets or all_shapes else cfg.token_buckets[:1]
        widths = sorted({cfg.page_bucket(p) for p in range(1, cfg.pages_per_seq + 1)}) if all_shapes else [None]
        for t_b in buckets:
            for width in widths:
                context = 1 if width is None else min(width * cfg.page_size, cfg.max_model_len)
                self.forward(self.synthetic_inputs(t_b, context=context))[0].block_until_ready()
        size = 1
        while swap_pages and size <= next_power_of_two(swap_pages):
            # Index arrays staged from numpy as swap_out/swap_in stage them (same programs).
            ids = put_replicated(np.zeros(size, np.int32), self.mesh)
            host = jax.device_put(self._gather(self.kv, ids), self.host_sharding)
            dropped = put_replicated(np.full(size, self.config.num_pages, np.int32), self.mesh)  # writes nothing
            self.kv = self._scatter(self.kv, jax.device_put(host, self.chunk_sharding), ids, dropped)
            size *= 2
        jax.block_until_ready(self.kv)

    # -------------------------------------------------------------------- swap
    def swap_out(self, ops: list[SwapOp]) -> None:
        """Copy each op's device pages to host memory (``pinned_host`` where the backend has it),
        filed under the op's owner (a request, or the prefix cache's host tier). A host page
        a request's copy lands in was given up by the host tier, if it held it: its old copy goes."""
        for op in ops:
            n = len(op.device_pages)
            ids = np.zeros(next_power_of_two(n), np.int32)
            ids[:n] = op.device_pages
            chunk = self._gather(self.kv, put_replicated(ids, self.mesh))
            host = jax.device_put(chunk, self.host_sharding)
            store = self._host_store.setdefault(op.owner, {})
            given_up = self._host_store.get(CACHE_OWNER) if op.request is not None else None
            for row, hp in enumerate(op.host_pages):
                store[hp] = (host, row)
                if given_up:
                    given_up.pop(hp, None)

    def swap_in(self, ops: list[SwapOp]) -> None:
        """Copy each op's host pages back into its (newly allocated) device pages:
        one host->device copy and one donated scatter per host chunk involved. The
        row ids are padded to the chunk's rows, so the scatter has the shapes
        ``warmup`` compiled even when only part of a chunk comes back. A
        request's host copies are dropped once copied back; the host tier's
        (an op without a request) stay, as the scheduler's books say."""
        for op in ops:
            groups: dict[int, tuple[jax.Array, list[int], list[int]]] = {}
            store = self._host_store[op.owner]
            take = store.pop if op.request is not None else store.__getitem__
            for hp, dp in zip(op.host_pages, op.device_pages):
                host, row = take(hp)
                _, rows, pages = groups.setdefault(id(host), (host, [], []))
                rows.append(row)
                pages.append(dp)
            for host, rows, pages in groups.values():
                size = host.shape[2]   # chunk rows: [L, 2, rows, page_size, Hkv, D]
                row_ids = np.zeros(size, np.int32)
                row_ids[:len(rows)] = rows
                page_ids = np.full(size, self.config.num_pages, np.int32)  # out of range -> dropped
                page_ids[:len(pages)] = pages
                chunk = jax.device_put(host, self.chunk_sharding)
                self.kv = self._scatter(self.kv, chunk, *put_replicated((row_ids, page_ids), self.mesh))

    # ---------------------------------------------- KV export/import (disaggregation)
    def read_pages(self, pages: list[int]) -> np.ndarray:
        """Host copy (numpy, ``jax.device_get``) of device ``pages``: ``[L, 2, n, page_size, Hkv, D]``."""
        n = len(pages)
        ids = np.zeros(next_power_of_two(n), np.int32)
        ids[:n] = pages
        return np.asarray(jax.device_get(self._gather(self.kv, put_replicated(ids, self.mesh))))[:, :, :n]

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        """Write ``data`` (``[L, 2, n, page_size, Hkv, D]``, from ``read_pages`` of an engine
        of the same model and dtype) into device ``pages`` with ``jax.device_put`` and the swap scatter."""
        n = len(pages)
        size = next_power_of_two(n)
        padded = np.zeros(data.shape[:2] + (size,) + data.shape[3:], data.dtype)
        padded[:, :, :n] = data
        page_ids = np.full(size, self.config.num_pages, np.int32)   # out of range -> dropped
        page_ids[:n] = pages
        chunk = jax.device_put(padded, self.chunk_sharding)
        self.kv = self._scatter(self.kv, chunk, *put_replicated((np.arange(size, dtype=np.int32), page_ids),
                                                                self.mesh))

    def host_memory_kind(self, request_id: str, host_page: int) -> str | None:
        """Memory kind of the host copy of ``host_page`` (e.g. ``"pinned_host"``); None if absent."""
        entry = self._host_store.get(request_id, {}).get(host_page)
        return None if entry is None else entry[0].sharding.memory_kind

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.model_config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * jnp.dtype(self.config.kv_dtype).itemsize


def _gather_pages(kv: list, page_ids: jax.Array) -> jax.Array:
    """``[L, 2, n, page_size, Hkv, D]``: the given pages of every layer's K and V."""
    return jnp.stack([jnp.stack([k[page_ids], v[page_ids]]) for k, v in kv])


def _scatter_pages(kv: list, chunk: jax.Array, rows: jax.Array, page_ids: jax.Array) -> list:
    """Write ``chunk[:, :, rows]`` (a swapped-out ``[L, 2, n, ...]`` chunk) into
    ``page_ids`` of every layer; out-of-range page ids are dropped."""
    data = chunk[:, :, rows]
    return [(k.at[page_ids].set(data[l, 0], mode="drop"), v.at[page_ids].set(data[l, 1], mode="drop"))
            for l, (k, v) in enumerate(kv)]


CPU_KV_BUDGET_BYTES = 512 * 1024**2


GIB = 1024**3


def pool_devices(mesh: Mesh | None = None) -> list:
    """This process's devices that hold the KV pool: those of ``mesh`` (default: the first device)."""
    return jax.devices()[:1] if mesh is None else \
        [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def _memory_stats(devices: list) -> list[tuple[int, int]] | None:
    """``(bytes_limit, bytes_in_use)`` of each device; None where a device reports none (CPU)."""
    stats = [d.memory_stats() or {} for d in devices]
    if not all("bytes_limit" in s for s in stats):
        return None
    return [(s["bytes_limit"], s.get("bytes_in_use", 0)) for s in stats]


def claim_memory_share(fraction: float, mesh: Mesh | None = None) -> list[int] | None:
    """Check, before an engine loads its weights, that its share of each pool device is
    free (``memory_share_problem``; arrays no longer referenced are collected first, so a
    shut-down engine's do not count). Returns the bytes in use per device then (what
    ``kv_pool_pages`` counts as not this engine's), or None on a backend that reports
    no memory (CPU). ``ValueError`` naming ``gpu_memory_utilization`` otherwise, raised by
    every process of a multi-process engine alike."""
    devices = pool_devices(mesh)
    if _memory_stats(devices) is None:
        return None
    gc.collect()
    stats = _memory_stats(devices)
    problems = (memory_share_problem(limit, in_use, fraction, str(d)) for d, (limit, in_use) in zip(devices, stats))
    _raise_on_every_process(next(filter(None, problems), None))
    return [in_use for _, in_use in stats]


def memory_share_problem(limit: int, in_use: int, fraction: float, device: str) -> str | None:
    """Why an engine cannot take ``fraction`` of a device's ``limit`` (bytes) when
    ``in_use`` bytes of it are held (by another engine of this process, say); None if
    it can."""
    if fraction * limit <= limit - in_use:
        return None
    return _share_text(fraction, limit, device,
                       f"but only {(limit - in_use) / GIB:.2f} GiB is free ({in_use / GIB:.2f} GiB is held already, by "
                       f"another engine in this process?); give each engine on a device its share (0.45 each "
                       f"for two) or set num_pages")


def kv_budget_bytes(limit: int, in_use_before: int, in_use_now: int, fraction: float) -> int:
    """Bytes of a device left for this engine's KV pool: its share, ``fraction`` of the
    device's ``limit``, less what loading it took (``in_use_now - in_use_before``: its
    weights). Negative when the weights take more than the share."""
    return int(fraction * limit) - (in_use_now - in_use_before)


def _share_text(fraction: float, limit: int, device: str, rest: str) -> str:
    """A ``gpu_memory_utilization`` error: the share asked for, then ``rest`` (why it cannot be had)."""
    return (f"gpu_memory_utilization={fraction:g} of {device}'s {limit / GIB:.2f} GiB is "
            f"{fraction * limit / GIB:.2f} GiB, {rest}")


def _raise_on_every_process(problem: str | None) -> None:
    """``ValueError(problem)`` if there is one, on every process of a multi-process engine
    when any of them has one: none is left waiting in a collective for one that stopped."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        anywhere = multihost_utils.process_allgather(np.array([problem is not None], np.int32))
        if problem is None and anywhere.any():
            problem = ("gpu_memory_utilization: another process of this engine found its share of a device "
                       "short (its error says how)")
    if problem is not None:
        raise ValueError(problem)


def kv_pool_pages(model_config: ModelConfig, page_size: int, kv_dtype, max_model_len: int, max_num_seqs: int,
                  fraction: float = 0.9, in_use_before: list[int] | None = None, max_pages: int | None = None,
                  mesh: Mesh | None = None) -> int:
    """Device KV pages for an engine with these limits.

    On backends that report their memory (GPU, TPU): what fits in this engine's share
    of the fullest device of ``mesh`` (default: the first device), ``fraction`` of its
    memory limit less what loading the engine took (``in_use_before``: bytes in use per
    pool device before, from ``claim_memory_share``; None: none). Each device holds
    ``1 / mesh.size`` of every page's KV heads (``model_config`` as the shards see it);
    with several processes the least free device of any process decides, so every
    process sizes the same pool. On CPU, which reports none and shares RAM with
    everything else: what ``max_num_seqs`` sequences of ``max_model_len`` tokens need,
    capped at ``CPU_KV_BUDGET_BYTES`` but never less than one full-length sequence.
    """
    tp = 1 if mesh is None else mesh.size
    per_page = page_size * 2 * model_config.num_hidden_layers * model_config.num_key_value_heads \
        * model_config.head_dim * jnp.dtype(kv_dtype).itemsize // tp
    devices = pool_devices(mesh)
    stats = _memory_stats(devices)
    if stats is not None:
        before = in_use_before or [0] * len(devices)
        free, device, limit, own = min((kv_budget_bytes(limit, was, in_use, fraction), str(device), limit, in_use - was)
                                       for device, (limit, in_use), was in zip(devices, stats, before))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            free = int(np.min(multihost_utils.process_allgather(np.array([free], np.int64))))
        if free < per_page:   # (every process sees the same least budget: all raise alike)
            raise ValueError(_share_text(fraction, limit, device, f"and the weights take {own / GIB:.2f} GiB of it: "
                                         f"less than one KV page ({per_page} bytes) is left; raise "
                                         f"gpu_memory_utilization, use a smaller dtype or more tensor-parallel "
                                         f"devices, or set num_pages"))
        pages = free // per_page
    else:
        per_seq = -(-max_model_len // page_size)
        pages = min(max_num_seqs * per_seq, max(per_seq, CPU_KV_BUDGET_BYTES // per_page))
    return min(pages, max_pages) if max_pages else pages
