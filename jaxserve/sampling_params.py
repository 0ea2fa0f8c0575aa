"""Sampling parameters of a request, validated at the edge (no JAX here, so
``import jaxserve`` and the simulator stay light)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jaxserve.constraints import StructuredOutput

# The engine step holds these in fixed-width arrays (``jaxserve.sampling.SamplingArrays``):
# top_k and step counts as int32, temperature/top_p as float32, seeds as uint32.
INT32_MAX = 2**31 - 1
MAX_TEMPERATURE = 100.0     # far above any useful value, far below float32's range
# A temperature below this samples greedily (vLLM's threshold): logits divided by a tiny one
# overflow float32 to inf (a logit of 20 over 2e-38), and the draw then took the first inf, not the best.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_LOGPROBS = 20           # alternatives per token (OpenAI's top_logprobs limit; one compiled variant)
MAX_PENALTY = 2.0           # presence/frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_BIAS = 100.0            # logit_bias values lie in [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS = 1024       # tokens one logit_bias may name
REPETITION_RANGE = (0.01, 10.0)   # repetition_penalty bounds: far past any useful value, far from 0 and inf


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` is greedy, as is any below 1e-5
    (``GREEDY_BELOW_TEMPERATURE``, vLLM's threshold). ``top_k <= 0``, ``top_p == 1`` and ``min_p
    == 0`` disable those filters (``min_p``: only tokens at least ``min_p`` times
    as likely as the likeliest are drawn, after temperature). ``seed`` makes sampling reproducible per request: the same
    seed gives the same draws whether the request runs alone or in a batch (from logits
    equal up to float rounding: docs/engine.md, "Sampling and seeds").
    ``max_tokens`` counts generated tokens only (not API-returned ones).
    ``structured`` constrains the output (JSON Schema, JSON object, forced tool
    call; see ``jaxserve.constraints``); a constraint that cannot be completed
    within ``max_tokens`` ends with ``finish_reason == "length"``.
    ``stop`` strings and stop tokens (EOS unless ``ignore_eos``, and
    ``stop_token_ids``) end the request with ``finish_reason == "stop"``; the
    text ends just before the stop string or token, or, with
    ``include_stop_str_in_output`` (vLLM's), just after it (a stop token's
    text only where ``skip_special_tokens`` keeps it: a special token such as
    EOS spells nothing then). The stop token's id is in the output ids either way.
    ``logprobs`` (None: off) keeps, for every generated token, its
    log-probability and the ``logprobs`` most likely tokens' (0 to
    ``MAX_LOGPROBS``) under the model's own distribution: the log-softmax of
    its logits, before temperature, top-k/top-p and any structured-output mask
    (``RequestOutput.logprobs``). ``prompt_logprobs`` (None: off) does the
    same for the prompt's tokens: each one's log-probability given the tokens
    before it and the ``prompt_logprobs`` most likely tokens' at its place
    (``RequestOutput.prompt_logprobs``; the first token has none). The prompt
    is then computed in full: what the prefix cache holds of it is not reused,
    as the cache keeps the KV of those tokens but not the logits.

    Logit adjustments, applied to the logits before temperature, top-k/top-p
    and any structured-output mask, in this order (transformers' and vLLM's):
    ``logit_bias`` (token id -> value added to its logit, each in [-100, 100],
    at most ``MAX_LOGIT_BIAS`` tokens); ``min_tokens``: the request's stop
    tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) cannot be
    sampled and its stop strings are not matched before ``min_tokens`` tokens
    are generated; ``repetition_penalty`` (transformers' and vLLM's, 1 = off):
    the logit of every token already in the context (prompt, generated and
    API-returned tokens) is divided by it when positive and multiplied by it
    otherwise; ``frequency_penalty`` and ``presence_penalty`` (OpenAI's, in
    [-2, 2]): each token's logit loses ``frequency_penalty`` times the number
    of times it was generated so far, and ``presence_penalty`` once if it was.
    Log-probabilities stay the model's own (before these adjustments).

    ``max_tool_calls`` (None: no limit; the Responses API's): server-side tool
    calls the request may run in all (a continuation resumed with a budget of its
    own, a new response, counts its own). A call past it is not run: the model gets
    an error result saying so (``RequestOutput.api_calls[i].error``) and goes
    on, so a model that keeps calling tools cannot loop forever. Calls run are
    counted: malformed calls (answered with an error) and client-side calls
    (which end the request's turn) are not.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tool_calls: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field. Every value that passes
        fits the step's arrays (int32, float32, uint32): nothing can overflow there."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not _is_int(self.max_tokens) or not 0 < self.max_tokens <= INT32_MAX:
            raise ValueError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be an integer in [-1, {INT32_MAX}] (0 or -1 disable it), "
                             f"got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if not isinstance(self.stop, (list, tuple)) or len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers in [0, {INT32_MAX}]")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        self._validate_adjustments()
        if self.max_tool_calls is not None and (not _is_int(self.max_tool_calls)
                                                or not 0 <= self.max_tool_calls <= INT32_MAX):
            raise ValueError(f"max_tool_calls must be None or an integer in [0, {INT32_MAX}], "
                             f"got {self.max_tool_calls!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError("structured must be a jaxserve.StructuredOutput")
            self.structured.validate()


    def _validate_adjustments(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        low, high = REPETITION_RANGE
        if not _is_real(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be a number in [{low:g}, {high:g}] (1 is off), "
                             f"got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids to numbers")
        for token, value in bias.items():
            if not _is_int(token) or not 0 <= token <= INT32_MAX:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not _is_real(value) or not -MAX_BIAS <= value <= MAX_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                 f"got {value!r} for token {token}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit adjustment is on (``logit_bias``, ``min_tokens``, penalties)."""
        return bool(self.min_tokens or self.repetition_penalty != 1.0 or self.presence_penalty
                    or self.frequency_penalty or (self.logit_bias and any(self.logit_bias.values())))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    """A finite int or float (not a bool, NaN or infinity)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
