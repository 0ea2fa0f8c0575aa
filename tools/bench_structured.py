"""Cost of structured output: decode tokens/s with and without a JSON Schema
constraint, same engine, same prompts, in one run (goal: <= 10 % slowdown).

Every request runs to ``--max-tokens`` (``ignore_eos``; the schema's free-text
string field keeps a random-weight model inside the JSON), so both sides
generate the same number of tokens. Rounds alternate four ways, so a slow spell
of a shared machine hits them all; the medians are reported, with ratios paired
per round, in wall time and in process CPU time (all threads; less distorted by
other load than wall time):

- no constraint;
- JSON Schema, the engine's path for this backend (CPU: the mask filled first,
  then one step program that samples under it; accelerators: filled while the
  forward runs, then a second program samples);
- JSON Schema, the other path (``ModelExecutor.overlap_mask_fill`` flipped);
- JSON Schema as before 2026-11-23: the overlapped two-program path with the
  mask filled through ``llguidance.numpy.fill_next_token_bitmask`` row by row.

    python3 tools/bench_structured.py                       # demo model, batch 32
    python3 tools/bench_structured.py --model smollm2-135m --max-tokens 32
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    "summary": {"type": "string"}},
    "required": ["title", "rating", "tags", "summary"], "additionalProperties": False}


def library_fill(structured, rows, num_rows):
    """The mask fill before 2026-11-23: the library's per-row wrapper."""
    import llguidance.numpy
    import numpy as np
    start = time.perf_counter()
    bitmask = np.full((num_rows, structured.words), -1, np.int32)
    for matcher, row in rows:
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)
    structured.fill_s += time.perf_counter() - start
    return bitmask


def run(llm, prompts, params) -> tuple[float, int, int, float]:
    """Wall seconds, generated tokens, engine steps and process CPU seconds (all
    threads: less disturbed than wall time on a shared machine) of one ``generate``."""
    steps0 = llm.engine.stats.steps
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return elapsed, sum(len(o.token_ids) for o in outs), llm.engine.stats.steps - steps0, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()

    import numpy as np

    from jaxserve import LLM, SamplingParams, StructuredOutput
    llm = LLM(args.model, max_num_seqs=args.batch, max_num_batched_tokens=max(256, args.batch * args.prompt_len),
              max_model_len=args.prompt_len + args.max_tokens + 32)
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10, min(vocab, 400), args.prompt_len)] for _ in range(args.batch)]
    common = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=1, ignore_eos=True)
    plain = SamplingParams(**common)
    constrained = SamplingParams(**common, structured=StructuredOutput.json(SCHEMA))
    structured, executor = llm.engine.structured, llm.engine.executor
    default_overlap = executor.overlap_mask_fill
    this_path = "mask filled while the forward runs" if default_overlap else "mask filled first, one program"
    other_path = "mask filled first, one program" if default_overlap else "mask filled while the forward runs"

    def constrained_run(overlap: bool, old_fill: bool):
        executor.overlap_mask_fill = overlap
        if old_fill:
            structured.fill = lambda rows, num_rows: library_fill(structured, rows, num_rows)
        f0, steps0 = structured.fill_s, llm.engine.stats.steps
        try:
            result = run(llm, prompts, constrained)
        finally:
            executor.overlap_mask_fill = default_overlap
            structured.__dict__.pop("fill", None)
        return result, (structured.fill_s - f0) / (llm.engine.stats.steps - steps0)

    variants = {"plain": lambda: (run(llm, prompts, plain), 0.0),
                "this": lambda: constrained_run(default_overlap, False),
                "other": lambda: constrained_run(not default_overlap, False),
                "before": lambda: constrained_run(True, True)}
    for name in variants:   # compile every path for every bucket this run uses
        variants[name]()
    results = {name: [] for name in variants}
    fill = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, go in variants.items():
            result, fill_s = go()
            results[name].append(result)
            fill[name].append(fill_s)

    def ratio(name, index):   # per token, paired within each round, then the median over rounds
        return statistics.median((c[1] / c[index]) / (p[1] / p[index]) for c, p in zip(results[name], results["plain"]))

    print(f"model {args.model}, batch {args.batch}, prompt {args.prompt_len}, max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}, {args.rounds} interleaved rounds (medians; ratios paired per round)")
    for name, label in (("plain", "no constraint"), ("this", f"JSON Schema, {this_path} (engine)"),
                        ("other", f"JSON Schema, {other_path}"), ("before", "JSON Schema, before 2026-11-23")):
        tps = statistics.median(tok / s for s, tok, _, _ in results[name])
        step_ms = statistics.median(s / n * 1e3 for s, _, n, _ in results[name])
        print(f"  {label:58s} {tps:8.1f} tok/s ({step_ms:5.2f} ms/step, mask fill "
              f"{statistics.median(fill[name]) * 1e3:4.2f} ms/step)  speed ratio {ratio(name, 0):.3f}  "
              f"CPU-time speed ratio {ratio(name, 3):.3f}")
    for name, label in (("this", "engine now"), ("before", "before")):
        print(f"  slowdown from constraints, {label}: {100 * (1 - ratio(name, 0)):.1f} % wall, "
              f"{100 * (1 - ratio(name, 3)):.1f} % CPU time (goal <= 10 %)")


if __name__ == "__main__":
    main()
