"""The prefix cache: chained hashes, ref counts and the retention-scored
evictable set (``scheduler.prefix_cache``), the KV manager's link/commit/
release, and the scheduler driven with a fake model that reads its context
back from simulated KV pages, so a wrongly shared or evicted page changes
the output (no JAX)."""

import random

import pytest

from scheduler import (BUILTIN_PROFILES, EventKind, Handling, PageAllocator, Request, RequestState, Scheduler,
                       SchedulerConfig, Segment, StepResult, make_policy)
from scheduler.kv_manager import CACHE_OWNER, KVManager
from scheduler.prefix_cache import PrefixCache, page_hash, root_hash

COST = BUILTIN_PROFILES["gptj-6b-a100-40g"]


def test_hashes_chain_and_separate_models():
    root = root_hash("model-a|float32")
    assert root != root_hash("model-b|float32") and root != root_hash("model-a|bfloat16")
    a = page_hash(root, [1, 2, 3, 4])
    assert a == page_hash(root, [1, 2, 3, 4]) and len(a) == 16
    assert a != page_hash(root, [1, 2, 3, 5])
    assert page_hash(a, [5, 6, 7, 8]) != page_hash(page_hash(root, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert page_hash(root, [256]) != page_hash(root, [1, 0])   # ids are 8-byte integers, not bytes


def test_eviction_order_is_retention_score_and_a_hit_refreshes_it():
    cache = PrefixCache()
    for p in range(4):
        cache.insert(p, bytes([p]) * 16)
    cache.release([0, 1], now=10.0)                  # plain: score 10 (tail first on ties)
    cache.release([2], now=1.0, bonus_s=30.0)        # a context inside an API call: score 31
    assert cache.num_evictable == 3 and not cache.is_evictable(3)
    assert cache.evict() == 1 and cache.evict() == 0
    cache.acquire([2])                               # a hit takes it out of the evictable set
    cache.release([2], now=40.0)
    cache.release([3], now=35.0)
    assert cache.evict() == 3 and cache.evict() == 2
    with pytest.raises(RuntimeError, match="nothing evictable"):
        cache.evict()
    assert cache.num_pages == 0 and cache.evicted_pages == 4


@pytest.mark.parametrize("seed", range(6))
def test_eviction_order_matches_one_at_a_time_under_mixed_releases(seed):
    """Plain releases go to an LRU, bonus (or out-of-time-order) ones to a heap;
    batched eviction across both, with re-referenced pages in between, evicts
    exactly what evicting the lowest (score, seq) one page at a time would, and
    keeps the residence average the same."""
    rng = random.Random(seed)
    cache = PrefixCache()
    model: dict[int, tuple[float, int, float]] = {}   # evictable page -> (score, seq, released)
    refs: dict[int, int] = {}
    seq, now, residence, next_page = 0, 0.0, float("inf"), 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not refs:   # a request computes a few new pages
            pages = list(range(next_page, next_page + rng.randint(1, 5)))
            next_page += len(pages)
            for p in pages:
                cache.insert(p, p.to_bytes(16, "little"))
                refs[p] = 1
        elif op < 0.6:   # a request lists some cached pages no more
            listed = [p for p, n in refs.items() if n > 0]
            pages = rng.sample(listed, min(len(listed), rng.randint(1, 6)))
            now += rng.choice([0.0, 0.5, 1.0, -0.25])   # ties, and now and then an earlier time
            bonus = rng.choice([0.0, 0.0, 0.0, 2.0])
            cache.release(pages, now, bonus)
            for p in reversed(pages):
                refs[p] -= 1
                if not refs[p]:
                    seq += 1
                    model[p] = (now + bonus, seq, now)
        elif op < 0.75:   # a hit links some cached pages again
            pages = rng.sample(sorted(refs), min(len(refs), rng.randint(1, 4)))
            cache.acquire(pages)
            for p in pages:
                refs[p] += 1
                model.pop(p, None)
        else:   # the pool needs pages
            count = rng.randint(1, 8)
            at = now + 1.0
            got = [p for p, _ in cache.evict_entries(count, at)]
            want = sorted(model, key=lambda p: model[p][:2])[:count]
            assert got == want
            for p in want:
                age = max(0.0, at - model.pop(p)[2])
                residence = age if residence == float("inf") else 0.9 * residence + 0.1 * age
                del refs[p]
            assert cache.residence_s == pytest.approx(residence, rel=0, abs=0)
        assert cache.num_evictable == len(model)
        cache.check_invariants({p: n for p, n in refs.items() if n})


def test_a_context_relinked_after_every_call_leaves_no_pile_of_stale_entries():
    """Soft retention while nothing is evicted: an agent's context is released
    inside each API call (with the retention bonus) and re-linked when the call
    returns. Each release used to leave an entry behind until the first eviction
    (100,000 calls: 100,000 entries holding 2M page ids); stale pages are now
    dropped once they outnumber the evictable ones 4 to 1, and the eviction order
    is the same."""
    cache = PrefixCache()
    context, plain = list(range(20)), [20, 21]
    for p in context + plain:
        cache.insert(p, p.to_bytes(16, "little"))
    cache.release(plain, now=0.0)
    for k in range(5000):
        cache.release(context, now=float(k), bonus_s=5.0)
        cache.acquire(context)
        # at most 4x the pages evictable at a release (22) + 64, and never growing with the calls
        assert cache._queued <= 4 * (len(plain) + len(context)) + 64 + len(context)
    assert len(cache._heap) <= 200
    cache.release(context, now=5000.0, bonus_s=5.0)
    cache.check_invariants({})
    assert [p for p, _ in cache.evict_entries(22, 6000.0)] == [21, 20] + context[::-1]


def make_kv(device=8, host=8, page_size=4):
    return KVManager(PageAllocator(device, page_size), PageAllocator(host, page_size, "host"), PrefixCache("m"))


def computed(kv, rid, ids):
    """A request with ``ids`` as context, all computed (its pages committed)."""
    r = Request(rid, 0.0, prompt_len=len(ids), max_tokens=4, token_ids=list(ids))
    kv.link(r, kv.lookup(r))
    assert kv.allocate_slots(r, kv.pages_needed(r, r.num_uncomputed_tokens))
    r.num_computed_tokens = len(ids)
    kv.commit(r)
    return r


def test_link_commit_release_and_longest_run():
    kv = make_kv()
    a = computed(kv, "a", list(range(10)))            # 2 full pages cached, a partial private one
    assert a.num_shared_pages == 2 and kv.cache.num_pages == 2
    kv.check_invariants([a], set(), set())
    b = Request("b", 0.0, prompt_len=11, max_tokens=1, token_ids=list(range(8)) + [99, 98, 97])
    assert kv.lookup(b) == a.device_pages[:2]
    c = Request("c", 0.0, prompt_len=8, max_tokens=1, token_ids=list(range(8)))
    assert kv.lookup(c) == a.device_pages[:1]          # one token is always left to compute
    d = Request("d", 0.0, prompt_len=9, max_tokens=1, token_ids=[0, 1, 2, 7] + list(range(4, 9)))
    assert kv.lookup(d) == []                          # first page differs: nothing after it matches
    kv.link(b, kv.lookup(b))
    assert b.num_computed_tokens == 8 and kv.cache.refs[a.device_pages[0]] == 2
    kv.check_invariants([a, b], set(), {"b"} - {"b"})
    kv.free_device(a)
    assert kv.cache.num_evictable == 0                  # b still lists both
    kv.free_device(b)
    assert kv.cache.num_evictable == 2 and kv.num_free_device == 8
    kv.check_invariants([], set(), set())


def test_a_request_scoring_its_prompt_links_only_pages_before_its_first_unscored_place():
    kv = make_kv()
    computed(kv, "a", list(range(12)))                 # 3 full pages cached
    ids = list(range(12)) + [50]
    for scored, pages in [([], 0), ([None], 0), ([None] * 5, 1), ([None] * 9, 2), ([None] * 13, 3)]:
        r = Request(f"s{len(scored)}", 0.0, prompt_len=13, max_tokens=1, token_ids=ids, prompt_logprobs=scored)
        kv.hash_context(r)   # (as at arrival)
        assert len(kv.lookup(r)) == pages, scored


def test_commit_of_a_prefix_computed_twice_keeps_one_copy():
    kv = make_kv()
    a = Request("a", 0.0, prompt_len=8, max_tokens=1, token_ids=list(range(8)))
    b = Request("b", 0.0, prompt_len=8, max_tokens=1, token_ids=list(range(8)))
    for r in (a, b):                                   # both admitted before either computed
        assert kv.allocate_slots(r, 2)
    for r in (a, b):
        r.num_computed_tokens = 8
        kv.commit(r)
    assert a.device_pages == b.device_pages and kv.cache.num_pages == 2 and kv.device_pool.num_free == 6
    kv.check_invariants([a, b], set(), set())


def test_allocation_evicts_only_unreferenced_cached_pages():
    kv = make_kv(device=4)
    a = computed(kv, "a", list(range(8)))              # 2 shared pages
    b = computed(kv, "b", list(range(100, 108)))       # 2 more: the pool is full
    kv.free_device(b)
    r = Request("r", 0.0, prompt_len=12, max_tokens=1, token_ids=list(range(200, 212)))
    assert not kv.allocate_slots(r, 3)                 # a's pages are referenced: only 2 can be had
    assert kv.allocate_slots(r, 2) and kv.cache.evicted_pages == 2
    assert set(r.device_pages).isdisjoint(a.device_pages)
    kv.check_invariants([a, r], set(), set())
    assert kv.device_pool.owned_by()[CACHE_OWNER] == sorted(a.device_pages)


def test_swap_in_relinks_pages_still_cached():
    kv = make_kv(device=8, host=8)
    r = computed(kv, "r", list(range(14)))             # 3 full pages + 2 tokens
    assert kv.start_swap_out(r)
    while not kv.swap_chunk(r, 8, out=True)[2]:
        pass
    assert kv.cache.num_evictable == 3 and len(r.host_pages) == 4
    assert kv.start_swap_in(r) and r.num_shared_pages == 3 and kv.relinked_swap_pages == 3
    op, n, done = kv.swap_chunk(r, 8, out=False)
    assert done and n == 1 and op.host_pages == op.host_pages[:1]   # only the partial page is copied
    kv.check_invariants([r], set(), set())


def test_swap_in_relinks_only_what_survived_evictions_while_swapped():
    """The pages a swapped request left cached are remembered for its swap-in
    only while nothing is evicted: here two of its three are evicted (tail
    first) by another request's allocation, so the swap-in re-links one and
    copies the rest."""
    kv = make_kv(device=8, host=8)
    r = computed(kv, "r", list(range(14)))             # 3 full pages + 2 tokens
    head = r.device_pages[0]
    assert kv.start_swap_out(r)
    while not kv.swap_chunk(r, 8, out=True)[2]:
        pass
    other = Request("o", 0.0, prompt_len=28, max_tokens=1, token_ids=list(range(100, 128)))
    assert kv.allocate_slots(other, 7) and kv.cache.evicted_pages == 2   # 5 free + the 2 newest-released
    kv.free(other)
    assert kv.start_swap_in(r) and r.num_shared_pages == 1 and r.device_pages[0] == head
    assert kv.relinked_swap_pages == 1
    op, n, done = kv.swap_chunk(r, 8, out=False)
    assert done and n == 3 and r.num_shared_pages == 3   # the 3 others copied; its 2 full ones committed again
    kv.check_invariants([r], set(), set())


def make_tiered_kv(device=4, host=3, page_size=4):
    kv = KVManager(PageAllocator(device, page_size), PageAllocator(host, page_size, "host"), PrefixCache("m"),
                   host_tier=True)
    kv.copies_done()
    kv.copy_budget = 8
    return kv


def test_host_tier_keeps_evicted_pages_and_a_hit_copies_them_back():
    kv = make_tiered_kv()
    a = computed(kv, "a", list(range(9)))              # 2 cached pages + a partial one
    kv.free_device(a)
    b = computed(kv, "b", list(range(100, 116)))       # 4 pages: a's 2 cached pages are evicted to host
    assert kv.cache.evicted_pages == 2 and kv.cache.num_host_pages == 2 and kv.cache.num_pages == 4
    copy_out, copy_in = kv.take_copies()
    assert copy_in is None and copy_out.request is None and copy_out.owner == CACHE_OWNER
    assert sorted(copy_out.host_pages) == sorted(kv.cache.host_page_of.values())
    kv.check_invariants([b], set(), set())             # host-resident cached pages are owned by the cache
    kv.free_device(b)
    kv.copies_done()
    kv.copy_budget = 1
    again = Request("a2", 0.0, prompt_len=9, max_tokens=1, token_ids=list(range(9)))
    hits = kv.lookup(again)
    assert len(hits) == 1 and hits[0] < 0              # host-resident; the budget allows one copy
    kv.copy_budget = 8
    hits = kv.lookup(again)
    assert len(hits) == 2 and all(p < 0 for p in hits)
    host_pages = [~p for p in hits]
    assert kv.num_evictable_in(hits) == 2              # each takes a device page
    kv.link(again, hits)
    assert again.num_computed_tokens == 8 and kv.cache.host_hit_tokens == 8 and again.num_shared_pages == 2
    copy_out, copy_in = kv.take_copies()
    assert copy_in.host_pages == host_pages and copy_in.device_pages == again.device_pages
    # The host copies stay (linking took 2 device pages: one of b's evicted pages went to the
    # last free host page, the other was dropped: the pages this step reads back are never evicted).
    assert set(host_pages) <= set(kv.cache.host_page_of.values()) and kv.cache.num_host_pages == 3
    kv.check_invariants([again], set(), set())
    kv.free_device(again)
    kv.copies_done()
    kv.copy_budget = 8
    c = computed(kv, "c", list(range(200, 216)))       # evicts all 4 cached pages; 3 host pages to keep them
    copy_out, _ = kv.take_copies()
    assert len(copy_out.host_pages) == len(set(copy_out.host_pages))   # a host page is written once a step
    kv.check_invariants([c], set(), set())


def test_swap_out_takes_host_pages_from_the_host_tier_first():
    kv = make_tiered_kv(device=4, host=5)
    a = computed(kv, "a", list(range(8)))
    kv.free_device(a)
    b = computed(kv, "b", list(range(100, 116)))       # a's 2 pages -> host: 3 host pages left free
    assert kv.cache.num_host_pages == 2 and kv.host_pool.num_free == 3 and kv.num_free_host == 5
    kv.copies_done()                                   # the step ran: its copies no longer pin host pages
    assert kv.start_swap_out(b)                        # needs 4: one taken from the host tier (its oldest)
    assert len(b.host_pages) == 4 and kv.cache.num_host_pages == 1 and kv.cache.host_evicted_pages == 1
    kv.check_invariants([b], set(), set())


def test_a_lookup_kept_across_steps_sees_a_host_page_computed_again_on_the_device():
    kv = make_tiered_kv(device=4, host=3)
    a = computed(kv, "a", list(range(9)))              # 2 cached pages + a private one
    kv.free_device(a)
    y = Request("y", 0.0, prompt_len=9, max_tokens=1, token_ids=list(range(9)))
    assert kv.allocate_slots(y, 2)                     # admitted without a hit, computes a's prefix again
    b = computed(kv, "b", list(range(100, 108)))       # a's 2 cached pages are evicted to host
    assert kv.cache.num_host_pages == 2
    kv.copies_done()
    kv.copy_budget = 8
    x = Request("x", 0.0, prompt_len=9, max_tokens=1, token_ids=list(range(9)))
    assert all(p < 0 for p in kv.lookup(x))            # host-resident, kept for the next step
    y.num_computed_tokens = 8
    kv.commit(y)                                       # the same hashes are on the device now
    hits = kv.lookup(x)
    assert hits == y.device_pages                      # not the host copies: no copy-in, no second entry
    kv.link(x, hits)
    assert kv.take_copies()[1] is None
    kv.check_invariants([y, x, b], set(), set())


def test_a_host_page_a_swap_in_reads_is_not_written_by_a_copy_out_of_the_same_step():
    kv = make_tiered_kv(device=4, host=2)
    r = computed(kv, "r", [90, 91, 92])                # one private page
    assert kv.start_swap_out(r) and kv.swap_chunk(r, 8, out=True)[2]
    a = computed(kv, "a", list(range(8)))              # 2 cached pages
    kv.free_device(a)
    b = computed(kv, "b", list(range(100, 112)))       # 3 pages: a's evicted, one kept on the last host page
    assert kv.host_pool.num_free == 0 and kv.cache.num_host_pages == 1
    kv.free_device(b)
    kv.copies_done()                                   # the next step
    kv.copy_budget = 8
    assert kv.start_swap_in(r)
    swap_in, _, done = kv.swap_chunk(r, 8, out=False)  # done: r's host page is freed, read this step
    assert done
    computed(kv, "c", list(range(200, 212)))           # evicts b's cached pages to host
    copy_out, _ = kv.take_copies()
    assert copy_out is not None
    assert not set(copy_out.host_pages) & set(swap_in.host_pages)   # copy-outs run before swap-ins


def test_a_page_a_swap_in_writes_is_not_copied_to_the_host_in_the_same_step():
    """The executor runs copy-outs before swap-ins. A page whose KV a swap-in brings back
    this step is cached at once (its request's commit); if that request is preempted and
    the page evicted in the same step, copying it to the host tier would keep the page's
    previous KV under the new hash, read back later as another context's. It is dropped
    instead. (A host-tier hit's copy-in page needs no such care: its hash stays on the
    host, on a page no copy of the step may reuse.)"""
    kv = make_tiered_kv(device=4, host=8)
    r = computed(kv, "r", [90, 91, 92, 93, 94])     # one full page, one partial
    assert kv.start_swap_out(r) and kv.swap_chunk(r, 8, out=True)[2]
    kv.copies_done()                                # (no copy budget: r's cached page is dropped when evicted)
    kv.free_device(computed(kv, "b", list(range(100, 116))))
    kv.copies_done()
    kv.copy_budget = 8
    assert kv.start_swap_in(r)
    swap_in, _, done = kv.swap_chunk(r, 8, out=False)
    h = r.block_hashes[0]
    assert done and kv.cache.page_of[h] == swap_in.device_pages[0] and h not in kv.cache.host_page_of
    kv.free_device(r)                               # preempted in the same step
    computed(kv, "c", list(range(200, 216)))        # evicts every cached page, r's too
    assert h not in kv.cache.page_of and h not in kv.cache.host_page_of   # dropped, not copied


def test_a_hit_copied_back_and_the_evictions_it_causes_share_one_copy_budget():
    kv = make_tiered_kv(device=4, host=4)
    a = computed(kv, "a", list(range(8)))
    kv.free_device(a)
    kv.free_device(computed(kv, "b", list(range(100, 116))))   # a's pages -> host; b's 4 cached on the device
    kv.copies_done()
    kv.copy_budget = 2
    x = Request("x", 0.0, prompt_len=9, max_tokens=1, token_ids=list(range(9)))
    hits = kv.lookup(x)
    assert len(hits) == 2 and all(p < 0 for p in hits)
    kv.link(x, hits)                                   # 2 copy-ins; their device pages evict 2 of b's
    copies = [op for op in kv.take_copies() if op is not None]
    assert sum(len(op.host_pages) for op in copies) <= 2   # the step's swap budget, not twice it


# ------------------------------------------------------- scheduler with fake KV
class PagedModel:
    """A fake model over simulated KV pages: a computed position writes its token
    id into its page slot (or the swap copies it); the next token is a hash of
    the context *read back from the pages*, so outputs change if a request is
    given a page holding other tokens."""

    def __init__(self, page_size):
        self.ps = page_size
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def step(self, plan):
        for op in plan.swap_out:
            for d, h in zip(op.device_pages, op.host_pages):
                self.host[h] = list(self.device.get(d, [None] * self.ps))
        for op in plan.swap_in:
            for d, h in zip(op.device_pages, op.host_pages):
                self.device[d] = list(self.host[h])
        ids = []
        for chunk in plan.chunks:
            r = chunk.request
            for pos in range(chunk.start, chunk.start + chunk.num_tokens):
                page = self.device.setdefault(r.device_pages[pos // self.ps], [None] * self.ps)
                page[pos % self.ps] = r.token_ids[pos]
            end = chunk.start + chunk.num_tokens
            context = [self.device[r.device_pages[p // self.ps]][p % self.ps] for p in range(end)]
            assert context == r.token_ids[:end], f"{r.request_id}: KV pages hold another context"
            ids.append(sum((i + 1) * (t or 0) for i, t in enumerate(context)) % 97 + 3)
        return StepResult(token_ids=ids)


def drive_paged(sched, model, arrivals: list, max_steps: int) -> None:
    """Step ``sched`` on ``model`` until every request of ``arrivals`` (``(time, request)``,
    added when due, its arrival time then) has ended: each API call returns after its
    duration with tokens of its own; the invariants are checked every step, and that no
    running request is left without tokens while the step's budget has room and an idle
    holder (a request not running) keeps device pages it could have had."""
    arrivals, pending, now, steps = list(arrivals), [], 0.0, 0
    while arrivals or sched.has_unfinished():
        steps += 1
        assert steps < max_steps
        for t, r in [a for a in arrivals if a[0] <= now]:
            arrivals.remove((t, r))
            r.arrival_time = now
            sched.add_request(r, now)
        for t, r in [p for p in pending if p[0] <= now]:
            pending.remove((t, r))
            k = r.segments[r.segment_index - 1].num_returned_tokens
            sched.api_return(r, k, now, token_ids=[(len(r.token_ids) + j) % 50 + 3 for j in range(k)])
        plan = sched.schedule(now)
        if plan.num_batched_tokens < plan.token_budget and (sched.kv.paused_holders or sched.kv.waiting_holders):
            served = {c.request.request_id for c in plan.chunks}
            assert all(r.request_id in served for r in sched.running if r.num_uncomputed_tokens), \
                "a running request got no tokens while an idle holder kept pages"
        result = model.step(plan)
        now += 0.01
        for event in sched.update(plan, result, now):
            if event.kind is EventKind.API_CALL:
                pending.append((now + event.segment.api_duration_s, event.request))
        sched.check_invariants()


def run_agents(cache: bool, num_pages: int, handling, seed=0, n=14, host_cache=True):
    ps = 4
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8, swap_budget_tokens=8,
                                      handling=handling, enable_prefix_caching=cache, host_cache=host_cache),
                      make_policy("fcfs"), PageAllocator(num_pages, ps), PageAllocator(6, ps, "host"), COST)
    model = PagedModel(ps)
    rng = random.Random(seed)
    system = [rng.randint(3, 99) for _ in range(13)]
    outs = {}
    for i in range(n):
        ids = system + [rng.randint(3, 99) for _ in range(rng.randint(1, 9))]
        segs = [Segment(rng.randint(1, 4), "tool", rng.choice([0.0, 0.05]), rng.randint(1, 5)), Segment(3)]
        outs[f"r{i}"] = Request(f"r{i}", 0.0, prompt_len=len(ids), max_tokens=sum(s.num_tokens for s in segs),
                                segments=segs, token_ids=ids)
    drive_paged(sched, model, [(0.0, r) for r in outs.values()], 3000)
    # Idle: every page free or cached-unreferenced, on both tiers.
    assert sched.kv.num_free_device == num_pages and sched.kv.num_free_host == 6
    assert all(owner == CACHE_OWNER for owner in sched.host_pool.owned_by())
    return {rid: r.output_token_ids for rid, r in outs.items()}, sched


def test_pages_adopted_between_steps_are_not_kept_on_host_by_copies_that_never_run():
    """A disaggregated decode engine adopts pages between steps (``adopt``, outside
    ``schedule``): an eviction then cannot plan a host-tier copy, since the next
    ``schedule`` starts afresh; a host entry without its copy would be read back
    as KV of another context."""
    ps = 4
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4, swap_budget_tokens=8,
                                      enable_prefix_caching=True, host_cache=True),
                      make_policy("fcfs"), PageAllocator(3, ps), PageAllocator(4, ps, "host"), COST)
    model, now = PagedModel(ps), 0.0

    def run(request):
        nonlocal now
        sched.add_request(request, now)
        while not request.is_finished:
            plan = sched.schedule(now)
            result = model.step(plan)
            now += 0.01
            sched.update(plan, result, now)
            sched.check_invariants()

    run(Request("a", 0.0, prompt_len=9, max_tokens=1, token_ids=list(range(3, 12))))   # 2 pages cached
    assert sched.schedule(now).is_empty                # idle: the engine's loop runs no step
    other = Request("o", 0.0, prompt_len=9, max_tokens=1, token_ids=list(range(50, 59)))
    adopted = sched.kv.adopt(sched.kv.hashes(other, 2))
    assert len(adopted) == 2 and sched.kv.cache.evicted_pages >= 1
    for i, page in adopted:                            # the KV the importer writes
        model.device[page] = other.token_ids[i * ps:(i + 1) * ps]
    run(Request("b", 0.0, prompt_len=9, max_tokens=1, token_ids=list(range(3, 12))))   # a's prefix again


@pytest.mark.parametrize("handling", [None, Handling.PRESERVE, Handling.DISCARD, Handling.SWAP])
@pytest.mark.parametrize("num_pages", [64, 12])
def test_outputs_identical_with_and_without_the_cache(handling, num_pages):
    """Cache off, device-only cache and host tier give the same greedy outputs;
    with the tight pool, device eviction to host and host eviction both happen
    and hits are served from host (the fake model reads the copied pages back)."""
    host_hits = host_evictions = 0
    for seed in range(4):
        want, _ = run_agents(False, num_pages, handling, seed)
        device_only, sched = run_agents(True, num_pages, handling, seed, host_cache=False)
        assert device_only == want and sched.kv.cache.num_host_pages == 0
        got, sched = run_agents(True, num_pages, handling, seed)
        assert got == want
        cache = sched.kv.cache
        assert cache.hit_tokens > 0
        if num_pages == 12:
            assert sched.num_preemptions + cache.evicted_pages > 0
        host_hits += cache.host_hit_tokens
        host_evictions += cache.host_evicted_pages
    if num_pages == 12:
        assert host_hits > 0 and host_evictions > 0


@pytest.mark.parametrize("cache", [True, False])
def test_a_prompt_sent_several_times_at_once_is_computed_once(cache):
    """Four requests with one 40-token prompt arrive together (``n`` choices, a burst
    of agents): the first computes it, the others wait while the page they would
    compute next is being computed and then link its 9 full pages (one token is
    always left to compute). A request with another prompt is not held behind them.
    Without the cache each computes all of it."""
    ps = 4
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, enable_prefix_caching=cache),
                      make_policy("fcfs"), PageAllocator(64, ps), PageAllocator(4, ps, "host"), COST)
    prompt = [(7 * i) % 90 + 3 for i in range(40)]
    same = [Request(f"s{i}", 0.0, prompt_len=40, max_tokens=3, token_ids=list(prompt)) for i in range(4)]
    other = Request("o", 0.0, prompt_len=20, max_tokens=3, token_ids=list(range(60, 80)))
    for r in [other] + same:   # (the other first: the waiting list of pages in flight is built before s0 joins it)
        sched.add_request(r, 0.0)
    model, now = PagedModel(ps), 0.0
    computed_tokens = dict.fromkeys([r.request_id for r in same + [other]], 0)
    first_step = {}
    while sched.has_unfinished():
        plan = sched.schedule(now)
        for chunk in plan.chunks:
            computed_tokens[chunk.request.request_id] += chunk.num_tokens
            first_step.setdefault(chunk.request.request_id, sched.iteration)
        sched.update(plan, model.step(plan), now + 0.01)
        now += 0.01
        sched.check_invariants()
    if cache:
        assert computed_tokens == {"s0": 40 + 2, "s1": 4 + 2, "s2": 4 + 2, "s3": 4 + 2, "o": 20 + 2}
        assert [r.num_cached_tokens for r in same] == [0, 36, 36, 36]
        assert first_step["o"] == first_step["s0"] and first_step["s1"] == first_step["s0"] + 1
    else:
        assert all(computed_tokens[r.request_id] == 42 for r in same)
    assert len({tuple(r.output_token_ids) for r in same}) == 1


def test_a_request_scoring_its_prompt_is_not_held_for_pages_in_flight():
    """``prompt_logprobs`` needs the logits of every prompt place, so the cache cannot
    serve such a request: it is admitted beside the one computing the same prompt."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8),
                      make_policy("fcfs"), PageAllocator(64, 4), PageAllocator(4, 4, "host"), COST)
    prompt = [(7 * i) % 90 + 3 for i in range(40)]
    first = Request("first", 0.0, prompt_len=40, max_tokens=2, token_ids=list(prompt))
    scoring = Request("scoring", 0.0, prompt_len=40, max_tokens=2, token_ids=list(prompt), prompt_logprobs=[])
    for r in (first, scoring):
        sched.add_request(r, 0.0)
    plan = sched.schedule(0.0)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("first", 0, 40),
                                                                                   ("scoring", 0, 40)]


def test_soft_discard_recomputes_only_what_was_evicted():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, handling=Handling.DISCARD),
                      make_policy("fcfs"), PageAllocator(16, 4), PageAllocator(4, 4, "host"), COST)
    r = Request("a", 0.0, prompt_len=10, max_tokens=2, segments=[Segment(1, "tool", 1.0, 2), Segment(1)],
                token_ids=list(range(3, 13)))
    sched.add_request(r, 0.0)
    plan = sched.schedule(0.0)
    [event] = sched.update(plan, StepResult(token_ids=[50]), 0.1)
    assert event.kind is EventKind.API_CALL and r.handling is Handling.DISCARD and not r.device_pages
    assert sched.kv.cache.num_evictable == 2                  # its 2 full pages, kept for its return
    sched.api_return(r, 2, 1.0, token_ids=[60, 61])
    plan = sched.schedule(1.0)
    [chunk] = plan.chunks
    assert (chunk.start, chunk.num_tokens) == (8, 5)          # tokens 8..12 only; 0..7 re-linked
    assert r.num_cached_tokens == 0 and r.state is RequestState.RUNNING
    sched.check_invariants()


def test_a_context_released_in_an_api_call_outranks_plain_pages_for_a_while_only():
    kv = KVManager(PageAllocator(6, 4), PageAllocator(4, 4, "host"), PrefixCache("m"), retention_s=30.0)
    parked = computed(kv, "parked", list(range(8)))
    kv.now = 0.0
    kv.free_device(parked, retain=True)               # soft discard at t=0: score 30
    plain = computed(kv, "plain", list(range(50, 58)))
    kv.now = 1.0
    kv.free_device(plain)                              # finished at t=1: score 1
    r = computed(kv, "r", list(range(100, 116)))       # 4 pages: 2 free + 2 evicted, the plain ones
    assert kv.lookup(Request("p", 1.0, prompt_len=9, max_tokens=1, token_ids=list(range(9)))) != []
    assert kv.lookup(Request("q", 1.0, prompt_len=9, max_tokens=1, token_ids=list(range(50, 59)))) == []
    kv.now = 100.0                                      # long after: fresher plain pages now outrank it
    kv.free_device(r)                                   # its 4 pages cached, score 100
    assert kv.cache.num_evictable == 6 and kv.device_pool.num_free == 0
    s = computed(kv, "s", list(range(200, 208)))       # 2 pages: the lowest scores go, the parked ones
    assert kv.lookup(Request("p", 100.0, prompt_len=9, max_tokens=1, token_ids=list(range(9)))) == []
    assert kv.cache.residence_s < float("inf") and kv.cache_horizon_s() == kv.cache.residence_s
    kv.check_invariants([s], set(), set())


# ------------------------------------------------------------------ simulator
def test_simulator_models_the_host_tier_and_charges_its_copies():
    """The simulator runs the same tier: with soft Discard under a tight device
    pool, parked contexts pushed off the device come back from host (more cached,
    less recomputed than device-only), and the copies are charged on the host link."""
    from jaxserve.core import SimClock
    from jaxserve.executor.sim import SimExecutor
    from jaxserve.replay.simulate import SimConfig, build_scheduler, run_simulation
    from scheduler import StepPlan, SwapOp

    def requests():
        rng = random.Random(4)
        return [Request(f"s{i}", 0.05 * i, prompt_len=rng.randint(150, 250), max_tokens=40,
                        segments=[Segment(20, "tool", rng.uniform(0.5, 2.0), 10), Segment(20)]) for i in range(40)]

    results = {}
    for host_pages in (0, 400):
        sched = build_scheduler(COST, make_policy("infercept"),
                                SimConfig(page_size=16, num_device_pages=80, num_host_pages=host_pages,
                                          handling=Handling.DISCARD, enable_prefix_caching=True))
        results[host_pages] = run_simulation(sched, requests(), check_invariants=True)
        assert sched.kv.num_free_device == 80 and sched.kv.num_free_host == host_pages
    device_only, tiered = results[0], results[400]
    assert device_only.swapped_tokens == 0 and tiered.swapped_tokens > 0   # Discard: only host-tier copies
    assert tiered.cached_tokens > device_only.cached_tokens
    assert tiered.recomputed_tokens < device_only.recomputed_tokens
    # A host-tier copy costs what a Swap copy of as many pages costs.
    executor = SimExecutor(COST, 16, SimClock())
    cache_copy = StepPlan(swap_in=[SwapOp(None, [1, 2], [3, 4])])
    assert executor.step_time(cache_copy) == (COST.t_swap(32), COST.t_swap(32), 32)


def run_random_agents(seed: int, policy: str, handling, num_pages: int, seqs: int, budget: int, classes: bool,
                      cache: bool = True, host_cache: bool = True,
                      priority_aging_s: float | None = None) -> dict[str, list[int]]:
    """40 randomized agent requests (a shared system prompt, tool calls, staggered arrivals,
    priority classes 0-2 when ``classes``) on ``PagedModel``: every step must read back
    exactly each request's own context, the scheduler's invariants must hold, and all must
    end. Returns each request's output tokens (a function of its context alone)."""
    ps = 4
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs, swap_budget_tokens=8,
                                      handling=handling, enable_prefix_caching=cache, host_cache=host_cache,
                                      max_model_len=num_pages * ps, priority_aging_s=priority_aging_s),
                      make_policy(policy), PageAllocator(num_pages, ps), PageAllocator(8, ps, "host"), COST)
    model, rng = PagedModel(ps), random.Random(seed)
    system = [rng.randint(3, 99) for _ in range(13)]
    arrivals, outs = [], {}
    for i in range(40):
        ids = (system if rng.random() < 0.7 else []) + [rng.randint(3, 99) for _ in range(rng.randint(1, 9))]
        segs = [Segment(rng.randint(1, 4), "tool", rng.choice([0.0, 0.05]), rng.randint(1, 5)),
                Segment(rng.randint(1, 8))] if rng.random() < 0.6 else [Segment(rng.randint(2, 12))]
        priority = rng.choice([0, 1, 2])
        r = Request(f"r{i}", 0.0, prompt_len=len(ids), max_tokens=sum(s.num_tokens for s in segs),
                    segments=segs, token_ids=ids, priority=priority if classes else 0)
        arrivals.append((rng.choice([0.0, 0.0, 0.005 * i]), r))
        outs[r.request_id] = r
    drive_paged(sched, model, arrivals, 5000)
    return {rid: r.output_token_ids for rid, r in outs.items()}


@pytest.mark.parametrize("seed, policy, handling, num_pages, seqs, budget, classes", [
    (74, "sjf", Handling.SWAP, 12, 8, 8, False),
    (60, "fcfs", Handling.SWAP, 8, 2, 64, True),
    (79, "lamps", None, 12, 3, 64, True),
])
def test_agents_with_swap_preemption_and_the_host_tier_read_back_only_their_own_kv(seed, policy, handling, num_pages,
                                                                                  seqs, budget, classes):
    """These seeds once read a page that a swap-in filled and an eviction copied to the
    host in the same step (``run_random_agents``)."""
    run_random_agents(seed, policy, handling, num_pages, seqs, budget, classes)


@pytest.mark.parametrize("seed, policy, num_pages, seqs, budget, host_cache, classes", [
    (304, "infercept", 9, 2, 8, True, False),
    (530, "sjf", 10, 2, 64, False, True),
    (574, "sjf", 9, 3, 24, True, False),
])
def test_a_completed_swap_in_gets_its_pages_from_an_idle_holder_at_once(seed, policy, num_pages, seqs, budget,
                                                                       host_cache, classes):
    """A swap-in that completes at admission (its pages re-linked from the cache, or
    copied in one chunk) runs from that step; when its next chunk needs a page and only
    an idle holder keeps one, that holder is evicted in the same step (these seeds once
    left it without tokens for a step, the plan sometimes empty: ``drive_paged`` checks
    every step)."""
    run_random_agents(seed, policy, None, num_pages, seqs, budget, classes, host_cache=host_cache)


@pytest.mark.parametrize("seed", range(40))
def test_random_agents_answer_the_same_in_one_class_or_three(seed):
    """Random policies, handlings, pools, batch sizes and budgets, with the prefix cache
    and its host tier on or off and classes aging or not: each run reads back only its
    own KV, and priority classes change when requests run, never what they answer."""
    rng = random.Random(seed * 7)
    settings = dict(policy=rng.choice(["fcfs", "infercept", "sjf", "lamps", "autellix", "continuum"]),
                    handling=rng.choice([None, Handling.PRESERVE, Handling.SWAP, Handling.DISCARD]),
                    cache=rng.random() < 0.7, host_cache=rng.random() < 0.5, num_pages=rng.choice([8, 9, 10, 12]),
                    seqs=rng.choice([2, 3, 8]), budget=rng.choice([8, 24, 64]),
                    priority_aging_s=rng.choice([None, None, 0.02, 0.1]))
    assert run_random_agents(seed, classes=True, **settings) == run_random_agents(seed, classes=False, **settings)
