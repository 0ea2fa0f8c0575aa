"""``LLMEngine``: the synchronous engine loop (DESIGN section 3).

One ``step()``: collect returned API calls -> ``scheduler.schedule`` -> swaps
-> one jitted forward + sample over the ragged batch -> stop rules and API
triggers -> outputs. ``LLM`` and ``AsyncEngine`` are thin drivers of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

import kernels
from jaxserve.api_executor import ApiExecutor, ApiResult
from jaxserve.compilation_cache import enable_compilation_cache
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import ApiCall, ApiCallOutput, RequestOutput
from jaxserve.profiles import default_cost_model
from jaxserve.runner import ModelRunner, RunnerConfig, kv_pool_pages
from jaxserve.sampling_params import SamplingParams
from jaxserve.tool_parser import make_tool_parser
from jaxserve.tools import Tool, normalize_tools
from jaxserve.weights import load_model, parse_dtype
from scheduler import (Handling, PageAllocator, Request, RequestState, Scheduler, SchedulerConfig, Segment,
                       make_policy, make_predictor)

log = logging.getLogger("jaxserve")


def resolve_model_dir(model: str | Path) -> Path:
    """``"demo"`` -> the built-in demo checkpoint; else a directory that must exist."""
    if str(model) == "demo":
        from jaxserve.demo import demo_dir
        return demo_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {str(model)!r} is neither 'demo' nor an existing checkpoint directory")
    return path


@dataclass
class EngineStats:
    """Counters since start (tokens and requests)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    batched_tokens: int = 0        # query tokens run through the model, all steps
    recomputed_tokens: int = 0     # tokens whose KV was computed before and computed again
    swapped_out_pages: int = 0
    swapped_in_pages: int = 0
    finished: dict = field(default_factory=dict)   # finish reason -> count
    steps: int = 0
    step_time_s: float = 0.0       # wall time inside step()
    device_wait_s: float = 0.0     # of which: waiting for the device to return sampled tokens
    dispatch_s: float = 0.0        # of which: inside the jitted call (on CPU this includes the compute)


@dataclass
class _Live:
    """Engine-side state of one request: token ids, sampling, text, tool parsing."""

    sched: Request
    token_ids: list[int]             # whole context: prompt + generated + API-returned
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    detok: IncrementalDetokenizer
    declared_calls: list[ApiCall]
    parser: object | None
    generated: list[int] = field(default_factory=list)
    max_computed: int = 0            # high-water mark of computed context (recompute accounting)
    call_info: list[dict] = field(default_factory=list)   # name/arguments/error per API call
    tool_call: dict | None = None    # pending client-side call
    last_reported_tokens: int = 0
    last_reported_text: int = 0


class LLMEngine:
    """Continuous-batching engine for one model on one device.

    Sizes: ``page_size`` tokens per KV page; ``num_pages`` device pages (None:
    from free device memory); ``host_num_pages`` host pages for Swap (None:
    as many as device pages); ``max_num_batched_tokens`` per step;
    ``swap_budget_tokens`` KV tokens copied host<->device per step.
    ``handling`` forces Preserve/Discard/Swap for every API call (None: the
    policy decides). ``tools`` registers server-side tools for parsed calls.
    ``keep_logits`` keeps the last step's logits in ``last_logits``.
    """

    def __init__(self, model: str | Path = "demo", *, dtype: str = "float32", page_size: int = 16,
                 num_pages: int | None = None, host_num_pages: int | None = None,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 256, max_model_len: int | None = None,
                 policy: str = "fcfs", handling: str | Handling | None = None, predictor: str = "oracle",
                 policy_options: dict | None = None, seed: int = 0, attention_impl: str | None = None,
                 interpret: bool | None = None, load_format: str = "safetensors",
                 tools: dict | list | None = None, tool_parser: str = "hermes",
                 cost_profile: str | None = None, swap_budget_tokens: int | None = None,
                 warmup: bool = True, compilation_cache: bool = True, check_invariants: bool = False,
                 keep_logits: bool = False,
                 clock=time.monotonic) -> None:
        if compilation_cache:
            enable_compilation_cache()
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {page_size}")
        self.model_dir = resolve_model_dir(model)
        self.clock = clock
        self.seed = seed
        self.check_invariants_each_step = check_invariants
        attention_impl = attention_impl or kernels.default_impl()
        if interpret is None:
            interpret = attention_impl != "reference" and jax.default_backend() == "cpu"
        dt = parse_dtype(dtype)
        model_obj, self.model_config = load_model(self.model_dir, dtype, attention_impl, load_format, seed)
        cfg = self.model_config
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if max_model_len and max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        if num_pages is None:
            num_pages = kv_pool_pages(cfg, page_size, dt, self.max_model_len, max_num_seqs)
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.runner = ModelRunner(model_obj, cfg, RunnerConfig(
            page_size=page_size, num_pages=num_pages, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, kv_dtype=dt,
            attention_impl=attention_impl, interpret=interpret, keep_logits=keep_logits))
        # A request's context can never outgrow the page pool (it would preempt itself forever).
        self.context_limit = min(self.max_model_len, num_pages * page_size)
        self.cost = default_cost_model(cost_profile, self.runner.kv_bytes_per_token, max_num_batched_tokens)
        sched_cfg = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                    swap_budget_tokens=swap_budget_tokens or max(page_size, max_num_batched_tokens),
                                    handling=Handling.parse(handling))
        self.scheduler = Scheduler(
            sched_cfg, make_policy(policy, predictor=make_predictor(predictor, seed), **(policy_options or {})),
            PageAllocator(num_pages, page_size, "device"),
            PageAllocator(num_pages if host_num_pages is None else host_num_pages, page_size, "host"), self.cost)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.tools: dict[str, Tool] = normalize_tools(tools)
        self.tool_parser_name = tool_parser
        make_tool_parser(tool_parser)  # validate the name now
        self.api = ApiExecutor()
        self.stats = EngineStats()
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self.last_logits = None   # float32 [rows, vocab] of the last step when keep_logits=True (tests, debugging)
        if warmup:
            self.runner.warmup(swap_pages=max(1, sched_cfg.swap_budget_tokens // page_size))

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str | None = None, prompt: str | None = None,
                    sampling_params: SamplingParams | None = None, prompt_token_ids: list[int] | None = None,
                    api_calls: list[ApiCall] | None = None, parse_tool_calls: bool | None = None,
                    arrival_time: float | None = None, predictions: dict | None = None) -> str:
        """Queue a request; returns its id. Bad input is a ``ValueError`` naming
        the field, and nothing is queued."""
        params = sampling_params or SamplingParams()
        params.validate()
        ids = self._prompt_ids(prompt, prompt_token_ids)
        if any(not isinstance(c, ApiCall) for c in api_calls or []):
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
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use")
        segments, done = [], 0
        for c in calls:
            segments.append(Segment(c.after_tokens - done, c.api_type, float(c.duration_s), len(c.returned_token_ids)))
            done = c.after_tokens
        if segments and done < params.max_tokens:
            segments.append(Segment(params.max_tokens - done))
        # A call at after_tokens == max_tokens is the request's last step: it ends when the call returns.
        now = self.clock()
        req = Request(request_id, arrival_time if arrival_time is not None else now, prompt_len=len(ids),
                      max_tokens=params.max_tokens, segments=segments, ignore_eos=params.ignore_eos,
                      predictions=dict(predictions or {}))
        parse = bool(self.tools) if parse_tool_calls is None else parse_tool_calls
        seed = params.seed if params.seed is not None else (self.seed * 1_000_003 + zlib.crc32(request_id.encode())) % 2**32
        self._live[request_id] = _Live(
            sched=req, token_ids=list(ids), prompt_token_ids=list(ids), params=params, seed=seed,
            detok=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop),
            declared_calls=calls, parser=make_tool_parser(self.tool_parser_name) if parse and self.tokenizer else None)
        self.scheduler.add_request(req, now)
        self.stats.prompt_tokens += len(ids)
        return request_id

    def _prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("prompt: give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
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
        live = self._live.get(request_id)
        if live is None:
            return None
        self._finish(live, "abort")
        return self._output(live, final=True)

    def resume(self, request_id: str, token_ids: list[int] | None = None, text: str | None = None,
               max_tokens: int | None = None) -> None:
        """Return the result of an external (client-side) call the request is paused on.
        ``max_tokens``: a fresh budget of generated tokens for the continuation (None: keep the rest)."""
        if (token_ids is None) == (text is None):
            raise ValueError("resume: give exactly one of token_ids or text")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if request_id not in self._live or not self.api.is_waiting_external(request_id):
            raise KeyError(f"request {request_id!r} is not paused on an external API call")
        if token_ids is not None:
            token_ids = list(token_ids)
            self._check_token_ids(token_ids, "token_ids")
        elif not isinstance(text, str):
            raise ValueError("text must be a string")
        if max_tokens is not None:
            live = self._live[request_id]
            live.sched.max_tokens = live.sched.num_generated + max_tokens
            live.params = dataclasses.replace(live.params, max_tokens=live.sched.max_tokens)
        self.api.resume(request_id, token_ids=token_ids, text=text)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for each request that changed."""
        touched: dict[str, _Live] = {}
        step_start = time.perf_counter()
        now = self.clock()
        for result in self.api.poll(now):
            self._on_api_result(result, now, touched)
        plan = self.scheduler.schedule(now)
        if plan.swap_out:
            self.runner.swap_out(plan.swap_out)
            self.stats.swapped_out_pages += sum(len(op.device_pages) for op in plan.swap_out)
        if plan.swap_in:
            self.runner.swap_in(plan.swap_in)
            self.stats.swapped_in_pages += sum(len(op.device_pages) for op in plan.swap_in)
        tokens = None
        if plan.chunks:
            live = {c.request.request_id: self._live[c.request.request_id] for c in plan.chunks}
            rows = {rid: (l.params.temperature, l.params.top_k, l.params.top_p,
                          l.seed, l.sched.num_generated) for rid, l in live.items()}
            inputs = self.runner.prepare(plan.chunks, {rid: l.token_ids for rid, l in live.items()}, rows)
            dispatch_start = time.perf_counter()
            device_tokens, self.last_logits = self.runner.execute(inputs)
            wait_start = time.perf_counter()
            self.stats.dispatch_s += wait_start - dispatch_start
            tokens = np.asarray(device_tokens)
            self.stats.device_wait_s += time.perf_counter() - wait_start
            self.stats.batched_tokens += plan.num_batched_tokens
            for c in plan.chunks:
                l = live[c.request.request_id]
                self.stats.recomputed_tokens += max(0, min(c.start + c.num_tokens, l.max_computed) - c.start)
                l.max_computed = max(l.max_computed, c.start + c.num_tokens)
        self.stats.steps += 1
        now = self.clock()
        produced = {r.request_id for r in self.scheduler.on_step_done(plan, now)}
        for i, chunk in enumerate(plan.chunks):
            rid = chunk.request.request_id
            if rid in produced:
                self._on_token(self._live[rid], int(tokens[i]), now, touched)
        if self.check_invariants_each_step:
            self.scheduler.check_invariants()
        self.stats.step_time_s += time.perf_counter() - step_start
        return [self._output(l, final=l.sched.is_finished or l.tool_call is not None) for l in touched.values()]

    def _on_token(self, live: _Live, token: int, now: float, touched: dict) -> None:
        touched[live.sched.request_id] = live
        live.token_ids.append(token)
        live.generated.append(token)
        self.stats.generation_tokens += 1
        params, req = live.params, live.sched
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return self._finish(live, "stop")
        delta, hit_stop = live.detok.add(token) if self.tokenizer is not None else ("", False)
        if hit_stop:
            return self._finish(live, "stop")
        event = self.scheduler.declared_event(req)
        if event == "api":
            call = live.declared_calls[len(req.api_calls)]
            self.scheduler.pause(req, now, call.api_type, call.duration_s)
            live.call_info.append({})
            self.api.call_simulated(req.request_id, now + call.duration_s, list(call.returned_token_ids))
            return None
        if event == "length" or len(live.token_ids) >= self.context_limit:
            return self._finish(live, "length")
        if live.parser is not None and delta:
            parsed = live.parser.feed(delta)
            if parsed is not None:
                self._pause_for_tool(live, parsed, now)
        return None

    def _pause_for_tool(self, live: _Live, parsed, now: float) -> None:
        req = live.sched
        tool = self.tools.get(parsed.name)
        info = {"name": parsed.name, "arguments": parsed.arguments}
        live.call_info.append(info)
        if tool is None and parsed.name:
            # Client-side tool: pause, hand the call to the caller, wait for resume().
            self.scheduler.pause(req, now, "external", None)
            live.tool_call = {"name": parsed.name, "arguments": parsed.arguments}
            self.api.expect_external(req.request_id)
            return
        self.scheduler.pause(req, now, tool.api_type if tool else "invalid", None)
        if tool is None:
            self.api.fail(req.request_id, f"malformed tool call: {parsed.arguments[:200]}")
        else:
            self.api.call_tool(req.request_id, tool, parsed.arguments, now)

    def _on_api_result(self, result: ApiResult, now: float, touched: dict) -> None:
        live = self._live.get(result.request_id)
        if live is None or live.sched.request_id not in self.scheduler.paused:
            return  # aborted meanwhile
        touched[result.request_id] = live
        live.tool_call = None
        if result.error is not None:
            live.call_info[-1]["error"] = result.error
            ids = self._encode_tool_result(f"error: {result.error}")
        elif result.token_ids is not None:
            ids = [int(t) for t in result.token_ids]
        else:
            ids = self._encode_tool_result(result.text or "")
        room = self.context_limit - len(live.token_ids) - 1
        if len(ids) > room:
            ids = ids[:max(0, room)]
        live.token_ids.extend(ids)
        self.scheduler.api_return(live.sched, len(ids), now)
        if self.scheduler.finished_after_return(live.sched):
            self._finish(live, "stop")
        elif len(live.token_ids) >= self.context_limit:
            self._finish(live, "length")

    def _encode_tool_result(self, text: str) -> list[int]:
        """Tool output as context tokens, wrapped the way the chat template shows tool turns."""
        if self.tokenizer is None:
            return []
        template = getattr(self.tokenizer, "chat_template", None) or ""
        if "<|im_start|>" in template:
            text = f"<|im_end|>\n<|im_start|>tool\n{text}<|im_end|>\n<|im_start|>assistant\n"
        else:
            text = f"<tool_response>{text}</tool_response>"
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _finish(self, live: _Live, reason: str) -> None:
        req = live.sched
        if req.host_pages:
            self.runner.release_host_pages(req.host_pages)
        self.api.cancel(req.request_id)
        self.scheduler.finish(req, reason, self.clock())
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        del self._live[req.request_id]
        live.tool_call = None

    # -------------------------------------------------------------- outputs
    def _output(self, live: _Live, final: bool) -> RequestOutput:
        req = live.sched
        new_ids = live.generated[live.last_reported_tokens:]
        new_text = live.detok.text[live.last_reported_text:]
        live.last_reported_tokens, live.last_reported_text = len(live.generated), len(live.detok.text)
        reason = req.finish_reason if req.is_finished else ("tool_calls" if live.tool_call else None)
        calls = []
        for rec, info in zip(req.api_calls if final or live.call_info else (), live.call_info):
            calls.append(ApiCallOutput(
                api_type=rec.api_type, handling=rec.handling.value, call_time=rec.call_time,
                return_time=rec.return_time, resume_time=rec.resume_time, context_tokens=rec.context_tokens,
                returned_tokens=rec.num_returned_tokens,
                fell_back_from=rec.fell_back_from.value if rec.fell_back_from else None,
                name=info.get("name"), arguments=info.get("arguments"), error=info.get("error")))
        metrics = {} if not final else {"arrival_time": req.arrival_time, "first_scheduled_time": req.first_scheduled_time,
                   "first_token_time": req.first_token_time, "finish_time": req.finish_time,
                   "num_preemptions": req.num_preemptions, "prompt_tokens": len(live.prompt_token_ids),
                   "generated_tokens": len(live.generated), "api_time_s": req.api_time_total}
        return RequestOutput(request_id=req.request_id, prompt_token_ids=live.prompt_token_ids,
                             token_ids=list(live.generated), text=live.detok.text, delta_token_ids=new_ids,
                             delta_text=new_text, finish_reason=reason, api_calls=calls,
                             tool_call=dict(live.tool_call) if live.tool_call else None, metrics=metrics)

    # ------------------------------------------------------------ helpers
    def next_wakeup(self) -> float | None:
        """When something could next happen while no request can run (API timers)."""
        return self.api.next_due()

    def usage(self) -> dict:
        """Gauges for metrics: requests by state and KV pages in use."""
        s = self.scheduler
        paused = {h.value: 0 for h in Handling}
        for r in s.paused.values():
            if r.handling is not None:
                paused[r.handling.value] += 1
        return {"running": len(s.running), "waiting": len(s.waiting), "swapping": len(s.swapping_in) + len(s.swapping_out),
                "paused": paused, "device_pages_used": s.device_pool.num_used, "device_pages_total": s.device_pool.num_pages,
                "host_pages_used": s.host_pool.num_used, "host_pages_total": s.host_pool.num_pages,
                "preemptions": s.num_preemptions}

    def shutdown(self) -> None:
        self.api.shutdown()


def _load_tokenizer(model_dir: Path):
    # A plain tokenizer.json loads through PreTrainedTokenizerFast, the class AutoTokenizer picks for
    # it, without AutoTokenizer's import of torch (several seconds of a cold start).
    try:
        declared = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        declared = None
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast") and (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast as loader
    else:
        from transformers import AutoTokenizer as loader
    try:
        return loader.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        log.warning("no tokenizer in %s (%s): prompts must be token ids", model_dir, e)
        return None


__all__ = ["LLMEngine", "RequestState", "resolve_model_dir"]
