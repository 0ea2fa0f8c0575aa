"""What ``jaxserve run-batch`` costs over the Python API: the same completions, greedy,
through ``LLM.generate`` and through the batch path (the server's app in-process,
``server.batch.run_batch``), each on its own engine of the same settings in this
process, one side after the other (``--rounds`` each, after one untimed round
that compiles). Prints each side's median seconds and tokens/s and their ratio.

    python3 tools/bench_batch.py [--model demo] [--requests 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Every step shape compiled first, so neither side compiles while it is timed (the batch
# path's requests arrive as they are tokenized, which can make shapes the other never uses).
ENGINE = dict(max_num_batched_tokens=256, max_num_seqs=64, max_model_len=512, policy="fcfs", warmup_all_shapes=True)


def prompts(n: int) -> list[str]:
    """``n`` different short prompts."""
    return [f"Request {i}: write a short note about item number {i * 7 % 101}." for i in range(n)]


def time_python_api(model: str, texts: list[str], max_tokens: int, rounds: int) -> list[float]:
    from jaxserve import LLM, SamplingParams
    llm = LLM(model, **ENGINE)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seconds = []
    try:
        for _ in range(rounds + 1):
            start = time.perf_counter()
            outputs = llm.generate(texts, params)
            seconds.append(time.perf_counter() - start)
            assert all(len(o.token_ids) == max_tokens for o in outputs)
    finally:
        llm.engine.shutdown()
    return seconds[1:]


def time_batch(model: str, texts: list[str], max_tokens: int, rounds: int) -> list[float]:
    from jaxserve.config import EngineConfig
    from jaxserve.distributed.asgi_bridge import Lifespan
    from server.batch import BatchRequest, run_batch
    from server.build import build_app, served_model_name

    args = Namespace(model=model, served_model_name=None, api_key=None, response_store=None, tools=None,
                     paused_context_ttl=0.0, max_body_bytes=2**62, body_timeout=3600.0,
                     max_concurrent_requests=256, max_fanout=16,
                     **{f.name: getattr(EngineConfig(), f.name) for f in EngineConfig.__dataclass_fields__.values()
                        if f.name != "model"} | ENGINE)
    engine, app = build_app(args)
    name = served_model_name(args)
    requests = [BatchRequest(i + 1, f"r{i}", "/v1/completions",
                             {"model": name, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": True}) for i, text in enumerate(texts)]

    async def rounds_of_batch() -> list[float]:
        lifespan = Lifespan(app)
        await lifespan.start()
        try:
            seconds = []
            for _ in range(rounds + 1):
                lines: list[dict] = []
                start = time.perf_counter()
                statuses = await run_batch(app, requests, lines.append)
                seconds.append(time.perf_counter() - start)
                assert statuses == {200: len(requests)}, statuses
                assert all(x["response"]["body"]["usage"]["completion_tokens"] == max_tokens for x in lines)
            return seconds
        finally:
            await lifespan.stop()

    try:
        return asyncio.run(rounds_of_batch())[1:]
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    texts = prompts(args.requests)
    api = time_python_api(args.model, texts, args.max_tokens, args.rounds)
    batch = time_batch(args.model, texts, args.max_tokens, args.rounds)
    tokens = args.requests * args.max_tokens
    rows = {"LLM.generate": statistics.median(api), "run-batch path": statistics.median(batch)}
    print(f"{args.requests} completions x {args.max_tokens} tokens, greedy, model {args.model}, "
          f"median of {args.rounds} rounds after one untimed")
    for name, s in rows.items():
        print(f"  {name:15s} {s:7.2f} s  {tokens / s:9.1f} tokens/s")
    print(f"  run-batch / LLM.generate time: {rows['run-batch path'] / rows['LLM.generate']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
