"""``jaxserve generate``: run prompts through the engine and print the results,
including how each declared API call was handled."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from jaxserve.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="demo", help="checkpoint directory, .gguf file, or a built-in name (smollm2-135m, demo; default demo)")
    parser.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt with the chat template")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (the default here) is greedy; the server and SamplingParams default to 1")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 is off)")
    parser.add_argument("--top-k", type=int, default=0, help="draw from the k likeliest (0 is off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="draw only tokens at least this fraction as likely "
                                                                  "as the likeliest (0 is off)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--min-tokens", type=int, default=0, help="no stop token or stop string before this many")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is off (transformers' and vLLM's)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's)")
    parser.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN_ID:VALUE",
                        help="add VALUE (in [-100, 100]) to TOKEN_ID's logit (repeatable)")
    parser.add_argument("--api-call", action="append", default=[], metavar="AFTER:SECONDS:TEXT",
                        help="declare an API call after AFTER generated tokens, taking SECONDS, returning TEXT "
                             "(applies to every prompt; repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per output")
    EngineConfig.add_cli_arguments(parser)


DEFAULT_PROMPTS = ["Hello, world! How are you today?", "What is 2 + 3 * (4 - 1)?",
                   "The quick brown fox", "Once upon a time there was a small model"]


def parse_api_calls(specs: list[str]) -> list:
    """``--api-call AFTER:SECONDS:TEXT`` values -> ``ApiCall``s with the TEXT not yet tokenized
    (``tokenize_returns``); ``ValueError`` naming the bad one (checked before a model loads)."""
    from jaxserve import ApiCall
    calls = []
    for spec in specs:
        parts = spec.split(":", 2)
        if len(parts) != 3:
            raise ValueError(f"--api-call must look like AFTER:SECONDS:TEXT, got {spec!r}")
        after, seconds, text = parts
        try:
            calls.append((ApiCall(after_tokens=int(after), duration_s=float(seconds), api_type="cli"), text))
        except ValueError as e:
            raise ValueError(f"--api-call {spec!r}: {e}") from None
    return calls


def parse_logit_bias(specs: list[str]) -> dict[int, float]:
    """``--logit-bias TOKEN_ID:VALUE`` values -> ``{token id: value}``; ``ValueError`` naming the bad one."""
    bias = {}
    for spec in specs:
        token, _, value = spec.partition(":")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias must look like TOKEN_ID:VALUE, got {spec!r}") from None
    return bias


def tokenize_returns(calls: list, tokenizer) -> list:
    """``parse_api_calls``'s result with each call's TEXT as its returned token ids."""
    return [dataclasses.replace(call, returned_token_ids=tokenizer.encode(text, add_special_tokens=False)
                                if tokenizer else []) for call, text in calls]


def main(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams
    from jaxserve.cli import refuse

    try:   # what can be checked without the model, before it loads
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
                                min_tokens=args.min_tokens, repetition_penalty=args.repetition_penalty,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                logit_bias=parse_logit_bias(args.logit_bias) or None)
        declared = parse_api_calls(args.api_call)
        if args.prompt is not None and not all(args.prompt):
            raise ValueError("--prompt must not be empty")
    except ValueError as e:
        return refuse("generate", e)
    try:
        llm = LLM(config=EngineConfig.from_cli(args))
    except (ValueError, OSError) as e:   # a bad engine flag, a model that is not there or does not load
        return refuse("generate", e)
    prompts = args.prompt or DEFAULT_PROMPTS
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                     add_generation_prompt=True) for p in prompts]
    calls = tokenize_returns(declared, llm.tokenizer)
    start = time.perf_counter()
    try:
        outs = llm.generate(prompts=prompts, sampling_params=params,
                            api_calls=[calls] * len(prompts) if calls else None)
    except ValueError as e:   # e.g. a prompt longer than the context window
        llm.engine.shutdown()
        return refuse("generate", e)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "reasoning": out.reasoning, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason,
                              "api_calls": [vars(c) for c in out.api_calls]}))
            continue
        print(f"--- {prompt!r}")
        if out.reasoning:
            print(f"    reasoning: {out.reasoning!r}")
        print(f"    {out.text!r}  [{out.finish_reason}, {len(out.token_ids)} tokens]")
        for c in out.api_calls:
            waited = (c.return_time or c.call_time) - c.call_time
            print(f"    api call {c.api_type}: {c.handling}{f' (fell back from {c.fell_back_from})' if c.fell_back_from else ''}"
                  f", context {c.context_tokens} tokens, waited {waited * 1e3:.1f} ms, returned {c.returned_tokens} tokens")
    total = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)")
    llm.engine.shutdown()
    return 0
