"""What the engine hands back: per-request outputs and declared API calls."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ApiCall:
    """A declared API call: after ``after_tokens`` generated tokens (counted from
    the start of the request), call an API of type ``api_type`` that takes
    ``duration_s`` seconds and appends ``returned_token_ids`` to the context."""

    after_tokens: int
    duration_s: float = 0.0
    returned_token_ids: tuple[int, ...] | list[int] = ()
    api_type: str = "api"

    def __post_init__(self) -> None:
        if not isinstance(self.after_tokens, int) or self.after_tokens < 1:
            raise ValueError(f"ApiCall.after_tokens must be an integer >= 1, got {self.after_tokens!r}")
        if not isinstance(self.duration_s, (int, float)) or not 0 <= self.duration_s < math.inf:
            raise ValueError(f"ApiCall.duration_s must be a finite number >= 0, got {self.duration_s!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.returned_token_ids):
            raise ValueError("ApiCall.returned_token_ids must be non-negative integers")


@dataclass
class ApiCallOutput:
    """How one API call went: handling used and timings (seconds, engine clock)."""

    api_type: str
    handling: str
    call_time: float
    return_time: float | None
    resume_time: float | None
    context_tokens: int
    returned_tokens: int
    fell_back_from: str | None = None
    name: str | None = None        # tool name for parsed calls (the first, when the turn had several)
    arguments: str | None = None   # JSON arguments for parsed calls (the first's)
    tool_calls: list[dict] = field(default_factory=list)   # every parsed call of the turn: {"name", "arguments"}
    error: str | None = None
    truncated: bool = False        # the result was cut to fit (jaxserve.tools.truncate_tool_result)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One token's log-probability (natural log, under the model's own
    distribution given the tokens before it: ``SamplingParams.logprobs`` for a
    generated token, ``prompt_logprobs`` for a prompt token) and ``top``: the most
    likely tokens at its place ``(token id, log-probability)``, most likely first
    (as many as asked; ties in the order the device's top-k gives)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """Cumulative state of one request, plus what is new since the last output.

    ``token_ids`` are generated ids only (API-returned tokens go into the
    context, not here). ``finish_reason`` is "stop", "length", "abort",
    "tool_calls" (paused on client-side tool calls, ``tool_calls``, in
    call order; resume with their results via ``resume``), "error" (the
    engine failed this request alone, ``error`` says why; ``AsyncEngine``
    raises it to the caller) or None while running. ``num_cached_tokens``: prompt tokens
    whose KV came from the prefix cache when the request was first scheduled
    (whole pages). ``logprobs``: with ``SamplingParams.logprobs``, one
    ``TokenLogprob`` per entry of ``token_ids`` (else None). ``prompt_logprobs``:
    with ``SamplingParams.prompt_logprobs``, one entry per prompt token, ``None``
    for the first (nothing precedes it) and a ``TokenLogprob`` for each other,
    from the first output after the whole prompt was computed (None before; the
    same list in every output, not copied: it never changes once complete).
    With a reasoning parser (``EngineConfig.reasoning_parser``) ``text`` is the
    answer and ``reasoning`` the thinking written before it, tags left out
    (``jaxserve.reasoning``); otherwise ``reasoning`` is empty and ``text`` all.
    ``metrics``: on the final output the request's timings (seconds on the
    engine's clock) and counts; on the first output with tokens its
    ``arrival_time`` and ``first_scheduled_time`` (its queue time, for a caller
    that stops reading before the end); otherwise empty.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    finish_reason: str | None = None
    api_calls: list[ApiCallOutput] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)   # {"name", "arguments"} each, with "tool_calls"
    reasoning: str = ""                # with a reasoning parser: the thinking (``text`` is then the answer)
    delta_reasoning: str = ""
    num_reasoning_tokens: int = 0      # of ``token_ids``, those of the reasoning (since a ``resume`` with max_tokens)
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    num_cached_tokens: int = 0         # prompt tokens whose KV came from the prefix cache
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tool_call(self) -> dict | None:
        """The first of ``tool_calls`` (None without any): the call, when the turn had one."""
        return self.tool_calls[0] if self.tool_calls else None
