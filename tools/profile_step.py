"""Where the time of one jitted engine step goes, per kind of XLA operation.

    python3 tools/profile_step.py --model /work/cache/smollm2-hf --rows 16 --context 64

Builds an engine (``max_num_seqs = --rows``), runs the jitted step on a
synthetic decode batch (``--rows`` one-token sequences, each attending over
``--context`` tokens, the page table as wide as ``prepare`` makes it) once to
compile it, then ``--calls`` times under ``jax.profiler`` and sums the trace's
per-operation events by operation kind (the HLO name without its number:
``ynn_fusion`` = a YNNPACK matmul fusion on XLA CPU, ``transpose_copy_fusion``,
...). Prints milliseconds per step and calls per step for the top kinds, and
checks the compiled program for what would make a step cost in proportion to
the KV pool: that every KV array is donated (aliased to an output) and that no
operation copies a pool-sized array. Last, the matmul floor: the step next to
one jitted program doing only the products of the same rows with every weight
matrix of the model (the LM head included), interleaved calls, CPU seconds:
how much of the step is the dense layers' arithmetic that any engine pays.

Wall times in the trace stretch with the machine's load; the shares between
kinds are what to read on a shared machine.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def op_times(trace_dir: Path, steps: int) -> list[tuple[str, float, float]]:
    """``(kind, ms per step, events per step)`` of the XLA operations in a perfetto trace, largest first."""
    trace_file = next(trace_dir.rglob("*.json.gz"))
    trace = json.load(gzip.open(trace_file))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        # Python frames ("$file:line fn") and the runtime's own spans are not operations.
        if e.get("ph") != "X" or name.startswith("$") or name.startswith("end: ") \
                or any(s in name for s in ("Thunk", "Slinky", "Pjit", "PjRt", "shard_args", "Handle ", "Parse")):
            continue
        kind = re.sub(r"\.\d+$", "", name)
        total[kind] += e.get("dur", 0)
        count[kind] += 1
    return [(k, t / 1e3 / steps, count[k] / steps) for k, t in total.most_common()]


def pool_checks(executor, inputs) -> dict:
    """From the compiled step: how many KV arrays are aliased to outputs (donated), and
    the copy operations whose result is as large as one layer's K or V pool."""
    text = executor.lower_step(inputs).compile().as_text()
    header = text.split("\n", 1)[0]
    aliased = len(re.findall(r"\{\d+\}: \(\d+, \{\}, may-alias\)", header))
    k_pool = executor.kv[0][0]
    shape = ",".join(str(d) for d in k_pool.shape)
    pool_copies = [line.strip()[:160] for line in text.splitlines()
                   if re.search(rf"\[{shape}\]\{{[^}}]*\}} (copy|transpose)\(", line)]
    return {"kv_arrays": 2 * len(executor.kv), "kv_arrays_aliased": aliased, "pool_copies": pool_copies}


def matmul_floor(executor, inputs, calls: int) -> tuple[float, float]:
    """Median process-CPU seconds of (the jitted step, a program of only its matmuls):
    ``rows x in`` times every 2-D weight ``[in, out]`` (the ``[vocab, hidden]``
    embedding as the LM head, transposed), the results summed so none is dropped."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    vocab = executor.model_config.vocab_size
    weights = [w for w in executor.params if w.ndim == 2]
    rows = inputs.num_seqs
    x = jnp.asarray(np.random.default_rng(0).normal(size=(rows, max(max(w.shape) for w in weights)))
                    .astype(np.float32))

    @jax.jit
    def dense(weights, x):
        total = jnp.float32(0)
        for w in weights:
            if w.shape[0] == vocab:   # embedding table = tied LM head
                total += jnp.sum(x[:, :w.shape[1]] @ w.T)
            else:
                total += jnp.sum(x[:, :w.shape[0]] @ w)
        return total

    programs = {"step": lambda: executor.forward(inputs)[0].block_until_ready(),
                "floor": lambda: dense(weights, x).block_until_ready()}
    times = {name: [] for name in programs}
    for name, run in programs.items():
        run()
    for _ in range(calls):
        for name, run in programs.items():
            start = time.process_time()
            run()
            times[name].append(time.process_time() - start)
    return float(np.median(times["step"])), float(np.median(times["floor"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--rows", type=int, default=16, help="decode rows (one token each)")
    parser.add_argument("--context", type=int, default=64, help="tokens each row attends over")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=5, help="profiled steps")
    parser.add_argument("--top", type=int, default=12, help="operation kinds printed")
    parser.add_argument("--floor-calls", type=int, default=10, help="interleaved calls for the matmul floor (0: skip)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import jax

    from jaxserve import LLM
    engine = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=args.rows).engine
    executor = engine.executor
    bucket = next((b for b in executor.config.token_buckets if b >= args.rows), executor.config.token_buckets[-1])
    inputs = executor.synthetic_inputs(bucket, context=args.context)
    executor.forward(inputs)[0].block_until_ready()
    with tempfile.TemporaryDirectory(prefix="jaxserve-trace-") as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(args.calls):
                executor.forward(inputs)[0].block_until_ready()
        ops = op_times(Path(tmp), args.calls)
    checks = pool_checks(executor, inputs)
    floor = matmul_floor(executor, inputs, args.floor_calls) if args.floor_calls else None
    engine.shutdown()
    width = inputs.meta["page_table"].shape[1]
    print(f"model {args.model}: {inputs.num_seqs} rows in a {bucket}-token step, context {args.context}, page table "
          f"{width} pages wide, KV pool {executor.config.num_pages} pages; {jax.default_backend()}")
    step_ms = sum(ms for _, ms, _ in ops)
    print(f"operations: {step_ms:.1f} ms per step in all (wall, from the trace)")
    for kind, ms, per_step in ops[:args.top]:
        print(f"  {ms:9.2f} ms {ms / step_ms:6.1%}  x{per_step:5.0f}  {kind}")
    print(f"KV arrays donated (aliased to an output): {checks['kv_arrays_aliased']} of {checks['kv_arrays']}; "
          f"pool-sized copies: {len(checks['pool_copies'])}")
    for line in checks["pool_copies"][:5]:
        print(f"  {line}")
    if floor:
        step_s, floor_s = floor
        print(f"matmul floor ({args.floor_calls} interleaved calls, median CPU): step {1e3 * step_s:.1f} ms, "
              f"its matmuls alone {1e3 * floor_s:.1f} ms -> step / floor = {step_s / floor_s:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
