"""``jaxserve profile``: measure this device's cost model and write it as JSON.

Measures ``T_fwd(n)`` (the jitted step over ``n`` batched tokens, every token
bucket), fits ``T_fwd(n) = base + per_token · n``, sweeps the context each
sequence of a decode batch attends over and fits the per-context-token term
``T_fwd(n, c) − T_fwd(n, c_0) = per_context_token · (c − c_0)`` (``c``: cached
tokens the step reads in all), finds the saturation point
(the smallest bucket reaching 90 % of peak tokens/s), measures the engine's
host-side time per step (a real ``LLMEngine.step()`` of decoding requests minus
its jitted step), and measures host<->device copy bandwidth with
``jax.device_put`` to and from ``pinned_host`` memory, plus the engine's own
swap path (gather + copy out, copy in + scatter) for comparison. With
``--tensor-parallel-size N`` every measurement is of the sharded engine: the
step over the N-device mesh, copies of each device's slice.

The step times depend on the engine's shapes (each synthetic batch's page table
is as wide as a context of its token count needs, as ``prepare`` sizes it, up to
``max_model_len``), so measure with the settings you will serve or replay with;
they are recorded in ``meta``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, positive_int
from jaxserve.parallel.mesh import MODEL_AXIS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="demo", help="model: a checkpoint directory, a .gguf file, or a built-in name (demo, smollm2-135m)")
    EngineConfig.add_cli_arguments(parser, defaults={"num_pages": 512})   # room for the swap-path test
    parser.add_argument("--copy-mib", type=positive_int, default=64, help="size of the host<->device copy test")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--out", default=None, help="JSON path (default: ~/.cache/jaxserve/profiles/<backend>.json)")


def _median_time(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_step(runner, inputs) -> float:
    start = time.perf_counter()
    runner.forward(inputs)[0].block_until_ready()
    return time.perf_counter() - start


def measure_step_times(runner, repeats: int, per_round: int = 3) -> dict[int, float]:
    """Seconds per jitted step at each token bucket, on the runner's synthetic full batches:
    the median of ``repeats`` rounds that each time every bucket ``per_round`` times, so a
    slow spell of the machine lands on all buckets alike rather than on one."""
    inputs = {t_b: runner.synthetic_inputs(t_b) for t_b in runner.config.token_buckets}
    for batch in inputs.values():
        _time_step(runner, batch)   # warm
    samples: dict[int, list[float]] = {t_b: [] for t_b in inputs}
    for _ in range(repeats):
        for t_b, batch in inputs.items():
            samples[t_b] += [_time_step(runner, batch) for _ in range(per_round)]
    return {t_b: statistics.median(v) for t_b, v in samples.items()}


def context_inputs(runner, token_bucket: int, context: int):
    """``runner.synthetic_inputs(token_bucket, context)``: every sequence attends over
    ``context`` cached tokens (capped at ``max_model_len``; its page table as wide as
    the engine makes it for that context), queried at the last position; writes
    nothing to the cache."""
    import dataclasses

    context = max(1, min(context, runner.config.max_model_len))
    base = runner.synthetic_inputs(token_bucket, context=context)
    meta = dict(base.meta)
    meta["positions"] = np.full_like(meta["positions"], context - 1)
    return dataclasses.replace(base, meta=meta)


def measure_context_sweep(runner, repeats: int, token_bucket: int | None = None,
                          per_round: int = 3, factor: int = 2) -> tuple[int, dict[int, float]]:
    """``(rows, {context per sequence: step seconds})`` for a decode batch of one
    token per sequence (the smallest bucket of at least 8 rows) at contexts
    ``page_size, factor·page_size, factor²·page_size, … ≤ max_model_len`` (and
    ``max_model_len``), timed in interleaved rounds like ``measure_step_times``.
    One compilation per page-table width (``page_bucket``) the contexts reach:
    ``factor`` 4 compiles half as many as 2 (on a GPU each costs seconds)."""
    cfg = runner.config
    if token_bucket is None:
        token_bucket = next((b for b in cfg.token_buckets if b >= 8), cfg.token_buckets[-1])
    contexts, c = [], cfg.page_size
    while c <= cfg.max_model_len:
        contexts.append(c)
        c *= factor
    if contexts[-1] != cfg.max_model_len:
        contexts.append(cfg.max_model_len)
    inputs = {c: context_inputs(runner, token_bucket, c) for c in contexts}
    for batch in inputs.values():
        _time_step(runner, batch)   # warm
    samples: dict[int, list[float]] = {c: [] for c in inputs}
    for _ in range(repeats):
        for c, batch in inputs.items():
            samples[c] += [_time_step(runner, batch) for _ in range(per_round)]
    rows = cfg.seq_bucket(token_bucket)
    return rows, {c: statistics.median(v) for c, v in samples.items()}


def fit_context_term(rows: int, times: dict[int, float]) -> float:
    """Least-squares seconds per cached context token read (``rows`` sequences each
    reading the swept context); 0 when the step time does not grow with it."""
    c = np.array(sorted(times), dtype=np.float64)
    t = np.array([times[int(k)] for k in c])
    if len(c) < 2:
        return 0.0
    slope, _ = np.polyfit(rows * c, t, 1)
    return max(0.0, float(slope))


def fit_t_fwd(times: dict[int, float]) -> tuple[float, float, int]:
    """Least-squares ``(base_s, per_token_s)`` and the saturation bucket."""
    n = np.array(sorted(times), dtype=np.float64)
    t = np.array([times[int(k)] for k in n])
    per_token, base = np.polyfit(n, t, 1)
    throughput = n / t
    saturation = int(n[np.argmax(throughput >= 0.9 * throughput.max())])
    return max(0.0, float(base)), max(1e-9, float(per_token)), saturation


def measure_copy_bandwidth(runner, mib: int, repeats: int) -> tuple[float, float]:
    """Bytes/s of device->host and host->device ``jax.device_put`` of ``mib`` MiB,
    split over the executor's mesh (each device copies its slice, as swaps do)."""
    mesh = runner.mesh
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(MODEL_AXIS))   # a slice per device
    on_device = split.with_memory_kind(runner.device_sharding.memory_kind)
    on_host = split.with_memory_kind(runner.host_sharding.memory_kind)
    n = mib * 1024 * 1024 // 4 // mesh.size * mesh.size
    x = jax.jit(lambda: jnp.ones((n,), jnp.float32), out_shardings=on_device)()
    x.block_until_ready()
    nbytes = x.size * 4
    d2h = _median_time(lambda: jax.device_put(x, on_host).block_until_ready(), repeats)
    host = jax.device_put(x, on_host)
    h2d = _median_time(lambda: jax.device_put(host, on_device).block_until_ready(), repeats)
    return nbytes / d2h, nbytes / h2d


def measure_swap_path(runner, repeats: int) -> float:
    """Bytes/s of the engine's swap path: swap out then in of half the page pool, round trip."""
    from scheduler import Request, SwapOp
    n = max(1, runner.config.num_pages // 2)
    req = Request("profile", 0.0, prompt_len=1, max_tokens=1)
    pages = list(range(n))
    op = SwapOp(req, pages, pages)

    def round_trip():
        runner.swap_out([op])
        runner.swap_in([op])
        jax.block_until_ready(runner.kv)

    seconds = _median_time(round_trip, repeats)
    return 2 * n * runner.config.page_size * runner.kv_bytes_per_token / seconds


def measure_step_overhead(engine, num_seqs: int = 8, steps: int = 40) -> float:
    """Median seconds of host-side work in one ``engine.step()``: a real step with
    ``num_seqs`` decoding requests (scheduling, building the padded inputs, reading
    back and appending sampled tokens) minus the jitted step alone on a synthetic
    batch of the same token bucket, the two timed alternately so both see the same
    machine. Leaves the engine empty."""
    from jaxserve.sampling_params import SamplingParams

    runner = engine.executor
    num_seqs = max(1, min(num_seqs, engine.scheduler.config.max_num_seqs))
    bucket = next((b for b in runner.config.token_buckets if b >= num_seqs), None)
    if bucket is None:
        return 0.0
    synthetic = runner.synthetic_inputs(bucket)
    prompt_len = max(1, min(4, engine.max_model_len - 3))
    steps = max(1, min(steps, engine.max_model_len - prompt_len - 2))   # (a small --max-model-len: fewer steps)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    ids = [f"profile-overhead-{i}" for i in range(num_seqs)]
    for rid in ids:
        engine.add_request(rid, prompt_token_ids=[5] * prompt_len, sampling_params=params)
    try:
        engine.step()   # the prompts, then decode only
        differences = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            differences.append(time.perf_counter() - start - _time_step(runner, synthetic))
    finally:
        for rid in ids:
            engine.abort(rid)
    return max(0.0, statistics.median(differences))


def measure_profile(engine, repeats: int = 5, copy_mib: int = 64, model: str = "", dtype: str = "",
                    context_factor: int = 2):
    """A ``scheduler.CostModel`` measured on ``engine``'s device with its shapes
    (``context_factor``: the context sweep's step, see ``measure_context_sweep``)."""
    from scheduler import CostModel

    runner = engine.executor
    times = measure_step_times(runner, repeats)
    base, per_token, saturation = fit_t_fwd(times)
    rows, context_times = measure_context_sweep(runner, repeats, factor=context_factor)
    per_context = fit_context_term(rows, context_times)
    overhead = measure_step_overhead(engine)
    d2h, h2d = measure_copy_bandwidth(runner, copy_mib, repeats)
    swap_bw = measure_swap_path(runner, repeats)
    copy_bw = min(d2h, h2d)
    cfg = runner.config
    return CostModel(
        fwd_base_s=base, fwd_per_token_s=per_token, fwd_per_context_token_s=per_context,
        saturation_tokens=saturation,
        bytes_per_token=runner.kv_bytes_per_token, swap_bandwidth_bytes_s=copy_bw,
        device_kv_bytes=cfg.num_pages * cfg.page_size * runner.kv_bytes_per_token,
        host_kv_bytes=engine.scheduler.host_pool.num_pages * cfg.page_size * runner.kv_bytes_per_token,
        max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens,
        step_overhead_s=overhead, swap_overlaps_forward=False, name=f"{jax.default_backend()}-{engine.model_dir.name}",
        meta={"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "model": model,
              "tensor_parallel_size": runner.mesh.size,
              "dtype": dtype, "max_model_len": engine.max_model_len, "page_size": cfg.page_size,
              "step_times_s": {str(k): v for k, v in times.items()},
              "context_sweep": {"rows": rows, "step_times_s": {str(k): v for k, v in context_times.items()}},
              "d2h_bytes_s": d2h, "h2d_bytes_s": h2d, "swap_path_bytes_s": swap_bw,
              "swap_path_vs_copy": swap_bw / copy_bw, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})


def print_profile(cost) -> None:
    meta = cost.meta
    print(f"device: {meta['device']} ({meta['backend']}) x {meta.get('tensor_parallel_size', 1)} (tensor parallel), "
          f"max_model_len {meta['max_model_len']}")
    print("tokens  step_ms   tokens/s")
    for n, t in sorted((int(k), v) for k, v in meta["step_times_s"].items()):
        print(f"{n:6d}  {t * 1e3:7.2f}  {n / t:9.0f}")
    sweep = meta.get("context_sweep")
    if sweep:
        print(f"context per sequence ({sweep['rows']} decoding sequences)  step_ms")
        for c, t in sorted((int(k), v) for k, v in sweep["step_times_s"].items()):
            print(f"{c:8d}  {t * 1e3:7.2f}")
    print(f"T_fwd(n, c) = {cost.fwd_base_s * 1e3:.3f} ms + {cost.fwd_per_token_s * 1e6:.3f} us * n + "
          f"{cost.fwd_per_context_token_s * 1e9:.3f} ns * c; "
          f"saturation ~{cost.saturation_tokens} tokens; host-side step overhead {cost.step_overhead_s * 1e3:.3f} ms")
    print(f"host<->device copy: d2h {meta['d2h_bytes_s'] / 1e9:.2f} GB/s, h2d {meta['h2d_bytes_s'] / 1e9:.2f} GB/s")
    print(f"engine swap path (gather+copy out, copy in+scatter): {meta['swap_path_bytes_s'] / 1e9:.2f} GB/s "
          f"= {100 * meta['swap_path_vs_copy']:.0f}% of copy bandwidth")


def main(args: argparse.Namespace) -> int:
    from jaxserve.cli import refuse
    from jaxserve.engine import LLMEngine

    try:
        engine = LLMEngine(config=EngineConfig.from_cli(args, warmup=True))
    except (ValueError, OSError) as e:   # a bad setting, a model that is not there or does not load
        return refuse("profile", e)
    try:
        cost = measure_profile(engine, args.repeats, args.copy_mib, model=str(args.model), dtype=args.dtype)
    except jax.errors.JaxRuntimeError as e:   # (a --copy-mib buffer the device cannot hold)
        return refuse("profile", str(e).splitlines()[0])
    finally:
        engine.shutdown()
    out = Path(args.out) if args.out else Path.home() / ".cache" / "jaxserve" / "profiles" / f"{jax.default_backend()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cost.save(out)
    print_profile(cost)
    print(f"wrote {out}")
    return 0
