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
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4, temperature=0.0))
    stats, executor = llm.engine.stats, llm.engine.executor
    steps0, step0, wait0, disp0 = stats.steps, stats.step_time_s, executor.device_wait_s, executor.dispatch_s
    start = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    steps = stats.steps - steps0
    dispatch = executor.dispatch_s - disp0
    host = (stats.step_time_s - step0) - (executor.device_wait_s - wait0) - dispatch
    tokens = sum(len(o.token_ids) for o in outs)
    llm.engine.shutdown()
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "steps": steps,
            "host_ms_per_step": 1e3 * host / max(steps, 1), "dispatch_ms_per_step": 1e3 * dispatch / max(steps, 1),
            "outputs": [o.token_ids for o in outs]}


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
    model.eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2, -4:], attention_mask=mask[:2, -4:], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
    tokens = int((out.shape[1] - width) * len(prompts))
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


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
        from jaxserve.engine import resolve_model_dir
        model_dir, load_format = str(resolve_model_dir(args.model)), "safetensors"
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    lens = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, args.num_prompts)
    prompts = [rng.integers(3, vocab, n).tolist() for n in lens]
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
        print(f"ratio jaxserve / transformers: {result['ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
