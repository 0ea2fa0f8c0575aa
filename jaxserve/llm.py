"""``LLM``: the offline Python API (batch generate, runs the engine to completion)."""

from __future__ import annotations

import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.outputs import ApiCall, RequestOutput
from jaxserve.sampling_params import SamplingParams


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

    def generate(self, prompts: list[str] | str | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None,
                 api_calls: list[list[ApiCall]] | None = None, use_tqdm: bool = False,
                 parse_reasoning: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns final outputs in input order.

        A request whose model calls a tool that is not registered ends with
        ``finish_reason == "tool_calls"`` and the calls in ``tool_calls``.
        ``parse_reasoning`` (None: when the engine has a ``reasoning_parser``):
        each output's ``reasoning`` apart from its ``text`` (False: ``text`` whole).

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
        if len(params) != n or len(calls) != n:
            raise ValueError("sampling_params and api_calls lists must match the number of prompts")
        ids = []
        try:
            for i in range(n):
                kwargs = {"prompt": items[i]} if prompts is not None else {"prompt_token_ids": items[i]}
                ids.append(self.engine.add_request(sampling_params=params[i], api_calls=calls[i],
                                                   parse_reasoning=parse_reasoning, **kwargs))
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

        self.engine.core.run(done=lambda: len(final) >= n, on_outputs=collect, idle=self.engine.idle)
        bar.close()
        return [final[rid] for rid in ids]
