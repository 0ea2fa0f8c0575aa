"""The KV page manager: device and host page pools and every request's page tables.

A request's page tables live on the request (``Request.device_pages`` and
``Request.host_pages``, page ids in context order: page ``i`` holds tokens
``[i·page_size, (i+1)·page_size)``) so executors can read them, but only this
class writes them. The scheduler decides *who* gets memory (admission,
preemption, API handling); this class decides *which* pages and keeps the
books: allocation for the next chunk, freeing, chunked swaps in both
directions, and the two indexes of requests that hold device KV without
running (the eviction candidates).

The prefix cache (``scheduler.prefix_cache``; optional) is kept here too.
Full pages whose KV is computed are handed from the request to the cache
(``commit``): the allocator then records them as owned by ``CACHE_OWNER``
and the cache counts the requests listing them. A request's table is its
shared pages (the first ``num_shared_pages``) then its private ones. Freeing
a request's device KV releases its shared pages to the cache, where they stay
until the pool needs them (``_take`` evicts the lowest retention score); a
new, resumed or swapped-in request re-links the longest cached run of its
full pages (``lookup``/``link``, ``start_swap_in``) and computes or copies
only the rest. Free device pages therefore count the evictable cached ones.
"""

from __future__ import annotations

from scheduler.pages import PageAllocator
from scheduler.plan import SwapOp
from scheduler.prefix_cache import PrefixCache, page_hash
from scheduler.request import Request

CACHE_OWNER = "<prefix-cache>"   # the allocator's owner of every cached device page


class KVManager:
    """Device and host pages of every live request (see module doc).

    Page counts are in pages of ``page_size`` tokens. Two holder indexes, in
    the order requests entered them: ``paused_holders`` (paused under Preserve
    with device KV) and ``waiting_holders`` (in the waiting queue with device
    KV: back from an API, or preempted while keeping pages). The scheduler
    files requests there (``hold_paused``/``hold_waiting``/``release``); any
    freeing of device KV drops the request from both.
    """

    def __init__(self, device_pool: PageAllocator, host_pool: PageAllocator,
                 prefix_cache: PrefixCache | None = None, retention_s: float = 0.0) -> None:
        """``prefix_cache``: None disables caching. ``retention_s``: the eviction
        bonus (seconds) of the context of a request released inside an API call."""
        if device_pool.page_size != host_pool.page_size:
            raise ValueError("device and host pools must use the same page size")
        if retention_s < 0:
            raise ValueError("retention_s must be >= 0")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.page_size = device_pool.page_size
        self.cache = prefix_cache
        self.retention_s = retention_s
        self.now = 0.0                       # seconds; the scheduler keeps it current (release scores)
        self.relinked_swap_pages = 0         # swap-in pages re-linked from the cache instead of copied
        self.paused_holders: dict[str, Request] = {}
        self.waiting_holders: dict[str, Request] = {}

    # ------------------------------------------------------------ allocation
    def pages_needed(self, request: Request, num_new_tokens: int) -> int:
        """Device pages ``request`` lacks to hold its computed context plus ``num_new_tokens``."""
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.page_size)
        return max(0, total - len(request.device_pages))

    def allocate_slots(self, request: Request, num_new_pages: int) -> bool:
        """Append ``num_new_pages`` free device pages to ``request``'s table
        (from ``pages_needed``). Returns False, changing nothing, when too few are free."""
        if num_new_pages > self.num_free_device:
            return False
        if num_new_pages:
            request.device_pages.extend(self._take(request.request_id, num_new_pages))
        return True

    def _take(self, owner: str, n: int) -> list[int]:
        """``n`` device pages for ``owner``, evicting cached pages as the free list runs short."""
        pool, cache = self.device_pool, self.cache
        short = n - pool.num_free
        if short > 0 and cache is not None:
            pool.free(CACHE_OWNER, cache.evict_many(min(short, cache.num_evictable), self.now))
        return pool.allocate(owner, n)

    @property
    def num_free_device(self) -> int:
        """Device pages an allocation can get: free plus cached-and-unreferenced."""
        cache = self.cache
        return self.device_pool.num_free + (cache.num_evictable if cache is not None else 0)

    def cache_horizon_s(self) -> float:
        """Seconds a context released inside an API call is expected to stay cached:
        the cache's measured release-to-eviction time (inf: nothing evicted yet;
        0: no cache). The retention bonus is not added: the measured residence of
        evicted pages already reflects it, and adding it made Discard look cheaper
        than it turned out under load (docs/benchmarks.md)."""
        if self.cache is None:
            return 0.0
        return self.cache.residence_s

    def can_allocate_device(self, n: int) -> bool:
        return n <= self.num_free_device

    def free_device(self, request: Request, retain: bool = False) -> None:
        """Free ``request``'s device KV (its context must be recomputed or is on
        host): private pages go back to the free list, shared ones to the cache
        (with the retention bonus when ``retain``: a context inside an API call)."""
        pages = request.device_pages
        if pages:
            shared = request.num_shared_pages
            if shared:
                self.cache.release(pages[:shared], self.now, self.retention_s if retain else 0.0)
            if len(pages) > shared:
                self.device_pool.free(request.request_id, pages[shared:])
            request.device_pages = []
            request.num_shared_pages = 0
        self.paused_holders.pop(request.request_id, None)
        self.waiting_holders.pop(request.request_id, None)

    def free(self, request: Request, retain: bool = False) -> None:
        """Free every page of ``request``, device and host."""
        self.free_device(request, retain)
        if request.host_pages:
            self.host_pool.free(request.request_id, request.host_pages)
            request.host_pages = []

    # ---------------------------------------------------------- prefix cache
    def hashes(self, request: Request, num_pages: int) -> list[bytes]:
        """Chained hashes of ``request``'s first ``num_pages`` full pages, as many
        as its token ids (or preset hashes) cover; extends ``block_hashes``."""
        hashes, ids, ps = request.block_hashes, request.token_ids, self.page_size
        while len(hashes) < num_pages and (len(hashes) + 1) * ps <= len(ids):
            i = len(hashes)
            hashes.append(page_hash(hashes[-1] if hashes else self.cache.root, ids[i * ps:(i + 1) * ps]))
        return hashes[:num_pages]

    def lookup(self, request: Request) -> list[int]:
        """The cached device pages of the longest run of ``request``'s full pages
        (at least one token is left to compute, for its logits); changes nothing.
        Empty without a cache or when ``request`` already holds device pages."""
        if self.cache is None or request.device_pages:
            return []
        return self.cache.match(self.hashes(request, (request.num_tokens - 1) // self.page_size))

    def num_evictable_in(self, pages: list[int]) -> int:
        """How many of ``pages`` (from ``lookup``) an allocation could otherwise evict."""
        return self.cache.count_evictable(pages)

    def link(self, request: Request, pages: list[int]) -> None:
        """Give ``request`` (no device KV) the cached ``pages`` from ``lookup``:
        its first ``len(pages)·page_size`` tokens count as computed."""
        if self.cache is None:
            return
        assert not request.device_pages and request.num_computed_tokens == 0, "link needs an empty table"
        self.cache.acquire(pages)
        request.device_pages = list(pages)
        request.num_shared_pages = len(pages)
        request.num_computed_tokens = len(pages) * self.page_size
        self.cache.query_tokens += request.num_tokens
        self.cache.hit_tokens += request.num_computed_tokens

    def commit(self, request: Request) -> None:
        """Hand ``request``'s computed full private pages to the cache. A page whose
        hash is already cached (another request computed the same prefix) is
        swapped for the cached one and freed."""
        cache = self.cache
        if cache is None:
            return
        shared = request.num_shared_pages
        full = request.num_computed_tokens // self.page_size
        if full <= shared:
            return
        hashes = self.hashes(request, full)
        pages, rid, pool = request.device_pages, request.request_id, self.device_pool
        handed, duplicates, reused = [], [], []   # one pool call for each kind, not one per page
        page_of = cache.page_of
        for i in range(shared, len(hashes)):
            h, page = hashes[i], pages[i]
            cached = page_of.get(h)
            if cached is None:
                handed.append(page)
                cache.insert(page, h)
            else:
                duplicates.append(page)
                reused.append(cached)
                pages[i] = cached
        if handed:
            pool.reassign(handed, rid, CACHE_OWNER)
        if duplicates:
            cache.acquire(reused)
            pool.free(rid, duplicates)
        request.num_shared_pages = max(shared, len(hashes))

    # ---------------------------------------------------------------- holders
    def hold_paused(self, request: Request) -> None:
        """``request`` paused under Preserve: index it if it holds device KV."""
        if request.device_pages:
            self.paused_holders[request.request_id] = request

    def hold_waiting(self, request: Request) -> None:
        """``request`` entered the waiting queue: index it if it holds device KV."""
        if request.device_pages:
            self.waiting_holders[request.request_id] = request

    def release(self, request: Request) -> None:
        """``request`` left the paused/waiting state it was indexed under (keeps its pages)."""
        self.paused_holders.pop(request.request_id, None)
        self.waiting_holders.pop(request.request_id, None)

    def paused_device_pages(self) -> int:
        """Device pages held by requests paused under Preserve."""
        return sum(len(r.device_pages) for r in self.paused_holders.values())

    # ------------------------------------------------------------------ swaps
    def start_swap_out(self, request: Request) -> bool:
        """Reserve host pages mirroring ``request``'s device pages; False (nothing
        reserved) when the host pool is too full."""
        n = len(request.device_pages)
        if not self.host_pool.can_allocate(n):
            return False
        request.host_pages = self.host_pool.allocate(request.request_id, n)
        request.pages_swapped = 0
        self.paused_holders.pop(request.request_id, None)
        return True

    def start_swap_in(self, request: Request) -> bool:
        """Reserve device pages mirroring ``request``'s host pages; False when too few
        are free. Its leading full pages still in the prefix cache are re-linked, not copied."""
        n = len(request.host_pages)
        hits = []
        if self.cache is not None:
            full = min(request.num_computed_tokens // self.page_size, n)
            hits = self.cache.match(self.hashes(request, full))
        if n - len(hits) > self.num_free_device - (self.num_evictable_in(hits) if hits else 0):
            return False
        if hits:
            self.cache.acquire(hits)
            self.relinked_swap_pages += len(hits)
        request.device_pages = hits + self._take(request.request_id, n - len(hits))
        request.num_shared_pages = len(hits)
        request.pages_swapped = len(hits)   # re-linked pages need no copy
        return True

    def swap_chunk(self, request: Request, max_pages: int, out: bool) -> tuple[SwapOp | None, int, bool]:
        """Copy the next at most ``max_pages`` pages of ``request`` device -> host
        (``out``) or host -> device. Returns ``(op, pages, done)``: the copy to
        plan (None when nothing is left to copy), its page count, and whether
        the swap is complete — then the source pages are freed (the executor
        copies before this step's forward, so they can be reused in it)."""
        source = request.device_pages if out else request.host_pages
        start = request.pages_swapped
        n = min(max_pages, len(source) - start)
        op = None
        if n > 0:
            op = SwapOp(request, request.device_pages[start:start + n], request.host_pages[start:start + n])
            request.pages_swapped += n
        done = request.pages_swapped == len(source)
        if done:
            request.pages_swapped = 0
            if out:
                self.free_device(request, retain=True)   # inside its API call
            else:
                self.host_pool.free(request.request_id, request.host_pages)
                request.host_pages = []
                self.commit(request)
        return op, max(n, 0), done

    # ------------------------------------------------------------- invariants
    def check_invariants(self, live: list[Request], paused_holders: set[str], waiting_holders: set[str]) -> None:
        """Every page is free or owned by exactly the live request whose table
        lists it; the holder indexes are exactly the ids given (computed by the
        caller from request states). Cached pages are owned by ``CACHE_OWNER``;
        each one's reference count is the number of live requests listing it
        among their shared pages, and it is evictable exactly when that is 0."""
        expected = {r.request_id: r.device_pages[r.num_shared_pages:] for r in live}
        listed: dict[int, int] = {}
        for r in live:
            assert len(set(r.device_pages)) == len(r.device_pages), f"{r.request_id} lists a page twice"
            assert r.num_shared_pages <= len(r.device_pages), f"{r.request_id}: more shared pages than pages"
            for p in r.device_pages[:r.num_shared_pages]:
                listed[p] = listed.get(p, 0) + 1
        if self.cache is not None:
            expected[CACHE_OWNER] = list(self.cache.hash_of)
            self.cache.check_invariants(listed)
        else:
            assert not listed, "shared pages without a prefix cache"
        self.device_pool.check_invariants(expected)
        self.host_pool.check_invariants({r.request_id: r.host_pages for r in live})
        assert set(self.paused_holders) == paused_holders, "paused-holder index out of step"
        assert set(self.waiting_holders) == waiting_holders, "waiting-holder index out of step"
