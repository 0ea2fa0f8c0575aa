"""The prefix cache on the real engine (demo model, greedy): outputs are the
same with the cache on and off for requests sharing a long system prompt,
with a roomy pool and with one so tight that preemption and cache eviction
happen, and with each handling forced on their API calls; the page
invariants are checked after every step and the pool ends free or
cached-and-unreferenced."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, ApiCall, SamplingParams

RNG = np.random.default_rng(0)
SYSTEM = RNG.integers(3, 500, 45).tolist()
PROMPTS = [SYSTEM + RNG.integers(3, 500, int(n)).tolist() for n in RNG.integers(3, 20, 12)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
REFERENCE: dict[bool, list[list[int]]] = {}


def generate(with_calls: bool, **config):
    llm = LLM("demo", page_size=8, max_num_batched_tokens=64, max_model_len=128, check_invariants=True,
              warmup=False, **config)
    calls = [[ApiCall(4, 0.002, [7, 8, 9], "tool")] for _ in PROMPTS] if with_calls else None
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY, api_calls=calls)
    sched = llm.engine.scheduler
    assert not sched.has_unfinished() and sched.kv.num_free_device == sched.device_pool.num_pages
    return outs, sched


def reference(with_calls: bool) -> list[list[int]]:
    if with_calls not in REFERENCE:
        outs, _ = generate(with_calls, enable_prefix_caching=False, num_pages=64,
                           handling="preserve" if with_calls else None)
        REFERENCE[with_calls] = [o.token_ids for o in outs]
    return REFERENCE[with_calls]


@pytest.mark.parametrize("num_pages,handling", [(64, None), (14, None), (14, "preserve"), (14, "discard"),
                                                (14, "swap")])
def test_greedy_outputs_identical_with_the_cache(num_pages, handling):
    with_calls = handling is not None
    want = reference(with_calls)
    outs, sched = generate(with_calls, num_pages=num_pages, handling=handling, num_host_pages=6)
    assert [o.token_ids for o in outs] == want
    cache = sched.kv.cache
    assert cache.hit_tokens > 0 and sum(o.num_cached_tokens for o in outs) >= 8 * 40   # most skip the system pages
    assert all(o.num_cached_tokens % 8 == 0 and o.num_cached_tokens < len(p) for o, p in zip(outs, PROMPTS))
    if num_pages == 14:
        assert sched.num_preemptions > 0 and cache.evicted_pages > 0
