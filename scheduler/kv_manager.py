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

The host tier (``host_tier``; needs a cache and a host pool with pages) keeps
what the device evicts: ``_take`` copies an evicted cached page to a host
page (a free one, else the least recently used host entry's) unless it is
already there, and ``lookup`` matches over both tiers: a hit on a
host-resident page gets a new device page at ``link`` and a copy back. The
copies are planned here and put in the step's plan by the scheduler
(``take_copies``): ``SwapOp``s without a request, run by the executor before
the forward, like Swap's. They share the step's swap budget
(``copy_budget``, pages): an evicted page with no budget left is dropped, a
hit is cut where the budget ends. Swap comes first on the host pool: a
swap-out takes host pages from cached entries when the free list is short
(``start_swap_out``), and the free host pages policies see count them.
Which pages live where is recorded only here: request tables, the pools'
owners (``CACHE_OWNER`` for cached pages of either tier) and the cache books.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Callable

from scheduler.pages import PageAllocator
from scheduler.plan import CACHE_OWNER, SwapOp
from scheduler.prefix_cache import PrefixCache, chain_hashes
from scheduler.request import Request

__all__ = ["CACHE_OWNER", "KVManager"]

_pages_of = attrgetter("device_pages")


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
                 prefix_cache: PrefixCache | None = None, retention_s: float = 0.0,
                 host_tier: bool = False) -> None:
        """``prefix_cache``: None disables caching. ``retention_s``: the eviction
        bonus (seconds) of the context of a request released inside an API call.
        ``host_tier``: keep evicted cached pages in the host pool (on only with a
        cache and a host pool of at least one page)."""
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
        self._lookups: dict[str, tuple[int, list[int]]] = {}   # request id -> (cache epoch, lookup pages)
        # request id -> (cache epoch, its shared pages) at its swap-out: while the epoch holds, they
        # are still cached and lead its swap-in's match
        self._swapped_runs: dict[str, tuple[int, list[int]]] = {}
        self.host_tier = host_tier and prefix_cache is not None and host_pool.num_pages > 0
        self.copy_budget = 0                              # host-tier copies this step may still plan (pages)
        self._copy_outs: list[tuple[int, int]] = []       # (device page, host page) to copy before the forward
        self._copy_ins: list[tuple[int, int]] = []        # (host page, device page) to copy before the forward
        self._host_busy: set[int] = set()   # host pages this step's copies read or write: kept this step
        # Device pages this step's swap-ins write (their requests' commits cache them at once): the
        # executor runs copy-outs first, so one evicted in this step would reach the host before its KV.
        self._arriving: set[int] = set()
        self._host_busy_lists: list[list[int]] = []   # more of them, folded in when ``_busy_host_pages`` is read
        # device page -> its hash, for pages ``adopt`` cached and no request has linked yet: their
        # first link is not a cache hit (another engine computed them for that very request)
        self._adopted: dict[int, bytes] = {}

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

    def add_page_each(self, requests: list[Request]) -> None:
        """Append one device page to each of ``requests`` (distinct; the caller
        checked ``num_free_device``): the decoders whose next token starts a page."""
        self._make_free(len(requests))
        for request, page in zip(requests, self.device_pool.allocate_each([r.request_id for r in requests])):
            request.device_pages.append(page)

    def _take(self, owner: str, n: int) -> list[int]:
        """``n`` device pages for ``owner``, evicting cached pages as the free list
        runs short (to the host tier when it is on and the step's copy budget lasts)."""
        self._make_free(n)
        return self.device_pool.allocate(owner, n)

    def _make_free(self, n: int) -> None:
        """Evict cached pages until ``n`` device pages are free (or nothing is evictable)."""
        pool, cache = self.device_pool, self.cache
        short = n - pool.num_free
        if short > 0 and cache is not None:
            evicted = cache.evict_entries(short, self.now)
            if self.host_tier:
                self._keep_on_host(evicted)
            pool.free(CACHE_OWNER, [page for page, _ in evicted])

    def _keep_on_host(self, evicted: list[tuple[int, bytes]]) -> None:
        """Device pages ``(page, hash)`` are being evicted, in this order: make sure the
        host tier holds each, while this step's copy budget lasts (one pass: the
        simulator evicts millions of pages an hour through here)."""
        cache = self.cache
        on_host = cache.host_page_of
        busy, copy_outs, host_pool = self._busy_host_pages(), self._copy_outs, self.host_pool
        if self._arriving:   # (not yet written: dropped, not copied)
            evicted = [(page, h) for page, h in evicted if page not in self._arriving]
        if not host_pool.num_free:   # a full host tier: the common case, in one call
            copies = cache.host_keep(evicted, self.copy_budget, busy)
            copy_outs += copies
            self.copy_budget -= len(copies)
            return
        for page, h in evicted:
            if h in on_host:
                cache.host_touch(h)   # copied before: nothing to copy
                continue
            if self.copy_budget <= 0:
                continue
            # A free host page no copy of this step reads (a swap-in that completed this step freed
            # its pages, but the executor runs copy-outs first; FIFO: such pages sit at the tail).
            host_page = host_pool.allocate_avoiding(CACHE_OWNER, busy) if host_pool.num_free else None
            if host_page is not None:
                cache.host_insert(host_page, h)
            else:
                host_page = cache.host_replace(h, busy)   # an LRU host page: stays owned by CACHE_OWNER
                if host_page is None:
                    continue
            busy.add(host_page)
            copy_outs.append((page, host_page))
            self.copy_budget -= 1

    def _busy_host_pages(self) -> set[int]:
        """The host pages this step's copies read or write (kept from reuse this step)."""
        if self._host_busy_lists:
            for pages in self._host_busy_lists:
                self._host_busy.update(pages)
            self._host_busy_lists.clear()
        return self._host_busy

    def copies_done(self) -> None:
        """The last plan ran (or none is pending): its host-tier copies are done, so
        no host page is busy and nothing is left to plan (``copy_budget`` 0)."""
        self._copy_outs, self._copy_ins = [], []
        self._host_busy.clear()
        self._host_busy_lists.clear()
        self._arriving.clear()
        self.copy_budget = 0

    def take_copies(self) -> tuple[SwapOp | None, SwapOp | None]:
        """This step's host-tier copies as ``(copy-out, copy-in)`` ops (None: none)."""
        outs, ins = self._copy_outs, self._copy_ins
        self._copy_outs, self._copy_ins = [], []
        copy_out = SwapOp(None, [d for d, _ in outs], [h for _, h in outs]) if outs else None
        copy_in = SwapOp(None, [d for _, d in ins], [h for h, _ in ins]) if ins else None
        return copy_out, copy_in

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

    @property
    def num_free_host(self) -> int:
        """Host pages a swap-out can get: free plus those holding host-tier copies."""
        cache = self.cache
        return self.host_pool.num_free + (cache.num_host_pages if self.host_tier else 0)

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
        """Free every page of ``request``, device and host (it ended)."""
        self._lookups.pop(request.request_id, None)
        self._swapped_runs.pop(request.request_id, None)
        self.free_device(request, retain)
        if request.host_pages:
            self.host_pool.free(request.request_id, request.host_pages)
            request.host_pages = []

    # ---------------------------------------------------------- prefix cache
    def hashes(self, request: Request, num_pages: int) -> list[bytes]:
        """Chained hashes of ``request``'s first ``num_pages`` full pages, as many
        as its token ids (or preset hashes) cover; extends ``block_hashes``."""
        hashes, ids, ps = request.block_hashes, request.token_ids, self.page_size
        done = len(hashes)
        end = min(num_pages, len(ids) // ps)
        if end > done:
            hashes += chain_hashes(hashes[-1] if hashes else self.cache.root, ids[done * ps:end * ps], ps)
        return hashes if len(hashes) <= num_pages else hashes[:num_pages]

    def hash_context(self, request: Request) -> None:
        """Hash the full pages of ``request``'s context now (at arrival, at an API
        return), off the admission path of ``schedule()``: a request is hashed
        once, page by page as its context grows, never per step."""
        if self.cache is not None:
            self.hashes(request, (request.num_tokens - 1) // self.page_size)

    def lookup(self, request: Request) -> list[int]:
        """The cached pages of the longest run of ``request``'s full pages (at
        least one token is left to compute, for its logits); changes nothing.
        With the host tier, a page cached on host only is ``~host_page``
        (negative), and the run stops at the first such page beyond this
        step's ``copy_budget``. Empty without a cache or when ``request``
        already holds device pages; for a request still scoring its prompt
        (``Request.prompt_logprobs``), only pages before its first unscored place.

        The result is kept per request and reused while the cache's ``epoch``
        is unchanged (then it can only have grown, so only the pages after it
        are looked up again: a waiting request at the head of a full pool is
        looked up every step)."""
        cache = self.cache
        if cache is None or request.device_pages:
            return []
        last = request.num_tokens - 1
        if request.scores_prompt:
            last = len(request.prompt_logprobs) - 1   # its prompt logprobs need the logits from the first unscored place on
            if last < 0:
                return []   # nothing scored yet: every place's logits are needed
        hashes = self.hashes(request, last // self.page_size)
        match = cache.match_tiers if self.host_tier else cache.match
        pages = self._cached_run(self._lookups.get(request.request_id), hashes, match)
        self._lookups[request.request_id] = (cache.epoch, pages)
        if self.host_tier and pages and min(pages) < 0:
            budget = self.copy_budget
            for i, p in enumerate(pages):
                if p < 0:
                    if budget <= 0:
                        return pages[:i]
                    budget -= 1
        return list(pages)

    def _cached_run(self, memo: tuple[int, list[int]] | None, hashes: list[bytes],
                    match: Callable[[list[bytes]], list[int]]) -> list[int]:
        """``match(hashes)`` (the longest cached run), from ``memo`` = ``(cache epoch,
        pages)`` of an earlier match of ``hashes``' first pages while the epoch is
        unchanged: nothing has left the cache since, so the run can only have grown
        and only the hashes after it are matched (the memo's list is extended)."""
        if memo is None or memo[0] != self.cache.epoch:
            return match(hashes)
        pages = memo[1]
        if len(pages) > len(hashes):
            return pages[:len(hashes)]
        if len(pages) < len(hashes):
            pages += match(hashes[len(pages):])
        return pages

    def fits(self, num_new_pages: int, hits: list[int]) -> bool:
        """Whether ``num_new_pages`` device pages can be allocated after linking
        ``hits`` (from ``lookup``; empty: none): ``num_new_pages <= num_free_device
        - num_evictable_in(hits)``. Linking takes at most ``len(hits)`` of what an
        allocation could get, so when the free list alone covers both, nothing
        is counted (the common case of a roomy pool)."""
        free = self.device_pool.num_free
        if num_new_pages + len(hits) <= free:
            return True
        return num_new_pages <= self.num_free_device - (self.num_evictable_in(hits) if hits else 0)

    def num_evictable_in(self, pages: list[int]) -> int:
        """How many pages linking ``pages`` (from ``lookup``) takes from what an
        allocation could get: its evictable device pages, and a new device page
        for each host-resident one."""
        n = self.cache.num_evictable_among(pages)
        if self.host_tier and pages and min(pages) < 0:
            n += len(pages) - sum(map((0).__le__, pages))   # the negative (host-only) ones, counted in C
        return n

    def link(self, request: Request, pages: list[int]) -> None:
        """Give ``request`` (no device KV) the cached ``pages`` from ``lookup``:
        its first ``len(pages)·page_size`` tokens count as computed. A
        host-resident page gets a new device page, cached under its hash, and
        a copy-in planned for this step."""
        cache = self.cache
        if cache is None:
            return
        assert not request.device_pages and request.num_computed_tokens == 0, "link needs an empty table"
        self._lookups.pop(request.request_id, None)
        pages = list(pages)
        on_host = [i for i, p in enumerate(pages) if p < 0] if pages and min(pages) < 0 else None
        cache.acquire([p for p in pages if p >= 0] if on_host else pages)   # first: not evictable below
        if on_host:
            self._host_busy.update(~pages[i] for i in on_host)
            self.copy_budget -= len(on_host)   # first: the copy-outs of the evictions below get only what is left
            fresh = self._take(CACHE_OWNER, len(on_host))
            for i, page in zip(on_host, fresh):
                host_page = ~pages[i]
                h = request.block_hashes[i]
                cache.insert(page, h)   # bumps the epoch: other lookups see it on the device
                cache.host_touch(h)
                self._copy_ins.append((host_page, page))
                pages[i] = page
            cache.host_hit_tokens += len(on_host) * self.page_size
        request.device_pages = pages
        request.num_shared_pages = len(pages)
        request.num_computed_tokens = len(pages) * self.page_size
        request.service_offset -= request.num_computed_tokens   # served by the cache, not computed
        cache.query_tokens += request.num_tokens
        cache.hit_tokens += request.num_computed_tokens
        if self._adopted:
            cache.hit_tokens -= self._first_links(pages) * self.page_size

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
        hashes = request.block_hashes
        if len(hashes) < full:
            hashes = self.hashes(request, full)   # (no copy of preset hashes in the common case)
        pages, rid, pool = request.device_pages, request.request_id, self.device_pool
        for i in range(shared, min(full, len(hashes))):
            h, page = hashes[i], pages[i]
            cached = cache.page_of.get(h)
            if cached is None:
                pool.reassign([page], rid, CACHE_OWNER)
                cache.insert(page, h)
            else:
                cache.acquire([cached])
                if self._adopted:
                    self._first_links([cached])
                pool.free(rid, [page])
                pages[i] = cached
            request.num_shared_pages = i + 1

    def adopt(self, hashes: list[bytes]) -> list[tuple[int, int]]:
        """Cache pages computed by another engine (prefill/decode disaggregation):
        each of ``hashes`` (a context's chained page hashes, page 0 first) not yet
        cached gets a device page named by it, left unreferenced (evictable, as
        after a finished request). Returns ``(index in hashes, page)`` of the pages
        whose KV the caller must write now; stops when no page is free. The first
        request that links an adopted page does not count it as a cache hit
        (``PrefixCache.hit_tokens``): the other engine computed it for that request."""
        cache = self.cache
        if cache is None:
            return []
        adopted: list[tuple[int, int]] = []
        for i, h in enumerate(hashes):
            if h in cache.page_of:
                continue
            if self.num_free_device == 0:
                break
            page = self._take(CACHE_OWNER, 1)[0]   # held (refs 1) until the end: not evicted by the next take
            cache.insert(page, h)
            adopted.append((i, page))
            self._adopted[page] = h
        cache.release([p for _, p in adopted], self.now)
        return adopted

    def _first_links(self, pages: list[int]) -> int:
        """Of ``pages`` (device pages a request now lists), how many ``adopt`` cached
        and no request listed since; they leave the adopted books."""
        adopted, hash_of = self._adopted, self.cache.hash_of
        return sum(1 for p in pages if adopted.pop(p, None) is hash_of[p])   # (else a stale entry: page reused)

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
        return sum(map(len, map(_pages_of, self.paused_holders.values())))

    # ------------------------------------------------------------------ swaps
    def start_swap_out(self, request: Request) -> bool:
        """Reserve host pages mirroring ``request``'s device pages; False (nothing
        reserved) when the host pool is too full."""
        n = len(request.device_pages)
        if n > self.num_free_host:
            return False
        while self.host_pool.num_free < n:   # swapped requests come before host-tier copies
            host_page = self.cache.host_evict(self._busy_host_pages())
            if host_page is None:
                return False
            self.host_pool.free(CACHE_OWNER, [host_page])
        request.host_pages = self.host_pool.allocate(request.request_id, n)
        request.pages_swapped = 0
        self.paused_holders.pop(request.request_id, None)
        return True

    def start_swap_in(self, request: Request) -> bool:
        """Reserve device pages mirroring ``request``'s host pages; False when too few
        are free. Its leading full pages still in the prefix cache are re-linked, not copied."""
        n = len(request.host_pages)
        hits = []
        cache = self.cache
        if cache is not None:
            full = min(request.num_computed_tokens // self.page_size, n)
            hits = self._cached_run(self._swapped_runs.get(request.request_id), self.hashes(request, full),
                                    cache.match)
        if not self.fits(n - len(hits), hits):
            return False
        self._swapped_runs.pop(request.request_id, None)
        if hits:
            cache.acquire(hits)
            if self._adopted:
                self._first_links(hits)
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
            if not out and self.host_tier:
                self._arriving.update(op.device_pages)
        done = request.pages_swapped == len(source)
        if done:
            request.pages_swapped = 0
            if out:
                if self.cache is not None:
                    self._swapped_runs[request.request_id] = (self.cache.epoch, request.device_pages[:request.num_shared_pages])
                self.free_device(request, retain=True)   # inside its API call
            else:
                self._host_busy_lists.append(request.host_pages)   # read by this step's swap-in: not rewritten in it
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
        host_expected = {r.request_id: r.host_pages for r in live}
        if self.cache is not None:
            host_expected[CACHE_OWNER] = list(self.cache.host_page_of.values())
        self.host_pool.check_invariants(host_expected)
        assert set(self.paused_holders) == paused_holders, "paused-holder index out of step"
        assert set(self.waiting_holders) == waiting_holders, "waiting-holder index out of step"
