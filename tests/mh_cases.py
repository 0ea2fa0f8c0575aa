"""One process of the multi-host test (``test_multihost.py``), run as a subprocess.

    python tests/mh_cases.py checkpoint DIR             # write the test checkpoint (demo tokenizer)
    python tests/mh_cases.py reference DIR OUT.json     # TP 4 in one process (4 host devices)
    python tests/mh_cases.py leader DIR OUT.json ADDR   # process 0 of 2 (2 host devices), TP 4
    python tests/mh_cases.py worker DIR - ADDR          # process 1 of 2 (2 host devices)

The leader and the reference generate the same greedy requests, some with a
declared API call under forced Swap (so pages move to host and back on both
processes), and write each request's tokens.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROLE = sys.argv[1]
DEVICES = {"reference": 4, "leader": 2, "worker": 2, "checkpoint": 1}[ROLE]
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

PROMPT_LENS = (5, 13, 22)
NEW_TOKENS = 10
# 8 query heads and 2 KV heads: at TP 4 each KV head is repeated on two devices, one per process.
# The demo tokenizer's 514 ids, in a vocabulary padded to 520 so TP 4 (and 8) divide it.
SHAPE = dict(num_attention_heads=8, num_key_value_heads=2, vocab_size=520)


def engine_settings(role: str, address: str | None) -> dict:
    settings = dict(tensor_parallel_size=4, page_size=8, num_pages=48, num_host_pages=32, max_num_batched_tokens=32,
                    max_model_len=96, warmup=False, compilation_cache=False, handling="swap", swap_budget_tokens=16)
    if role in ("leader", "worker"):
        settings.update(num_processes=2, process_id=0 if role == "leader" else 1, coordinator_address=address)
    return settings


def generate(model_dir: str, role: str, address: str | None) -> dict:
    from jaxserve import LLM, ApiCall, SamplingParams, StructuredOutput

    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, n).tolist() for n in PROMPT_LENS]
    calls = [[], [ApiCall(3, 0.05, [11, 12, 13], "x")], [ApiCall(6, 0.02, [14], "y")]]
    llm = LLM(model_dir, **engine_settings(role, address))
    outs = llm.generate(prompt_token_ids=prompts, api_calls=calls,
                        sampling_params=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    refused = {}   # what the multi-host protocol cannot run yet is refused, naming the option
    for name, params in [("logprobs", SamplingParams(logprobs=1)), ("penalties", SamplingParams(presence_penalty=1.0)),
                         ("structured", SamplingParams(structured=StructuredOutput.json_object()))]:
        try:
            llm.engine.make_request(f"refused-{name}", None, params, prompts[0])
        except ValueError as e:
            refused[name] = str(e)
    result = dict(tokens=[o.token_ids for o in outs], swapped_out=llm.engine.stats.swapped_out_pages, refused=refused,
                  swapped_in=llm.engine.stats.swapped_in_pages, processes=__import__("jax").process_count(),
                  mesh_devices=llm.engine.executor.mesh.size)
    llm.engine.shutdown()
    return result


def main() -> int:
    model_dir = sys.argv[2]
    if ROLE == "checkpoint":
        import shutil

        from conftest import build_hf_model
        from jaxserve.demo import demo_dir
        build_hf_model("llama", **SHAPE).save_pretrained(model_dir)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):   # so the server serves it
            shutil.copy(demo_dir() / name, Path(model_dir) / name)
        return 0
    address = sys.argv[4] if len(sys.argv) > 4 else None
    if ROLE == "worker":
        from jaxserve import LLMEngine
        from jaxserve.parallel.protocol import serve_worker
        engine = LLMEngine(model_dir, **engine_settings(ROLE, address))
        serve_worker(engine.executor)
        return 0
    Path(sys.argv[3]).write_text(json.dumps(generate(model_dir, ROLE, address)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
