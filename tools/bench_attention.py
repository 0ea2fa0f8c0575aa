"""Achieved bandwidth of ragged paged attention vs the device's copy bandwidth.

For each context length it times a decode batch (``--batch`` sequences, one
query token each) and a mixed batch (the same decodes plus ``--prefill-chunks``
prefill chunks of ``--chunk-len`` tokens continuing a cached prefix), for the
reference and for the Pallas kernel of the current backend. Bandwidth counts
the bytes that must move: K and V of every valid cached token, plus q and the
output. The copy bandwidth is measured in the same run (read + write of a
large on-device array). On a Hopper GPU the default set is the reference,
the Mosaic GPU kernel and, while this JAX has Pallas Triton, the Triton
kernel; ``vs ref`` and ``vs triton`` are speedups over those two. A kernel
that cannot take the requested shapes/dtype (e.g. Mosaic GPU with float32)
prints its validation error instead of a time. Times are medians over ``--iters`` runs after
``--warmup`` runs, each ended by ``jax.block_until_ready``.

    python tools/bench_attention.py                      # defaults per backend
    python tools/bench_attention.py --check              # also compare with reference
    python tools/bench_attention.py --impl pallas_gpu --context-lens 2048,8192 --batch 64
    python tools/bench_attention.py --impl pallas_mosaic_gpu --interpret --dtype bfloat16 \
        --head-dim 64 --context-lens 128 --batch 2 --iters 1 --warmup 0   # CPU smoke test
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels  # noqa: E402

ON_ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
DEFAULTS = dict(  # (accelerator, cpu)
    batch=(64, 4), context_lens=("2048,4096,8192", "256,512"), num_q_heads=(32, 4),
    num_kv_heads=(8, 2), head_dim=(128, 64), dtype=("bfloat16", "float32"),
    chunk_len=(512, 32), copy_mib=(2048, 64), iters=(20, 5),
)


@dataclass
class Case:
    name: str
    context_len: int
    args: tuple[jax.Array, ...]
    bytes_moved: int
    num_tokens: int


def default(key: str):
    return DEFAULTS[key][0 if ON_ACCELERATOR else 1]


def median_seconds(fn, *args, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(mib: int, warmup: int, iters: int) -> float:
    """Bytes/s of an on-device elementwise copy (reads + writes ``mib`` MiB each)."""
    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    seconds = median_seconds(jax.jit(lambda a: a + 1.0), x, warmup=warmup, iters=iters)
    return 2 * x.nbytes / seconds


def make_case(name: str, q_lens: list[int], kv_lens: list[int], opts, rng) -> Case:
    """Random ragged batch with shuffled pages; q rows padded to a power of two."""
    dtype = jnp.dtype(opts.dtype)
    page_size = opts.page_size
    pages_needed = [-(-n // page_size) for n in kv_lens]
    pages_per_seq = max(pages_needed)
    num_pages = sum(pages_needed)
    page_ids = rng.permutation(num_pages).astype(np.int32)
    page_table = np.zeros((len(kv_lens), pages_per_seq), np.int32)
    start = 0
    for s, n in enumerate(pages_needed):
        page_table[s, :n] = page_ids[start:start + n]
        start += n
    num_real = sum(q_lens)
    num_tokens = 1 << (num_real - 1).bit_length()
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    key_q, key_k, key_v = jax.random.split(jax.random.PRNGKey(int(rng.integers(2**31))), 3)
    page_shape = (num_pages, page_size, opts.num_kv_heads, opts.head_dim)
    q = jax.random.normal(key_q, (num_tokens, opts.num_q_heads, opts.head_dim), dtype)
    k_pages = jax.random.normal(key_k, page_shape, dtype)
    v_pages = jax.random.normal(key_v, page_shape, dtype)
    args = (q, k_pages, v_pages, jnp.asarray(page_table), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32))
    kv_bytes = 2 * sum(kv_lens) * opts.num_kv_heads * opts.head_dim * dtype.itemsize
    q_out_bytes = 2 * num_real * opts.num_q_heads * opts.head_dim * dtype.itemsize
    return Case(name, max(kv_lens), args, kv_bytes + q_out_bytes, num_real)


def make_cases(opts) -> list[Case]:
    rng = np.random.default_rng(0)
    cases = []
    for context_len in opts.context_lens:
        decode_q, decode_kv = [1] * opts.batch, [context_len] * opts.batch
        cases.append(make_case("decode", decode_q, decode_kv, opts, rng))
        chunk_len = min(opts.chunk_len, context_len)
        cases.append(make_case(
            "mixed", decode_q + [chunk_len] * opts.prefill_chunks,
            decode_kv + [context_len] * opts.prefill_chunks, opts, rng))
    return cases


def default_impls(native: str) -> list[str]:
    """Reference, the backend's kernel and, next to Mosaic GPU, Triton while JAX has it."""
    impls = ["reference"] if native == "reference" else ["reference", native]
    if native == "pallas_mosaic_gpu" and kernels.triton_available():
        impls.append("pallas_gpu")
    return impls


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    native = kernels.default_impl()
    parser.add_argument("--impl", action="append", choices=kernels.IMPLS,
                        help=f"implementation(s) to time (repeatable; default reference"
                             f"{'' if native == 'reference' else ' and ' + native})")
    parser.add_argument("--interpret", action="store_true",
                        help="run Pallas kernels in interpret mode (smoke test off-device)")
    parser.add_argument("--batch", type=int, default=default("batch"), help="decode sequences")
    parser.add_argument("--context-lens", default=default("context_lens"),
                        help="comma-separated cached tokens per sequence")
    parser.add_argument("--prefill-chunks", type=int, default=2, help="prefill chunks in 'mixed'")
    parser.add_argument("--chunk-len", type=int, default=default("chunk_len"),
                        help="query tokens per prefill chunk")
    parser.add_argument("--dtype", default=default("dtype"), choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-q-heads", type=int, default=default("num_q_heads"))
    parser.add_argument("--num-kv-heads", type=int, default=default("num_kv_heads"))
    parser.add_argument("--head-dim", type=int, default=default("head_dim"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=default("iters"))
    parser.add_argument("--copy-mib", type=int, default=default("copy_mib"),
                        help="MiB for the copy-bandwidth measurement")
    parser.add_argument("--check", action="store_true",
                        help="check each kernel against the reference at every size")
    opts = parser.parse_args(argv)
    opts.context_lens = [int(x) for x in opts.context_lens.split(",")]
    impls = opts.impl or default_impls(native)
    opts.impl = sorted(set(impls), key=lambda impl: (impl != "reference", impl))  # Reference first.
    return opts


def main(argv=None) -> None:
    opts = parse_args(argv)
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
          f"dtype={opts.dtype} Hq={opts.num_q_heads} Hkv={opts.num_kv_heads} "
          f"D={opts.head_dim} page_size={opts.page_size} batch={opts.batch}")
    copy_bw = copy_bandwidth(opts.copy_mib, opts.warmup, opts.iters)
    print(f"copy bandwidth: {copy_bw / 1e9:.1f} GB/s ({opts.copy_mib} MiB read + written)\n")
    tolerance = 1e-4 if opts.dtype == "float32" else 3e-2
    header = (f"{'case':<7}{'ctx':>7}{'tokens':>8}  {'impl':<18}{'ms':>9}{'GB/s':>9}"
              f"{'% copy':>8}{'vs ref':>8}{'vs triton':>10}" + ("  check" if opts.check else ""))
    print(header)
    print("-" * len(header))
    failures = 0
    for case in make_cases(opts):
        baseline = {}  # impl -> seconds, for "reference" and "pallas_gpu"
        reference_out = None
        if "reference" in opts.impl or opts.check:
            ref_fn = jax.jit(functools.partial(kernels.ragged_paged_attention, impl="reference"))
            reference_out = ref_fn(*case.args)
        for impl in opts.impl:
            fn = jax.jit(functools.partial(kernels.ragged_paged_attention, impl=impl,
                                           interpret=opts.interpret))
            prefix = f"{case.name:<7}{case.context_len:>7}{case.num_tokens:>8}  {impl:<18}"
            try:
                seconds = median_seconds(fn, *case.args, warmup=opts.warmup, iters=opts.iters)
            except ValueError as error:  # Validation: shapes/dtype this kernel cannot take.
                print(f"{prefix}skipped: {error}")
                continue
            if impl in ("reference", "pallas_gpu"):
                baseline[impl] = seconds
            bandwidth = case.bytes_moved / seconds
            speedups = "".join(f"{f'{baseline[b] / seconds:.2f}x' if b in baseline else '-':>{w}}"
                               for b, w in (("reference", 8), ("pallas_gpu", 10)))
            line = (f"{prefix}{seconds * 1e3:>9.3f}{bandwidth / 1e9:>9.1f}"
                    f"{100 * bandwidth / copy_bw:>7.1f}%{speedups}")
            if opts.check:
                out = np.asarray(fn(*case.args), np.float32)[:case.num_tokens]
                expected = np.asarray(reference_out, np.float32)[:case.num_tokens]
                error = float(np.max(np.abs(out - expected) / (1.0 + np.abs(expected))))
                ok = np.isfinite(out).all() and error <= tolerance
                failures += not ok
                line += f"  {'ok' if ok else 'FAIL'} ({error:.1e})"
            print(line)
    if failures:
        sys.exit(f"{failures} check(s) failed")


if __name__ == "__main__":
    main()
