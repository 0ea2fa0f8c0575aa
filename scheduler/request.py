"""The one record of a request: ids, token ids, API segments, state, pages, timing.

Everything the engine, the scheduler and the executors know about a request
lives here (DESIGN section 4). The scheduler reads only counts, so the
simulator drives the same ``Request`` with ``token_ids`` left empty; the
engine fills ``token_ids`` and the front-end fields (``sampling_params``,
``detokenizer``, ``tool_parser``), which the scheduler never reads. Page
tables (``device_pages``, ``host_pages``) are written only by the KV page
manager.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestState(enum.Enum):
    WAITING = "waiting"            # queued: new, preempted, or back from an API call
    RUNNING = "running"            # scheduled in the batch
    PAUSED = "paused"              # inside an API call (Preserve keeps pages, Discard holds none)
    SWAPPING_OUT = "swapping_out"  # inside an API call, KV being copied to host
    SWAPPED = "swapped"            # inside an API call (or back from it), KV on host
    SWAPPING_IN = "swapping_in"    # KV being copied back to device
    FINISHED = "finished"
    ABORTED = "aborted"


class Handling(enum.Enum):
    """What happens to a request's KV cache while it waits for an API."""

    PRESERVE = "preserve"
    DISCARD = "discard"
    SWAP = "swap"

    @classmethod
    def parse(cls, value: "Handling | str | None") -> "Handling | None":
        """``None`` means "the policy decides"; strings are matched by value."""
        if value is None or isinstance(value, Handling):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(h.value for h in cls)
            raise ValueError(f"handling must be one of {names} or None, got {value!r}") from None


@dataclass(slots=True)
class Segment:
    """Generate ``num_tokens`` tokens, then (if ``api_type`` is set) call an API.

    ``api_duration_s`` is how long the call takes (known in replay, predicted or
    unknown live), ``num_returned_tokens`` how many tokens it appends to the
    context. The last segment of a request normally has no API call.
    """

    num_tokens: int
    api_type: str | None = None
    api_duration_s: float | None = None
    num_returned_tokens: int = 0
    returned_token_ids: tuple[int, ...] | None = None   # the tokens themselves, when known (declared calls)

    @property
    def has_api_call(self) -> bool:
        return self.api_type is not None


@dataclass(eq=False, slots=True)
class ApiCallRecord:
    """What happened at one API call, for metrics and ``RequestOutput.api_calls``."""

    api_type: str
    handling: Handling
    call_time: float
    return_time: float | None = None
    resume_time: float | None = None   # first step that ran it again
    context_tokens: int = 0             # C_i at the call
    num_returned_tokens: int = 0
    fell_back_from: Handling | None = None  # e.g. SWAP -> DISCARD when the host pool was full
    name: str | None = None             # parsed tool calls: the first call's tool name and raw JSON
    arguments: str | None = None        # arguments; every call of the turn in tool_calls; error texts
    tool_calls: list[dict] = field(default_factory=list)
    error: str | None = None
    truncated: bool = False             # the tool's result was cut to fit (inside its wrapper)


@dataclass(eq=False, slots=True)
class Request:
    """One request's scheduling state. Counts are in tokens, times in seconds.

    Invariants: ``num_computed_tokens <= num_tokens``; KV for positions
    ``[0, num_computed_tokens)`` is on device (``device_pages``) when RUNNING,
    WAITING-with-pages or PAUSED under Preserve; on host (``host_pages``) when SWAPPED.
    """

    request_id: str
    arrival_time: float
    prompt_len: int
    max_tokens: int
    segments: list[Segment] = field(default_factory=list)
    ignore_eos: bool = False
    # Priority class: a lower value is admitted first and preempted last; the policy ranks
    # requests within a class (``Scheduler._rank_key``). 0 unless the caller sets one.
    priority: int = 0
    priority_aged: int = 0   # classes aging took off ``priority`` while it waited (``SchedulerConfig.priority_aging_s``)
    # Predictions used by ranking policies (keys such as "output_len", "api_duration_s").
    predictions: dict = field(default_factory=dict)
    # Token ids: the whole context (prompt + generated + API-returned); empty in the simulator.
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)   # generated tokens only
    stop_token_ids: frozenset[int] = frozenset()                # a sampled id in here ends the request
    # Front-end state the scheduler never reads (opaque here: no engine imports).
    sampling_params: object | None = None
    seed: int = 0
    # generated tokens before the current turn (a follow-up resumed with a budget of its own): its
    # sampling steps count from here, as a fresh request's from its first token, so a seeded
    # follow-up samples alike resumed or computed fresh
    turn_start: int = 0
    detokenizer: object | None = None
    tool_parser: object | None = None
    # ``max_tokens`` is applied after the front end read the last allowed token (``EventKind.LAST_TOKEN``):
    # a client-side tool call that token completes pauses the request, as any other call does
    length_after_frontend: bool = False
    reasoning: object | None = None         # reasoning/answer split of the text (``jaxserve.reasoning``)
    grammar: object | None = None           # structured-output state (kept across API pauses)
    logit_adjuster: object | None = None    # logit_bias, min_tokens, penalties (``jaxserve.logit_adjust``)
    pending_tool_calls: list[dict] = field(default_factory=list)   # client-side calls the caller must answer
    tool_calls_run: int = 0                 # server-side tool calls run for it (``max_tool_calls``)
    logprobs: list | None = None            # one record per generated token when asked (``StepResult.logprobs``)
    # When asked: one entry per prompt token scored so far, ``None`` first (the first token has no
    # context), then one record each (``StepResult.prompt_logprobs``); complete at ``prompt_len`` entries.
    prompt_logprobs: list | None = None
    max_computed_tokens: int = 0            # high-water mark of computed context (recompute accounting)
    reported_tokens: int = 0                # streamed so far: generated tokens, text characters
    reported_text: int = 0
    reported_content: int = 0               # with ``reasoning``: characters of answer and of reasoning
    reported_reasoning: int = 0

    state: RequestState = RequestState.WAITING
    num_tokens: int = 0            # context: prompt + generated + API-returned
    num_computed_tokens: int = 0   # tokens whose KV is in the cache
    # Query tokens computed for it so far (every chunk, recomputed ones too; Autellix's attained
    # service) less ``num_computed_tokens``: + tokens dropped (recompute), - tokens linked from the
    # prefix cache. Written where those happen, so the service costs nothing per step.
    service_offset: int = 0
    num_generated: int = 0         # generated tokens (what max_tokens counts)
    device_pages: list[int] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)
    pages_swapped: int = 0         # swap progress, in pages (out or in)
    # Prefix cache (written by the KV page manager): chained hashes of the context's full pages
    # (from ``token_ids``, or set by the simulator from a trace's prefix structure), how many
    # leading ``device_pages`` are shared cache pages, and prompt tokens served from the cache
    # at first admission.
    block_hashes: list[bytes] = field(default_factory=list)
    num_shared_pages: int = 0
    num_cached_tokens: int = 0

    handling: Handling | None = None
    segment_index: int = 0         # which segment is being generated
    segment_generated: int = 0     # tokens generated in the current segment
    api_calls: list[ApiCallRecord] = field(default_factory=list)
    api_returned: bool = False     # the current call has returned
    pending_return_tokens: int = 0  # tokens the returned call appends on resume

    queue_key_time: float = 0.0    # fcfs: the time it (re-)entered the queue
    first_scheduled_time: float | None = None
    last_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None       # why the engine failed it (finish_reason "error")
    num_preemptions: int = 0
    waiting_iterations: int = 0    # starvation counter (iterations waiting after first scheduled)
    starving: bool = False         # promoted to the head until it completes
    policy_state: dict = field(default_factory=dict)  # per-policy cache (scores, levels)

    def __post_init__(self) -> None:
        if self.num_tokens == 0:
            self.num_tokens = self.prompt_len
        self.queue_key_time = self.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)

    @property
    def attained_tokens(self) -> int:
        """Query tokens computed for this request so far, every chunk counted (recomputes too)."""
        return self.num_computed_tokens + self.service_offset

    @property
    def scores_prompt(self) -> bool:
        """Whether it still scores prompt tokens (``prompt_logprobs`` asked and not complete):
        those need the logits of their places, so the prefix cache cannot serve them."""
        scored = self.prompt_logprobs
        return scored is not None and len(scored) < self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def current_segment(self) -> Segment | None:
        if self.segment_index < len(self.segments):
            return self.segments[self.segment_index]
        return None

    @property
    def max_context_tokens(self) -> int:
        """Tokens its context can reach: the prompt, every output token and every API return."""
        return self.prompt_len + self.max_tokens + sum(s.num_returned_tokens for s in self.segments)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.prompt_len]

    @property
    def api_time_total(self) -> float:
        """Seconds spent inside API calls that have returned."""
        return sum(c.return_time - c.call_time for c in self.api_calls if c.return_time is not None)

    def declared_call_due(self) -> bool:
        """True when the current segment's tokens are generated and it ends in an API call."""
        seg = self.current_segment
        return seg is not None and seg.has_api_call and self.segment_generated >= seg.num_tokens
