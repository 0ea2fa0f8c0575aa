"""Page accounting: a free list of fixed-size KV pages, in plain Python.

The same class serves the device pool and the host (swap) pool. Ownership is
recorded so the invariant "every page is free or owned by exactly one
request, never both" can be checked after every step.
"""

from __future__ import annotations

from collections import deque


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
        self._owner: dict[int, str] = {}

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
        if n > len(self._free):
            raise OutOfPagesError(f"{self.name} pool: asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, owner: str, pages: list[int]) -> None:
        """Return ``pages`` (all owned by ``owner``) to the free list."""
        for p in pages:
            if self._owner.get(p) != owner:
                raise RuntimeError(f"{self.name} page {p} freed by {owner!r} but owned by {self._owner.get(p)!r}")
            del self._owner[p]
            self._free.append(p)

    def owned_by(self) -> dict[str, list[int]]:
        """Pages grouped by owner (for invariant checks and metrics)."""
        out: dict[str, list[int]] = {}
        for page, owner in self._owner.items():
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
        assert not (free_set & self._owner.keys()), f"{self.name}: pages both free and owned: {sorted(free_set & self._owner.keys())[:8]}"
        assert len(free_set) + len(self._owner) == self.num_pages, (
            f"{self.name}: {len(free_set)} free + {len(self._owner)} owned != {self.num_pages} pages")
        if expected is not None:
            actual = {o: sorted(p) for o, p in self.owned_by().items()}
            want = {o: sorted(p) for o, p in expected.items() if p}
            assert actual == want, f"{self.name}: ownership mismatch, allocator {actual} vs requests {want}"
