"""``LLMEngine``: the real engine's front end over ``EngineCore``.

It loads the model, the tokenizer and the tools, turns prompts into
``Request`` records, applies the rules that need text (stop strings, parsed
tool calls, tool-result wrapping) to the core's events, and turns requests
into ``RequestOutput``s. The step itself is ``EngineCore.step`` (DESIGN
section 3); ``LLM``, ``AsyncEngine`` and the real-engine replay drive it
through ``EngineCore.run``.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import zlib
from pathlib import Path

import jax
import numpy as np

import kernels
from jaxserve.api_calls import ApiCalls, ApiResult, ToolOutput
from jaxserve.compilation_cache import enable_compilation_cache
from jaxserve.config import EngineConfig, read_chat_template
from jaxserve.core import Clock, EngineCore, EngineStats, WallClock
from jaxserve.detokenizer import DETOKENIZER_CONTEXT, IncrementalDetokenizer
from jaxserve.logit_adjust import LogitAdjuster
from jaxserve.executor.model import (ModelExecutor, ModelExecutorConfig, claim_memory_share, cuda_graphs_for,
                                     kv_pool_pages, min_token_bucket_for)
from jaxserve.model_source import load_tokenizer, resolve_model
from jaxserve.outputs import ApiCall, ApiCallOutput, RequestOutput
from jaxserve.parallel.multihost import PER_PROCESS, check_same_settings, init_distributed, tensor_parallel_mesh
from jaxserve.parallel.protocol import executor_class
from jaxserve.predictor.serving import LengthProbeHook, learned_checkpoint
from jaxserve.profiles import default_cost_model
from jaxserve.reasoning import REASONING_TURN_SEPARATOR, ReasoningFormat, ReasoningSplit, get_reasoning_format
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import RequestGrammar, StructuredDecoding
from jaxserve.tool_format import select_format
from jaxserve.tools import (LONE_SURROGATE, MAX_TOOL_RESULT_TOKENS, ResultEncoder, Tool, normalize_tools,
                            truncate_tool_result)
from jaxserve.weights import load_model, parse_dtype, read_config
from scheduler import (EventKind, Handling, PageAllocator, Request, RequestEvent, RequestState, Scheduler,
                       SchedulerConfig, Segment, make_policy, make_predictor)

log = logging.getLogger("jaxserve")





def _check_priority(priority) -> None:
    """A request's priority class must be an integer (``ValueError`` naming it)."""
    if not isinstance(priority, (int, np.integer)) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer (lower is served first), got {priority!r}")

class LLMEngine:
    """The real engine: a model, a tokenizer and tools over an ``EngineCore``.

    Settings come from ``config`` (an ``EngineConfig``; default: the defaults)
    with keyword ``overrides`` of its fields (``model`` may be given first,
    positionally). ``tools`` registers server-side tools for parsed calls
    (name -> callable or ``Tool``); ``clock`` replaces the wall clock (tests).
    The engine is the core's front end: it turns text into requests, applies
    stop strings and parsed tool calls to the core's token events, tokenizes
    tool results, and turns requests into ``RequestOutput``s.
    """

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, *,
                 tools: dict | list | None = None, clock: Clock | None = None, **overrides) -> None:
        if model is not None:
            overrides["model"] = str(model)
        self.config = config = EngineConfig.build(config, **overrides)
        self.tools: dict[str, Tool] = normalize_tools(tools)
        init_distributed(config)   # multi-host: before anything starts JAX's backends
        if config.compilation_cache:
            enable_compilation_cache(config.compilation_cache_max_gb)
        self.model_dir = resolve_model(config.model)
        attention_impl = config.attention_impl or self._default_attention_impl(config)
        interpret = config.interpret
        if interpret is None:
            interpret = attention_impl != "reference" and jax.default_backend() == "cpu"
        dt = parse_dtype(config.dtype)
        self.mesh = tensor_parallel_mesh(config, self.model_dir)
        checkpoint_cfg = read_config(self.model_dir)   # (the model as its files hold it; the shards' view below)
        check_same_settings({**{k: v for k, v in dataclasses.asdict(config).items() if k not in PER_PROCESS},
                             "checkpoint": checkpoint_cfg})   # (its repr leaves the raw config.json out)
        # This engine's share of the accelerator's memory, checked free before its weights take any.
        in_use_before = None if config.num_pages else claim_memory_share(config.gpu_memory_utilization, self.mesh)
        model_obj, self.model_config = load_model(self.model_dir, config.dtype, attention_impl,
                                                  config.load_format, config.seed, mesh=self.mesh)
        cfg = self.model_config
        # --predictor learned:DIR: the length probe, checked against this model before anything starts.
        probe_dir = learned_checkpoint(config.predictor)
        length_probe = LengthProbeHook(probe_dir, model_obj, checkpoint_cfg, config.model) if probe_dir else None
        if config.max_model_len and config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        num_pages = config.num_pages or kv_pool_pages(cfg, config.page_size, dt, self.max_model_len,
                                                       config.max_num_seqs, config.gpu_memory_utilization,
                                                       in_use_before, mesh=self.mesh)
        if num_pages * config.page_size < self.max_model_len:
            log.warning("the KV pool holds %d tokens, less than max_model_len=%d: a context may reach %d tokens "
                        "(raise num_pages or gpu_memory_utilization, or lower max_model_len)",
                        num_pages * config.page_size, self.max_model_len, num_pages * config.page_size)
        batched = config.batched_tokens
        sched_cfg = SchedulerConfig(max_num_batched_tokens=batched, max_num_seqs=config.max_num_seqs,
                                    swap_budget_tokens=config.swap_budget_tokens or max(config.page_size, batched),
                                    handling=Handling.parse(config.handling), max_model_len=self.max_model_len,
                                    enable_prefix_caching=config.enable_prefix_caching,
                                    prefix_cache_key=f"{self.model_dir.resolve()}|{config.dtype}|"
                                                     f"{config.load_format}|{config.seed}",
                                    prefix_retention_s=float(config.prefix_retention_s),
                                    priority_aging_s=None if config.priority_aging_s is None
                                    else float(config.priority_aging_s),
                                    # the host tier's copies are not on the multi-host wire
                                    host_cache=config.num_processes == 1)
        predictor = make_predictor(config.predictor, config.seed)
        if length_probe is not None:
            predictor.default_len = length_probe.train_mean_tokens
        policy = make_policy(config.policy, predictor=predictor, **config.policy_options)
        # A dynamic token budget with beta_high > 1 may batch more than max_num_batched_tokens:
        # the executor's token buckets go up to the most it can ask for.
        step_tokens = max(batched, policy.max_step_tokens(batched))
        host_pages = num_pages if config.num_host_pages is None else config.num_host_pages
        # (sized per process from its own device memory: a worker's pools must be process 0's)
        check_same_settings({"num_pages": num_pages, "host_pages": host_pages, "step_tokens": step_tokens})
        executor = executor_class()(model_obj, cfg, ModelExecutorConfig(
            page_size=config.page_size, num_pages=num_pages, max_num_batched_tokens=step_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len, kv_dtype=dt,
            attention_impl=attention_impl, interpret=interpret, keep_logits=config.keep_logits,
            min_token_bucket=min_token_bucket_for(jax.default_backend()),
            cuda_graphs=cuda_graphs_for(jax.devices()[0], config.cuda_graphs)),
            length_probe=length_probe, mesh=self.mesh)
        self.cost = default_cost_model(config.cost_profile, executor.kv_bytes_per_token, batched)
        scheduler = Scheduler(sched_cfg, policy, PageAllocator(num_pages, config.page_size, "device"),
                              PageAllocator(host_pages, config.page_size, "host"), self.cost)
        self.tokenizer = load_tokenizer(self.model_dir)
        if config.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("chat_template: this model has no tokenizer to render chats with")
            self.tokenizer.chat_template = read_chat_template(config.chat_template)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_format = select_format(config.tool_call_parser, template)
        # Tool results as context tokens, never as control: control tokens are every special token and
        # the added tokens the chat template and the tool format write as markup.
        self.result_encoder = None if self.tokenizer is None else ResultEncoder(self.tokenizer, "".join(
            [template or "", self.tool_format.wrap_results(["", ""], template), *self.tool_format.template_markers,
             self.tool_format.call_opener or ""]))
        self.reasoning_format = None if config.reasoning_parser is None else get_reasoning_format(config.reasoning_parser)
        # Structured output: the executor asks it for the token bitmask of constrained rows.
        self.structured = StructuredDecoding(self.tokenizer, cfg.vocab_size, self._turn_end_ids(),
                                             self.tool_format) if self.tokenizer is not None else None
        executor.constraints = self.structured
        self.core = EngineCore(scheduler, executor, clock or WallClock(), frontend=self,
                               check_invariants=config.check_invariants)
        self._ids = itertools.count()
        if config.warmup:
            executor.warmup(swap_pages=max(1, sched_cfg.swap_budget_tokens // config.page_size),
                            all_shapes=config.warmup_all_shapes)
        if hasattr(executor, "start_broadcasting"):   # process 0 of several: workers follow from here
            executor.start_broadcasting()

    # ------------------------------------------------------------- parts
    def _default_attention_impl(self, config: EngineConfig) -> str:
        """The device's attention kernel for this checkpoint's cache dtype, head_dim and GQA
        group at ``config.page_size`` (a kernel that cannot tile them falls back, logged)."""
        shape = read_config(self.model_dir)
        group = shape.num_attention_heads // shape.num_key_value_heads
        return kernels.default_impl(parse_dtype(config.dtype), (shape.head_dim, config.page_size, group))

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def executor(self) -> ModelExecutor:
        return self.core.executor

    @property
    def api(self) -> ApiCalls:
        return self.core.api

    @property
    def clock(self) -> Clock:
        return self.core.clock

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    @property
    def context_limit(self) -> int:
        """Tokens a context may reach (``max_model_len`` capped by the page pool)."""
        return self.scheduler.context_limit

    @property
    def failure(self) -> str | None:
        """Why the engine cannot step (a lost worker process of the mesh); None when it can."""
        return getattr(self.executor, "failure", None)

    @property
    def last_logits(self):
        """float32 ``[rows, vocab]`` logits of the last step (with ``keep_logits``)."""
        return self.executor.last_logits

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str | None = None, prompt: str | None = None,
                    sampling_params: SamplingParams | None = None, prompt_token_ids: list[int] | None = None,
                    api_calls: list[ApiCall] | None = None, parse_tool_calls: bool | None = None,
                    arrival_time: float | None = None, predictions: dict | None = None,
                    parse_reasoning: bool | None = None, priority: int = 0) -> str:
        """Queue a request; returns its id. Bad input is a ``ValueError`` naming
        the field, and nothing is queued. ``parse_reasoning`` (None: whenever the
        engine has a ``reasoning_parser``): split its reasoning from its answer.
        ``priority``: its class, lower first (admitted before any higher class,
        preempted after; the policy ranks requests within a class)."""
        request = self.make_request(request_id, prompt, sampling_params, prompt_token_ids, api_calls,
                                    parse_tool_calls, arrival_time, predictions, parse_reasoning, priority)
        self.core.add(request)
        return request.request_id

    def make_request(self, request_id: str | None = None, prompt: str | None = None,
                     sampling_params: SamplingParams | None = None, prompt_token_ids: list[int] | None = None,
                     api_calls: list[ApiCall] | None = None, parse_tool_calls: bool | None = None,
                     arrival_time: float | None = None, predictions: dict | None = None,
                     parse_reasoning: bool | None = None, priority: int = 0) -> Request:
        """The validated ``Request`` record for these inputs, not yet queued
        (``add_request`` queues it; a replay hands records to ``core.run``)."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a jaxserve.SamplingParams, got {type(sampling_params).__name__}")
        _check_priority(priority)
        # The request's own copy: a caller that changes (or breaks) its object for the next request
        # must not change this one, whose settings every step reads again.
        params = copy.deepcopy(sampling_params) if sampling_params is not None else SamplingParams()
        params.validate()
        ids = self._prompt_ids(prompt, prompt_token_ids)
        if api_calls is not None and not isinstance(api_calls, (list, tuple)) \
                or any(not isinstance(c, ApiCall) for c in api_calls or []):
            raise ValueError("api_calls must be a list of jaxserve.ApiCall")
        calls = sorted(api_calls or [], key=lambda c: c.after_tokens)
        for c in calls:
            self._check_token_ids(c.returned_token_ids, "api_calls: returned_token_ids")
            if c.after_tokens > params.max_tokens:
                raise ValueError(f"api_calls: after_tokens={c.after_tokens} must be <= max_tokens={params.max_tokens}")
        if len({c.after_tokens for c in calls}) != len(calls):
            raise ValueError("api_calls: two calls have the same after_tokens")
        returned = sum(len(c.returned_token_ids) for c in calls)
        total = len(ids) + params.max_tokens + returned
        if total > self.max_model_len:
            field_name = "prompt" if len(ids) >= self.max_model_len else "max_tokens"
            raise ValueError(f"{field_name}: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens})"
                             f"{f' + API-returned ({returned})' if returned else ''} = {total} exceeds the "
                             f"context window max_model_len={self.max_model_len}")
        pool = self.scheduler.device_pool
        if pool.pages_for_tokens(total) > pool.num_pages:
            raise ValueError(f"prompt: this request needs {pool.pages_for_tokens(total)} KV pages but the pool has "
                             f"only {pool.num_pages}; raise num_pages or lower max_tokens")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        segments, done = [], 0
        for c in calls:
            segments.append(Segment(c.after_tokens - done, c.api_type, float(c.duration_s),
                                    len(c.returned_token_ids), tuple(int(t) for t in c.returned_token_ids)))
            done = c.after_tokens
        if segments and done < params.max_tokens:
            segments.append(Segment(params.max_tokens - done))
        # A call at after_tokens == max_tokens is the request's last step: it ends when the call returns.
        now = self.clock.now()
        parse = bool(self.tools) if parse_tool_calls is None else parse_tool_calls
        inside = self._opens_inside(ids, parse_reasoning)
        # A turn not known to open inside the reasoning (Qwen3's) may think before a constrained answer.
        grammar = self._start_grammar(params, self.reasoning_format if inside is False else None)
        if grammar is not None:   # a forced call must be parsed; markup inside JSON strings must not be
            parse = params.structured.kind == "tool_call"
        seed = params.seed if params.seed is not None else \
            (self.config.seed * 1_000_003 + zlib.crc32(request_id.encode())) % 2**32
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) is not None and self.config.num_processes > 1:
                raise ValueError(f"{name}: not supported across hosts (num_processes={self.config.num_processes}) yet")
        vocab = self.model_config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias: its keys must be token ids in [0, {vocab}), got {max(params.logit_bias)}")
        if params.adjusts_logits and self.config.num_processes > 1:   # (a second sampling program, not broadcast)
            raise ValueError(f"logit_bias, min_tokens and penalties: not supported across hosts "
                             f"(num_processes={self.config.num_processes}) yet")
        stop_ids = self._stop_ids(params)
        if grammar is not None and grammar.ends_with_eos:
            stop_ids -= self.eos_token_ids   # its EOS ends the turn of calls (a pause), not the request
        request = Request(
            request_id, arrival_time if arrival_time is not None else now, prompt_len=len(ids),
            max_tokens=params.max_tokens, segments=segments, ignore_eos=params.ignore_eos,
            priority=int(priority), predictions=dict(predictions or {}), token_ids=list(ids),
            stop_token_ids=frozenset(stop_ids),
            sampling_params=params, seed=seed, logprobs=None if params.logprobs is None else [],
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                                params.include_stop_str_in_output, context=ids[-DETOKENIZER_CONTEXT:])
            if self.tokenizer is not None else None,
            tool_parser=self.tool_format.parser() if parse and self.tokenizer else None, grammar=grammar,
            length_after_frontend=parse and self.tokenizer is not None,
            reasoning=self._reasoning_split(inside, grammar),
            logit_adjuster=LogitAdjuster(params, frozenset(stop_ids)) if params.adjusts_logits else None)
        return request

    def _opens_inside(self, ids: list[int], parse_reasoning: bool | None) -> bool | None:
        """Whether the first turn of a request of prompt ``ids`` starts inside the reasoning
        (the format says so, or the prompt ends with its start tag); None when its
        reasoning is not split (not asked, no parser or no tokenizer)."""
        fmt = self.reasoning_format
        if fmt is None or parse_reasoning is False or self.tokenizer is None:
            return None
        return fmt.opens_inside or self._ends_with_think(ids)

    def _reasoning_split(self, inside: bool | None, grammar: RequestGrammar | None) -> ReasoningSplit | None:
        """The reasoning split of a request whose first turn opens ``inside`` the reasoning
        (``_opens_inside``; None: no split). With a grammar: one that lets the turn open
        with its reasoning (``thinks_first``: JSON, regex and choice answers) constrains it
        all, the reasoning split out as without a grammar; a ``response_format`` one sleeps
        while a turn known to open inside reasons, and constrains the answer after it (as
        vLLM's); otherwise (a forced tool call, a Lark grammar) the grammar constrains the
        text from its first token, and there is no reasoning to split."""
        if inside is None:
            return None
        if grammar is not None and not grammar.thinks_first:
            if grammar.forced_call or not inside:
                return None
            grammar.sleep()
        return ReasoningSplit(self.reasoning_format, inside)

    def _ends_with_think(self, ids: list[int]) -> bool:
        """Whether context ``ids`` end with the reasoning format's start tag (and newlines):
        the chat template opened the reasoning (DeepSeek-R1's, QwQ's), so the turn that
        follows starts inside it."""
        tail = self.tokenizer.decode(ids[-8:], skip_special_tokens=False) if ids else ""
        return tail.rstrip("\n").endswith(self.reasoning_format.start)

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)

    def _start_grammar(self, params: SamplingParams, reasoning: ReasoningFormat | None = None
                       ) -> RequestGrammar | None:
        if params.structured is None:
            return None
        if self.structured is None:
            raise ValueError(f"{params.structured.param}: structured output needs a model with a tokenizer")
        if self.config.num_processes > 1:
            # The masked sampler is a second program the multi-host protocol does not broadcast yet.
            raise ValueError(f"{params.structured.param}: structured output is not supported across hosts "
                             f"(num_processes={self.config.num_processes}) yet")
        return self.structured.start(params.structured, reasoning)

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("prompt: give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt_token_ids, (str, bytes, dict)) or not hasattr(prompt_token_ids, "__iter__"):
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(prompt_token_ids).__name__}")
        else:
            ids = list(prompt_token_ids)
        if not ids or (prompt is not None and not prompt):
            raise ValueError("prompt must not be empty")
        self._check_token_ids(ids, "prompt_token_ids")
        return [int(t) for t in ids]

    def _check_token_ids(self, ids, field_name: str) -> None:
        vocab = self.model_config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"{field_name} must be integers in [0, {vocab})")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a live request (frees its pages); ``None`` if unknown or already ended."""
        request = self.core.abort(request_id)
        return None if request is None else self.outputs([request])[0]

    def resume(self, request_id: str, token_ids: list[int] | None = None, text: str | list[str] | None = None,
               max_tokens: int | None = None, priority: int | None = None) -> None:
        """Return the result of the external (client-side) calls the request is paused on:
        context ``token_ids``, or ``text`` (one string, or one per call of the turn, in call
        order, each wrapped as its own tool turn). ``max_tokens``: a fresh budget of
        generated tokens for the continuation, a new turn: ``min_tokens`` and the presence and
        frequency penalties count from here, as for a new request whose prompt holds the
        context (None: keep the rest, the same turn; a ``ValueError`` when the call used the
        last token of the budget). ``priority``: the continuation's class (None: the request's)."""
        if (token_ids is None) == (text is None):
            raise ValueError("resume: give exactly one of token_ids or text")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if priority is not None:
            _check_priority(priority)
        request = self.scheduler.requests.get(request_id)
        if request is None or not self.api.is_waiting_external(request_id):
            raise KeyError(f"request {request_id!r} is not paused on an external API call")
        # Everything is checked before anything changes: a refused resume leaves the request as it was.
        if token_ids is not None:
            token_ids = list(token_ids)
            self._check_token_ids(token_ids, "token_ids")
        elif not (isinstance(text, str) or (isinstance(text, list) and text and all(isinstance(t, str) for t in text))):
            raise ValueError("text must be a string or a non-empty list of strings")
        elif isinstance(text, list) and request.pending_tool_calls and len(text) != len(request.pending_tool_calls):
            raise ValueError(f"text: {len(text)} results for the {len(request.pending_tool_calls)} call(s) of "
                             "the turn (one per call, in call order; or one string for them all)")
        if text is not None:
            room, wrapper = self._results_room(request, len(text) if isinstance(text, list) else 1)
            if room < wrapper:
                raise ValueError(f"text: the context window has {max(0, room)} token(s) left, fewer than the "
                                 f"{wrapper} of the results' tool turn with nothing in it; abort the request")
        if max_tokens is None and request.num_generated >= request.max_tokens:
            raise ValueError(f"max_tokens: the call was made with the last of the request's {request.max_tokens} "
                             "tokens; give the continuation a budget of its own (resume(..., max_tokens=N))")
        params = None
        if max_tokens is not None:   # a new turn: min_tokens and presence/frequency count from here
            params = dataclasses.replace(   # (validates; a shorter budget ends it first: length)
                request.sampling_params, max_tokens=request.num_generated + max_tokens,
                min_tokens=min(request.sampling_params.min_tokens, max_tokens))
        if token_ids is not None and request.reasoning is not None and self._ends_with_think(token_ids):
            request.reasoning.reopen_inside()   # the client's template opened the next turn's reasoning
        if params is not None:
            request.sampling_params, request.max_tokens = params, params.max_tokens
            request.turn_start = request.num_generated
            request.tool_calls_run = 0   # (``max_tool_calls`` caps a response's calls: this is a new one)
            if request.logit_adjuster is not None:
                request.logit_adjuster.new_turn(request.num_generated)
            if request.reasoning is not None:   # counted and shown per continuation, as its tokens are
                request.reasoning.new_continuation()
                if request.reported_reasoning:   # (the blank line before the next turn's reasoning is not shown)
                    request.reported_reasoning += len(REASONING_TURN_SEPARATOR)
        if priority is not None:
            self.scheduler.set_priority(request, int(priority))
        self.api.resume(request_id, token_ids=token_ids, text=text)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def is_live(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for each request that changed."""
        return self.outputs(self.core.step())

    def outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """One output per distinct request of ``requests`` (in first-seen order). Building
        one that raises (a text-handling defect) fails that request alone: its output is
        an "error" one and every other request goes on."""
        seen: dict[str, Request] = {}
        for r in requests:
            seen.setdefault(r.request_id, r)
        outs = []
        for r in seen.values():
            try:
                outs.append(self._output(r))
            except Exception as e:  # noqa: BLE001 - one request's output defect fails that request only
                self.core.fail(r, e)
                outs.append(RequestOutput(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                                          token_ids=list(r.output_token_ids), text="", finish_reason=r.finish_reason,
                                          error=r.error))
        return outs

    # ------------------------------------------------- frontend (EngineCore)
    def on_event(self, event: RequestEvent, now: float) -> None:
        """Text-level rules for a request that produced a token: stop strings,
        then parsed tool calls (the core already applied stop ids, declared
        calls and length)."""
        request = event.request
        token = request.output_token_ids[-1]
        stop_token = request.finish_reason == "stop" and token in request.stop_token_ids
        grammar = request.grammar
        if stop_token and grammar is not None and grammar.active and grammar.matcher.is_error():
            # The grammar reached a dead end (no text continues it: its mask for this token erred,
            # and llguidance then allows only a stop token): the answer is unfinished, not complete.
            self.core.relabel(request, "length")
        if request.detokenizer is None or (stop_token and not request.detokenizer.include_stop):
            return
        adjuster = request.logit_adjuster
        delta, hit_stop = request.detokenizer.add(token, adjuster is None or not adjuster.holds_stops(request.num_generated))
        split = request.reasoning
        if split is not None:
            split.on_token(request.detokenizer.text)
        if hit_stop:
            self.core.finish(request, "stop")   # (a stop string completed by the last allowed token: see finish)
            return
        if stop_token:
            return   # (its text is in the output: include_stop_str_in_output)
        if grammar is not None and not request.is_finished \
                and (reason := grammar.accept(token, request.max_tokens - request.num_generated)) is not None:
            self.core.finish(request, reason)
            return
        if grammar is not None and grammar.dormant and split.in_answer:
            grammar.wake()   # this token ended the reasoning: the answer's tokens are constrained
            # A text end tag may end inside a token that goes on into the answer (``>"`` closes
            # ``</think>`` and opens a JSON string): the grammar takes that text first, as tokens
            # spelling exactly it (greedy over the vocabulary: a SentencePiece ``encode`` would add a
            # leading space; llguidance takes any tokenization of an allowed text).
            carried = split.answer_text(request.detokenizer.text)
            for t in self.structured.llg_tokenizer.greedy_tokenize(carried) if carried else ():
                if (reason := grammar.accept(t, request.max_tokens - request.num_generated)) is not None:
                    self.core.finish(request, reason)
                    return
        last = event.kind is EventKind.LAST_TOKEN   # (max_tokens reached: ends at "length" unless a call pauses it)
        if not (event.kind is EventKind.TOKEN or last) or request.tool_parser is None:
            return
        if split is not None:
            delta = split.take_content(request.detokenizer.text)   # (markup inside the reasoning is no call)
        calls = request.tool_parser.feed(delta) if delta else []
        if grammar is not None and grammar.forced_call and (grammar.active or grammar.turn_complete):
            # A forced turn of calls: pause on all of them once the grammar says the turn is complete
            # (it closes the turn itself before a call that would not fit in the rest of max_tokens).
            grammar.calls.extend(calls)
            if not grammar.turn_complete:
                return
            grammar.turn_complete = False
            calls, grammar.calls = grammar.calls, []
            request.stop_token_ids = frozenset(self._stop_ids(request.sampling_params))
            if request.logit_adjuster is not None:
                request.logit_adjuster.set_stop_ids(request.stop_token_ids, request.num_generated)
        if calls and self._has_client_call(calls):
            self._pause_for_tools(request, calls, now)
        elif calls and not last:
            room, wrapper = self._results_room(request, len(calls))
            if room < wrapper:   # (no closed tool turn and a token after it fit: the tools are not run)
                self.core.finish(request, "length")
            else:
                self._pause_for_tools(request, calls, now)
        # (a turn of server-side calls at the last allowed token ends: no token is left to answer them)

    def _has_client_call(self, calls: list) -> bool:
        """Whether a turn of parsed calls names a client-side tool (the caller answers it)."""
        return any(c.name and c.name not in self.tools for c in calls)

    def _pause_for_tools(self, request: Request, calls: list, now: float) -> None:
        """Pause ``request`` on the calls of one turn (``ParsedToolCall``, in order). If
        any names a client-side tool, the caller gets every well-formed call of the turn
        (``pending_tool_calls``) and answers with ``resume``; otherwise the server-side
        tools run at once and their results (a malformed call's error among them) come
        back together, in call order. An optional-calls grammar (``allowed_tools``) ends
        with the turn, or starts over for the turn after the server's results."""
        external = self._has_client_call(calls)
        grammar = request.grammar
        if grammar is not None and grammar.optional_calls:   # (allowed tools, mode auto)
            if external:
                grammar.active = False   # the caller's results open a new response: free, as after a forced turn
            else:
                grammar.rearm()          # the turn after the server's results is held to the allowed tools too
        if external:
            self.scheduler.pause(request, now, "external", None)
            request.pending_tool_calls = [{"name": c.name, "arguments": c.arguments} for c in calls if c.name]
            self.api.expect_external(request.request_id)
        else:
            tools = [self.tools.get(c.name) for c in calls]
            self.scheduler.pause(request, now, next((t.api_type for t in tools if t), "invalid"), None)
            self.api.call_tools(request.request_id, [self._tool_job(request, tool, c) for tool, c in zip(tools, calls)],
                                now)
        if request.reasoning is not None:   # the turn after the results may think again
            request.reasoning.new_turn(len(request.detokenizer.text))
        record = request.api_calls[-1]
        record.name, record.arguments = calls[0].name, calls[0].arguments
        record.tool_calls = [{"name": c.name, "arguments": c.arguments} for c in calls]

    @staticmethod
    def _tool_job(request: Request, tool: Tool | None, call) -> tuple[Tool, str] | ToolOutput:
        """What ``ApiCalls.call_tools`` does for one server-side ``call`` (``tool``: the
        registered tool it names, None: malformed): run it, or answer with an error: a
        malformed call, or one past ``SamplingParams.max_tool_calls`` (the calls run so
        far are counted; malformed and refused ones are not)."""
        if tool is None:
            return ToolOutput(error=f"malformed tool call: {call.arguments[:200]}")
        limit = request.sampling_params.max_tool_calls
        if limit is not None and request.tool_calls_run >= limit:
            return ToolOutput(error=f"not run: this request may run {limit} tool calls in all (max_tool_calls); "
                                    "answer without calling tools")
        request.tool_calls_run += 1
        return tool, call.arguments

    def _turn_end_ids(self) -> set[int]:
        """The EOS ids a grammar may end on: the end-of-turn token the chat template writes
        after an assistant message (the first token of a tool turn's wrapper) when it is one
        of the model's EOS ids, so a forced call's context re-renders token for token and a
        client's follow-up resumes it; else every EOS id."""
        template = getattr(self.tokenizer, "chat_template", None)
        wrapper = self.tokenizer.encode(self.tool_format.wrap_results([""], template), add_special_tokens=False)
        return {wrapper[0]} if wrapper and wrapper[0] in self.eos_token_ids else self.eos_token_ids

    def _results_room(self, request: Request, num_results: int) -> tuple[int, int]:
        """``(room, wrapper)``: the context tokens left for the results of ``num_results``
        calls (a token to sample after them kept), and the tokens of their tool turn's
        wrapper alone (empty results)."""
        template = getattr(self.tokenizer, "chat_template", None)
        wrapper = len(self.tokenizer.encode(self.tool_format.wrap_results([""] * num_results, template),
                                            add_special_tokens=False)) if self.tokenizer is not None else 0
        return self.context_limit - request.num_tokens - 1, wrapper

    def result_token_ids(self, request: Request, result: ApiResult) -> list[int]:
        """Tool outputs of one turn as context tokens, wrapped the way the chat template
        shows tool turns, in call order; an output over ``MAX_TOOL_RESULT_TOKENS`` (or over
        its equal share of the room left in the context) is cut inside the wrapper, and the
        call is marked ``truncated``. When the model ended its turn with EOS (a parallel turn of
        calls), the wrapper's own leading end-of-turn token is left out."""
        if self.tokenizer is None:
            return []
        outputs = result.outputs
        template = getattr(self.tokenizer, "chat_template", None)
        fmt = self.tool_format
        results = self.result_encoder
        room, wrapper = self._results_room(request, len(outputs))
        limit = min(MAX_TOOL_RESULT_TOKENS, (room - wrapper) // len(outputs) - 2)   # 2: merges across the seams
        texts = [LONE_SURROGATE.sub("\ufffd", f"error: {out.error}" if out.error is not None else (out.text or ""))
                 for out in outputs]   # (lone surrogates: ``errors="surrogateescape"`` text no tokenizer encodes)
        while True:
            kept = [truncate_tool_result(text, limit, self.tokenizer, out.full_chars if out.error is None else None,
                                         results.encode_text) for text, out in zip(texts, outputs)]
            ids = results.encode(fmt.wrap_results([k for k, _ in kept], template),
                                 fmt.result_spans([k for k, _ in kept], template))
            if ids and ids[0] in self.eos_token_ids and request.token_ids and request.token_ids[-1] in self.eos_token_ids:
                ids = ids[1:]
            if len(ids) <= room or limit <= 0:
                break
            limit -= -(-(len(ids) - room) // len(outputs))   # (the seams merged otherwise than the margin allowed)
        for (_, truncated), text, out in zip(kept, texts, outputs):
            if truncated:
                request.api_calls[-1].truncated = True
                log.info("tool result cut to %d tokens (%d characters in full)", limit,
                         (out.full_chars if out.error is None else None) or len(text))
        return ids

    # -------------------------------------------------------------- outputs
    def _output(self, request: Request) -> RequestOutput:
        generated = request.output_token_ids
        tool_calls = request.pending_tool_calls
        reason = request.finish_reason if request.is_finished else ("tool_calls" if tool_calls else None)
        final = reason is not None
        detokenizer = request.detokenizer
        text = "" if detokenizer is None else detokenizer.text if final else \
            detokenizer.text[:max(detokenizer.releasable(), request.reported_text)]   # held: may start a stop string
        new_ids = generated[request.reported_tokens:]
        new_text = text[request.reported_text:]
        request.reported_tokens, request.reported_text = len(generated), len(text)
        reasoning = new_reasoning = ""
        split = request.reasoning
        if split is not None:   # the answer and the reasoning of the text released so far
            if final:
                split.finish(detokenizer.text)
            reasoning = split.reasoning(detokenizer.text, len(text), final)
            text = split.content(detokenizer.text, len(text), final)
            new_text, new_reasoning = text[request.reported_content:], reasoning[request.reported_reasoning:]
            request.reported_content, request.reported_reasoning = len(text), len(reasoning)
        scored = request.prompt_logprobs
        calls = [ApiCallOutput(
            api_type=rec.api_type, handling=rec.handling.value, call_time=rec.call_time,
            return_time=rec.return_time, resume_time=rec.resume_time, context_tokens=rec.context_tokens,
            returned_tokens=rec.num_returned_tokens,
            fell_back_from=rec.fell_back_from.value if rec.fell_back_from else None,
            name=rec.name, arguments=rec.arguments, tool_calls=[dict(c) for c in rec.tool_calls], error=rec.error,
            truncated=rec.truncated)
            for rec in request.api_calls]
        if final:
            metrics = {
                "arrival_time": request.arrival_time, "first_scheduled_time": request.first_scheduled_time,
                "first_token_time": request.first_token_time, "finish_time": request.finish_time,
                "num_preemptions": request.num_preemptions, "prompt_tokens": request.prompt_len,
                "generated_tokens": len(generated), "api_time_s": request.api_time_total,
                "num_cached_tokens": request.num_cached_tokens}
        elif new_ids and len(new_ids) == len(generated):   # the first tokens: the queue time is known
            metrics = {"arrival_time": request.arrival_time, "first_scheduled_time": request.first_scheduled_time}
        else:
            metrics = {}
        return RequestOutput(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                             token_ids=list(generated), text=text, delta_token_ids=new_ids,
                             delta_text=new_text, finish_reason=reason, api_calls=calls,
                             tool_calls=[dict(c) for c in tool_calls], error=request.error, metrics=metrics,
                             reasoning=reasoning, delta_reasoning=new_reasoning,
                             num_reasoning_tokens=0 if split is None else split.reasoning_tokens,
                             num_cached_tokens=request.num_cached_tokens,
                             logprobs=None if request.logprobs is None else list(request.logprobs),
                             prompt_logprobs=scored if scored is not None and len(scored) == request.prompt_len
                             else None)

    # ------------------------------------------------------------ helpers
    def next_wakeup(self) -> float | None:
        """When something could next happen while no request can run (API timers)."""
        return self.core.next_wakeup()

    def idle(self, until: float | None, max_wait_s: float = 0.05) -> None:
        """Wait while nothing can run: until ``until`` (None: 1 ms), at most
        ``max_wait_s`` (tool threads and other callers can finish work sooner)."""
        now = self.clock.now()
        self.clock.sleep_until(now + (0.001 if until is None else min(max_wait_s, max(0.0, until - now))))

    def usage(self) -> dict:
        """Gauges for metrics: requests by state and KV pages in use."""
        s = self.scheduler
        paused = {h.value: 0 for h in Handling}
        for r in s.paused.values():
            if r.handling is not None:
                paused[r.handling.value] += 1
        return {"running": len(s.running), "waiting": len(s.waiting), "swapping": len(s.swapping_in) + len(s.swapping_out),
                "paused": paused,
                "device_pages_used": s.device_pool.num_pages - s.kv.num_free_device,   # cached-unreferenced: free
                "device_pages_total": s.device_pool.num_pages,
                "host_pages_used": s.host_pool.num_pages - s.kv.num_free_host,   # host-tier cached: free
                "host_pages_total": s.host_pool.num_pages,
                "preemptions": s.num_preemptions, "api_calls": dict(s.api_calls_by_handling),
                **self.prefix_cache_usage()}

    def prefix_cache_usage(self) -> dict:
        """Prefix cache counters (tokens, cumulative; host hits are part of the hits) and
        cached pages now (device; host tier)."""
        cache = self.scheduler.kv.cache
        if cache is None:
            return {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_host_hits": 0,
                    "prefix_cached_pages": 0, "prefix_cached_host_pages": 0}
        return {"prefix_cache_queries": cache.query_tokens, "prefix_cache_hits": cache.hit_tokens,
                "prefix_cache_host_hits": cache.host_hit_tokens, "prefix_cached_pages": cache.num_pages,
                "prefix_cached_host_pages": cache.num_host_pages}

    def shutdown(self) -> None:
        self.api.shutdown()
        if hasattr(self.executor, "close"):   # multi-host: the workers stop too
            self.executor.close()


__all__ = ["LLMEngine", "RequestState"]
