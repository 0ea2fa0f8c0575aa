"""Time one decode step of the engine, and how long its jitted call takes to return.

    python tools/step_time.py --shape llama-1b --rows 32 --context 256 --steps 50
    XLA_FLAGS=--xla_gpu_... python tools/step_time.py ...     # the same step under other XLA flags
    python tools/step_time.py ... --trace DIR                  # and a jax.profiler trace of the timed steps

Builds the engine for a ``jaxserve.bench.SHAPES`` model with random weights, compiles one
decode step shape (``rows`` one-token sequences, each over ``context`` cached tokens) and
times ``steps`` calls of it. ``dispatch_ms`` is how long ``ModelExecutor.forward`` takes to
return (staging the inputs included), ``ms_per_step`` how long until its tokens are ready. On
an accelerator an asynchronous call returns long before its step ends; a call that returns
only near the end means the host spends the step launching work (many small kernels), which
CUDA graphs (XLA command buffers) remove. Prints one JSON line (the last line of output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(args: argparse.Namespace) -> dict:
    """``{"ms_per_step", "dispatch_ms", ...}``: medians over ``args.steps`` timed calls."""
    import jax

    from jaxserve.bench import SHAPES, shape_checkpoint
    from jaxserve.engine import LLMEngine
    model_dir = shape_checkpoint(SHAPES[args.shape])
    engine = LLMEngine(str(model_dir), dtype=args.dtype, load_format="dummy", page_size=16, num_pages=args.num_pages,
                       max_num_seqs=args.rows, max_num_batched_tokens=max(args.rows, 8), warmup=False,
                       max_model_len=max(2 * args.context, 64), compilation_cache=False,
                       attention_impl=args.attention_impl)
    try:
        runner = engine.executor
        bucket = next(b for b in runner.config.token_buckets if b >= args.rows)
        inputs = runner.synthetic_inputs(bucket, context=args.context)
        for _ in range(3):   # compile, then warm
            runner.forward(inputs)[0].block_until_ready()
        dispatch, total = [], []
        with jax.profiler.trace(args.trace) if args.trace else contextlib.nullcontext():
            for _ in range(args.steps):
                start = time.perf_counter()
                tokens = runner.forward(inputs)[0]
                returned = time.perf_counter()
                tokens.block_until_ready()
                dispatch.append(returned - start)
                total.append(time.perf_counter() - start)
        return {"shape": args.shape, "dtype": args.dtype, "rows": inputs.num_seqs, "token_bucket": bucket,
                "context": args.context, "attention_impl": runner.config.attention_impl,
                "backend": jax.default_backend(),
                "ms_per_step": 1e3 * statistics.median(total), "dispatch_ms": 1e3 * statistics.median(dispatch),
                "dispatch_share": statistics.median(dispatch) / statistics.median(total),
                "steps": args.steps, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    finally:
        engine.shutdown()


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
    parser.add_argument("--trace", default=None, metavar="DIR", help="write a jax.profiler trace of the timed calls")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(measure(parse_args())))
