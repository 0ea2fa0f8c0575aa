"""Every registered policy drives the real engine (demo model) through API calls
under a tight page pool: every request finishes, all pages are free at the end,
and greedy outputs do not depend on the policy (scheduling order, handling and
preemption never change the math)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, ApiCall, SamplingParams
from scheduler import available_policies


RESULTS: dict[str, list[list[int]]] = {}


@pytest.mark.parametrize("policy", [p for p in available_policies() if p != "mars"])  # mars is lamps' alias
def test_policy_runs_end_to_end_with_api_calls(policy):
    llm = LLM("demo", policy=policy, page_size=8, num_pages=20, num_host_pages=8, max_num_batched_tokens=32,
              max_model_len=128, check_invariants=True, warmup=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(4, 40, 10)]
    calls = [[ApiCall(2 + k % 3, 0.002 * (k % 4), [7] * (k % 5), ["math", "qa", "ve"][k % 3]),
              ApiCall(8, 0.001, [9, 9], "math")] for k in range(10)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True), api_calls=calls)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 and len(o.api_calls) == 2 for o in outs)
    sched = llm.engine.scheduler
    assert not sched.has_unfinished()
    assert sched.kv.num_free_device == sched.device_pool.num_pages
    assert sched.kv.num_free_host == sched.host_pool.num_pages
    RESULTS[policy] = [o.token_ids for o in outs]
    first = next(iter(RESULTS.values()))
    assert RESULTS[policy] == first
