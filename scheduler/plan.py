"""The step contract: what one step does (``StepPlan``), what it produced
(``StepResult``), what that meant for each request (``RequestEvent``), and
what a policy may read (``MemoryView``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from scheduler.cost_model import CostModel, expected_cached_tokens
from scheduler.request import Request, Segment


class MemoryView(NamedTuple):
    """A snapshot of memory for policies. Pages are ``page_size`` tokens each.
    (A named tuple: the scheduler makes one per step.)"""

    free_device_pages: int
    total_device_pages: int
    free_host_pages: int
    total_host_pages: int
    page_size: int
    running_tokens: int        # context tokens of requests currently RUNNING (C_other for a new call)
    num_running: int
    paused_device_pages: int   # pages held by requests paused under Preserve
    cost: CostModel
    cache_horizon_s: float = 0.0   # how long a discarded context's full pages stay cached (s; 0: no cache)

    def expected_cached_tokens(self, context_tokens: int, api_duration_s: float) -> int:
        """Of ``context_tokens`` released into the prefix cache at a call of
        ``api_duration_s`` seconds, the tokens expected still cached at its return."""
        return expected_cached_tokens(context_tokens, self.page_size, api_duration_s, self.cache_horizon_s)

    @property
    def bytes_per_token(self) -> int:
        return self.cost.bytes_per_token


class ScheduledChunk(NamedTuple):
    """Run ``num_tokens`` query tokens of ``request`` starting at context position ``start``.

    ``samples`` is True when the chunk reaches the end of the context, so the
    step produces the request's next token. A named tuple: the scheduler makes
    one per running request per step, and a tuple is the cheapest record to build
    (``tuple.__new__(ScheduledChunk, (request, start, num_tokens, samples))``).
    """

    request: Request
    start: int
    num_tokens: int
    samples: bool


class DecodeChunk:
    """The chunk of a decoding request: one query token at ``start`` (its
    ``num_computed_tokens``), sampling. Read like a ``ScheduledChunk``.

    The scheduler keeps one per decoding request and puts the same object in
    every plan while the request decodes, so a step of N decoders builds no
    per-request record; ``start`` is read from the request, so it is the
    chunk's start from ``schedule()`` until ``update()`` advances the request
    (read a plan before its ``update``, as executors do).
    """

    __slots__ = ("request", "place")
    num_tokens = 1
    samples = True

    def __init__(self, request: Request, place: int) -> None:
        self.request = request
        self.place = place   # the scheduler's sequence number of the request's entry into the batch

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    def __repr__(self) -> str:
        return f"DecodeChunk({self.request.request_id!r}, start={self.start})"


CACHE_OWNER = "<prefix-cache>"   # the pools' owner of every cached page (device tier and host tier)


@dataclass(slots=True)
class SwapOp:
    """Copy KV pages between device and host: ``device_pages[i] <-> host_pages[i]``.

    ``request`` None: pages of the prefix cache's host tier (``owner`` is
    ``CACHE_OWNER``): a copy-out keeps an evicted cached page on host, a
    copy-in brings one back for a prefix hit and leaves the host copy in place.
    """

    request: Request | None
    device_pages: list[int]
    host_pages: list[int]

    @property
    def owner(self) -> str:
        """Whose host pages these are: the request's id, or ``CACHE_OWNER``."""
        return CACHE_OWNER if self.request is None else self.request.request_id


@dataclass(slots=True)
class StepPlan:
    chunks: list[ScheduledChunk | DecodeChunk] = field(default_factory=list)
    swap_out: list[SwapOp] = field(default_factory=list)   # apply before the forward
    swap_in: list[SwapOp] = field(default_factory=list)    # apply before the forward
    preempted: list[Request] = field(default_factory=list)
    token_budget: int = 0
    time: float = 0.0   # when ``schedule()`` planned it (s, the scheduler's clock)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_context_tokens(self) -> int:
        """Cached tokens the step's attention reads: each chunk reads its request's
        context up to its last query token, ``start + num_tokens``."""
        return sum(c.start + c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.chunks or self.swap_out or self.swap_in)


@dataclass(slots=True)
class StepResult:
    """What an executor returns for a ``StepPlan``.

    ``token_ids[i]`` is the token sampled for ``plan.chunks[i]`` (read only for
    chunks that sample); ``None`` when the executor has no token ids (the
    simulator). ``elapsed_s`` is the step's duration when the executor computes it
    (the simulator); 0 means the core measures it on its clock. ``logprobs[i]``:
    the log-probability record of that token (opaque here: the engine's
    ``TokenLogprob``) for chunks whose request keeps them (``Request.logprobs``
    not None), appended there with the token; ``None`` when no chunk's request does.
    ``prompt_logprobs[i]``: the records of the prompt tokens ``plan.chunks[i]`` scored
    (``Request.prompt_logprobs``: those from its next unscored position on, in order;
    empty for a chunk that scored none), appended there; ``None`` when no chunk scored any.
    """

    token_ids: Sequence[int] | None = None
    elapsed_s: float = 0.0
    logprobs: Sequence | None = None
    prompt_logprobs: Sequence | None = None


class EventKind(enum.Enum):
    TOKEN = "token"          # produced a token and keeps running
    API_CALL = "api_call"    # produced a token that ends a declared segment: paused for its API call
    FINISHED = "finished"    # ended (``request.finish_reason`` says why)
    # produced the last token ``max_tokens`` allows, for a request whose front end reads it first
    # (``Request.length_after_frontend``): it ends at "length" after that, unless the front end paused it
    LAST_TOKEN = "last_token"


class RequestEvent(NamedTuple):
    """What ``Scheduler.update`` did to one request that produced a token (a
    named tuple: one per running request per step)."""

    request: Request
    kind: EventKind
    segment: Segment | None = None   # API_CALL: the declared segment whose call starts now
