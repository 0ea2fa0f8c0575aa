"""``LLM``: the offline Python API (batch generate and chat, runs the engine to completion)."""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.outputs import ApiCall, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.chat import (RESERVED_TEMPLATE_KWARGS, advertised_tools, function_tools, render_chat,
                           template_message)


class LLM:
    """``LLM("demo").generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))``.

    ``config`` is an ``EngineConfig``; keyword arguments override its fields
    (``dtype``, ``page_size``, ``num_pages``, ``max_num_batched_tokens``,
    ``policy``, ``handling``, ``seed``, ``attention_impl`` …) or name the
    engine's ``tools`` and ``clock``.
    """

    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **engine_kwargs) -> None:
        self.engine = LLMEngine(model, config, **engine_kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             tools: list[dict] | None = None, tool_choice: str = "auto", chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False, use_tqdm: bool = False,
             parse_reasoning: bool | None = None, priority: int | list[int] | None = None) -> list[RequestOutput]:
        """Reply to each conversation: ``messages`` is one conversation (OpenAI-style message
        dicts: ``role``, ``content`` as a string or text parts, an assistant's ``tool_calls``
        and ``reasoning_content``, a tool's ``tool_call_id``) or a list of them; returns
        final outputs in input order.

        Each is rendered with the model's chat template as ``/v1/chat/completions``
        renders it (``jaxserve.chat``: the same checks, normalization and rendering): the
        given ``tools`` (OpenAI tool dicts) and then the engine's registered tools they do
        not shadow, through the template's own tool support or, for a template without
        it, the tool-call format's system prompt. ``tool_choice`` ``"none"`` advertises no
        tools and parses no calls. Otherwise calls are parsed in the model's format: a
        registered tool runs inside the engine and the reply goes on; a call to one of
        ``tools`` ends its request with ``finish_reason == "tool_calls"`` and the calls in
        ``tool_calls`` (``text`` keeps the call's markup as the model wrote it, which the
        server hides). ``add_generation_prompt`` opens the assistant's turn;
        ``continue_final_message`` instead leaves the last message open for the model to
        continue (an assistant prefill). ``chat_template_kwargs``: more template variables
        (``enable_thinking``, say). ``parse_reasoning`` and ``priority``: as ``generate``'s.

        Bad input is a ``ValueError`` naming the argument (``messages[i].content``,
        ``tools[0]``...), and nothing is queued.
        """
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("messages: this model has no chat template to render them with")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: one conversation (a list of message dicts) or a list of them")
        many = not isinstance(messages[0], dict)
        conversations = messages if many else [messages]
        if tool_choice not in ("auto", "none"):
            raise ValueError(f"tool_choice: 'auto' or 'none' (a forced call: SamplingParams(structured="
                             f"StructuredOutput.tool_call(...))), got {tool_choice!r}")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs or ()))
        if reserved:
            raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} are chat()'s to set")
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message: the last message cannot be continued under a new "
                             "generation prompt; set add_generation_prompt=False")
        declared = function_tools(tools or [])
        advertised = [] if tool_choice == "none" else advertised_tools(declared, self.engine.tools)
        options = {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message}
        prompts = []
        for i, conversation in enumerate(conversations):
            where = f"messages[{i}]" if many else "messages"
            if not isinstance(conversation, list) or not conversation:
                raise ValueError(f"{where}: a conversation is a non-empty list of message dicts")
            rendered = [template_message(m, f"{where}[{j}]") for j, m in enumerate(conversation)]
            try:
                prompts.append(render_chat(tok, rendered, advertised, self.engine.tool_format, options))
            except Exception as e:   # noqa: BLE001 - jinja's errors (a role order the template refuses)
                raise ValueError(f"{where}: the chat template rejected them: {e}") from None
        return self.generate(prompt_token_ids=prompts, sampling_params=sampling_params, use_tqdm=use_tqdm,
                             parse_reasoning=parse_reasoning, parse_tool_calls=bool(advertised), priority=priority)

    def generate(self, prompts: list[str] | str | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None,
                 api_calls: list[list[ApiCall]] | None = None, use_tqdm: bool = False,
                 parse_reasoning: bool | None = None, parse_tool_calls: bool | None = None,
                 priority: int | list[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns final outputs in input order.

        A request whose model calls a tool that is not registered ends with
        ``finish_reason == "tool_calls"`` and the calls in ``tool_calls``.
        ``parse_reasoning`` (None: when the engine has a ``reasoning_parser``):
        each output's ``reasoning`` apart from its ``text`` (False: ``text`` whole).
        ``parse_tool_calls`` (None: when the engine has tools): find calls in the model's
        format in what it writes. ``priority`` (one for all prompts, or one per prompt;
        None: 0): each request's class, lower first (``LLMEngine.add_request``).

        All inputs are validated before any request is queued, so a bad one
        raises ``ValueError`` and leaves the engine as it was.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("prompts: give exactly one of prompts or prompt_token_ids")
        items = prompts if prompts is not None else prompt_token_ids
        if prompt_token_ids is not None and any(isinstance(p, (int, np.integer, str, bytes)) for p in items):
            raise ValueError("prompt_token_ids: one list of token ids per prompt (a list of lists)")
        if api_calls is not None and not all(c is None or isinstance(c, (list, tuple)) for c in api_calls):
            raise ValueError("api_calls: one list of jaxserve.ApiCall per prompt (a list of lists)")
        n = len(items)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * n
        calls = api_calls if api_calls is not None else [None] * n
        priorities = priority if isinstance(priority, list) else [0 if priority is None else priority] * n
        if len(params) != n or len(calls) != n or len(priorities) != n:
            raise ValueError("sampling_params, api_calls and priority lists must match the number of prompts")
        ids = []
        try:
            for i in range(n):
                kwargs = {"prompt": items[i]} if prompts is not None else {"prompt_token_ids": items[i]}
                ids.append(self.engine.add_request(sampling_params=params[i], api_calls=calls[i],
                                                   parse_reasoning=parse_reasoning, parse_tool_calls=parse_tool_calls,
                                                   priority=priorities[i], **kwargs))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=n, disable=not use_tqdm, desc="generate")

        def collect(requests) -> None:
            for out in self.engine.outputs(requests):
                if out.finished and out.request_id in wanted and out.request_id not in final:
                    if out.finish_reason == "tool_calls":
                        # A call to a tool nobody registered: offline there is no one to resume
                        # it, so it ends here with the calls in ``out.tool_calls``; free its pages.
                        self.engine.abort(out.request_id)
                    final[out.request_id] = out
                    bar.update(1)

        try:
            self.engine.core.run(done=lambda: len(final) >= n, on_outputs=collect, idle=self.engine.idle)
        except BaseException:   # (a KeyboardInterrupt, a failed step): no request of this call outlives it
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [final[rid] for rid in ids]
