"""Cold start on CPU: time from process start to the first generated token, and peak
RSS, of a fresh process per measurement, with an empty and with a warm compilation
cache, for each model. Goals (issue 17): demo < 10 s cold / < 3 s warm; SmolLM2
< 30 s cold / < 10 s warm; peak RSS < 2x (weights + KV pool).

    python tools/cold_start.py                                   # demo
    python tools/cold_start.py --model demo --model /work/cache/smollm2-hf

Each model gets a fresh cache directory (``JAXSERVE_CACHE_DIR``): ``cold`` runs
first on it empty, ``warm`` second on what ``cold`` left. The baseline, in the same
run on its own empty cache, compiles every token bucket at start (``--no-baseline``
skips it); the ratio is baseline / cold. One chat prompt, greedy, ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"demo": (10.0, 3.0), "smollm2": (30.0, 10.0)}   # seconds to first token: (cold, warm)
QUESTION = "What is the capital of France?"


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads (imports included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(args: argparse.Namespace) -> None:
    """One measured start: load, warm up, generate; prints one JSON line."""
    from jaxserve import LLM, SamplingParams
    llm = LLM(args.model, max_model_len=args.max_model_len)
    engine = llm.engine
    if args.eager:
        engine.executor.warmup(all_buckets=True)
    ready = time.time()
    tok = engine.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
        engine.add_request("cold", prompt=prompt, sampling_params=SamplingParams(max_tokens=args.max_tokens,
                                                                                   temperature=0.0))
    elif tok is not None:
        engine.add_request("cold", prompt=QUESTION, sampling_params=SamplingParams(max_tokens=args.max_tokens,
                                                                                     temperature=0.0))
    else:
        engine.add_request("cold", prompt_token_ids=[5] * 16, sampling_params=SamplingParams(
            max_tokens=args.max_tokens, temperature=0.0))
    first, first_cpu, text, tokens = None, None, "", 0
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.token_ids:
                first, first_cpu = time.time(), cpu_seconds()
            text, tokens = out.text, len(out.token_ids)
    done = time.time()
    runner = engine.executor
    weights = sum(x.nbytes for x in runner.params)
    pool = sum(k.nbytes + v.nbytes for k, v in runner.kv)
    print(json.dumps({"ready_at": ready, "first_token_at": first, "first_token_cpu_s": first_cpu, "done_at": done,
                      "tokens": tokens, "text": text,
                      "weights_bytes": weights, "kv_pool_bytes": pool, "num_pages": runner.config.num_pages,
                      "step_shapes": len(runner.step_shapes),
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
    engine.shutdown()


def measure(model: str, cache: Path, args, eager: bool = False) -> dict:
    """Spawn one child on ``cache``; times are seconds since the spawn."""
    env = dict(os.environ, JAXSERVE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    env.pop("JAXSERVE_NO_COMPILATION_CACHE", None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", model,
           "--max-model-len", str(args.max_model_len), "--max-tokens", str(args.max_tokens)] + (["--eager"] if eager else [])
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"child failed for {model}:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r.update(ready_s=r["ready_at"] - start, first_token_s=r["first_token_at"] - start, total_s=r["done_at"] - start)
    r["rss_ratio"] = r["peak_rss_bytes"] / (r["weights_bytes"] + r["kv_pool_bytes"])
    return r


def goal_for(model: str) -> tuple[float, float] | None:
    name = Path(model).name.lower()
    return next((v for k, v in GOALS.items() if k in name), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", default=None, help="'demo' or a checkpoint (repeatable)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--eager", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.model = args.model[0]
        child(args)
        return 0
    results = {}
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall times stretch with it; "
          f"CPU seconds do not)")
    print(f"{'model':<28}{'run':<10}{'ready s':>9}{'1st tok s':>10}{'CPU s':>7}{'total s':>9}{'RSS GB':>8}"
          f"{'w+kv GB':>9}{'RSS/(w+kv)':>11}  goal (1st tok)")
    for model in args.model or ["demo"]:
        runs = {}
        with tempfile.TemporaryDirectory(prefix="jaxserve-coldstart-") as tmp:
            runs["cold"] = measure(model, Path(tmp) / "lazy", args)
            runs["warm"] = measure(model, Path(tmp) / "lazy", args)
            if not args.no_baseline:
                runs["baseline"] = measure(model, Path(tmp) / "eager", args, eager=True)
        goal = goal_for(model)
        for name, r in runs.items():
            target = "" if goal is None or name == "baseline" else f"< {goal[name == 'warm']:.0f} s"
            print(f"{Path(model).name:<28}{name:<10}{r['ready_s']:9.2f}{r['first_token_s']:10.2f}"
                  f"{r['first_token_cpu_s']:7.1f}{r['total_s']:9.2f}"
                  f"{r['peak_rss_bytes'] / 1e9:8.2f}{(r['weights_bytes'] + r['kv_pool_bytes']) / 1e9:9.2f}"
                  f"{r['rss_ratio']:11.2f}  {target}")
        if "baseline" in runs:
            print(f"  first token: baseline (every token bucket compiled at start, empty cache) / cold = "
                  f"{runs['baseline']['first_token_s'] / runs['cold']['first_token_s']:.2f}x; "
                  f"cold / warm = {runs['cold']['first_token_s'] / runs['warm']['first_token_s']:.2f}x")
        print(f"  text: {runs['warm']['text']!r}; load average now {os.getloadavg()[0]:.1f}")
        results[model] = runs
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
