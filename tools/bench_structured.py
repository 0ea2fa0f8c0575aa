"""Cost of structured output: decode tokens/s with and without a JSON Schema
constraint, same engine, same prompts, in one run (goal: <= 10 % slowdown).

Every request runs to ``--max-tokens`` (``ignore_eos``; the schema's free-text
string field keeps a random-weight model inside the JSON), so both sides
generate the same number of tokens. Rounds alternate unconstrained /
constrained / constrained-without-overlap (the mask computed before the
forward is dispatched, as a serial engine would) so a slow spell of a shared
machine hits all three; the medians are reported, with the host time spent
filling masks per step.

    python3 tools/bench_structured.py                       # demo model, batch 32
    python3 tools/bench_structured.py --model /work/cache/smollm2-hf --max-tokens 32
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


def serial_masks(structured) -> None:
    """Make ``structured`` fill each step's mask before the forward is dispatched (no overlap)."""
    overlapped = structured.bitmask_fn

    def bitmask_fn(grammars, num_rows):
        fill = overlapped(grammars, num_rows)
        if fill is None:
            return None
        bitmask = fill()
        return lambda: bitmask
    structured.bitmask_fn = bitmask_fn


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
    structured = llm.engine.structured
    overlapped_fn = structured.bitmask_fn

    for p in (plain, constrained):   # compile both paths for every bucket this run uses
        run(llm, prompts, p)
    results = {"plain": [], "constrained": [], "serial": []}
    fill = []
    for _ in range(args.rounds):
        results["plain"].append(run(llm, prompts, plain))
        f0, r0 = structured.fill_s, structured.rows_filled
        results["constrained"].append(run(llm, prompts, constrained))
        fill.append((structured.fill_s - f0, results["constrained"][-1][2], structured.rows_filled - r0))
        serial_masks(structured)
        results["serial"].append(run(llm, prompts, constrained))
        structured.bitmask_fn = overlapped_fn

    def tps(name):
        return [tok / s for s, tok, _, _ in results[name]]

    def ratio(name):   # paired within each round, then the median over rounds
        return statistics.median(c / p for c, p in zip(tps(name), tps("plain")))

    print(f"model {args.model}, batch {args.batch}, prompt {args.prompt_len}, max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}, {args.rounds} interleaved rounds (medians; ratios paired per round)")
    for name, label in (("plain", "no constraint"), ("constrained", "JSON Schema, mask overlapped"),
                        ("serial", "JSON Schema, mask before dispatch")):
        tokens = statistics.median(tok for _, tok, _, _ in results[name])
        step_ms = statistics.median(s / n * 1e3 for s, _, n, _ in results[name])
        cpu_ratio = statistics.median(c[3] / c[1] / (p[3] / p[1]) for c, p in zip(results[name], results["plain"]))
        print(f"  {label:34s} {statistics.median(tps(name)):9.1f} tok/s  ({tokens} tokens, {step_ms:6.2f} ms/step)"
              f"  ratio {ratio(name):.3f}  CPU s/token ratio {cpu_ratio:.3f}")
    per_step = statistics.median(f / n * 1e3 for f, n, _ in fill)
    per_row = statistics.median(f / r * 1e6 for f, _, r in fill)
    print(f"  mask fill on the host: {per_step:.2f} ms/step, {per_row:.1f} us/row")
    print(f"  slowdown from constraints: {100 * (1 - ratio('constrained')):.1f} % (goal <= 10 %)")


if __name__ == "__main__":
    main()
