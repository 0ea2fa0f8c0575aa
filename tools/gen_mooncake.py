"""A synthetic Mooncake-format hour shaped like the public conversation trace.

    python tools/gen_mooncake.py --out /tmp/mooncake_hour.jsonl          # 12,000 requests, 1 h
    python tools/gen_mooncake.py --requests 2000 --duration 600 --out small.jsonl

The public trace (Mooncake's conversation trace: an hour of production
requests, ~12k input tokens on average) is not bundled; this writes a trace
with its shape, in its format (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks):

* conversations start as a Poisson process; a conversation has 1 + a
  geometric number of further turns (``--mean-turns`` in all), the next turn
  arriving a log-normal think time after the previous one (median
  ``--think-s``), so prefixes are re-used minutes apart, as in the public
  trace (its reuse is 37 % with an unbounded cache but ~4 % with an LRU the
  size of one GPU's KV pool);
* the first turn is a log-normal document/context (median ``--first-input``
  tokens, capped at 120k), a fifth of them behind one of 50 shared system
  prompts (Zipf-popular, 1-4k tokens);
* every later turn's input is the previous input + its output + a new user
  message; its ``hash_ids`` repeat the previous turn's full blocks and give
  new ids to the rest (a partial last block changes when tokens are appended);
* outputs are log-normal around ``--mean-output`` tokens.

It prints the trace's cache bounds (``jaxserve.replay.mooncake.cache_bounds``)
at the ``llama3-8b-h100`` device pool and at 8M tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.profiles import LLAMA3_8B_H100  # noqa: E402
from jaxserve.replay.mooncake import cache_bounds, to_jsonl  # noqa: E402
from jaxserve.replay.page_keys import MOONCAKE_BLOCK_TOKENS as BLOCK  # noqa: E402
from jaxserve.replay.trace import load_trace  # noqa: E402

MAX_INPUT = 120_000
NUM_SYSTEM_PROMPTS = 50


def generate(num_requests: int, duration_s: float, seed: int, mean_turns: float, think_s: float,
             first_input: float, mean_output: float) -> list[dict]:
    """``num_requests`` Mooncake records over ``duration_s`` seconds, sorted by time."""
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system = [(fresh(int(k)), int(k) * BLOCK) for k in rng.integers(2, 9, NUM_SYSTEM_PROMPTS)]
    popularity = 1.0 / np.arange(1, NUM_SYSTEM_PROMPTS + 1)
    popularity /= popularity.sum()
    conversations = max(1, int(1.04 * num_requests / mean_turns))   # turns past the hour are cut
    starts = np.sort(rng.uniform(0, duration_s, conversations))
    records = []
    for start in starts:
        turns = int(rng.geometric(1.0 / mean_turns))
        length = int(rng.lognormal(np.log(first_input), 0.9))
        ids: list[int] = []              # the blocks kept from before (whole blocks only)
        if rng.random() < 0.2:
            prefix, tokens = system[int(rng.choice(NUM_SYSTEM_PROMPTS, p=popularity))]
            ids, length = list(prefix), tokens + length
        t = float(start)
        for _ in range(turns):
            length = min(length, MAX_INPUT)
            ids = ids[:length // BLOCK] + fresh(-(-length // BLOCK) - min(len(ids), length // BLOCK))
            output = max(1, int(rng.lognormal(np.log(mean_output) - 0.5, 1.0)))
            records.append({"timestamp": int(t * 1000), "input_length": length, "output_length": output,
                            "hash_ids": ids})
            ids = ids[:length // BLOCK]
            t += float(rng.lognormal(np.log(think_s), 1.0))
            length += output + int(rng.lognormal(np.log(300), 1.0))
    records.sort(key=lambda r: r["timestamp"])
    return [r for r in records if r["timestamp"] < duration_s * 1000][:num_requests]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=12_000)
    ap.add_argument("--duration", type=float, default=3600.0, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mean-turns", type=float, default=1.6)
    ap.add_argument("--think-s", type=float, default=120.0)
    ap.add_argument("--first-input", type=float, default=7000.0, help="median first-turn input, tokens")
    ap.add_argument("--mean-output", type=float, default=350.0)
    args = ap.parse_args()
    records = generate(args.requests, args.duration, args.seed, args.mean_turns, args.think_s,
                       args.first_input, args.mean_output)
    Path(args.out).write_text(to_jsonl(records))
    entries = load_trace(args.out)
    inputs = np.array([e.prompt_len for e in entries])
    outputs = np.array([e.segments[0].num_tokens for e in entries])
    print(f"{len(entries)} requests over {entries[-1].arrival_time:.0f} s; input mean {inputs.mean():.0f} "
          f"(max {inputs.max()}), output mean {outputs.mean():.0f} tokens -> {args.out}")
    pool = LLAMA3_8B_H100.device_kv_bytes // LLAMA3_8B_H100.bytes_per_token
    for capacity in (pool, 8_000_000):
        b = cache_bounds(entries, capacity)
        print(f"cache bounds at {capacity:,} tokens: every block kept {b.infinite_share:.1%}, "
              f"LRU {b.lru_share:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
