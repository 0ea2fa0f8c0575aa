"""The prefix cache's books: which device pages hold which full pages of tokens.

A full page of ``page_size`` tokens is named by a chained hash: the BLAKE2b
digest of (the previous page's hash, the page's token ids as 8-byte
integers), rooted at a digest of the cache key (model and dtype), so equal
hashes mean equal token prefixes of the same model and the cache never mixes
models. Partial pages are never named, so never shared.

Each cached page has a reference count: the number of live requests whose
page table lists it. A page whose count is 0 stays cached but evictable. The
eviction order is a retention score, lowest first: the time the page was last
released plus a retention bonus in seconds (0 for ordinary releases, the
configured bonus for the context of a request inside an API call). So a
parked context outranks fresher plain pages for ``bonus`` seconds, its lead
shrinks as time passes, a hit refreshes it, and when the pool needs pages the
lowest score goes regardless: retention is a priority, never a lock.
Ties go by release order. The books keep one entry per release: most
releases carry no bonus and come in time order, so their entries form an
LRU queue; the rest sit in a heap; eviction merges the two in (score,
release order). A hit takes a page out of the evictable map in O(1) and
leaves its entry's listing stale (skipped at eviction, dropped now and then).

The host tier (optional, run by the ``KVManager``) keeps copies of cached
pages in host memory: a page evicted from the device is copied to a host
page first, and a later prefix hit on it copies it back. Its books are a
second map, hash -> host page, in least-recently-used order (a hit or a
fresh copy makes an entry the newest); host entries are never referenced by
a request (a hit copies the page to a new device page), so every one is
evictable, oldest first. A page can be cached on both tiers at once (the
host copy stays after a copy-in, so evicting the device copy again costs no
copy).

Pure bookkeeping: it knows page ids, not which request holds them (the
``KVManager`` does) and never touches the free lists.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict, deque
from typing import Sequence

HASH_BYTES = 16


def root_hash(cache_key: str) -> bytes:
    """The parent hash of a context's first page, for ``cache_key`` (model, dtype)."""
    return hashlib.blake2b(b"jaxserve-prefix:" + cache_key.encode(), digest_size=HASH_BYTES).digest()


def page_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full page of ``token_ids`` after ``parent``."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=HASH_BYTES).digest()


def chain_hashes(parent: bytes, token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """``page_hash`` of each full page of ``token_ids`` in turn, the first after
    ``parent``: one conversion of the ids to bytes for the whole run."""
    data = array("q", token_ids).tobytes()
    step = 8 * page_size
    out = []
    blake2b = hashlib.blake2b
    for start in range(0, len(data) - step + 1, step):
        parent = blake2b(parent + data[start:start + step], digest_size=HASH_BYTES).digest()
        out.append(parent)
    return out


class PrefixCache:
    """Page hash <-> device page id, reference counts and the evictable set (see module doc)."""

    def __init__(self, cache_key: str = "") -> None:
        self.root = root_hash(cache_key)
        self.page_of: dict[bytes, int] = {}     # hash -> device page
        self.hash_of: dict[int, bytes] = {}     # device page -> hash
        # device page -> live requests listing it (0 for pages not cached): a list, as page ids are
        # small integers and a list index is ~3x cheaper than a dict's; grown by ``insert``
        self.refs: list[int] = []
        # The evictable pages, each keyed (score, seq) by its release (``seq`` counts releases' pages).
        # Each release is one record ``(release time, its first seq)`` shared by its pages (its seqs
        # are consecutive and no two releases' interleave, so ordering pages of different releases
        # by (score, the release's first seq) is ordering them by (score, seq)); ``_evictable`` maps
        # each evictable page to its release. A page re-referenced since (leaving ``_evictable``), or
        # released again (a new record), is stale in the older entry listing it: skipped there.
        self._evictable: dict[int, tuple[float, int]] = {}
        # Releases without a bonus at a time no earlier than the last such release: an LRU of
        # ``(release, pages in eviction order)``, oldest first, in key order; its first
        # ``_lru_pos`` pages of the oldest are gone.
        self._lru: deque[tuple[tuple[float, int], list[int]]] = deque()
        self._lru_pos = 0
        self._lru_queued = 0               # pages in the LRU's entries from ``_lru_pos``, stale ones included
        self._lru_last = float("-inf")   # the newest LRU entry's release time
        # The others (a retention bonus): a heap of (score, seq of its first page, pages, release),
        # one entry per release, its pages in eviction order with consecutive seqs.
        self._heap: list[tuple[float, int, list[int], tuple[float, int]]] = []
        self._queued = 0   # pages in heap entries, stale ones included
        self._seq = 0
        self.query_tokens = 0    # tokens looked up at admissions (cumulative)
        self.hit_tokens = 0      # of those, tokens whose KV came from the cache
        self.evicted_pages = 0
        self.epoch = 0           # bumped when a page leaves a tier or a host-tier hash enters the device
        #                          (copied back or computed again; a ``match_tiers`` result can only grow otherwise)
        # Host tier: hash -> host page, least recently used first.
        # (No reverse map: nothing asks a host page for its hash, and the simulator moves millions
        # of pages an hour through this one.)
        self.host_page_of: OrderedDict[bytes, int] = OrderedDict()
        self.host_hit_tokens = 0      # of ``hit_tokens``, tokens copied back from the host tier
        self.host_evicted_pages = 0
        self.residence_s = float("inf")          # EMA of release-to-eviction time; inf until one is evicted

    # ----------------------------------------------------------------- views
    @property
    def num_pages(self) -> int:
        """Device pages holding a cached page (referenced or not)."""
        return len(self.hash_of)

    @property
    def num_evictable(self) -> int:
        """Cached pages no live request lists (reusable by the pool)."""
        return len(self._evictable)

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def num_evictable_among(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` (distinct) are evictable (a C-level set intersection)."""
        return len(self._evictable.keys() & pages)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Device pages of the longest cached run of ``hashes`` from the first."""
        pages = []
        get = self.page_of.get
        for h in hashes:
            p = get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def match_tiers(self, hashes: Sequence[bytes]) -> list[int]:
        """The longest cached run of ``hashes`` from the first, over both tiers:
        a device page id, or ``~host_page`` (negative) for a page cached on host only."""
        pages = []
        on_device, on_host = self.page_of.get, self.host_page_of.get
        for h in hashes:
            p = on_device(h)
            if p is None:
                p = on_host(h)
                if p is None:
                    break
                p = ~p
            pages.append(p)
        return pages

    # -------------------------------------------------------------- changes
    def insert(self, page: int, h: bytes) -> None:
        """Name ``page`` (just computed, listed by one request) ``h``; count 1."""
        assert h not in self.page_of and page not in self.hash_of, "page or hash cached twice"
        if h in self.host_page_of:
            self.epoch += 1   # a host-only page is on the device now: ``match_tiers`` results change
        self.page_of[h] = page
        self.hash_of[page] = h
        refs = self.refs
        if page >= len(refs):
            refs.extend([0] * (page + 1 - len(refs)))
        refs[page] = 1

    def acquire(self, pages: Sequence[int]) -> None:
        """One more request lists each of ``pages`` (distinct; takes them out of the evictable set)."""
        refs, unlist = self.refs, self._evictable.pop
        for p in pages:
            n = refs[p]
            refs[p] = n + 1
            if not n:
                unlist(p)   # its LRU or heap entry lists it stale now

    def release(self, pages: Sequence[int], now: float, bonus_s: float = 0.0) -> None:
        """One request fewer lists each of ``pages`` (distinct, in context order); those no
        one lists become evictable with score ``now + bonus_s`` (ties go
        tail first, so a context is evicted from its end and its head stays
        matchable)."""
        refs, evictable = self.refs, self._evictable
        first = self._seq + 1
        release = (now, first)   # its identity tells the pages its entry lists live from stale ones
        freed = []
        for p in reversed(pages):
            n = refs[p] - 1
            refs[p] = n
            if not n:
                freed.append(p)
                evictable[p] = release
        if not freed:
            return
        self._seq += len(freed)
        if not bonus_s and now >= self._lru_last:
            self._lru.append((release, freed))
            self._lru_last = now
            self._lru_queued += len(freed)
            if self._lru_queued > 4 * len(evictable) + 64:   # drop stale LRU pages now and then
                self._compact_lru()
            return
        heapq.heappush(self._heap, (now + bonus_s, first, freed, release))
        self._queued += len(freed)
        self._compact_heap_if_stale()

    def _compact_lru(self) -> None:
        """Rebuild the LRU with its live pages only (same order)."""
        evictable, pos = self._evictable, self._lru_pos
        entries = []
        for release, pages in self._lru:
            live = [p for p in pages[pos:] if evictable.get(p) is release]
            pos = 0
            if live:
                entries.append((release, live))
        self._lru = deque(entries)
        self._lru_pos = 0
        self._lru_queued = sum(len(pages) for _, pages in entries)

    def evict(self, now: float | None = None) -> int:
        """Forget the evictable page with the lowest score; returns its page id.
        ``now`` (seconds) updates ``residence_s``, the EMA of how long an
        evicted page stayed cached after its release."""
        evicted = self.evict_entries(1, now)
        if not evicted:
            raise RuntimeError("prefix cache: nothing evictable")
        return evicted[0][0]

    def evict_entries(self, count: int, now: float | None = None) -> list[tuple[int, bytes]]:
        """``evict`` ``count`` times in one pass (fewer when fewer pages are
        evictable): ``[(page, its hash)]`` in eviction order, the lowest
        ``(score, seq)`` first. The LRU is in key order and a heap entry's pages
        have consecutive seqs, so taking the lower of the LRU's oldest page and
        the top entry's next page is the one-at-a-time order exactly."""
        lru, heap = self._lru, self._heap
        evicted: list[tuple[int, bytes]] = []
        want = count
        while want > 0:
            if not heap:
                self._evict_lru(want, None, now, evicted)
                break
            if lru:   # below the heap's lowest key (if that is stale, it is below its entry's next live one)
                want -= self._evict_lru(want, heap[0][:2], now, evicted)
                if want <= 0:
                    break
            # (``_evict_lru`` stopped at a live page, or emptied the LRU)
            want -= self._evict_heap_entry(want, lru[0][0] if lru else None, now, evicted)
        self.evicted_pages += len(evicted)
        self.epoch += len(evicted)
        self._compact_heap_if_stale()
        return evicted

    def _compact_heap_if_stale(self) -> None:
        """Rebuild the heap with its live pages only, one entry each (same keys, so the
        same eviction order), once stale pages outnumber live evictable ones 4 to 1: a
        context re-linked after every call of a busy agent would otherwise leave an
        entry per call behind while nothing is evicted."""
        evictable = self._evictable
        if self._queued <= 4 * len(evictable) + 64:
            return
        self._heap = [(s, first + j, [p], release) for s, first, run, release in self._heap
                      for j, p in enumerate(run) if evictable.get(p) is release]
        heapq.heapify(self._heap)
        self._queued = len(self._heap)

    def _evict_lru(self, want: int, bound: tuple[float, int] | None, now: float | None,
                   evicted: list[tuple[int, bytes]]) -> int:
        """Evict up to ``want`` of the LRU's oldest live pages whose key is below ``bound``
        (None: no bound) into ``evicted``, skipping stale ones; returns how many. It
        stops at a live page (or with the LRU empty) unless ``want`` were evicted."""
        lru, evictable, hash_of, page_of = self._lru, self._evictable, self.hash_of, self.page_of
        residence, inf = self.residence_s, float("inf")
        done, pos, passed = 0, self._lru_pos, 0
        while lru and done < want:
            release, pages = lru[0]
            if bound is not None and release > bound:
                break
            age = now - release[0] if now is not None else 0.0
            if age <= 0.0:
                age = 0.0
            n, start = len(pages), pos
            while pos < n and done < want:
                p = pages[pos]
                pos += 1
                if evictable.get(p) is not release:
                    continue   # stale
                del evictable[p]
                if now is not None:   # ``_forget``, inlined: the simulator evicts millions of pages an hour
                    residence = age if residence == inf else 0.9 * residence + 0.1 * age
                h = hash_of.pop(p)
                del page_of[h]   # (its count is 0 already: it was evictable)
                evicted.append((p, h))
                done += 1
            passed += pos - start
            if pos >= n:
                lru.popleft()
                pos = 0
        while lru:   # stop at a live page: skip the stale ones at the head
            release, pages = lru[0]
            n, start = len(pages), pos
            while pos < n and evictable.get(pages[pos]) is not release:
                pos += 1
            passed += pos - start
            if pos < n:
                break
            lru.popleft()
            pos = 0
        self._lru_pos = pos
        self._lru_queued -= passed
        self.residence_s = residence
        return done

    def _evict_heap_entry(self, want: int, bound: tuple[float, int] | None, now: float | None,
                          evicted: list[tuple[int, bytes]]) -> int:
        """Evict up to ``want`` pages of the heap's top entry into ``evicted``, while
        their key is below ``bound`` (the LRU's oldest; None: no bound); returns how many."""
        evictable = self._evictable
        s, first, run, release = heapq.heappop(self._heap)
        done = 0
        for j, p in enumerate(run):
            seq = first + j
            if done >= want or (bound is not None and (s, seq) > bound):
                heapq.heappush(self._heap, (s, seq, run[j:], release))   # the rest, still next in order
                break
            self._queued -= 1
            if evictable.get(p) is not release:
                continue   # stale: re-referenced since it was released
            del evictable[p]
            self._forget(p, release[0], now, evicted)
            done += 1
        return done

    def _forget(self, page: int, released: float, now: float | None, evicted: list[tuple[int, bytes]]) -> None:
        """Drop evictable ``page`` (released at ``released`` s) from the maps into
        ``evicted``; ``now`` (s): update ``residence_s``."""
        if now is not None:
            age = now - released
            if age <= 0.0:
                age = 0.0
            self.residence_s = age if self.residence_s == float("inf") else 0.9 * self.residence_s + 0.1 * age
        h = self.hash_of.pop(page)
        del self.page_of[h]   # (its count is 0 already: it was evictable)
        evicted.append((page, h))

    # ------------------------------------------------------------ host tier
    @property
    def num_host_pages(self) -> int:
        """Host pages holding a cached page (all evictable)."""
        return len(self.host_page_of)

    def host_insert(self, host_page: int, h: bytes) -> None:
        """Name ``host_page`` (a fresh copy of a device page) ``h``: the newest host entry."""
        assert h not in self.host_page_of, "hash cached twice on the host"
        self.host_page_of[h] = host_page

    def host_touch(self, h: bytes) -> None:
        """A hit on (or a re-eviction of) host entry ``h``: it becomes the newest."""
        self.host_page_of.move_to_end(h)

    def host_evict(self, keep: set[int] | frozenset[int] = frozenset()) -> int | None:
        """Forget the least recently used host entry whose page is not in ``keep``
        (pages this step still reads); returns its host page, None if none."""
        lru = self.host_page_of
        skipped = []   # entries in ``keep``, oldest first: they go back to the front
        while lru:
            h, hp = lru.popitem(last=False)
            if hp not in keep:
                break
            skipped.append((h, hp))
        else:
            hp = None
        for h_kept, hp_kept in reversed(skipped):
            lru[h_kept] = hp_kept
            lru.move_to_end(h_kept, last=False)
        if hp is None:
            return None
        self.host_evicted_pages += 1
        self.epoch += 1
        return hp

    def host_replace(self, h: bytes, keep: set[int] | frozenset[int] = frozenset()) -> int | None:
        """``host_evict``, then name the host page it freed ``h`` (not cached on host:
        ``host_insert`` without its checks; a full host tier does this for every page
        it keeps); returns that host page, None if every host page is in ``keep``."""
        host_page = self.host_evict(keep)
        if host_page is not None:
            self.host_page_of[h] = host_page   # the newest entry
        return host_page

    def host_keep(self, evicted: list[tuple[int, bytes]], budget: int, keep: set[int]) -> list[tuple[int, int]]:
        """Device pages ``evicted`` (``[(page, hash)]``, in eviction order) are
        leaving the device and no host page is free: a hash the host tier holds
        becomes its newest entry (``host_touch``); each other one, while
        ``budget`` lasts, takes the least recently used host entry not in
        ``keep`` (``host_replace``), and that host page joins ``keep``. Returns
        the copies ``[(device page, host page)]`` to make."""
        lru = self.host_page_of
        copies: list[tuple[int, int]] = []
        replaced = 0
        for page, h in evicted:
            if h in lru:
                lru.move_to_end(h)
                continue
            if len(copies) >= budget or not lru:
                continue
            old, host_page = lru.popitem(last=False)   # ``host_replace``'s common case, inlined
            if host_page in keep:
                lru[old] = host_page
                lru.move_to_end(old, last=False)
                host_page = self.host_replace(h, keep)
                if host_page is None:
                    continue
            else:
                replaced += 1
                lru[h] = host_page
            copies.append((page, host_page))
            keep.add(host_page)
        self.host_evicted_pages += replaced
        self.epoch += replaced
        return copies

    # ------------------------------------------------------------ invariants
    def check_invariants(self, listed: dict[int, int]) -> None:
        """``listed``: cached page -> how many live requests list it. Counts match,
        the evictable set is exactly the pages no one lists, the maps agree."""
        assert len(self.page_of) == len(self.hash_of), "prefix cache: hash maps differ in size"
        for h, p in self.page_of.items():
            assert self.hash_of.get(p) == h, f"prefix cache: page {p} and its hash disagree"
        assert all(self.refs[p] == 0 for p in range(len(self.refs)) if p not in self.hash_of), \
            "prefix cache: an uncached page has references"
        for p in self.hash_of:
            n = self.refs[p]
            assert n == listed.get(p, 0), f"prefix cache: page {p} has {n} refs, {listed.get(p, 0)} requests list it"
            assert (n == 0) == self.is_evictable(p), f"prefix cache: page {p} evictable={self.is_evictable(p)} with {n} refs"
        evictable, pos = self._evictable, self._lru_pos
        live = []   # the live pages of the LRU's and the heap's entries: each evictable page once
        for release, pages in self._lru:
            live += [p for p in pages[pos:] if evictable.get(p) is release]
            pos = 0
        assert self._lru_queued == sum(map(len, (pages for _, pages in self._lru))) - self._lru_pos, \
            "prefix cache: LRU page count out of step"
        for _, _, run, release in self._heap:
            live += [p for p in run if evictable.get(p) is release]
        assert sorted(live) == sorted(evictable), "prefix cache: an evictable page listed live not once"
        keys = [release for release, _ in self._lru]
        assert keys == sorted(keys), "prefix cache: LRU out of key order"
        assert set(listed) <= set(self.hash_of), "prefix cache: a request lists an uncached page as shared"
        assert len(set(self.host_page_of.values())) == len(self.host_page_of), "prefix cache: a host page cached twice"
