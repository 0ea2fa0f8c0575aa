"""Interactive requests behind a batch backlog, with and without priority classes.

A backlog of long requests is queued, the engine runs ``--head-start`` steps, then
short interactive requests arrive. "classes" queues the backlog in class 1 and the
interactive requests in class 0 (what a server's Batch API does with its lines);
"one class" queues them all in class 0, as before priority classes. Both run on one
engine (prefix caching off, so neither run reuses the other's pages), alternating,
``--rounds`` times each after an untimed round that compiles. Prints, per mode, the
interactive requests' time to first token and end-to-end latency (engine clock,
seconds: median over rounds of the round's mean) and the whole run's seconds
(the backlog's makespan), then the ratios classes / one class.

    python3 tools/bench_priority.py [--model demo] [--policy fcfs] [--backlog 48] [--interactive 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_round(llm, classes: bool, seed: int, args) -> dict:
    """Run one backlog + interactive burst; returns the interactive requests' mean TTFT and
    E2E (s) and the round's wall seconds."""
    from jaxserve import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size

    def add(n: int, prompt_len: int, max_tokens: int, priority: int) -> list[str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [engine.add_request(prompt_token_ids=rng.integers(3, vocab, prompt_len).tolist(),
                                   sampling_params=params, priority=priority) for _ in range(n)]

    preempted = engine.scheduler.num_preemptions
    start = time.perf_counter()
    add(args.backlog, args.prompt_len, args.backlog_tokens, 1 if classes else 0)
    for _ in range(args.head_start):
        engine.step()
    interactive = set(add(args.interactive, args.prompt_len, args.interactive_tokens, 0))
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id in interactive:
                final[out.request_id] = out.metrics
    seconds = time.perf_counter() - start
    ttft = [m["first_token_time"] - m["arrival_time"] for m in final.values()]
    e2e = [m["finish_time"] - m["arrival_time"] for m in final.values()]
    return {"ttft": statistics.fmean(ttft), "e2e": statistics.fmean(e2e), "seconds": seconds,
            "preemptions": engine.scheduler.num_preemptions - preempted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--policy", default="fcfs", help="the scheduling policy (ranks within a class)")
    ap.add_argument("--backlog", type=int, default=48, help="batch requests queued first")
    ap.add_argument("--backlog-tokens", type=int, default=48, help="tokens each batch request generates")
    ap.add_argument("--interactive", type=int, default=8, help="interactive requests arriving after the head start")
    ap.add_argument("--interactive-tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--head-start", type=int, default=4, help="engine steps the backlog runs alone")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="the running batch's size (what makes a queue)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from jaxserve import LLM

    llm = LLM(args.model, policy=args.policy, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=128,
              max_model_len=256, enable_prefix_caching=False, warmup_all_shapes=True)
    rows: dict[str, list[dict]] = {"classes": [], "one class": []}
    try:
        for r in range(args.rounds + 1):
            for mode in rows:
                result = one_round(llm, mode == "classes", seed=1000 * r + len(rows[mode]), args=args)
                if r:
                    rows[mode].append(result)
    finally:
        llm.engine.shutdown()
    print(f"model {args.model}, policy {args.policy}, max_num_seqs {args.max_num_seqs}; backlog "
          f"{args.backlog} x {args.backlog_tokens} tokens, then {args.interactive} interactive x "
          f"{args.interactive_tokens} tokens after {args.head_start} steps; median of {args.rounds} rounds")
    print(f"{'mode':>10} {'TTFT s':>8} {'E2E s':>8} {'round s':>8} {'preempted':>9}")
    med = {mode: {k: statistics.median(row[k] for row in rounds) for k in ("ttft", "e2e", "seconds", "preemptions")}
           for mode, rounds in rows.items()}
    for mode, m in med.items():
        print(f"{mode:>10} {m['ttft']:8.3f} {m['e2e']:8.3f} {m['seconds']:8.2f} {m['preemptions']:9.0f}")
    on, off = med["classes"], med["one class"]
    print(f"classes / one class: interactive TTFT {on['ttft'] / off['ttft']:.2f}x, E2E "
          f"{on['e2e'] / off['e2e']:.2f}x; the whole round {on['seconds'] / off['seconds']:.2f}x")


if __name__ == "__main__":
    main()
