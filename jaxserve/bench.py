"""Engine benchmark: jaxserve vs transformers ``generate`` on the same checkpoint,
the same prompts and the same greedy settings, in one run.

Prints output tokens/s of each and their ratio, and jaxserve's host-side time
per step (scheduling + batch building + token bookkeeping: step wall time
minus the time inside the jitted call and waiting for its result).

With ``--tensor-parallel-size N`` (N > 1) jaxserve runs at TP 1, 2, 4, ... N
in the same run and prints tokens/s per degree and its ratio to TP 1 (on CPU
host devices the ratio shows the sharding overhead; on GPUs or a TPU slice,
the speedup), after checking every degree generated the same tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.config import EngineConfig

# Llama-3.2-1B shapes, for --shape llama-1b with random ("dummy") weights.
LLAMA_1B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
            "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 1}
# A small Llama (8 heads, so TP up to 8 divides it) for tensor-parallel runs on CPU host devices.
LLAMA_SMALL = {**LLAMA_1B, "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32}
SHAPES = {"llama-1b": LLAMA_1B, "llama-small": LLAMA_SMALL}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="demo", help="checkpoint directory or 'demo'")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="benchmark a model of these shapes with random weights instead of --model")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--length-probe", default=None, metavar="DIR",
                        help="instead: time per step without and with the learned length probe of DIR "
                             "(--predictor learned:DIR), interleaved rounds, same prompts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per engine with --length-probe")
    # The benchmark sizes these from its own prompts and shape.
    EngineConfig.add_cli_arguments(parser, exclude=("max_num_seqs", "max_model_len", "load_format"))


def _shape_checkpoint(shape: dict) -> Path:
    path = Path(tempfile.mkdtemp(prefix="jaxserve-bench-"))
    (path / "config.json").write_text(json.dumps(shape))
    return path


def run_jaxserve(model_dir: str, prompts: list[list[int]], args, load_format: str, tp: int | None = None) -> dict:
    """Generate ``prompts`` greedily (after a short warm run); ``tp`` overrides ``--tensor-parallel-size``."""
    from jaxserve import LLM, SamplingParams
    overrides = {} if tp is None else {"tensor_parallel_size": tp}
    llm = LLM(config=EngineConfig.from_cli(args, model=model_dir, max_num_seqs=max(len(prompts), 1),
                                           max_model_len=args.prompt_len + args.max_tokens + args.page_size,
                                           load_format=load_format, **overrides))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Step shapes compile on first use: an untimed pass over the same workload compiles them all.
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    stats, executor = llm.engine.stats, llm.engine.executor
    steps0, step0, wait0, disp0 = stats.steps, stats.step_time_s, executor.device_wait_s, executor.dispatch_s
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    steps = stats.steps - steps0
    dispatch = executor.dispatch_s - disp0
    host = (stats.step_time_s - step0) - (executor.device_wait_s - wait0) - dispatch
    tokens = sum(len(o.token_ids) for o in outs)
    llm.engine.shutdown()
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "cpu_seconds": cpu, "steps": steps,
            "host_ms_per_step": 1e3 * host / max(steps, 1), "dispatch_ms_per_step": 1e3 * dispatch / max(steps, 1),
            "outputs": [o.token_ids for o in outs]}


def run_probe_cost(model_dir: str, prompts: list[list[int]], args, load_format: str) -> dict:
    """Mean wall time per engine step without / with the length probe in the step.

    Two engines on the same prompts; ``args.rounds`` interleaved rounds of each
    (so a slow spell of a shared machine lands on both); each round is a full
    ``generate`` of every prompt (prefill rows run the probe's read-out, every
    row runs the probe itself). Returns ms per step and the ratio."""
    from jaxserve import LLM, SamplingParams
    common = dict(dtype=args.dtype, page_size=args.page_size, num_pages=args.num_pages,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(len(prompts), 1),
                  max_model_len=args.prompt_len + args.max_tokens + args.page_size, load_format=load_format)
    engines = {"without": LLM(model_dir, **common),
               "with": LLM(model_dir, predictor=f"learned:{args.length_probe}", **common)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    times = {k: [] for k in engines}
    outputs = {}
    for llm in engines.values():   # warm: compile every shape the rounds use
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            stats = llm.engine.stats
            step0, steps0 = stats.step_time_s, stats.steps
            outputs[name] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
            times[name].append((stats.step_time_s - step0) / max(stats.steps - steps0, 1))
    # The jitted step alone, full decode batch of the largest bucket, many interleaved calls:
    # the minimum is robust to a shared machine's slow spells.
    runners = {k: llm.engine.executor for k, llm in engines.items()}
    bucket = runners["with"].config.token_buckets[-1]
    batch = {k: r.synthetic_inputs(bucket) for k, r in runners.items()}
    jitted = {k: [] for k in runners}
    for _ in range(20 * args.rounds):
        for k, r in runners.items():
            start = time.perf_counter()
            r.forward(batch[k])[0].block_until_ready()
            jitted[k].append(time.perf_counter() - start)
    for llm in engines.values():
        llm.engine.shutdown()
    per_round = [w / wo for w, wo in zip(times["with"], times["without"])]
    step = {k: 1e3 * min(v) for k, v in jitted.items()}
    return {"ms_per_step_without": 1e3 * float(np.median(times["without"])),
            "ms_per_step_with": 1e3 * float(np.median(times["with"])),
            "probe_overhead": float(np.median(per_round)) - 1.0,
            "probe_overhead_rounds": [r - 1.0 for r in per_round],
            "jitted_bucket": bucket, "jitted_ms_min_without": step["without"], "jitted_ms_min_with": step["with"],
            "jitted_overhead": step["with"] / step["without"] - 1.0,
            "same_tokens": outputs["with"] == outputs["without"]}


def run_transformers(model_dir: str | None, shape: dict | None, prompts: list[list[int]], args) -> dict:
    import torch
    import transformers as tf
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if shape is not None:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{k: v for k, v in shape.items()
                                                      if k not in ("model_type", "architectures")}))
        model = model.to(dtype)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"   # the same accelerator jaxserve runs on
    model = model.to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2, -4:], attention_mask=mask[:2, -4:], max_new_tokens=2, do_sample=False, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        start, cpu_start = time.perf_counter(), time.process_time()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = int((out.shape[1] - width) * len(prompts))
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "cpu_seconds": cpu, "device": device}


def run_degrees(model_dir: str, prompts: list[list[int]], args, load_format: str, tp1: dict) -> dict:
    """jaxserve at TP 2, 4, ... ``--tensor-parallel-size`` (``tp1``: the TP 1 run); prints
    tokens/s per degree and the ratio to TP 1. Every degree must generate TP 1's tokens."""
    degrees, tp = {1: tp1}, 2
    while tp <= args.tensor_parallel_size:
        degrees[tp] = run_jaxserve(model_dir, prompts, args, load_format, tp=tp)
        if degrees[tp]["outputs"] != tp1["outputs"]:
            raise SystemExit(f"TP {tp} generated other tokens than TP 1")
        tp *= 2
    print("tensor parallel: TP  tokens/s  ratio to TP 1  (same tokens at every degree)")
    for tp, run in degrees.items():
        print(f"                 {tp:2d}  {run['tokens_per_s']:8.1f}  {run['tokens_per_s'] / tp1['tokens_per_s']:6.2f}x")
    return {str(tp): {"tokens_per_s": run["tokens_per_s"], "ratio_to_tp1": run["tokens_per_s"] / tp1["tokens_per_s"]}
            for tp, run in degrees.items()}


def main(args: argparse.Namespace) -> int:
    import jax
    rng = np.random.default_rng(0)
    shape = SHAPES.get(args.shape)
    if shape is not None:
        model_dir, load_format, vocab = str(_shape_checkpoint(shape)), "dummy", shape["vocab_size"]
    else:
        from jaxserve.model_source import resolve_model
        model_dir, load_format = str(resolve_model(args.model)), "safetensors"
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    lens = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, args.num_prompts)
    prompts = [rng.integers(3, vocab, n).tolist() for n in lens]
    if args.length_probe:
        cost = run_probe_cost(model_dir, prompts, args, load_format)
        print(f"model {args.shape or args.model}, {args.num_prompts} prompts x {args.max_tokens} tokens, "
              f"{args.rounds} interleaved rounds")
        print(f"engine step (median over rounds): without probe {cost['ms_per_step_without']:.3f} ms, with "
              f"{cost['ms_per_step_with']:.3f} ms; median paired overhead {cost['probe_overhead']:+.2%} "
              f"(rounds: {', '.join(f'{r:+.1%}' for r in cost['probe_overhead_rounds'])}); "
              f"same tokens: {cost['same_tokens']}")
        print(f"jitted step alone, {cost['jitted_bucket']}-token decode batch (min of {20 * args.rounds}): "
              f"without {cost['jitted_ms_min_without']:.3f} ms, with {cost['jitted_ms_min_with']:.3f} ms "
              f"-> overhead {cost['jitted_overhead']:+.2%}")
        if args.json:
            Path(args.json).write_text(json.dumps(cost, indent=2))
        return 0
    ours = run_jaxserve(model_dir, prompts, args, load_format, tp=1 if args.tensor_parallel_size > 1 else None)
    result = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
              "model": args.shape or args.model, "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
              "dtype": args.dtype, "jaxserve": {k: v for k, v in ours.items() if k != "outputs"}}
    print(f"device: {result['device']} ({result['backend']}), model: {result['model']}, "
          f"{args.num_prompts} prompts x {args.max_tokens} tokens, {args.dtype}")
    print(f"jaxserve:     {ours['tokens_per_s']:9.1f} tokens/s  ({ours['tokens']} tokens in {ours['seconds']:.2f} s, "
          f"{ours['steps']} steps)")
    print(f"  host-side per step (scheduling + batch building + token bookkeeping): {ours['host_ms_per_step']:.3f} ms; "
          f"inside the jitted call: {ours['dispatch_ms_per_step']:.3f} ms (on CPU that includes the compute)")
    if args.tensor_parallel_size > 1:
        result["tensor_parallel"] = run_degrees(model_dir, prompts, args, load_format, ours)
    if not args.skip_transformers:
        ref = run_transformers(model_dir if shape is None else None, shape, prompts, args)
        result["transformers"] = ref
        result["ratio"] = ours["tokens_per_s"] / ref["tokens_per_s"]
        print(f"transformers: {ref['tokens_per_s']:9.1f} tokens/s  ({ref['tokens']} tokens in {ref['seconds']:.2f} s)")
        print(f"ratio jaxserve / transformers: {result['ratio']:.2f}x (wall); "
              f"{ref['cpu_seconds'] / ours['cpu_seconds']:.2f}x in process CPU seconds "
              f"({ours['cpu_seconds']:.1f} vs {ref['cpu_seconds']:.1f}; the fairer figure on a shared machine)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
