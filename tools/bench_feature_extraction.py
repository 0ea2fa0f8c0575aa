"""Feature extraction for the length probe: one forward per request vs padded
batches of similar length (``HiddenStateReader.read`` vs ``read_many``), on the
same requests of the multi-API trace, in one run.

    python tools/bench_feature_extraction.py --model /work/cache/smollm2-hf --requests 24 --rounds 2

Prints context tokens per CPU second (process time: the machine is shared, so
wall time is distorted by the load) for each way and their ratio; the two
ways alternate round by round so drift hits both.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.predictor.dataset import load_text_requests  # noqa: E402
from jaxserve.predictor.features import HiddenStateReader, load_served_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--requests", type=int, default=24, help="text requests taken (evenly over context lengths)")
    ap.add_argument("--max-context", type=int, default=1024, help="only requests whose context fits this")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    args = ap.parse_args()

    served = load_served_model(args.model)
    requests = sorted(load_text_requests(None, served.tokenizer, args.max_context), key=lambda r: len(r.token_ids))
    step = max(1, len(requests) // args.requests)
    chosen = requests[::step][:args.requests]
    contexts = [(r.token_ids, r.prompt_ends) for r in chosen]
    tokens = sum(max(ends) for _, ends in contexts)
    reader = HiddenStateReader(served)
    reader.read_many(contexts[:2])   # first-call costs out of the timing
    cpu = {"one by one": 0.0, "batched": 0.0}
    for _ in range(args.rounds):
        start = time.process_time()
        for ids, ends in contexts:
            reader.read(ids, ends)
        cpu["one by one"] += time.process_time() - start
        start = time.process_time()
        reader.read_many(contexts, max_batch_tokens=args.batch_tokens)
        cpu["batched"] += time.process_time() - start
    print(f"{len(contexts)} requests, {tokens} context tokens, {args.rounds} rounds, model {args.model}")
    for name, seconds in cpu.items():
        print(f"{name:11s}: {tokens * args.rounds / seconds:8.0f} tokens per CPU second")
    print(f"batched / one by one throughput: {cpu['one by one'] / cpu['batched']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
