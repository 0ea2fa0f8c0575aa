"""Which replica serves a request: conversation affinity (no Ray, no JAX).

The front (``jaxserve.distributed.frontend``) asks ``ReplicaRouter.choose``
for every generation request, with the ``RoutingHints`` read from its body
and headers, and tells the router what happened (``routed``, ``finished``,
``parked``). With the ``affinity`` policy the order is:

1. **parked tool context**: a follow-up whose messages name a tool call id
   that a replica answered with ``finish_reason: "tool_calls"`` goes to that
   replica (it holds the paused context, ``server.parked``);
2. **session key**: the ``x-session-affinity`` header, else the body's
   ``session_id``, ``prompt_cache_key`` or ``user``: the replica that served
   the key last;
3. **longest cached prefix**: the prompt's first pages of token ids
   (``page_size`` tokens each) are hashed as a chain (the hash of page i
   covers pages 0..i, as the engine's prefix cache does); each replica has a
   bounded LRU set of the hashes routed to it, and the replica holding the
   deepest page wins if that covers at least ``min_match_fraction`` of the
   request's hashed pages and the replica has fewer than ``max_imbalance``
   more requests in flight than the least loaded one (as SGLang's
   cache-aware router: a shared system prompt alone must not pin all new
   conversations on one replica). Each set is held to what its replica can
   hold: the front polls every replica's count of cached pages (device and
   host tiers, ``set_capacity``) and forgets its least recently routed
   hashes beyond it, so a replica whose cache evicts under load stops
   attracting prefixes it no longer has (the front's hashes are of its own
   rendering of the messages, not the engine's pages, so this follows the
   replica's capacity and recency, not each eviction);
4. **least loaded**: fewest requests in flight from this front.

``least_loaded`` and ``round_robin`` skip 1-3 (baselines for the benchmark).
Under every policy, a request that names a stored Responses API response
(``previous_response_id``; ``GET``/``DELETE /v1/responses/{id}``) or a
conversation (``conversation``; ``/v1/conversations/{id}...``) goes to
the replica that answered it (``stored``), as only that replica's store
holds it: this is where the state lives, not a preference.
A replica marked down (``set_alive``) gets nothing until it is back; the
affinity entries pointing at it are dropped when it is marked down (its
engine restarts empty).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

HEALTH_TIMEOUT_S = 2.0   # a replica that does not answer a health check in this long counts as down (one being
#                          restarted by Ray holds the call until it is back: a check must not wait for that)

MAX_HASHED_PAGES = 64          # prompt pages hashed per request (a prefix longer than this matches as this)
MAX_CHARS_PER_TOKEN = 32       # the prompt text tokenized for them: at most this many characters a hashed token
HASHES_PER_REPLICA = 50_000    # bounded map: page hashes remembered per replica (LRU)
MAX_KEYS = 100_000             # bounded maps: session keys and parked tool-call ids (LRU)
MAX_IMBALANCE = 8              # prefix affinity yields when its replica has this many more requests in flight
MIN_MATCH_FRACTION = 0.5       # prefix affinity needs this fraction of the request's hashed pages cached


@dataclass
class RoutingHints:
    """What a request tells the router. ``page_hashes``: chained hashes of its
    first full pages of token ids (page 0 first)."""

    session_key: str | None = None
    tool_call_ids: list[str] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)
    stored_response: str | None = None   # the Responses API response it continues or reads


def page_hashes(token_ids: list[int], page_size: int, max_pages: int = MAX_HASHED_PAGES) -> list[bytes]:
    """Chained hashes of the full pages of ``token_ids`` (at most ``max_pages``)."""
    hashes: list[bytes] = []
    previous = b""
    for start in range(0, min(len(token_ids) // page_size, max_pages) * page_size, page_size):
        page = ",".join(map(str, token_ids[start:start + page_size])).encode()
        previous = hashlib.blake2b(previous + page, digest_size=16).digest()
        hashes.append(previous)
    return hashes


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # OpenAI content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return json.dumps(content, sort_keys=True)


def _as_message(item):
    """A Responses API input item as the chat message it stands for (a ``function_call``
    an assistant message with that one call, its output a tool message)."""
    if not isinstance(item, dict):
        return item
    kind = item.get("type", "message")
    if kind == "function_call":
        return {"role": "assistant", "tool_calls": [{"id": item.get("call_id"), "type": "function", "function": {
            "name": item.get("name"), "arguments": item.get("arguments")}}]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")}
    return item


def _message_list(body: dict) -> list | None:
    """The conversation a body carries: chat ``messages``, or a Responses API
    ``instructions`` + ``input`` (a string is one user message) as chat messages."""
    if isinstance(body.get("messages"), list):
        return body["messages"]
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    instructions = body.get("instructions")
    head = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    return head + [_as_message(item) for item in items]


def prompt_text(body: dict) -> str:
    """A rendering of the request's prompt that is stable across turns: a
    conversation's next turn renders to a text that starts with this turn's."""
    messages = _message_list(body)
    if messages is not None:
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            calls = m.get("tool_calls")
            parts.append(f"<{m.get('role', '')}>{_content_text(m.get('content'))}"
                         + (json.dumps(calls, sort_keys=True) if calls else "") + "\n")
        return "".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def stored_state(body: dict) -> str | None:
    """The stored state a Responses request continues: its ``previous_response_id``, or its
    ``conversation`` (an id, or ``{"id": ...}``); None when it names neither (or oddly)."""
    previous, conversation = body.get("previous_response_id"), body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    return next((key for key in (previous, conversation) if isinstance(key, str)), None)


def read_hints(body: dict, headers: dict[str, str], tokenize: Callable[[str], list[int]] | None,
               page_size: int) -> RoutingHints:
    """The hints of one request (``body``: its JSON object; ``headers``: lower-case
    names). ``tokenize``: text -> token ids (``None``: UTF-8 bytes stand in for tokens).
    Never raises on odd bodies: a body it cannot read has no hints (the replica reports its errors)."""
    hints = RoutingHints()
    for key in (headers.get("x-session-affinity"), body.get("session_id"), body.get("prompt_cache_key"),
                body.get("user")):
        if isinstance(key, str) and key:
            hints.session_key = key
            break
    hints.stored_response = stored_state(body)
    for m in _message_list(body) or []:
        if not isinstance(m, dict):
            continue
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, dict) and isinstance(call.get("id"), str):
                hints.tool_call_ids.append(call["id"])
        if isinstance(m.get("tool_call_id"), str):
            hints.tool_call_ids.append(m["tool_call_id"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = prompt
    else:   # only the hashed pages' text is tokenized: a body of megabytes costs what a long prompt does
        text = prompt_text(body)[:MAX_HASHED_PAGES * page_size * MAX_CHARS_PER_TOKEN]
        ids = tokenize(text) if tokenize is not None and text else list(text.encode("utf-8", "surrogatepass"))
    hints.page_hashes = page_hashes(ids, page_size)
    return hints


class ReplicaRouter:
    """Routing state of one front: in-flight counts, and the bounded affinity maps."""

    def __init__(self, replicas: list[str], policy: str = "affinity", *, max_imbalance: int = MAX_IMBALANCE,
                 min_match_fraction: float = MIN_MATCH_FRACTION, hashes_per_replica: int = HASHES_PER_REPLICA,
                 max_keys: int = MAX_KEYS) -> None:
        if not replicas:
            raise ValueError("replicas: at least one replica name")
        if policy not in ("affinity", "least_loaded", "round_robin"):
            raise ValueError(f"replica_router: unknown policy {policy!r}")
        self.replicas = list(replicas)
        self.policy = policy
        self.max_imbalance = max_imbalance
        self.min_match_fraction = min_match_fraction
        self.hashes_per_replica = hashes_per_replica
        self.max_keys = max_keys
        self.alive = {name: True for name in replicas}
        self.capacity = {name: hashes_per_replica for name in replicas}   # page hashes kept per replica now
        self._added = {name: 0 for name in replicas}   # hashes routed to each since its last capacity report
        self.in_flight = {name: 0 for name in replicas}
        self.prefixes: dict[str, OrderedDict[bytes, None]] = {name: OrderedDict() for name in replicas}
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.parked_calls: OrderedDict[str, str] = OrderedDict()
        self.stored_responses: OrderedDict[str, str] = OrderedDict()
        self.routed_by: dict[str, int] = {}
        self._cycle = itertools.cycle(self.replicas)

    # ------------------------------------------------------------ choosing
    def choose(self, hints: RoutingHints) -> tuple[str, str]:
        """``(replica, reason)``; reason is stored | parked | session | prefix | least_loaded |
        round_robin. ``RuntimeError`` when no replica is up."""
        up = [r for r in self.replicas if self.alive[r]]
        if not up:
            raise RuntimeError("no replica is up")
        choice = None
        holder = self.stored_responses.get(hints.stored_response) if hints.stored_response else None
        if holder is not None and self.alive[holder]:
            choice = holder, "stored"
        elif self.policy == "round_robin":
            choice = next(r for r in self._cycle if self.alive[r]), "round_robin"
        elif self.policy == "affinity":
            choice = self._affinity(hints, up)
        if choice is None:
            choice = min(up, key=lambda r: (self.in_flight[r], self.replicas.index(r))), "least_loaded"
        self.routed_by[choice[1]] = self.routed_by.get(choice[1], 0) + 1
        return choice

    def _affinity(self, hints: RoutingHints, up: list[str]) -> tuple[str, str] | None:
        for call_id in reversed(hints.tool_call_ids):
            replica = self.parked_calls.get(call_id)
            if replica is not None and self.alive[replica]:
                return replica, "parked"
        if hints.session_key is not None:
            replica = self.sessions.get(hints.session_key)
            if replica is not None and self.alive[replica]:
                return replica, "session"
        least = min(self.in_flight[r] for r in up)
        best, depth = None, 0
        for replica in up:
            known = self.prefixes[replica]
            d = 0
            while d < len(hints.page_hashes) and hints.page_hashes[d] in known:
                d += 1
            if d > depth and self.in_flight[replica] - least < self.max_imbalance:
                best, depth = replica, d
        if best is None or depth < self.min_match_fraction * len(hints.page_hashes):
            return None
        return best, "prefix"

    # ----------------------------------------------------------- recording
    def routed(self, replica: str, hints: RoutingHints) -> None:
        """A request was sent to ``replica``: count it in flight and remember its keys there."""
        self.in_flight[replica] += 1
        if hints.session_key is not None:
            _remember(self.sessions, hints.session_key, replica, self.max_keys)
        self._added[replica] += len(hints.page_hashes)
        known = self.prefixes[replica]
        limit = min(self.capacity[replica] + self._added[replica], self.hashes_per_replica)
        for h in hints.page_hashes:
            _remember(known, h, None, limit)

    def finished(self, replica: str) -> None:
        self.in_flight[replica] = max(0, self.in_flight[replica] - 1)

    def parked(self, replica: str, tool_call_ids: list[str]) -> None:
        """``replica`` answered with these client-side tool calls (their contexts are parked there)."""
        for call_id in tool_call_ids:
            _remember(self.parked_calls, call_id, replica, self.max_keys)

    def stored(self, replica: str, response_ids: list[str]) -> None:
        """``replica`` answered with these Responses API responses (its store holds them)."""
        for response_id in response_ids:
            _remember(self.stored_responses, response_id, replica, self.max_keys)

    def set_capacity(self, replica: str, cached_pages: int) -> None:
        """``replica`` reports ``cached_pages`` pages in its prefix cache (both tiers):
        keep at most that many of its hashes, plus those routed to it since its
        previous report (their pages may not be computed yet), and never more than
        ``hashes_per_replica``; the most recently routed stay."""
        self.capacity[replica] = max(0, cached_pages)
        limit = min(self.capacity[replica] + self._added[replica], self.hashes_per_replica)
        self._added[replica] = 0
        known = self.prefixes[replica]
        while len(known) > limit:
            known.popitem(last=False)

    def set_alive(self, replica: str, alive: bool) -> None:
        """Mark a replica up or down; going down forgets what it held (it restarts empty)."""
        if self.alive[replica] and not alive:
            self.prefixes[replica].clear()
            for table in (self.sessions, self.parked_calls, self.stored_responses):
                for key in [k for k, r in table.items() if r == replica]:
                    del table[key]
        self.alive[replica] = alive


def _remember(table: OrderedDict, key, value, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
