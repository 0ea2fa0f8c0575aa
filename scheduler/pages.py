"""Page accounting: a free list of fixed-size KV pages, in plain Python.

The same class serves the device pool and the host (swap) pool. Ownership is
recorded so the invariant "every page is free or owned by exactly one
request, never both" can be checked after every step.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PageAllocator:
    """Hands out page ids ``0 … num_pages-1``; O(1) allocate and free per page."""

    def __init__(self, num_pages: int, page_size: int, name: str = "device") -> None:
        if num_pages < 0 or page_size <= 0:
            raise ValueError(f"{name} pool needs num_pages >= 0 and page_size > 0")
        self.num_pages = num_pages
        self.page_size = page_size
        self.name = name
        self._free: deque[int] = deque(range(num_pages))
        # Owner per page id (None = free). A list, not a dict: no rehash spikes
        # on the hot path however many pages churn.
        self._owner: list[str | None] = [None] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for_tokens(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: str, n: int) -> list[int]:
        """Take ``n`` free pages for ``owner``; raises ``OutOfPagesError`` if too few."""
        free = self._free
        if n > len(free):
            raise OutOfPagesError(f"{self.name} pool: asked for {n} pages, {len(free)} free")
        pop, owner_of = free.popleft, self._owner
        pages = [pop() for _ in repeat(None, n)]
        for p in pages:
            owner_of[p] = owner
        return pages

    def allocate_each(self, owners: list[str]) -> list[int]:
        """One free page for each of ``owners``, in order; raises ``OutOfPagesError`` if too few."""
        if len(owners) > len(self._free):
            raise OutOfPagesError(f"{self.name} pool: asked for {len(owners)} pages, {len(self._free)} free")
        pop, owner_of = self._free.popleft, self._owner
        pages = [pop() for _ in owners]
        for p, owner in zip(pages, owners):
            owner_of[p] = owner
        return pages

    def allocate_avoiding(self, owner: str, avoid: set[int]) -> int | None:
        """One free page for ``owner`` that is not in ``avoid``, or None if every free
        page is. Pages of ``avoid`` met on the way go to the back of the free list
        (as taking and freeing them again would)."""
        free = self._free
        for _ in range(len(free)):
            page = free.popleft()
            if page not in avoid:
                self._owner[page] = owner
                return page
            free.append(page)
        return None

    def free(self, owner: str, pages: list[int]) -> None:
        """Return ``pages`` (all owned by ``owner``) to the free list."""
        self._hand_over(pages, owner, None, "freed")
        self._free.extend(pages)

    def reassign(self, pages: list[int], owner: str, new_owner: str) -> None:
        """Hand ``pages`` (all owned by ``owner``) to ``new_owner`` without freeing them."""
        self._hand_over(pages, owner, new_owner, "handed on")

    def _hand_over(self, pages: list[int], owner: str, new_owner: str | None, verb: str) -> None:
        """Set ``pages``' owner to ``new_owner``, checking ``owner`` holds each of them (a
        page that it does not is a bookkeeping bug: the error stops the step, and the
        pages before it have changed hands already)."""
        owners = self._owner
        for p in pages:
            if owners[p] != owner:
                raise RuntimeError(f"{self.name} page {p} {verb} by {owner!r} but owned by {owners[p]!r}")
            owners[p] = new_owner

    def owned_by(self) -> dict[str, list[int]]:
        """Pages grouped by owner (for invariant checks and metrics)."""
        out: dict[str, list[int]] = {}
        for page, owner in enumerate(self._owner):
            if owner is not None:
                out.setdefault(owner, []).append(page)
        return out

    def check_invariants(self, expected: dict[str, list[int]] | None = None) -> None:
        """Every page is free or owned, never both, never twice; optionally match ``expected``.

        ``expected`` maps owner -> the pages the caller believes it holds.
        Raises ``AssertionError`` with the first violation found.
        """
        free = list(self._free)
        free_set = set(free)
        assert len(free) == len(free_set), f"{self.name}: a page is on the free list twice"
        owned = {p for p, o in enumerate(self._owner) if o is not None}
        assert not (free_set & owned), f"{self.name}: pages both free and owned: {sorted(free_set & owned)[:8]}"
        assert len(free_set) + len(owned) == self.num_pages, (
            f"{self.name}: {len(free_set)} free + {len(owned)} owned != {self.num_pages} pages")
        if expected is not None:
            actual = {o: sorted(p) for o, p in self.owned_by().items()}
            want = {o: sorted(p) for o, p in expected.items() if p}
            assert actual == want, f"{self.name}: ownership mismatch, allocator {actual} vs requests {want}"
