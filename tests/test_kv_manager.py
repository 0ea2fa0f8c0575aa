"""The KV page manager on its own (no scheduler, no JAX): allocation, chunked
swaps in both directions, holder indexes, invariants."""

import pytest

from scheduler.kv_manager import KVManager
from scheduler.pages import PageAllocator
from scheduler.request import Request


def make_kv(device=16, host=16, page_size=4):
    return KVManager(PageAllocator(device, page_size), PageAllocator(host, page_size, "host"))


def with_context(kv, rid, tokens):
    """A request whose first ``tokens`` tokens are computed and on device."""
    r = Request(rid, 0.0, prompt_len=tokens, max_tokens=1)
    assert kv.allocate_slots(r, kv.pages_needed(r, tokens))
    r.num_computed_tokens = tokens
    return r


def test_pages_needed_and_allocate_slots_all_or_nothing():
    kv = make_kv(device=4)
    r = Request("a", 0.0, prompt_len=9, max_tokens=1)
    assert kv.pages_needed(r, 9) == 3           # 9 tokens at 4 per page
    assert kv.allocate_slots(r, 3) and len(r.device_pages) == 3
    r.num_computed_tokens = 9
    assert kv.pages_needed(r, 3) == 0           # tokens 10..12 still fit page 3
    assert kv.pages_needed(r, 4) == 1
    assert not kv.allocate_slots(r, 2)          # only one page left: nothing taken
    assert len(r.device_pages) == 3 and kv.num_free_device == 1
    kv.check_invariants([r], set(), set())


def test_mismatched_page_sizes_are_rejected():
    with pytest.raises(ValueError, match="same page size"):
        KVManager(PageAllocator(4, 4), PageAllocator(4, 8, "host"))


@pytest.mark.parametrize("out", [True, False])
def test_swap_is_chunked_by_the_budget_and_frees_the_source_when_done(out):
    kv = make_kv()
    r = with_context(kv, "a", 18)                # 5 pages
    device = list(r.device_pages)
    assert kv.start_swap_out(r)
    host = list(r.host_pages)
    assert len(host) == 5
    if not out:                                  # finish the swap-out first, then swap back in
        while not kv.swap_chunk(r, 5, out=True)[2]:
            pass
        assert not r.device_pages and kv.num_free_device == 16
        assert kv.start_swap_in(r)
        device = list(r.device_pages)
    ops, done = [], False
    while not done:
        op, n, done = kv.swap_chunk(r, 2, out)
        assert op is not None and n == len(op.device_pages) == len(op.host_pages)
        ops.append(op)
        kv.check_invariants([r], set(), set())
    assert [len(op.device_pages) for op in ops] == [2, 2, 1]
    # page i of the context goes to page i of the other side, in order
    assert [p for op in ops for p in op.device_pages] == device
    assert [p for op in ops for p in op.host_pages] == host
    assert r.pages_swapped == 0
    if out:
        assert not r.device_pages and r.host_pages == host and kv.num_free_device == 16
    else:
        assert r.device_pages == device and not r.host_pages and kv.host_pool.num_free == 16
    kv.check_invariants([r], set(), set())


def test_swap_out_needs_host_room_and_swap_in_device_room():
    kv = make_kv(device=6, host=2)
    r = with_context(kv, "a", 12)               # 3 pages; the host holds 2
    kv.hold_paused(r)
    assert not kv.start_swap_out(r)
    assert not r.host_pages and len(r.device_pages) == 3 and kv.host_pool.num_free == 2
    assert "a" in kv.paused_holders              # nothing changed
    kv.free_device(r)
    r.host_pages = kv.host_pool.allocate("a", 2)
    other = with_context(kv, "b", 20)            # 5 of 6 device pages
    assert not kv.start_swap_in(r) and not r.device_pages
    kv.free(other)
    assert kv.start_swap_in(r) and len(r.device_pages) == 2


def test_holder_indexes_follow_pages():
    kv = make_kv()
    a, b = with_context(kv, "a", 4), with_context(kv, "b", 4)
    empty = Request("c", 0.0, prompt_len=4, max_tokens=1)
    kv.hold_paused(a)
    kv.hold_waiting(b)
    kv.hold_waiting(empty)                       # holds no pages: not a holder
    assert list(kv.paused_holders) == ["a"] and list(kv.waiting_holders) == ["b"]
    assert kv.paused_device_pages() == 1
    kv.check_invariants([a, b, empty], {"a"}, {"b"})
    assert kv.start_swap_out(a) and not kv.paused_holders   # swapping out: no longer an idle holder
    kv.free_device(b)                            # evicted: recomputed later
    assert not kv.waiting_holders and not b.device_pages
    kv.free(a)
    assert kv.num_free_device == 16 and kv.host_pool.num_free == 16
    kv.check_invariants([a, b, empty], set(), set())


def test_invariants_catch_a_corrupt_page_table_or_index():
    kv = make_kv()
    a = with_context(kv, "a", 8)
    a.device_pages.append(15)                    # a page the pool never gave it
    with pytest.raises(AssertionError, match="ownership mismatch"):
        kv.check_invariants([a], set(), set())
    a.device_pages.pop()
    kv.hold_waiting(a)
    with pytest.raises(AssertionError, match="waiting-holder index"):
        kv.check_invariants([a], set(), set())
