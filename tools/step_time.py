"""Time one decode step of the engine, and how long its jitted call takes to return.

    python tools/step_time.py --shape llama-1b --rows 32 --context 256 --steps 50
    XLA_FLAGS=--xla_gpu_... python tools/step_time.py ...     # the same step under other XLA flags
    python tools/step_time.py ... --trace DIR                  # and a jax.profiler trace of the timed steps
    python tools/step_time.py ... --forward-only               # the forward program alone, no sampler
    python tools/step_time.py ... --cuda-graphs                # the engine's cuda_graphs option on
    python tools/step_time.py ... --structured                 # a structured-output step (all tokens allowed)
    python tools/step_time.py ... --baseline REV               # and the same for git revision REV, with ratios
    python tools/step_time.py ... --baseline DIR --pairs 3     # a tree exported to DIR; 3 alternating pairs
    python tools/step_time.py ... --device-busy-steps 10       # and how much of a step the device computes

Builds the engine for a ``jaxserve.bench.SHAPES`` model with random weights, compiles one
decode step shape (``rows`` one-token sequences, each over ``context`` cached tokens) and
times ``steps`` calls of it. ``dispatch_ms`` is how long ``ModelExecutor.forward`` takes to
return (staging the inputs included; ``forward_logits`` with ``--forward-only``),
``ms_per_step`` how long until its result is ready. On an accelerator an asynchronous call
returns before its step ends, except that XLA:GPU runs a ``lax.cond`` by copying its
predicate to the host and waiting for it: the sampler's makes the whole step's call return
only at its end (H200, 2026-11-26: ``dispatch_share`` 0.99-1.00 with the sampler, 0.63
without), so ``--forward-only`` times the forward alone. The direct
measure of where a step's time goes is ``--device-busy-steps``: the device's busy time per
step against the step's wall time (0.42 on that H200 for a 1B decode step: the host bounds
it). Prints one JSON line (the last line of output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from git_export import export_revision

ROOT = Path(__file__).resolve().parents[1]


def measure(args: argparse.Namespace) -> dict:
    """``{"ms_per_step", "dispatch_ms", ...}``: medians over ``args.steps`` timed calls."""
    import jax

    from jaxserve.bench import SHAPES, shape_checkpoint
    from jaxserve.engine import LLMEngine
    from jaxserve.structured import bitmask_words
    model_dir = shape_checkpoint(SHAPES[args.shape])
    engine = LLMEngine(str(model_dir), dtype=args.dtype, load_format="dummy", page_size=16, num_pages=args.num_pages,
                       max_num_seqs=args.rows, max_num_batched_tokens=max(args.rows, 8), warmup=False,
                       max_model_len=max(2 * args.context, 64), compilation_cache=False,
                       attention_impl=args.attention_impl, cuda_graphs=args.cuda_graphs)
    try:
        runner = engine.executor
        bucket = next(b for b in runner.config.token_buckets if b >= args.rows)
        inputs = runner.synthetic_inputs(bucket, context=args.context)
        if args.forward_only:
            call = runner.forward_logits
        elif args.structured:   # every token allowed: the cost of the path, not of a grammar
            allow_all = np.full((len(inputs.logits_indices), bitmask_words(engine.model_config.vocab_size)), -1,
                                np.int32)
            call = lambda batch: runner.forward_sampled(batch, lambda: allow_all)[0]   # noqa: E731
        else:
            call = lambda batch: runner.forward(batch)[0]   # noqa: E731
        for _ in range(3):   # compile, then warm
            call(inputs).block_until_ready()
        dispatch, total = [], []
        with jax.profiler.trace(args.trace) if args.trace else contextlib.nullcontext():
            for _ in range(args.steps):
                start = time.perf_counter()
                out = call(inputs)
                returned = time.perf_counter()
                out.block_until_ready()
                dispatch.append(returned - start)
                total.append(time.perf_counter() - start)
        stream = device_busy(call, inputs, args.device_busy_steps) if args.device_busy_steps else None
        busy = None if stream is None else stream["busy_ms"]
        return {"shape": args.shape, "dtype": args.dtype, "rows": inputs.num_seqs, "token_bucket": bucket,
                "context": args.context, "attention_impl": runner.config.attention_impl,
                "backend": jax.default_backend(),
                "ms_per_step": 1e3 * statistics.median(total), "dispatch_ms": 1e3 * statistics.median(dispatch),
                "dispatch_share": statistics.median(dispatch) / statistics.median(total),
                "device_stream": None if stream is None else stream["line"], "device_busy_ms": busy,
                "device_share": None if busy is None else busy / (1e3 * statistics.median(total)),
                "forward_only": args.forward_only, "structured": args.structured, "cuda_graphs": args.cuda_graphs,
                "steps": args.steps,
                "xla_flags": os.environ.get("XLA_FLAGS", "")}
    finally:
        engine.shutdown()


def device_busy(call, inputs, steps: int) -> dict | None:
    """The device's busiest stream over ``steps`` more calls, from a ``jax.profiler``
    trace (``trace_summary.busiest_device_stream``): its record, milliseconds per step;
    None where the trace has no device stream (CPU)."""
    import jax

    import trace_summary
    with tempfile.TemporaryDirectory(prefix="step-trace-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                call(inputs).block_until_ready()
        lines = trace_summary.summarize(trace_summary.find_xplane(Path(trace_dir)), top=1, steps=steps)
    return trace_summary.busiest_device_stream(lines)


def parse_args(argv=None) -> argparse.Namespace:
    from jaxserve.bench import SHAPES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, default=32, help="one-token sequences in the step")
    parser.add_argument("--context", type=int, default=256, help="cached tokens each sequence attends over")
    parser.add_argument("--steps", type=int, default=50, help="timed calls")
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--attention-impl", default=None, help="kernels.IMPLS name (default: the device's)")
    parser.add_argument("--forward-only", action="store_true",
                        help="time the forward program alone, without the sampler (whose lax.cond makes XLA:GPU "
                             "wait for the step before it returns)")
    parser.add_argument("--structured", action="store_true",
                        help="time a structured-output step (every token allowed): on an accelerator the forward, "
                             "the host's bitmask, then the masked sampler as a second program")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="build the engine with cuda_graphs (XLA command buffers for the step programs); "
                             "without it they are off, to compare (the engine's own default is on on GPUs)")
    parser.add_argument("--trace", default=None, metavar="DIR", help="write a jax.profiler trace of the timed calls")
    parser.add_argument("--device-busy-steps", type=int, default=0, metavar="N",
                        help="after timing, trace N more calls and report the device's busy milliseconds per step "
                             "(device_share: busy / ms_per_step; near 1: the device bounds the step)")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also measure git revision REV (or the exported tree in folder REV, e.g. on a "
                             "machine without the repository's history), each in a fresh process, and print "
                             "the ratios")
    parser.add_argument("--pairs", type=int, default=1,
                        help="with --baseline: alternate baseline and this checkout this many times (the "
                             "ratios are the pairs' medians; the same program varies ~20 %% between fresh "
                             "processes on a GPU)")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.pairs > 1 and args.baseline is None:
        parser.error("--pairs needs --baseline")
    if args.structured and args.forward_only:
        parser.error("--structured and --forward-only time different programs: choose one")
    return args


def _child(src: Path, argv: list[str]) -> dict:
    """``src``'s tools/step_time.py with ``argv`` in a fresh process: its JSON line."""
    path = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))   # keep carried packages
    proc = subprocess.run([sys.executable, str(src / "tools" / "step_time.py"), *argv], cwd=src,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=path))
    if proc.returncode:
        sys.exit(f"step_time in {src} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less ``flags`` and their values (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def compare(args: argparse.Namespace, argv: list[str]) -> dict:
    """The same measurement for this checkout and for ``args.baseline``: a folder holding
    an exported tree (``jaxserve``, ``kernels``, ``scheduler``, ``tools``), or a git revision
    whose folders are exported to a temporary one; each run in a fresh process, baseline
    first, ``args.pairs`` times alternating. ``this`` and the baseline's entry are the last
    pair's runs; the ratios (this / baseline) are the pairs' medians, each pair's in ``pairs``."""
    own = _without(argv, ("--baseline", "--pairs"))
    with tempfile.TemporaryDirectory(prefix="step-time-") as tmp:
        src = Path(args.baseline).resolve()   # (the child runs in it: a relative path would resolve twice)
        if not (src / "tools" / "step_time.py").is_file():
            src = Path(tmp)
            export_revision(args.baseline, src, ("jaxserve", "kernels", "scheduler", "tools"))
        pairs = []
        for _ in range(args.pairs):
            base = _child(src, own)
            this = _child(ROOT, own)
            pairs.append({"dispatch_ratio": this["dispatch_ms"] / base["dispatch_ms"],
                          "ms_per_step_ratio": this["ms_per_step"] / base["ms_per_step"]})
    return {"this": this, args.baseline: base, "pairs": pairs,
            "dispatch_ratio": statistics.median(p["dispatch_ratio"] for p in pairs),
            "ms_per_step_ratio": statistics.median(p["ms_per_step_ratio"] for p in pairs)}


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
    parsed = parse_args()
    print(json.dumps(compare(parsed, sys.argv[1:]) if parsed.baseline else measure(parsed)))
