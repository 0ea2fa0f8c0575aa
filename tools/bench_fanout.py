"""One prompt sent several times at once (``n`` choices, a burst of agents on one
system prompt): wall time and prompt tokens computed per round, this checkout
against the scheduler of a git revision, each in its own process on the same
model and settings.

    python3 tools/bench_fanout.py --model smollm2-135m --copies 4 --prompt-len 1000 \\
        --max-tokens 16 --budget 4096 --rounds 3 --baseline HEAD~1

Each round sends ``--copies`` requests with one fresh prompt (random token ids,
never seen before, so nothing is cached across rounds), greedy, through
``LLM.generate``; a first round of the same shapes warms the step programs up
and is not counted. Prints, per side, the median seconds per round, the prompt
tokens computed per round (prompt length less ``num_cached_tokens``, summed over
the copies), and whether the copies' outputs agree; then this/base.
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# ``--scheduler-src DIR`` (internal, for ``--baseline``): import ``scheduler`` from DIR instead.
if "--scheduler-src" in sys.argv:
    sys.path.insert(0, sys.argv[sys.argv.index("--scheduler-src") + 1])
sys.path.insert(1, str(REPO / "tools"))

from git_export import export_revision  # noqa: E402


def run(args: argparse.Namespace) -> dict:
    """The rounds in this process; returns the side's row."""
    import scheduler
    from jaxserve import LLM, SamplingParams
    llm = LLM(args.model, max_num_batched_tokens=args.budget, max_num_seqs=max(8, args.copies),
              dtype=args.dtype, enable_prefix_caching=True)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed)
    seconds, computed, agree = [], [], True
    for round_index in range(args.rounds + 1):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        start = time.perf_counter()
        outs = llm.generate(prompt_token_ids=[prompt] * args.copies, sampling_params=params)
        elapsed = time.perf_counter() - start
        agree = agree and len({tuple(o.token_ids) for o in outs}) == 1
        if round_index:   # the first round warms the programs up
            seconds.append(elapsed)
            computed.append(sum(args.prompt_len - o.num_cached_tokens for o in outs))
    return {"scheduler": str(Path(scheduler.__file__).parent), "median_s": statistics.median(seconds),
            "seconds": seconds, "computed": computed, "agree": agree}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default=None, metavar="REV", help="also run git revision REV's scheduler")
    ap.add_argument("--scheduler-src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json-row", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json_row:
        print(json.dumps(run(args)))
        return
    print(f"{args.copies} copies of a {args.prompt_len}-token prompt, {args.max_tokens} tokens each, "
          f"budget {args.budget}, model {args.model}, {args.rounds} rounds (+1 warm-up)", flush=True)
    rows = {"this": _side(args, None)}
    if args.baseline:
        src = tempfile.mkdtemp(prefix="bench-fanout-base-")
        atexit.register(shutil.rmtree, src, True)
        export_revision(args.baseline, src, ("scheduler",))
        rows[args.baseline] = _side(args, src)
    for name, row in rows.items():
        print(f"{name:>10}: median {row['median_s']:.2f} s per round (rounds {', '.join(f'{s:.2f}' for s in row['seconds'])}),"
              f" prompt tokens computed per round {row['computed']}, copies agree: {row['agree']}", flush=True)
    if args.baseline:
        this, base = rows["this"], rows[args.baseline]
        print(f"this/base: time {this['median_s'] / base['median_s']:.2f}x, "
              f"prompt tokens computed {statistics.mean(this['computed']) / statistics.mean(base['computed']):.2f}x")


def _side(args: argparse.Namespace, src: str | None) -> dict:
    """One side's rounds in a subprocess (``src``: the scheduler's folder; None: this checkout's)."""
    cmd = [sys.executable, __file__, "--json-row", "--model", args.model, "--copies", str(args.copies),
           "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens), "--budget", str(args.budget),
           "--rounds", str(args.rounds), "--dtype", args.dtype, "--seed", str(args.seed)]
    if src:
        cmd += ["--scheduler-src", src]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    expected = str(Path(src) / "scheduler") if src else str(REPO / "scheduler")
    if row["scheduler"] != expected:
        raise SystemExit(f"the side meant to run {expected} imported {row['scheduler']}")
    return row


if __name__ == "__main__":
    main()
