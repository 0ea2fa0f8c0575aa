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
from scheduler import CACHE_OWNER

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


@pytest.mark.parametrize("num_pages,handling,num_host_pages", [
    (64, None, 6), (14, None, 6), (14, None, 0), (14, "preserve", 6), (14, "discard", 6), (14, "swap", 6),
    (14, "discard", 0)])
def test_greedy_outputs_identical_with_the_cache(num_pages, handling, num_host_pages):
    """Device-only (``num_host_pages=0``) and with the host tier (6 host pages)."""
    with_calls = handling is not None
    want = reference(with_calls)
    outs, sched = generate(with_calls, num_pages=num_pages, handling=handling, num_host_pages=num_host_pages)
    assert [o.token_ids for o in outs] == want
    cache = sched.kv.cache
    assert cache.hit_tokens > 0 and sum(o.num_cached_tokens for o in outs) >= 8 * 40   # most skip the system pages
    assert all(o.num_cached_tokens % 8 == 0 and o.num_cached_tokens < len(p) for o, p in zip(outs, PROMPTS))
    if num_pages == 14:
        assert sched.num_preemptions > 0 and cache.evicted_pages > 0


def test_a_prefix_evicted_to_host_comes_back_by_device_put():
    """A prompt's cached pages are pushed off the device by two other prompts, into
    the host tier (real ``jax.device_put`` copies); the same prompt again is served
    from both tiers: its full pages count in ``num_cached_tokens`` and its greedy
    output equals the first run's. With ``num_host_pages=0`` the evicted pages are
    gone and it recomputes them."""
    prompt = RNG.integers(3, 500, 61).tolist()
    others = [RNG.integers(3, 500, 61).tolist() for _ in range(2)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cached = {}
    for host_pages in (16, 0):
        llm = LLM("demo", page_size=8, num_pages=14, num_host_pages=host_pages, max_num_batched_tokens=64,
                  max_model_len=128, check_invariants=True, warmup=False)
        [first] = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)
        for other in others:
            llm.generate(prompt_token_ids=[other], sampling_params=greedy)
        cache = llm.engine.scheduler.kv.cache
        assert cache.evicted_pages >= 7
        [again] = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy)
        assert again.token_ids == first.token_ids
        cached[host_pages] = again.num_cached_tokens
        if host_pages:
            assert cache.host_hit_tokens > 0 and cache.num_host_pages > 0
            executor = llm.engine.executor   # the host tier's copies are host-memory arrays
            kinds = {executor.host_memory_kind(CACHE_OWNER, hp) for hp in cache.host_page_of.values()}
            assert kinds and kinds <= {"pinned_host", "unpinned_host"}
            assert again.num_cached_tokens == 7 * 8   # every full page of the prompt, from either tier
        else:
            assert cache.host_hit_tokens == 0 and cache.num_host_pages == 0
    assert cached[16] > cached[0]
