"""Where a GGUF model's load time goes, part by part: each part first built and then read
back from what jaxserve keeps (``$JAXSERVE_CACHE_DIR``; a fresh temporary one per repeat),
and ``abstract_model`` against the same build with ``nnx.Rngs`` (what it did before).
Every timing runs in a fresh process (libraries keep parses of their own in-process),
the parts in turn, ``--repeats`` rounds.

    python3 tools/gguf_load_parts.py                       # smollm2-135m
    python3 tools/gguf_load_parts.py --model path/to/model.gguf --repeats 5

Prints the median seconds of each row and the kept / built ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIRS = {"index": ("index: parse the file", "index: kept"),
         "tokenizer": ("tokenizer: convert", "tokenizer: kept"),
         "abstract model": ("abstract model: nnx.Rngs", "abstract model: abstract_model")}


def child(part: str, model: str) -> None:
    """Time ``part`` once in this process; print its seconds."""
    sys.path.insert(0, str(ROOT))
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve import gguf_checkpoint
    from jaxserve.model_source import resolve_model
    from jaxserve.weights import abstract_model, model_class_for, read_config

    path = Path(resolve_model(model))
    if part.startswith("abstract"):
        cfg = read_config(path)
        cls = model_class_for(cfg.model_type)
        run = (lambda: nnx.eval_shape(lambda: cls(cfg, dtype=jnp.float32, attention_impl="reference",
                                                  rngs=nnx.Rngs(0)))) if part.endswith("nnx.Rngs") \
            else (lambda: abstract_model(cfg, jnp.float32, "reference"))
    elif part.startswith("index"):
        run = lambda: gguf_checkpoint.open_index(path)   # noqa: E731
    else:
        run = lambda: gguf_checkpoint.load_tokenizer(path)   # noqa: E731
    start = time.perf_counter()
    run()
    print(time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a .gguf file or smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model)
        return 0
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        cache = Path(tempfile.mkdtemp(prefix="gguf-parts-"))
        try:
            for built, kept in PAIRS.values():   # the first run of a pair fills the cache the second reads
                for part in (built, kept):
                    out = subprocess.run([sys.executable, __file__, "--model", args.model, "--child", part],
                                         env={**os.environ, "JAXSERVE_CACHE_DIR": str(cache)},
                                         capture_output=True, text=True, check=True)
                    rows.setdefault(part, []).append(float(out.stdout.strip().splitlines()[-1]))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{args.model}, median of {args.repeats} (each timing in a fresh process)")
    for name, seconds in median.items():
        print(f"  {name:<34} {seconds:8.3f} s")
    for part, (built, kept) in PAIRS.items():
        print(f"  {part}: {median[kept] / median[built]:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
