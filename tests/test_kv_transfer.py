"""Moving a prompt's KV pages between two engines (prefill/decode disaggregation, without Ray):
export from one engine's prefix cache, import into another's, and generate there."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.distributed.kv_transfer import cached_pages, context_hashes, export_pages, import_pages
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

SETTINGS = dict(dtype="float32", num_pages=48, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=8,
                warmup=False, check_invariants=True)
PROMPT = [(7 * i + 3) % 200 + 5 for i in range(70)]   # 4 full pages of 16 cacheable, 6 tokens left


def _run(engine: LLMEngine, rid: str, max_tokens: int) -> list[int]:
    return _run_prompt(engine, rid, PROMPT, max_tokens)


def _run_prompt(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(rid, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=max_tokens,
                                                                                   temperature=0.0))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return list(out.token_ids)


@pytest.fixture(scope="module")
def engines():
    prefill, decode, reference = (LLMEngine("demo", **SETTINGS) for _ in range(3))
    yield prefill, decode, reference
    for e in (prefill, decode, reference):
        e.shutdown()


def test_moved_pages_are_used_and_give_the_same_tokens(engines):
    prefill, decode, reference = engines
    expected = _run(reference, "ref", 12)
    _run(prefill, "p", 1)
    hashes, kv = export_pages(prefill, PROMPT)
    assert len(hashes) == 4 and hashes == context_hashes(decode, PROMPT)   # both sides name pages alike
    c = prefill.executor.model_config
    assert kv.shape == (c.num_hidden_layers, 2, 4, 16, c.num_key_value_heads, c.head_dim)
    assert cached_pages(decode, PROMPT) == (0, 4)
    assert import_pages(decode, hashes, kv) == 4
    assert cached_pages(decode, PROMPT) == (4, 4)
    pages = decode.scheduler.kv.cache.match(hashes)
    np.testing.assert_array_equal(decode.executor.read_pages(pages), kv)
    assert import_pages(decode, hashes, kv) == 0                         # already cached: nothing written
    cache = decode.scheduler.kv.cache
    hits_before, queries_before = cache.hit_tokens, cache.query_tokens
    assert _run(decode, "d", 12) == expected
    assert cache.query_tokens - queries_before == len(PROMPT)
    assert cache.hit_tokens == hits_before   # moved pages are linked, not recomputed, but are no cache hit
    assert _run(decode, "d-again", 12) == expected
    assert cache.hit_tokens - hits_before == 64   # the same prompt again: its pages were cached before it


def test_only_the_pages_the_receiver_lacks_move(engines):
    """A decode engine holding a prompt's first pages (an earlier turn) gets only the rest."""
    prefill, decode, reference = engines
    prompt = [(11 * i + 5) % 190 + 7 for i in range(70)]
    turn1 = prompt[:40]                                                   # 2 full pages of the same prefix
    expected = _run_prompt(reference, "ref2", prompt, 8)
    _run_prompt(decode, "d-turn1", turn1, 1)
    _run_prompt(prefill, "p2", prompt, 1)
    assert cached_pages(decode, prompt) == (2, 4)
    hashes, kv = export_pages(prefill, prompt, skip=2)
    assert hashes == context_hashes(decode, prompt)[2:] and kv.shape[2] == 2   # pages 2 and 3 only
    assert import_pages(decode, hashes, kv) == 2
    assert cached_pages(decode, prompt) == (4, 4)
    hits_before = decode.scheduler.kv.cache.hit_tokens
    assert _run_prompt(decode, "d2", prompt, 8) == expected
    assert decode.scheduler.kv.cache.hit_tokens - hits_before == 32   # turn 1's pages; the moved ones are no hit
    assert export_pages(prefill, prompt, skip=4) == ([], None)            # the receiver holds them all


def test_import_stops_when_the_pool_is_full(engines):
    _, decode, _ = engines
    kvm = decode.scheduler.kv
    free = kvm.num_free_device
    fake = [bytes([i]) * 16 for i in range(free + 3)]
    adopted = kvm.adopt(fake)
    assert len(adopted) == free and [i for i, _ in adopted] == list(range(free))
    assert kvm.num_free_device == free   # adopted pages are evictable, as cached pages of finished requests


def test_usage_of_a_disaggregated_request_counts_only_what_was_cached_before_it():
    """A decode replica's request whose prompt pages a prefill replica just computed reports
    none of them as cached (they were linked from the moved pages, which the decode engine's
    cache counts as hits); a repeat of the prompt, found in the decode cache, reports them. A
    request that scores its prompt (``prompt_logprobs``) computes it on the decode replica and
    asks the prefill replica for nothing."""
    import asyncio
    from types import SimpleNamespace

    from jaxserve.async_engine import AsyncEngine
    from jaxserve.distributed.kv_transfer import DisaggregatedEngine, PrefillReplica, TransferMetrics
    from prometheus_client import CollectorRegistry

    prefill_side = PrefillReplica.__new__(PrefillReplica)   # (its constructor reads CLI settings)
    prefill_side.engine = AsyncEngine(engine=LLMEngine("demo", **SETTINGS))

    asked = []   # the priority class each prefill was asked in

    class Handle:   # what a Ray Serve deployment handle's ``prefill.remote(...)`` awaits to
        async def remote(self, token_ids, skip_pages, priority):
            asked.append(priority)
            return await prefill_side.prefill(token_ids, skip_pages, priority)

    class Health:   # (asked when a prefill takes longer than a probe period: a cold compile on a busy machine)
        async def remote(self):
            return {"alive": True}

    decode = DisaggregatedEngine(engine=LLMEngine("demo", **SETTINGS))
    decode.prefill = SimpleNamespace(prefill=Handle(), health=Health())
    registry = CollectorRegistry()
    decode.metrics = TransferMetrics(registry)

    async def cached_of(rid, prompt=PROMPT, priority=0, **scoring):
        async for out in decode.generate(sampling_params=SamplingParams(max_tokens=2, temperature=0.0, **scoring),
                                         request_id=rid, prompt_token_ids=prompt, priority=priority):
            pass
        return out.num_cached_tokens

    try:
        assert asyncio.run(cached_of("first", priority=3)) == 0
        assert registry.get_sample_value("jaxserve:remote_prefills_total") == 1   # the pages did move
        assert asyncio.run(cached_of("batch", PROMPT[:40])) == 32 and asked == [3]   # (its 2 pages were cached)
        assert asyncio.run(cached_of("again")) == 64   # 4 full pages, now in the decode replica's cache
        assert asyncio.run(cached_of("scored", PROMPT[::-1], prompt_logprobs=0)) == 0
        assert registry.get_sample_value("jaxserve:remote_prefills_total") == 1   # not asked for its pages
    finally:
        decode.shutdown()
        prefill_side.engine.shutdown()


def test_a_prefill_deployment_that_stops_answering_costs_only_speed():
    """Ray Serve holds a call to a deployment with no replica running until one starts
    again (maybe never): a decode replica whose prefill call is still pending asks the
    deployment's health, and computes the prompt itself when that goes unanswered
    (counted as a fallback), with the same answer; a slow prefill whose deployment
    answers its health check is waited for."""
    import asyncio
    from types import SimpleNamespace

    from jaxserve.async_engine import AsyncEngine
    from jaxserve.distributed.kv_transfer import DisaggregatedEngine, PrefillReplica, TransferMetrics
    from prometheus_client import CollectorRegistry

    prefill_side = PrefillReplica.__new__(PrefillReplica)   # (its constructor reads CLI settings)
    prefill_side.engine = AsyncEngine(engine=LLMEngine("demo", **SETTINGS))
    state = {"up": False}

    class Prefill:
        async def remote(self, token_ids, skip_pages, priority):
            if not state["up"]:
                await asyncio.Event().wait()   # (held by Ray Serve: no replica runs)
            await asyncio.sleep(0.5)           # (slower than a probe period)
            return await prefill_side.prefill(token_ids, skip_pages, priority)

    class Health:
        async def remote(self):
            if not state["up"]:
                await asyncio.Event().wait()
            return {"alive": True}

    decode = DisaggregatedEngine(engine=LLMEngine("demo", **SETTINGS))
    decode.prefill = SimpleNamespace(prefill=Prefill(), health=Health())
    decode.prefill_probe_s = 0.1
    registry = CollectorRegistry()
    decode.metrics = TransferMetrics(registry)

    async def answer(rid, prompt):
        async for out in decode.generate(sampling_params=SamplingParams(max_tokens=4, temperature=0.0),
                                         request_id=rid, prompt_token_ids=prompt):
            pass
        return out.token_ids

    try:
        down = asyncio.run(asyncio.wait_for(answer("down", PROMPT), 60))
        assert registry.get_sample_value("jaxserve:remote_prefill_fallbacks_total") == 1
        assert not registry.get_sample_value("jaxserve:remote_prefills_total")
        state["up"] = True
        up = asyncio.run(answer("up", PROMPT[::-1]))
        assert registry.get_sample_value("jaxserve:remote_prefills_total") == 1   # waited for, not given up
        assert registry.get_sample_value("jaxserve:remote_prefill_fallbacks_total") == 1
        assert up == asyncio.run(answer("again", PROMPT[::-1]))
        assert down == asyncio.run(answer("local", PROMPT))   # the fallback's answer is the engine's own
    finally:
        decode.shutdown()
        prefill_side.engine.shutdown()
