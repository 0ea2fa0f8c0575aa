"""Prove the engine on an accelerator in one command: kernels, bandwidth, engine
speed against transformers, swap bandwidth and a cost profile.

    python tools/gpu_validate.py --out DIR                  # on a GPU/TPU host (< 8 min on one H100)
    python tools/gpu_validate.py --out DIR --interpret --quick   # tiny shapes on CPU (CI)

Writes ``DIR/gpu_report.json`` (one object per section) and ``DIR/gpu_report.md``
(the same as tables), plus ``DIR/profile_<backend>.json`` (a cost profile the
simulator reads with ``--cost-profile``). Sections:

- ``backend``: device kind and count, memory, jax/jaxlib/flax/torch versions.
- ``kernels``: every ``ragged_paged_attention`` impl in ``kernels.IMPLS``, the
  reference included, against float64 attention on the host, on the kernel test
  cases (``tests/test_kernels.py``) plus a ``head_dim`` 128 case, bf16 and f32: max
  error and pass/fail. Pallas impls for another backend are listed as not
  applicable unless ``--interpret``.
- ``device_tests``: the suite's Mosaic GPU compiled tests and float32 parity tests run
  under pytest on the device, their summary (and failures) kept in the report.
- ``attention_bandwidth``: decode batch 64 at contexts 2k/4k/8k in bf16: achieved
  GB/s of each impl against the device's measured copy bandwidth and its speed-up
  over the reference.
- ``compile``: seconds to lower and to compile one decode step of the 1B shape (and of
  a two-layer cut of it), reference attention vs the device's kernel.
- ``engine_vs_transformers``: a Llama-3.2-1B-shaped model with random weights:
  output tokens/s of jaxserve and of transformers on the same device, same prompts.
- ``swap_bandwidth``: device -> ``pinned_host`` -> device round trip of KV pages
  by the engine's swap path against plain ``device_put`` copies, and the slowdown
  of a decode step that has a swap of the same pages issued with it.
- ``step_launch``: one decode step timed in child processes (``tools/step_time.py``): the
  whole step, and the forward alone under default XLA flags, XLA command buffers (CUDA
  graphs) and with the reference attention; each with ``device_share``, the device's busy
  time per step (from a short trace) over the step's wall time.
- ``profile``: ``jaxserve profile`` on this device, saved as a cost profile.

Each section is timed and isolated: one that fails is recorded with its error and
the next one runs. The exit status is 1 when any section failed or any kernel
check exceeded its tolerance. Before anything runs, the script imports what it
needs and names every missing package (see docs/benchmarks.md for wheels).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# What ``import jaxserve`` and the sections import (``jsonschema``: jaxserve.constraints, at import).
REQUIRED = ("jax", "jaxlib", "flax", "numpy", "safetensors", "tokenizers", "transformers", "torch", "jinja2", "tqdm",
            "jsonschema")
SECTIONS = ("backend", "kernels", "device_tests", "attention_bandwidth", "compile", "engine_vs_transformers",
            "swap_bandwidth", "step_launch", "profile")
# step_launch: the same decode step in a child process per variant.
STEP_VARIANTS = {   # name: (XLA_FLAGS added, tools/step_time.py arguments added)
    "default": ("", []),   # the whole step, ``cuda_graphs`` off (step_time's baseline; the engine's default is on)
    "forward_only": ("", ["--forward-only"]),
    # (the kinds of runs 4-5, the forward alone, so figures compare across sessions; the engine's
    # ``cuda_graphs`` adds conditionals and loops: ``jaxserve.executor.model.CUDA_GRAPH_COMMANDS``)
    "command_buffers": ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN "
                        "--xla_gpu_graph_min_graph_size=1", ["--forward-only"]),
    "cuda_graphs": ("", ["--cuda-graphs"]),   # the whole step with the engine's own option
    "structured": ("", ["--structured"]),      # forward, host bitmask, masked sampler (two programs)
    "reference_attention": ("", ["--forward-only", "--attention-impl", "reference"]),
}
# The suite's tests that mean most on an accelerator: the Mosaic GPU kernel compiled for real, and
# float32 token parity with transformers through the engine (its kernel choice, its precision).
DEVICE_TESTS = ("tests/test_kernels_mosaic_gpu.py", "tests/test_engine_parity.py")
DEVICE_TESTS_SELECTED = "compiled or empty or (greedy_matches_transformers and not interpret) or logits_match " \
                        "or full_precision"
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}   # max |out - ref| / (1 + |ref|)
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1}


def missing_packages() -> list[str]:
    """The names in ``REQUIRED`` that do not import."""
    missing = []
    for name in REQUIRED:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - any import failure means "not usable here"
            missing.append(name)
    return missing


def median_seconds(fn, warmup: int = 1, iters: int = 5) -> float:
    """Median wall seconds of ``fn()`` (which must block until its work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------- sections
def section_backend(opts) -> dict:
    import flax
    import jax
    import jaxlib
    import torch
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {"backend": jax.default_backend(), "device_kind": device.device_kind, "device_count": jax.device_count(),
            "memory_bytes": stats.get("bytes_limit"), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "flax": flax.__version__, "torch": torch.__version__, "torch_cuda": torch.cuda.is_available(),
            "memory_kinds": sorted(m.kind for m in device.addressable_memories()), "interpret": opts.interpret}


def _impl_platform(impl: str) -> str | None:
    """The backend a Pallas impl is written for, from its name (None: any backend)."""
    return "tpu" if "tpu" in impl else "gpu" if "gpu" in impl else None


def runnable_impls(opts) -> dict[str, str | None]:
    """Every impl in ``kernels.IMPLS`` -> None if it can run here, else why not."""
    import jax

    import kernels
    out = {}
    for impl in kernels.IMPLS:
        target = _impl_platform(impl)
        ok = target is None or opts.interpret or target == jax.default_backend()
        out[impl] = None if ok else f"written for {target}, backend is {jax.default_backend()}"
    return out


@functools.cache
def _kernel_tests():
    """``tests/test_kernels.py`` as a module: its cases, batches and float64 attention."""
    spec = importlib.util.spec_from_file_location("jaxserve_kernel_cases", ROOT / "tests" / "test_kernels.py")
    tk = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tk)
    return tk


def _kernel_cases(opts):
    """(name, dtype name, Batch, options) from the kernel tests, plus a head_dim 128 case per dtype."""
    import jax.numpy as jnp
    tk = _kernel_tests()
    names = list(tk.CASES)[:2] if opts.quick else list(tk.CASES)
    for name in names:
        batch, case = tk.case_batch(name)
        yield name, jnp.dtype(case["dtype"]).name, batch, case["options"]
    if not opts.interpret:
        for dtype in (jnp.float32, jnp.bfloat16):
            batch = tk.make_batch(7, **tk.MIXED, num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=dtype)
            yield f"gqa4_d128_{jnp.dtype(dtype).name}", jnp.dtype(dtype).name, batch, {}
    else:   # the smallest shape every kernel tiles (Mosaic GPU needs bf16/f16 and head_dim 64)
        batch = tk.make_batch(7, **tk.MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
        yield "gqa2_d64_bfloat16", "bfloat16", batch, {}


def _relative_error(out, truth, rows: int) -> float:
    """max |out - truth| / (1 + |truth|) over the first ``rows`` (real) query rows."""
    import numpy as np
    out = np.asarray(out, np.float64)[:rows]
    return float(np.max(np.abs(out - truth[:rows]) / (1.0 + np.abs(truth[:rows]))))


def section_kernels(opts) -> dict:
    """Every impl, the reference included, against float64 attention computed on the host
    (``numpy_attention`` of the kernel tests). A float32 cache is traced at the engine's
    float32 precision (``at_highest_precision``); ``reference_f32_default_precision_error``
    is the largest error of the reference over the float32 cases at JAX's default precision
    instead (which lets XLA:GPU use TF32)."""
    import jax
    import numpy as np

    import kernels
    from jaxserve.executor.model import at_highest_precision
    impls = runnable_impls(opts)
    rows, default_precision_error = [], None
    for name, dtype, batch, options in _kernel_cases(opts):
        truth = _kernel_tests().numpy_attention(batch, **options)
        real = sum(batch.q_lens)
        for impl, why_not in impls.items():
            row = {"case": name, "dtype": dtype, "impl": impl}
            if why_not:
                rows.append({**row, "status": "n/a", "note": why_not})
                continue
            call = functools.partial(kernels.ragged_paged_attention, impl=impl,
                                     interpret=opts.interpret and impl != "reference", **options)
            try:
                out = np.asarray(jax.jit(at_highest_precision(call) if dtype == "float32" else call)(*batch.args))
                error = _relative_error(out, truth, real)
                finite = bool(np.isfinite(out).all())
                ok = finite and error <= TOLERANCE[dtype]
                rows.append({**row, "status": "ok" if ok else "FAIL", "max_error": error, "finite": finite,
                             "tolerance": TOLERANCE[dtype]})
            except ValueError as exc:
                # The kernels' own checks before launch ("impl=...: needs ...") say a shape or dtype is
                # outside what the kernel tiles: a documented limit, not a failure.
                unsupported = str(exc).startswith(f"impl={impl!r}")
                rows.append({**row, "status": "unsupported" if unsupported else "FAIL",
                             "note": f"{type(exc).__name__}: {str(exc)[:300]}"})
            except Exception as exc:  # noqa: BLE001 - a kernel that does not build is a result
                rows.append({**row, "status": "FAIL", "note": f"{type(exc).__name__}: {str(exc)[:300]}"})
            if impl == "reference" and dtype == "float32":
                out = jax.jit(functools.partial(kernels.ragged_paged_attention, impl=impl, **options))(*batch.args)
                default_precision_error = max(default_precision_error or 0.0, _relative_error(out, truth, real))
    return {"impls": {k: v or "runs here" for k, v in impls.items()}, "checks": rows,
            "reference_f32_default_precision_error": default_precision_error,
            "passed": all(r["status"] != "FAIL" for r in rows)}


def _child_env(**overrides: str) -> dict[str, str]:
    """The environment of a child process on this device: this checkout importable, and no
    device memory preallocated (this process already holds its share)."""
    return dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **overrides)


def section_device_tests(opts) -> dict:
    """``DEVICE_TESTS`` under pytest in a child process on this device (``-k
    DEVICE_TESTS_SELECTED``; with ``--interpret`` only the kernel-choice tests, which
    proves the plumbing). The child does not preallocate device memory (this process
    has) and compiles at XLA's default optimization (``JAXSERVE_TEST_XLA_OPTIMIZE``); the
    report keeps pytest's summary and, on failure, the end of its output."""
    selected = "backend_selection" if opts.interpret else DEVICE_TESTS_SELECTED
    env = _child_env(JAXSERVE_TEST_XLA_OPTIMIZE="1")   # the suite's conftest would compile at LLVM level 0
    cmd = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", "-k", selected,
           *DEVICE_TESTS]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"selected": selected, "passed": False, "summary": "timed out after 300 s", "output_tail": out[-4000:]}
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1].strip("= ") if lines else "(no output)"
    body = {"selected": selected, "returncode": proc.returncode, "summary": summary,
            "passed": proc.returncode == 0}
    if proc.returncode:
        body["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
    return body


def section_attention_bandwidth(opts) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kernels
    sys.path.insert(0, str(ROOT / "tools"))
    import bench_attention
    tiny = opts.interpret
    shape = SimpleNamespace(dtype="bfloat16", page_size=16, num_q_heads=4 if tiny else 32,
                            num_kv_heads=2 if tiny else 8, head_dim=16 if tiny else 128)
    batch = 2 if tiny else 64
    contexts = ([32] if opts.quick else [32, 64]) if tiny else [2048, 4096, 8192]
    iters = 1 if tiny else 10
    copy_bw = bench_attention.copy_bandwidth(8 if tiny else 2048, 1, iters)
    impls = [i for i, why in runnable_impls(opts).items() if why is None]
    rng = np.random.default_rng(0)
    rows = []
    for context in contexts:
        case = bench_attention.make_case("decode", [1] * batch, [context] * batch, shape, rng)
        ref_seconds = None
        for impl in impls:
            row = {"context": context, "batch": batch, "impl": impl, "bytes": case.bytes_moved}
            try:
                fn = jax.jit(functools.partial(kernels.ragged_paged_attention, impl=impl,
                                               interpret=opts.interpret and impl != "reference"))
                seconds = bench_attention.median_seconds(fn, *case.args, warmup=1, iters=iters)
            except Exception as exc:  # noqa: BLE001
                rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
                continue
            if impl == "reference":
                ref_seconds = seconds
            rows.append({**row, "ms": 1e3 * seconds, "gb_s": case.bytes_moved / seconds / 1e9,
                         "fraction_of_copy": case.bytes_moved / seconds / copy_bw,
                         "speedup_vs_reference": ref_seconds / seconds if ref_seconds else None})
        del case
    return {"dtype": shape.dtype, "heads": [shape.num_q_heads, shape.num_kv_heads], "head_dim": shape.head_dim,
            "copy_gb_s": copy_bw / 1e9, "rows": rows, "dtype_itemsize": jnp.dtype(shape.dtype).itemsize}


def _shape_args(opts, **overrides) -> SimpleNamespace:
    """Arguments for ``jaxserve.bench`` runs at this run's scale."""
    tiny = opts.interpret
    args = dict(dtype="float32" if tiny else "bfloat16", page_size=16,
                max_num_batched_tokens=32 if tiny else 2048, prompt_len=16 if tiny else 128,
                max_tokens=8 if tiny else 128, num_prompts=4 if tiny else 32)
    args.update(overrides)
    per_seq = -(-(args["prompt_len"] + args["max_tokens"] + args["page_size"]) // args["page_size"])
    return SimpleNamespace(**args, num_pages=2 * args["num_prompts"] * per_seq)   # room for all, no more


def _shape_checkpoint(opts, **overrides) -> tuple[str, dict]:
    """A dummy-weight checkpoint of this run's model shape (``overrides`` changed in it)."""
    from jaxserve.bench import LLAMA_1B, shape_checkpoint
    shape = {**(TINY_LLAMA if opts.interpret else LLAMA_1B), **overrides}
    return str(shape_checkpoint(shape)), shape


def section_compile(opts) -> dict:
    """Seconds to lower and to compile one decode step (the smallest token bucket, 1k tokens of
    context) of the engine-benchmark shape, with all its layers and with two, for the reference
    attention and the device's kernel: where a cold start's compile time goes."""
    import kernels
    from jaxserve.engine import LLMEngine
    _, shape = _shape_checkpoint(opts)
    args = _shape_args(opts)
    context = 64 if opts.interpret else 1024
    impls = dict.fromkeys(["reference", kernels.default_impl(args.dtype)])
    rows = []
    for layers in sorted({shape["num_hidden_layers"], 2}, reverse=True):
        model_dir, _ = _shape_checkpoint(opts, num_hidden_layers=layers)
        for impl in impls:
            engine = LLMEngine(model_dir, dtype=args.dtype, load_format="dummy", page_size=args.page_size,
                               num_pages=64 if opts.interpret else 1024, max_num_seqs=64, warmup=False,
                               max_num_batched_tokens=args.max_num_batched_tokens, attention_impl=impl,
                               max_model_len=256 if opts.interpret else 4096, compilation_cache=False)
            try:
                runner = engine.executor
                inputs = runner.synthetic_inputs(runner.config.token_buckets[0], context=context)
                lower_s, compile_s = runner.compile_seconds(inputs)
            finally:
                engine.shutdown()
            rows.append({"layers": layers, "impl": impl, "token_bucket": inputs.token_bucket,
                         "page_table_width": inputs.meta["page_table"].shape[1],
                         "lower_s": lower_s, "compile_s": compile_s})
    return {"model": "tiny-llama" if opts.interpret else "llama-3.2-1b shape", "dtype": args.dtype, "rows": rows}


def section_engine_vs_transformers(opts) -> dict:
    import numpy as np

    from jaxserve.bench import run_jaxserve, run_transformers
    model_dir, shape = _shape_checkpoint(opts)
    args = _shape_args(opts)
    rng = np.random.default_rng(0)
    lens = rng.integers(args.prompt_len // 2, args.prompt_len + 1, args.num_prompts)
    prompts = [rng.integers(3, shape["vocab_size"], n).tolist() for n in lens]
    ours = run_jaxserve(model_dir, prompts, args, "dummy")
    ours.pop("outputs")
    ref = run_transformers(None, shape, prompts, args)
    return {"model": "tiny-llama" if opts.interpret else "llama-3.2-1b shape (random weights)",
            "dtype": args.dtype, "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "jaxserve": ours, "transformers": ref,
            "ratio": ours["tokens_per_s"] / ref["tokens_per_s"]}


def _engine(opts):
    """The engine the swap and profile sections share (built once: compiling is the slow part)."""
    from jaxserve.engine import LLMEngine
    if getattr(opts, "engine", None) is None:
        model_dir, _ = _shape_checkpoint(opts)
        args = _shape_args(opts)
        opts.engine = LLMEngine(model_dir, dtype=args.dtype, load_format="dummy", page_size=args.page_size,
                                num_pages=64 if opts.interpret else 4096, max_num_seqs=64,
                                max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=256 if opts.interpret else 4096, compilation_cache=not opts.interpret)
    return opts.engine


def section_swap_bandwidth(opts) -> dict:
    import jax

    from jaxserve.profiling import measure_copy_bandwidth
    from scheduler import Request, SwapOp
    runner = _engine(opts).executor
    iters = 2 if opts.interpret else 5
    n = 16 if opts.interpret else 1024   # pages per swap op
    pages = list(range(n))
    op = SwapOp(Request("validate", 0.0, prompt_len=1, max_tokens=1), pages, pages)
    nbytes = n * runner.config.page_size * runner.kv_bytes_per_token

    def round_trip():
        runner.swap_out([op])
        runner.swap_in([op])
        jax.block_until_ready(runner.kv)

    swap_s = median_seconds(round_trip, 1, iters)
    d2h, h2d = measure_copy_bandwidth(runner, max(1, nbytes // 2**20), iters)
    decode = runner.synthetic_inputs(runner.config.token_buckets[0], context=1024 if not opts.interpret else 64)

    def step():
        runner.forward(decode)[0].block_until_ready()

    def step_during_swap() -> float:
        """Seconds of one decode step dispatched right behind a swap-out of ``n`` pages
        (its copy still in flight); the swap-in that restores the pool is not timed."""
        jax.block_until_ready(runner.kv)
        runner.swap_out([op])
        start = time.perf_counter()
        runner.forward(decode)[0].block_until_ready()
        seconds = time.perf_counter() - start
        runner.swap_in([op])
        jax.block_until_ready(runner.kv)
        return seconds

    alone = median_seconds(step, 1, iters)
    step_during_swap()
    with_swap = statistics.median(step_during_swap() for _ in range(iters))
    return {"host_memory_kind": runner.host_sharding.memory_kind, "pages": n, "bytes": nbytes,
            "swap_round_trip_gb_s": 2 * nbytes / swap_s / 1e9, "copy_d2h_gb_s": d2h / 1e9, "copy_h2d_gb_s": h2d / 1e9,
            "swap_vs_copy": (2 * nbytes / swap_s) / (2 / (1 / d2h + 1 / h2d)),
            "decode_step_ms": 1e3 * alone, "decode_step_during_swap_ms": 1e3 * with_swap,
            "decode_slowdown": with_swap / alone,
            "swap_alone_ms": 1e3 * swap_s}


def section_step_launch(opts) -> dict:
    """``tools/step_time.py`` (one 32-row decode step of the 1B shape at 256 tokens of
    context) in a child process per ``STEP_VARIANTS`` entry: the whole step (``cuda_graphs`` off); the forward
    alone (no sampler, whose ``lax.cond`` makes XLA:GPU's call wait for the step), with
    default flags, with XLA command buffers (CUDA graphs) including custom calls, and with
    the reference attention (no Pallas custom call); the whole step with the engine's
    ``cuda_graphs`` option; a structured-output step (all tokens allowed: the forward, the
    host's bitmask, then the masked sampler). ``device_share`` is the device's busy
    time per step (from a trace of 10 more steps) over the step's wall time: near 1 the
    device bounds the step, well under 1 the host does.
    With ``--interpret``: the default variant on a small shape (proves the plumbing)."""
    variants = {"default": STEP_VARIANTS["default"]} if opts.interpret else STEP_VARIANTS
    shape = ["--shape", "llama-small", "--rows", "4", "--context", "64", "--steps", "3"] if opts.interpret else \
        ["--shape", "llama-1b", "--rows", "32", "--context", "256", "--steps", "50", "--device-busy-steps", "10"]
    rows = []
    for name, (flags, extra) in variants.items():
        env = _child_env(XLA_FLAGS=" ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), flags])))
        cmd = [sys.executable, str(ROOT / "tools" / "step_time.py"), *shape, *extra]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            rows.append({"variant": name, "error": "timed out after 180 s"})
            continue
        try:
            result = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):   # a child that failed (e.g. XLA refused a flag) prints no JSON
            rows.append({"variant": name, "error": (proc.stdout + proc.stderr)[-1500:]})
            continue
        rows.append({"variant": name, **{k: result[k] for k in ("attention_impl", "forward_only", "structured",
                                                                "cuda_graphs",
                                                                "rows", "context",
                                                                "ms_per_step", "dispatch_ms", "dispatch_share",
                                                                "device_stream", "device_busy_ms", "device_share")}})
    flags = {k: v[0] or ("(per program: --cuda-graphs)" if "--cuda-graphs" in v[1] else "(none)")
             for k, v in variants.items()}
    return {"shape": shape[1], "xla_flags": flags, "rows": rows,
            "passed": not any("error" in row for row in rows)}


def section_profile(opts, out: Path) -> dict:
    import jax

    from jaxserve.profiling import measure_profile
    # Contexts 4x apart: every page-table width is a compile (~7-20 s on the 1B shape on an H200).
    cost = measure_profile(_engine(opts), repeats=2 if opts.interpret else 5, copy_mib=8 if opts.interpret else 256,
                           model="tiny-llama" if opts.interpret else "llama-1b", dtype=_shape_args(opts).dtype,
                           context_factor=4)
    path = out / f"profile_{jax.default_backend()}.json"
    cost.save(path)
    return {"path": str(path), "fwd_base_ms": 1e3 * cost.fwd_base_s, "fwd_per_token_us": 1e6 * cost.fwd_per_token_s,
            "saturation_tokens": cost.saturation_tokens, "step_overhead_ms": 1e3 * cost.step_overhead_s,
            "swap_bandwidth_gb_s": cost.swap_bandwidth_bytes_s / 1e9,
            "step_times_ms": {k: 1e3 * v for k, v in cost.meta["step_times_s"].items()}}


# ----------------------------------------------------------------------- report
def _md_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_markdown(report: dict) -> str:
    """The report as Markdown: one heading per section, tables for lists of rows."""
    lines = ["# jaxserve accelerator report", ""]
    for name in SECTIONS:
        body = report.get(name)
        if body is None:
            continue
        lines += [f"## {name}", ""]
        scalars = {k: v for k, v in body.items() if not isinstance(v, (list, dict))}
        for k, v in scalars.items():
            if isinstance(v, str) and "\n" in v:   # a traceback or test output: verbatim
                lines += [f"- {k}:", "", "```", v.rstrip(), "```", ""]
            else:
                lines.append(f"- {k}: {_md_value(v)}")
        for k, v in body.items():
            if isinstance(v, dict):
                lines.append(f"- {k}: " + ", ".join(f"{a}={_md_value(b)}" for a, b in v.items()))
        for k, v in body.items():
            if isinstance(v, list) and v and isinstance(v[0], dict):
                cols = list(dict.fromkeys(c for row in v for c in row))
                lines += ["", f"{k}:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                lines += ["| " + " | ".join(_md_value(row.get(c, "")) for c in cols) + " |" for row in v]
        lines.append("")
    return "\n".join(lines)


def run(opts) -> int:
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    missing = missing_packages()
    if missing:
        print(f"missing packages: {', '.join(missing)}; carry them as wheels (docs/benchmarks.md, "
              f"'Accelerator kit') and run again", file=sys.stderr)
        return 2
    if opts.interpret:
        import jax
        jax.config.update("jax_platforms", "cpu")
    sys.path.insert(0, str(ROOT))
    wanted = opts.sections.split(",") if opts.sections else list(SECTIONS)
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]}
    runners = {"backend": section_backend, "kernels": section_kernels, "device_tests": section_device_tests,
               "attention_bandwidth": section_attention_bandwidth, "compile": section_compile,
               "engine_vs_transformers": section_engine_vs_transformers,
               "swap_bandwidth": section_swap_bandwidth, "step_launch": section_step_launch,
               "profile": lambda o: section_profile(o, out)}
    failed = []
    for name in SECTIONS:
        if name not in wanted:
            continue
        start = time.perf_counter()
        print(f"[{name}] ...", flush=True)
        try:
            body = runners[name](opts)
        except Exception as exc:  # noqa: BLE001 - record it, run the next section
            body = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
            failed.append(name)
        body["seconds"] = time.perf_counter() - start
        if body.get("passed") is False:
            failed.append(name)
        report[name] = body
        print(f"[{name}] {'FAILED' if name in failed else 'done'} in {body['seconds']:.1f} s", flush=True)
        (out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str))
        (out / "gpu_report.md").write_text(render_markdown(report))
    if getattr(opts, "engine", None) is not None:
        opts.engine.shutdown()
    report["failed_sections"] = failed
    (out / "gpu_report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_report.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 1 if failed else 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu_report.json / .md and the profile")
    parser.add_argument("--interpret", action="store_true",
                        help="tiny shapes on CPU, Pallas kernels in interpret mode (proves the script in CI)")
    parser.add_argument("--quick", action="store_true", help="fewer kernel cases (CI)")
    parser.add_argument("--sections", default=None, help=f"comma-separated subset of {','.join(SECTIONS)}")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(run(parse_args()))
