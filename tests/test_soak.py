"""A long-running engine's books stay bounded: after waves of requests run to
completion (API calls, aborts, the prefix cache with its host tier, every
policy), no container reachable from the scheduler keeps growing with the
number of finished requests (the decoder-place index kept every request that
ever decoded, until 1d29174: with that fix reverted, every case here fails)."""

from __future__ import annotations

import collections
import random
import types

import pytest

from scheduler import (BUILTIN_PROFILES, EventKind, Handling, PageAllocator, Request, Scheduler, SchedulerConfig,
                       Segment, StepResult, available_policies, make_policy)

COST = BUILTIN_PROFILES["gptj-6b-a100-40g"]
SYSTEM = [[random.Random(s).randrange(3, 1000) for _ in range(40)] for s in range(4)]
OWN = ("scheduler",)   # classes whose attributes are followed


def container_sizes(root: object) -> dict[str, int]:
    """``{path: len}`` of every dict, list, set and deque reachable from ``root``
    through the attributes (``__dict__`` and ``__slots__``) of the project's
    objects; the elements of a container are followed too (path ``[*]``, sizes
    of one path summed)."""
    sizes: dict[str, int] = collections.defaultdict(int)
    seen: set[int] = set()

    def attrs(obj: object):
        yield from getattr(obj, "__dict__", {}).items()
        for cls in type(obj).__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    yield name, getattr(obj, name)

    def visit(obj: object, path: str) -> None:
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, type(None), type, types.FunctionType,
                                                types.MethodType, types.BuiltinFunctionType)):
            return
        seen.add(id(obj))
        if isinstance(obj, (dict, types.MappingProxyType)):
            sizes[path] += len(obj)
            for key, value in list(obj.items()):
                visit(key, path + "{k}")
                visit(value, path + "[*]")
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            sizes[path] += len(obj)
            for value in list(obj):
                visit(value, path + "[*]")
        elif type(obj).__module__.split(".")[0] in OWN:
            if hasattr(obj, "__len__"):
                sizes[path + "#len"] += len(obj)
            for name, value in attrs(obj):
                visit(value, f"{path}.{name}")

    visit(root, "scheduler")
    return dict(sizes)


def run_wave(sched: Scheduler, wave: int, now: float, rng: random.Random, aborts: bool) -> float:
    """40 requests (0-3 API calls each, token ids sharing system prompts) run to completion."""
    for i in range(40):
        segments = [Segment(rng.randint(1, 6), rng.choice(["math", "qa", "tool"]),
                            rng.choice([0.0, 0.02, 0.2, 0.5]), rng.randint(0, 5)) for _ in range(rng.randint(0, 3))]
        segments.append(Segment(rng.randint(1, 6)))
        n = rng.randint(5, 60)
        ids = (rng.choice(SYSTEM) + [rng.randrange(3, 1000) for _ in range(n)])[:n]
        sched.add_request(Request(f"w{wave}-{i}", now, prompt_len=n, max_tokens=sum(s.num_tokens for s in segments),
                                  segments=segments, token_ids=ids), now)
    pending: list[tuple[float, Request, int]] = []
    for step in range(20_000):
        if not sched.has_unfinished():
            return now
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            if item[1].request_id in sched.requests:
                sched.api_return(item[1], item[2], now, token_ids=[rng.randrange(3, 1000) for _ in range(item[2])])
        if aborts and step % 7 == 0 and sched.requests and rng.random() < 0.3:
            sched.abort(rng.choice(sorted(sched.requests)), now)
        if sched.has_work():
            plan = sched.schedule(now)
            now += 0.01
            for event in sched.update(plan, StepResult(token_ids=[rng.randrange(3, 1000) for _ in plan.chunks]), now):
                if event.kind is EventKind.API_CALL:
                    segment = event.request.segments[event.request.segment_index - 1]
                    pending.append((now + segment.api_duration_s, event.request, segment.num_returned_tokens))
        else:
            now += 0.01
    raise AssertionError("no progress")


# (policy, forced handling, aborts, device pages): a pool tight enough that the cache evicts and the
# host tier fills, so every book of it is full by the first snapshot. (On a roomy pool the cache
# keeps growing by design, so growth says nothing there; the retention heap's case, a pool that
# never evicts, is tests/test_prefix_cache.py::test_a_context_relinked_after_every_call_...)
CASES = ([(policy, None, True, 256) for policy in available_policies()]
         + [("infercept", handling, False, 256) for handling in (Handling.PRESERVE, Handling.DISCARD, Handling.SWAP)])


@pytest.mark.parametrize("policy,handling,aborts,pages", CASES)
def test_no_container_grows_with_finished_requests(policy, handling, aborts, pages):
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, swap_budget_tokens=16, handling=handling,
                             enable_prefix_caching=True, prefix_retention_s=0.3)
    sched = Scheduler(config, make_policy(policy), PageAllocator(pages, 4), PageAllocator(64, 4, "host"), COST)
    rng, now, snapshots = random.Random(0), 0.0, []
    # 6 waves fill the pools and the cache; then a snapshot every 3 waves. Ten snapshots: a book
    # bounded by the pools (the retention heap: 4 stale entries per evictable page) may rise over
    # three or four in a row, a book that grows with finished requests rises at every one.
    for wave in range(36):
        now = run_wave(sched, wave, now, rng, aborts)
        if wave >= 8 and (wave + 1) % 3 == 0:
            assert not sched.requests
            sched.check_invariants()
            snapshots.append(container_sizes(sched))
    finished = 27 * 40   # requests that ended between the first snapshot and the last
    grown = {}
    for path in set().union(*snapshots):
        sizes = [s.get(path, 0) for s in snapshots]
        # up at every snapshot, by half an entry per finished request or more: it grows with them
        # (books bounded by the pools fill more slowly than that, then stop)
        if all(b > a for a, b in zip(sizes, sizes[1:])) and sizes[-1] - sizes[0] >= finished // 2:
            grown[path] = sizes
    assert not grown, f"containers growing with finished requests (sizes after 9, 12, ..., 36 waves): {grown}"
