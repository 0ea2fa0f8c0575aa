"""Single-request decode speed against ``max_model_len``, in one process.

    python tools/decode_context.py --model /work/cache/smollm2-hf --lens 2048,8192

For each ``max_model_len`` one engine decodes the same greedy request (a short
prompt, ``--max-tokens`` tokens); a first pass compiles the shapes, then
``--rounds`` timed passes alternate between the engines so a slow spell of the
machine lands on all of them. Decode tokens/s counts tokens after the first one
(prefill excluded). The baseline runs the same engines with every page table
padded to ``max_model_len`` (as before page-table bucketing); the ``8-row``
baseline runs them with the smallest token bucket at 8 tokens, what a CPU decode
step of one sequence was padded to before it ran as a 2-token step
(``min_token_bucket_for``). Goal
(issue 17): the longest and shortest ``max_model_len`` within 10 % of each other.

A second measurement isolates the jitted decode step from the engine's host
work: ``--step-calls`` calls per engine of the same one-row decode batch at the
request's final context, interleaved call by call (ABAB..., order reversed every
call pair), timed in wall and process CPU seconds; medians. On a shared machine
the CPU-second figures are the ones to read: they do not stretch with load.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def decode_tokens_per_s(engine, prompt_ids: list[int], max_tokens: int) -> tuple[float, float]:
    """Greedy decode of one request, from its first token to its last: tokens per wall
    second and tokens per process CPU second."""
    from jaxserve import SamplingParams
    engine.add_request("decode", prompt_token_ids=prompt_ids,
                       sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    first, count = None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.token_ids:
                first, first_cpu, count = time.perf_counter(), time.process_time(), len(out.token_ids)
            last_count = len(out.token_ids)
    tokens = last_count - count
    return tokens / (time.perf_counter() - first), tokens / (time.process_time() - first_cpu)


def step_seconds(engines: dict, context: int, calls: int) -> dict[int, tuple[float, float]]:
    """Median (wall, CPU) seconds of one jitted one-row decode step at ``context`` tokens,
    per engine; calls interleaved between the engines, the order flipped each pass."""
    from jaxserve.bench import interleaved_step_times
    runners = {n: e.executor for n, e in engines.items()}
    batches = {n: r.synthetic_inputs(r.config.token_buckets[0], context=context) for n, r in runners.items()}
    times = interleaved_step_times(runners, batches, calls)
    return {n: (statistics.median(wall), statistics.median(cpu)) for n, (wall, cpu) in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--lens", default="2048,8192")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--step-calls", type=int, default=30,
                        help="interleaved calls per engine of the jitted decode step alone (0: skip)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from jaxserve import LLM
    from jaxserve.config import EngineConfig
    lens = [int(x) for x in args.lens.split(",")]
    prompt = [5 + i % 100 for i in range(args.prompt_len)]
    engines = {n: LLM(args.model, max_model_len=n, max_num_seqs=1, max_num_batched_tokens=256,
                      gpu_memory_utilization=EngineConfig.gpu_memory_utilization / len(lens)).engine
               for n in lens}   # all alive on one device: each its part of one engine's share
    modes = ["bucketed"] + ([] if args.no_baseline else ["padded", "8-row"])
    configs = {}
    for n, engine in engines.items():
        cfg = engine.executor.config
        configs[n] = {"bucketed": cfg, "padded": dataclasses.replace(cfg, min_page_bucket=cfg.pages_per_seq),
                      "8-row": dataclasses.replace(cfg, min_token_bucket=8)}
    samples = {(n, m): [] for n in lens for m in modes}
    for round_ in range(args.rounds + 1):   # round 0 compiles
        for mode in modes:
            for n, engine in engines.items():
                engine.executor.config = configs[n][mode]
                rate = decode_tokens_per_s(engine, prompt, args.max_tokens)
                if round_:
                    samples[(n, mode)].append(rate)
    print(f"model {args.model}, one request, prompt {args.prompt_len} tokens, {args.max_tokens} generated, "
          f"median of {args.rounds} rounds")
    print(f"{'max_model_len':>14}{'mode':>12}{'tok/s':>9}{'tok/CPU s':>11}")
    medians = {k: statistics.median(r for r, _ in v) for k, v in samples.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
    for (n, mode), rate in medians.items():
        print(f"{n:>14}{mode:>12}{rate:9.1f}{cpu[(n, mode)]:11.1f}")
    lo, hi = min(lens), max(lens)
    for mode in modes:
        print(f"{mode}: tok/s at {hi} / at {lo} = {medians[(hi, mode)] / medians[(lo, mode)]:.3f} "
              f"(per CPU second: {cpu[(hi, mode)] / cpu[(lo, mode)]:.3f})")
    if "padded" in modes:
        print(f"bucketed / padded at {hi}: {medians[(hi, 'bucketed')] / medians[(hi, 'padded')]:.2f}x "
              f"(per CPU second: {cpu[(hi, 'bucketed')] / cpu[(hi, 'padded')]:.2f}x)")
        print(f"bucketed / 8-row at {lo}: {medians[(lo, 'bucketed')] / medians[(lo, '8-row')]:.2f}x "
              f"(per CPU second: {cpu[(lo, 'bucketed')] / cpu[(lo, '8-row')]:.2f}x)")
    if args.step_calls:
        for n, engine in engines.items():
            engine.executor.config = configs[n]["bucketed"]
        context = args.prompt_len + args.max_tokens
        step = step_seconds(engines, context, args.step_calls)
        print(f"jitted decode step alone, one row at context {context}, median of {args.step_calls} interleaved calls:")
        for n, (wall, cpu_s) in step.items():
            print(f"{n:>14}  {1e3 * wall:8.2f} ms wall  {1e3 * cpu_s:8.2f} ms CPU")
        print(f"step time at {hi} / at {lo} = {step[hi][0] / step[lo][0]:.3f} (wall), "
              f"{step[hi][1] / step[lo][1]:.3f} (CPU)")
    for engine in engines.values():
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
