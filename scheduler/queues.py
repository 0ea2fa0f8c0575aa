"""Request collections the scheduler's hot path can afford.

``RequestQueue`` is an insertion-ordered set of requests (O(1) append, remove
and membership, iteration in insertion order); the scheduler's ``waiting`` and
``running`` queues are ``RequestQueue``s. ``RankedQueue`` keeps requests sorted
by a cached key (O(log n) search + one memmove per insert or remove), so a
policy can hand out "the next request to admit" without re-sorting every step.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import count
from typing import Iterable, Iterator

from scheduler.request import Request


class RequestQueue:
    """Insertion-ordered set of requests keyed by ``request_id``.

    Reads like a list (``len``, ``in``, iteration, ``[i]``, slicing, ``index``);
    writes are ``append`` and ``remove`` only, each O(1).
    """

    __slots__ = ("_items",)

    def __init__(self, requests: Iterable[Request] = ()) -> None:
        self._items: dict[str, Request] = {r.request_id: r for r in requests}

    def append(self, request: Request) -> None:
        if request.request_id in self._items:
            raise ValueError(f"request {request.request_id!r} is already queued")
        self._items[request.request_id] = request

    def remove(self, request: Request) -> None:
        if self._items.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id!r} is not in the queue")
        del self._items[request.request_id]

    def discard(self, request: Request) -> bool:
        """Remove ``request`` if present; returns whether it was."""
        if self._items.get(request.request_id) is request:
            del self._items[request.request_id]
            return True
        return False

    def __contains__(self, request: object) -> bool:
        rid = getattr(request, "request_id", None)
        return rid is not None and self._items.get(rid) is request

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items.values())

    def __reversed__(self) -> Iterator[Request]:
        return reversed(self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __getitem__(self, index):
        return list(self._items.values())[index]

    def index(self, request: Request) -> int:
        for i, r in enumerate(self._items.values()):
            if r is request:
                return i
        raise ValueError(f"request {request.request_id!r} is not in the queue")

    def __repr__(self) -> str:
        return f"RequestQueue({list(self._items)})"


class RankedQueue:
    """Requests sorted by a cached sort key, lowest first.

    Keys are tuples of totally ordered values (numbers in practice); ties keep
    insertion order. Entries are stored flat, ``(*key, seq)``, which keeps
    bisect's comparisons cheap. ``add`` and ``remove`` cost at most a bisect plus
    one ``list.insert``/``del`` (a memmove), so thousands of entries stay cheap
    (``remove`` of the head, admission's case, needs no bisect).
    """

    __slots__ = ("_keys", "_reqs", "_key_of", "_seq")

    def __init__(self) -> None:
        self._keys: list[tuple] = []      # (*key, seq), sorted
        self._reqs: list[Request] = []    # parallel to _keys
        self._key_of: dict[str, tuple] = {}
        self._seq = count()

    def __len__(self) -> int:
        return len(self._reqs)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._key_of

    def key(self, request: Request):
        """The key ``request`` is filed under (``None`` if absent)."""
        entry = self._key_of.get(request.request_id)
        return None if entry is None else entry[:-1]

    def entry(self, request: Request) -> tuple | None:
        """``(*key, seq)``: the request's exact, totally ordered position (``None`` if absent)."""
        return self._key_of.get(request.request_id)

    def add(self, request: Request, key: tuple) -> None:
        """File ``request`` under ``key`` (re-files it if already present)."""
        if request.request_id in self._key_of:
            self.remove(request)
        entry = (*key, next(self._seq))
        i = bisect_right(self._keys, entry)
        self._keys.insert(i, entry)
        self._reqs.insert(i, request)
        self._key_of[request.request_id] = entry

    def remove(self, request: Request) -> bool:
        """Drop ``request``; returns False when it was not filed."""
        entry = self._key_of.pop(request.request_id, None)
        if entry is None:
            return False
        keys = self._keys
        # Admission dequeues the head, in order: no search then (a bisect compares key tuples).
        i = 0 if keys[0] is entry else bisect_left(keys, entry)
        del keys[i]
        del self._reqs[i]
        return True

    def clear(self) -> None:
        self._keys.clear()
        self._reqs.clear()
        self._key_of.clear()

    def __iter__(self) -> Iterator[Request]:
        """In key order. Removing the request just yielded is allowed mid-iteration."""
        reqs = self._reqs
        i = 0
        while i < len(reqs):
            r = reqs[i]
            yield r
            if i < len(reqs) and reqs[i] is r:
                i += 1

    def ordered(self) -> list[Request]:
        return list(self._reqs)

    def head(self) -> Request | None:
        return self._reqs[0] if self._reqs else None
