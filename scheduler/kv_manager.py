"""The KV page manager: device and host page pools and every request's page tables.

A request's page tables live on the request (``Request.device_pages`` and
``Request.host_pages``, page ids in context order: page ``i`` holds tokens
``[i·page_size, (i+1)·page_size)``) so executors can read them, but only this
class writes them. The scheduler decides *who* gets memory (admission,
preemption, API handling); this class decides *which* pages and keeps the
books: allocation for the next chunk, freeing, chunked swaps in both
directions, and the two indexes of requests that hold device KV without
running (the eviction candidates).

A prefix cache (chained page hashes, reference counts, an LRU of evictable
cached pages) belongs here too: ``allocate_slots`` and ``free_device`` are the
only places pages enter and leave a page table, so it can be added behind
them without the scheduler changing.
"""

from __future__ import annotations

from scheduler.pages import PageAllocator
from scheduler.plan import SwapOp
from scheduler.request import Request


class KVManager:
    """Device and host pages of every live request (see module doc).

    Page counts are in pages of ``page_size`` tokens. Two holder indexes, in
    the order requests entered them: ``paused_holders`` (paused under Preserve
    with device KV) and ``waiting_holders`` (in the waiting queue with device
    KV: back from an API, or preempted while keeping pages). The scheduler
    files requests there (``hold_paused``/``hold_waiting``/``release``); any
    freeing of device KV drops the request from both.
    """

    def __init__(self, device_pool: PageAllocator, host_pool: PageAllocator) -> None:
        if device_pool.page_size != host_pool.page_size:
            raise ValueError("device and host pools must use the same page size")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.page_size = device_pool.page_size
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
        if num_new_pages > self.device_pool.num_free:
            return False
        if num_new_pages:
            request.device_pages.extend(self.device_pool.allocate(request.request_id, num_new_pages))
        return True

    @property
    def num_free_device(self) -> int:
        return self.device_pool.num_free

    def free_device(self, request: Request) -> None:
        """Free ``request``'s device KV (its context must be recomputed or is on host)."""
        if request.device_pages:
            self.device_pool.free(request.request_id, request.device_pages)
            request.device_pages = []
        self.paused_holders.pop(request.request_id, None)
        self.waiting_holders.pop(request.request_id, None)

    def free(self, request: Request) -> None:
        """Free every page of ``request``, device and host."""
        self.free_device(request)
        if request.host_pages:
            self.host_pool.free(request.request_id, request.host_pages)
            request.host_pages = []

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
        """Reserve device pages mirroring ``request``'s host pages; False when too few are free."""
        n = len(request.host_pages)
        if not self.device_pool.can_allocate(n):
            return False
        request.device_pages = self.device_pool.allocate(request.request_id, n)
        request.pages_swapped = 0
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
                self.free_device(request)
            else:
                self.host_pool.free(request.request_id, request.host_pages)
                request.host_pages = []
        return op, max(n, 0), done

    # ------------------------------------------------------------- invariants
    def check_invariants(self, live: list[Request], paused_holders: set[str], waiting_holders: set[str]) -> None:
        """Every page is free or owned by exactly the live request whose table
        lists it; the holder indexes are exactly the ids given (computed by the
        caller from request states)."""
        self.device_pool.check_invariants({r.request_id: r.device_pages for r in live})
        self.host_pool.check_invariants({r.request_id: r.host_pages for r in live})
        assert set(self.paused_holders) == paused_holders, "paused-holder index out of step"
        assert set(self.waiting_holders) == waiting_holders, "waiting-holder index out of step"
