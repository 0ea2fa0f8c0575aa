"""Tensor-parallel runs for ``test_tensor_parallel.py``, in a process of its own.

XLA reads ``--xla_force_host_platform_device_count`` once, when JAX starts, and
the rest of the suite runs with one device; so the test runs this script as
``python tests/tp_cases.py OUT.json`` with 8 forced host devices and checks
what it wrote: per case, the greedy tokens of every request, the logits of
every step, preemptions and swapped pages, and the transformers references.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from conftest import build_hf_model  # noqa: E402

KINDS = ("llama", "mistral", "qwen2", "qwen3")
# 8 query heads so TP 8 divides them; 2 KV heads, so TP 4 and 8 repeat each KV head 2 and 4 times.
SHAPE = dict(num_attention_heads=8, num_key_value_heads=2)
TP_DEGREES = (1, 2, 4, 8)
PROMPT_LENS = (3, 9, 17, 30)
NEW_TOKENS = 12
GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, 256, n).tolist() for n in PROMPT_LENS]


def hf_greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def run(path: Path, tp: int, num_pages: int, api_calls=None, handling: str | None = None,
        logprobs: int | None = None) -> dict:
    """Step an engine by hand over ``prompts()``; record tokens, each step's logits and counters
    (and with ``logprobs``, the first request's, which asks for them: ``[token, logprob, top]``)."""
    from jaxserve import LLMEngine, SamplingParams

    cpu_start = time.process_time()
    engine = LLMEngine(str(path), tensor_parallel_size=tp, page_size=8, num_pages=num_pages, num_host_pages=64,
                       max_num_batched_tokens=32, max_model_len=96, warmup=False, keep_logits=True,
                       check_invariants=True, handling=handling, swap_budget_tokens=16)
    params = SamplingParams(max_tokens=NEW_TOKENS, **GREEDY)
    for i, ids in enumerate(prompts()):
        engine.add_request(f"r{i}", prompt_token_ids=ids, sampling_params=params if i or logprobs is None else
                           SamplingParams(max_tokens=NEW_TOKENS, logprobs=logprobs, **GREEDY),
                           api_calls=None if api_calls is None else api_calls[i])
    tokens: dict[str, list[int]] = {}
    logits = []
    records = None
    while engine.has_unfinished():
        outs = engine.step()
        if engine.last_logits is not None and outs:
            logits.append(np.asarray(engine.last_logits).tolist())
        for out in outs:
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
            if out.request_id == "r0" and out.logprobs is not None:
                records = [[r.token_id, r.logprob, [list(t) for t in r.top]] for r in out.logprobs]
        if not outs:
            time.sleep(0.001)      # an API call in flight
    executor = engine.executor
    result = dict(tokens=[tokens[f"r{i}"] for i in range(len(PROMPT_LENS))], logits=logits,
                  preemptions=engine.scheduler.num_preemptions, swapped_in=engine.stats.swapped_in_pages,
                  swapped_out=engine.stats.swapped_out_pages, kv_devices=len(executor.kv[0][0].sharding.device_set),
                  kv_shard_heads=executor.kv[0][0].addressable_shards[0].data.shape[2],
                  host_memory_kind=executor.host_sharding.memory_kind,
                  host_chunk_spec=str(executor.host_sharding.spec),
                  free_pages=engine.scheduler.kv.num_free_device, num_pages=engine.scheduler.device_pool.num_pages,
                  logprobs=records, cpu_s=time.process_time() - cpu_start)
    engine.shutdown()
    return result


def main(out_path: str) -> None:
    from jaxserve import ApiCall

    results: dict = {"references": {}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            model = build_hf_model(kind, **SHAPE)
            path = Path(tmp) / kind
            model.save_pretrained(path)
            results["references"][kind] = [hf_greedy(model, p) for p in prompts()]
            for tp in TP_DEGREES:
                results["runs"][f"{kind}-tp{tp}"] = run(path, tp, num_pages=64, logprobs=3 if kind == "llama" else None)
        # 9 pages of 8 tokens for four requests of up to 42 tokens: preemption by recompute.
        results["runs"]["llama-tp4-tight"] = run(Path(tmp) / "llama", 4, num_pages=9, logprobs=3)
        calls = [[ApiCall(2 + i, 0.01, [7, 8, 9][:i + 1], "x")] for i in range(len(PROMPT_LENS))]
        for tp, handling in ((1, "preserve"), (8, "swap"), (2, "swap")):
            results["runs"][f"qwen2-tp{tp}-{handling}"] = run(Path(tmp) / "qwen2", tp, num_pages=64,
                                                              api_calls=calls, handling=handling)
        results["probe_tp4"] = probe_loads(Path(tmp) / "llama", Path(tmp) / "probe", tp=4)
    Path(out_path).write_text(json.dumps(results))


def probe_loads(path: Path, probe_dir: Path, tp: int) -> str:
    """A length probe saved for checkpoint ``path`` as ``jaxserve predictor train`` saves it
    (the model loaded on one device), then an engine at ``tp`` told to use it: "accepted",
    or the refusal."""
    import jax

    from jaxserve import LLMEngine
    from jaxserve.predictor.bins import bin_lengths
    from jaxserve.predictor.checkpoint import model_identity, save_probe
    from jaxserve.predictor.probe import init_probe
    from jaxserve.weights import load_model
    model, config = load_model(path, "float32", progress=False)
    features = np.random.default_rng(0).normal(size=(64, config.hidden_size)).astype(np.float32)
    save_probe(probe_dir, init_probe(jax.random.key(0), features, 32, bin_lengths()),
               model_identity(model, config, str(path)), 32, {"train_mean_tokens": 100.0})
    try:
        LLMEngine(str(path), tensor_parallel_size=tp, predictor=f"learned:{probe_dir}", page_size=8, num_pages=32,
                  max_model_len=96, warmup=False).shutdown()
    except ValueError as e:
        return str(e)
    return "accepted"


if __name__ == "__main__":
    main(sys.argv[1])
