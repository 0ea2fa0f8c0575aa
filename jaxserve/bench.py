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
import atexit
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.config import EngineConfig, positive_int

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
    parser.add_argument("--model", default="demo", help="model: a checkpoint directory, a .gguf file, or a built-in name (demo, smollm2-135m)")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES),
                        help="benchmark a model of these shapes with random weights instead of --model")
    parser.add_argument("--num-prompts", type=positive_int, default=64)
    parser.add_argument("--prompt-len", type=positive_int, default=32)
    parser.add_argument("--max-tokens", type=positive_int, default=64)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--length-probe", default=None, metavar="DIR",
                        help="instead: time per step without and with the learned length probe of DIR "
                             "(--predictor learned:DIR), interleaved, same prompts; 'random': a probe of the "
                             "trained shape with random weights for this model (the cost depends on shapes only)")
    scoring = parser.add_mutually_exclusive_group()
    scoring.add_argument("--logprobs", type=int, default=None, metavar="K",
                        help="instead: time per engine step of the same generate without and with "
                             "SamplingParams(logprobs=K) (0..20) on one engine, interleaved rounds")
    scoring.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                        help="instead: the same with SamplingParams(prompt_logprobs=K) (0..20): every prompt "
                             "token scored (with the prefix cache on, the prompts are also computed again; "
                             "--no-enable-prefix-caching times the scoring alone)")
    scoring.add_argument("--penalties", action="store_true",
                        help="instead: the same with SamplingParams(repetition_penalty=1.1, presence_penalty=0.5, "
                             "frequency_penalty=0.5, logit_bias of 16 tokens) (each step samples after its logit "
                             "adjustments, in a second program)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="generate rounds per engine (per side with --logprobs) with --length-probe or --logprobs")
    parser.add_argument("--probe-calls", type=positive_int, default=60,
                        help="interleaved calls per engine of the jitted step alone with --length-probe")
    # The benchmark sizes these from its own prompts and shape.
    EngineConfig.add_cli_arguments(parser, exclude=("max_num_seqs", "max_model_len", "load_format"))


def shape_checkpoint(shape: dict) -> Path:
    """A checkpoint directory in the temporary folder holding only ``shape`` as its
    ``config.json`` (for ``load_format="dummy"``: random weights of that shape). Named by
    the shape's SHA-256, so every run of the same shape reuses one directory (they used
    to leave a new one behind each time)."""
    text = json.dumps(shape, sort_keys=True)
    path = Path(tempfile.gettempdir()) / f"jaxserve-shape-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    config = path / "config.json"
    if not config.is_file() or config.read_text() != text:
        path.mkdir(exist_ok=True)
        fd, staged = tempfile.mkstemp(dir=path, prefix=".config-")   # written whole, then renamed:
        with os.fdopen(fd, "w") as f:                                # concurrent runs agree
            f.write(text)
        os.replace(staged, config)
    return path


def run_jaxserve(model_dir: str, prompts: list[list[int]], args, load_format: str, tp: int | None = None) -> dict:
    """Generate ``prompts`` greedily (after a short warm run); ``tp`` overrides ``--tensor-parallel-size``."""
    from jaxserve import LLM, SamplingParams
    overrides = {} if tp is None else {"tensor_parallel_size": tp}
    llm = LLM(config=EngineConfig.from_cli(args, model=model_dir, max_num_seqs=max(len(prompts), 1),
                                           max_model_len=args.prompt_len + args.max_tokens + args.page_size,
                                           load_format=load_format, **overrides))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # Step shapes compile on first use: an untimed pass compiles them all. Its prompts have the
    # same lengths (so the same step shapes) but other tokens (each rotated by one), so the timed
    # pass finds none of its prompts in the prefix cache: like transformers, it computes every
    # prompt token, and it compiles nothing.
    llm.generate(prompt_token_ids=[p[1:] + p[:1] for p in prompts], sampling_params=params)
    shapes = set(llm.engine.executor.step_shapes)
    stats, executor = llm.engine.stats, llm.engine.executor
    steps0, step0, wait0, disp0 = stats.steps, stats.step_time_s, executor.device_wait_s, executor.dispatch_s
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    steps = stats.steps - steps0
    dispatch = executor.dispatch_s - disp0
    host = (stats.step_time_s - step0) - (executor.device_wait_s - wait0) - dispatch
    tokens = sum(len(o.token_ids) for o in outs)
    compiled = sorted(set(executor.step_shapes) - shapes)   # should stay empty: compiling is not serving
    llm.engine.shutdown()
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "cpu_seconds": cpu, "steps": steps,
            "host_ms_per_step": 1e3 * host / max(steps, 1), "dispatch_ms_per_step": 1e3 * dispatch / max(steps, 1),
            "cached_prompt_tokens": sum(o.num_cached_tokens for o in outs),
            "shapes_compiled_while_timed": len(compiled), "outputs": [o.token_ids for o in outs]}


def random_probe_checkpoint(model_dir: str, args, load_format: str, hidden: int = 256) -> str:
    """A length-probe checkpoint for ``model_dir`` with the trained probe's shapes (an MLP
    ``hidden`` wide over the model's hidden size, ``NUM_BINS`` outputs) and random weights,
    in a temporary directory. A probe's cost depends on its shapes only, so this measures
    the cost on a model no probe was trained for yet (``--length-probe random``)."""
    import jax
    from jaxserve.predictor.bins import bin_lengths
    from jaxserve.predictor.checkpoint import model_identity, save_probe
    from jaxserve.predictor.probe import init_probe
    from jaxserve.weights import load_model
    model, config = load_model(model_dir, args.dtype, "reference", load_format, progress=False)
    features = np.random.default_rng(0).normal(size=(64, config.hidden_size)).astype(np.float32)
    params = init_probe(jax.random.key(0), features, hidden, bin_lengths())
    out = tempfile.mkdtemp(prefix="jaxserve-probe-")
    atexit.register(shutil.rmtree, out, True)   # (runs used to leave one behind each)
    save_probe(out, params, model_identity(model, config, model_dir), hidden,
               {"train_mean_tokens": 100.0, "random_weights": True})
    return out


def interleaved_step_times(runners: dict, batches: dict, calls: int) -> dict[str, tuple[list[float], list[float]]]:
    """Wall and process-CPU seconds of ``calls`` jitted steps per model executor, each on
    its ``batches[name]`` (``StepInputs``), interleaved call by call with the order
    reversed every pass so a slow spell of a shared machine lands on every side.
    One untimed call each first (it compiles the shape). Returns name -> (wall, CPU)."""
    for name, runner in runners.items():
        runner.forward(batches[name])[0].block_until_ready()
    times = {name: ([], []) for name in runners}
    order = list(runners)
    for _ in range(calls):
        for name in order:
            start, cpu_start = time.perf_counter(), time.process_time()
            runners[name].forward(batches[name])[0].block_until_ready()
            times[name][0].append(time.perf_counter() - start)
            times[name][1].append(time.process_time() - cpu_start)
        order.reverse()
    return times


def interleaved_rounds(sides: dict, prompts: list[list[int]], rounds: int) -> tuple[dict, dict]:
    """``rounds`` greedy ``generate`` rounds of ``prompts`` per side (``sides``: name ->
    ``(LLM, SamplingParams)``), interleaved with the order flipped every round, after
    two warm passes each (every step shape compiled; the second finds the prompts in the
    prefix cache, as every round does). Returns ``(name -> ([wall s per engine step],
    [CPU s per engine step]) by round, name -> the last round's token ids)``."""
    for llm, params in sides.values():
        for _ in range(2):
            llm.generate(prompt_token_ids=prompts, sampling_params=params)
    times: dict = {name: ([], []) for name in sides}
    outputs: dict = {}
    order = list(sides)
    for _ in range(rounds):
        for name in order:
            llm, params = sides[name]
            steps0, wall0, cpu0 = llm.engine.stats.steps, time.perf_counter(), time.process_time()
            outputs[name] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
            steps = max(llm.engine.stats.steps - steps0, 1)
            times[name][0].append((time.perf_counter() - wall0) / steps)
            times[name][1].append((time.process_time() - cpu0) / steps)
        order.reverse()
    return times, outputs


def _paired(with_s: list[float], without_s: list[float]) -> dict:
    """Median of each side and median of the paired ratios (call i with / call i without), minus 1."""
    ratios = [w / wo for w, wo in zip(with_s, without_s)]
    return {"median_without_ms": 1e3 * float(np.median(without_s)),
            "median_with_ms": 1e3 * float(np.median(with_s)),
            "overhead": float(np.median(ratios)) - 1.0,
            "overhead_iqr": [float(q) - 1.0 for q in np.percentile(ratios, [25, 75])]}


def run_probe_cost(model_dir: str, prompts: list[list[int]], args, load_format: str) -> dict:
    """Cost of the length probe: two engines on the same prompts, without / with
    ``--predictor learned:DIR``, measured three ways in one run.

    1. ``args.rounds`` rounds of a full ``generate`` of every prompt on each engine,
       interleaved, the order flipped every round: wall and process-CPU seconds per
       engine step (prefill rows also copy the predictions to the host).
    2. The jitted step alone on a full decode batch (one row per prompt, at the final
       context): ``args.probe_calls`` calls per engine, interleaved call by call with
       the order flipped; per-call wall and CPU seconds; the overhead is the median of
       the paired ratios (call i with / call i without), so a slow spell of a shared
       machine lands on both sides of a pair.
    3. The probe alone (its jitted function on the batch's ``[S, H]`` hidden states),
       against the step without it: what (2) must show, measured without the step's noise.
    """
    import jax
    from jaxserve import LLM, SamplingParams
    from jaxserve.predictor.probe import probe_predict
    probe_dir = args.length_probe
    if probe_dir == "random":
        probe_dir = random_probe_checkpoint(model_dir, args, load_format)
    common = dict(dtype=args.dtype, page_size=args.page_size, num_pages=args.num_pages,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(len(prompts), 1),
                  max_model_len=args.prompt_len + args.max_tokens + args.page_size, load_format=load_format,
                  gpu_memory_utilization=args.gpu_memory_utilization / 2)   # two engines share the device
    engines = {"without": LLM(model_dir, **common),
               "with": LLM(model_dir, predictor=f"learned:{probe_dir}", **common)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rounds, outputs = interleaved_rounds({k: (llm, params) for k, llm in engines.items()}, prompts, args.rounds)
    runners = {k: llm.engine.executor for k, llm in engines.items()}
    buckets = runners["with"].config.token_buckets
    bucket = next((b for b in buckets if b >= len(prompts)), buckets[-1])
    batch = {k: r.synthetic_inputs(bucket, context=args.prompt_len + args.max_tokens) for k, r in runners.items()}
    calls = interleaved_step_times(runners, batch, args.probe_calls)
    probe_params = runners["with"].length_probe_params
    seq_rows = runners["with"].config.seq_bucket(bucket)   # the rows the probe runs on inside the step
    hidden = jax.device_put(np.random.default_rng(0).normal(
        size=(seq_rows, runners["with"].model_config.hidden_size)).astype(np.float32))
    probe = jax.jit(probe_predict)
    probe(probe_params, hidden).block_until_ready()
    probe_s = []
    for _ in range(args.probe_calls):
        start = time.process_time()
        probe(probe_params, hidden).block_until_ready()
        probe_s.append(time.process_time() - start)
    for llm in engines.values():
        llm.engine.shutdown()
    step_cpu = float(np.median(calls["without"][1]))
    return {"probe": args.length_probe, "rounds": args.rounds, "probe_calls": args.probe_calls,
            "engine_step_wall": _paired(rounds["with"][0], rounds["without"][0]),
            "engine_step_cpu": _paired(rounds["with"][1], rounds["without"][1]),
            "jitted_rows": seq_rows, "jitted_context": args.prompt_len + args.max_tokens,
            "jitted_step_wall": _paired(calls["with"][0], calls["without"][0]),
            "jitted_step_cpu": _paired(calls["with"][1], calls["without"][1]),
            "probe_alone_cpu_ms": 1e3 * float(np.median(probe_s)),
            "probe_alone_share": float(np.median(probe_s)) / step_cpu,
            "same_tokens": outputs["with"] == outputs["without"]}


PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5,
                 logit_bias={token: 1.0 for token in range(3, 19)})
"""``--penalties``: every logit adjustment on (``jaxserve.logit_adjust``)."""


def run_option_cost(model_dir: str, prompts: list[list[int]], args, load_format: str) -> dict:
    """Cost of a sampling option: one engine generates ``prompts`` greedily without and
    with ``SamplingParams(logprobs=args.logprobs)`` (or ``prompt_logprobs=args.prompt_logprobs``,
    or ``PENALTIES`` with ``args.penalties``), ``args.rounds`` rounds each,
    interleaved with the order flipped every round (both sides warmed first: every
    step shape of both variants compiled, every prompt in the prefix cache as in each
    round). Wall and process-CPU seconds per engine step; the overhead is the median
    of the paired ratios (round i with / round i without)."""
    from jaxserve import LLM, SamplingParams
    llm = LLM(config=EngineConfig.from_cli(args, model=model_dir, max_num_seqs=max(len(prompts), 1),
                                           max_model_len=args.prompt_len + args.max_tokens + args.page_size,
                                           load_format=load_format))
    asked = {"prompt_logprobs": args.prompt_logprobs} if args.prompt_logprobs is not None else \
        PENALTIES if args.penalties else {"logprobs": args.logprobs}
    params = {"without": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
              "with": SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, **asked)}
    rounds, outputs = interleaved_rounds({k: (llm, p) for k, p in params.items()}, prompts, args.rounds)
    llm.engine.shutdown()
    return {"asked": asked, "rounds": args.rounds,
            "engine_step_wall": _paired(rounds["with"][0], rounds["without"][0]),
            "engine_step_cpu": _paired(rounds["with"][1], rounds["without"][1]),
            "same_tokens": outputs["with"] == outputs["without"]}


def _overhead_line(label: str, m: dict) -> str:
    """One ``_paired`` result as a line: both medians and the overhead [interquartile range]."""
    lo, hi = m["overhead_iqr"]
    return (f"{label}: without {m['median_without_ms']:.3f} ms, with {m['median_with_ms']:.3f} ms, "
            f"overhead {m['overhead']:+.2%} [{lo:+.2%}, {hi:+.2%}]")


def run_transformers(model_dir: str | None, shape: dict | None, prompts: list[list[int]], args) -> dict:
    import torch
    import transformers as tf
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"   # the same accelerator jaxserve runs on
    if shape is not None:
        with torch.device(device):   # random weights drawn where they run (a 1B model on CPU takes a while)
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**{k: v for k, v in shape.items()
                                                          if k not in ("model_type", "architectures")}))
        model = model.to(dtype)
    else:
        model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
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
    from jaxserve.cli import refuse
    from jaxserve.sampling_params import MAX_LOGPROBS
    from jaxserve.weights import resolve_dtype
    for flag in ("logprobs", "prompt_logprobs"):
        k = getattr(args, flag)
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise SystemExit(f"--{flag.replace('_', '-')} must be in [0, {MAX_LOGPROBS}], got {k}")
    args.dtype = resolve_dtype(args.dtype)   # ("auto": both engines run, and the report names, the real one)
    rng = np.random.default_rng(0)
    shape = SHAPES.get(args.shape)
    if shape is not None:
        model_dir, load_format, vocab = str(shape_checkpoint(shape)), "dummy", shape["vocab_size"]
    else:
        from jaxserve.model_source import resolve_model
        from jaxserve.weights import read_config
        try:
            model_dir, load_format = str(resolve_model(args.model)), "safetensors"
            vocab = read_config(Path(model_dir)).vocab_size   # (a checkpoint directory or a .gguf file)
        except (ValueError, OSError) as e:
            return refuse("bench", e)
    try:
        return _bench(args, rng, model_dir, load_format, vocab, shape)
    except ValueError as e:   # a setting the engine refuses (a prompt past the window), a probe it cannot load
        return refuse("bench", e)


def _bench(args: argparse.Namespace, rng, model_dir: str, load_format: str, vocab: int, shape: dict | None) -> int:
    """``main``'s measurements, once the model is resolved (``shape``: a built-in dummy shape or None)."""
    import jax

    lens = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, args.num_prompts)
    prompts = [rng.integers(3, vocab, n).tolist() for n in lens]
    if args.logprobs is not None or args.prompt_logprobs is not None or args.penalties:
        cost = run_option_cost(model_dir, prompts, args, load_format)
        asked = ", ".join(f"{k}={v}" if k != "logit_bias" else f"logit_bias of {len(v)} tokens"
                          for k, v in cost["asked"].items())
        print(f"model {args.shape or args.model}, {args.num_prompts} prompts x {args.max_tokens} tokens, "
              f"{asked}; overhead = median of paired ratios with/without - 1 [interquartile range]")
        print(_overhead_line(f"engine step, wall ({args.rounds} interleaved generate rounds)", cost["engine_step_wall"]))
        print(_overhead_line(f"engine step, CPU ({args.rounds} interleaved generate rounds)", cost["engine_step_cpu"]))
        print(f"same tokens: {cost['same_tokens']}" + (" (penalties may change them)" if args.penalties else ""))
        if args.json:
            Path(args.json).write_text(json.dumps(cost, indent=2))
        return 0
    if args.length_probe:
        cost = run_probe_cost(model_dir, prompts, args, load_format)
        print(f"model {args.shape or args.model}, {args.num_prompts} prompts x {args.max_tokens} tokens, probe "
              f"{cost['probe']}; overhead = median of paired ratios with/without - 1 [interquartile range]")
        line = _overhead_line
        rows, calls = cost["jitted_rows"], args.probe_calls
        print(line(f"engine step, wall ({args.rounds} interleaved generate rounds)", cost["engine_step_wall"]))
        print(line(f"engine step, CPU ({args.rounds} interleaved generate rounds)", cost["engine_step_cpu"]))
        print(line(f"jitted {rows}-row decode step, wall ({calls} interleaved calls)", cost["jitted_step_wall"]))
        print(line(f"jitted {rows}-row decode step, CPU ({calls} interleaved calls)", cost["jitted_step_cpu"]))
        print(f"probe alone on {cost['jitted_rows']} rows: {cost['probe_alone_cpu_ms']:.4f} ms CPU = "
              f"{cost['probe_alone_share']:.3%} of the step without it; same tokens: {cost['same_tokens']}")
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
