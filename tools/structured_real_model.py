"""Forced tool calls and JSON Schema answers on a real instruct model, checked
with ``jsonschema``: every prompt's call arguments (``tool_choice`` named and
"required") and every ``response_format`` answer must validate. Prints one
line per prompt and exits non-zero on any failure.

    python3 tools/structured_real_model.py --model /work/cache/smollm2-hf
"""

from __future__ import annotations

import argparse
import json
import sys

import jsonschema

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ALARM = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                          "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                                          "label": {"type": "string", "maxLength": 30}},
         "required": ["hour", "minute"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm clock",
                                           "parameters": ALARM}}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "born": {"type": "integer", "minimum": 1000, "maximum": 2025},
                                           "field": {"enum": ["science", "art", "politics", "sport"]},
                                           "alive": {"type": "boolean"}},
          "required": ["name", "born", "field", "alive"], "additionalProperties": False}
PROMPTS = ["What's the weather like in Paris?", "Wake me up at half past six.", "Is it raining in Tokyo?",
           "Set an alarm for 7:15 called gym.", "How warm is it in Lisbon in fahrenheit?", "Tell me a joke."]
PEOPLE = ["Marie Curie", "Pablo Picasso", "Ada Lovelace", "Serena Williams"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from jaxserve import LLM, SamplingParams, StructuredOutput
    llm = LLM(args.model, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, warmup=False)
    tok = llm.tokenizer

    def chat(text: str, tools=None) -> list[int]:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], tools=tools,
                                           add_generation_prompt=True, tokenize=False)
        return tok.encode(rendered, add_special_tokens=False)

    failures = 0
    specs = [("named get_weather", StructuredOutput.tool_call(TOOLS, "get_weather")),
             ("named set_alarm", StructuredOutput.tool_call(TOOLS, "set_alarm")),
             ("required", StructuredOutput.tool_call(TOOLS))]
    for label, spec in specs:
        outs = llm.generate(prompt_token_ids=[chat(p, TOOLS) for p in PROMPTS],
                            sampling_params=SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=spec))
        for prompt, out in zip(PROMPTS, outs):
            try:
                assert out.finish_reason == "tool_calls", f"finish_reason {out.finish_reason}: {out.text!r}"
                for call in out.tool_calls:   # one turn may hold several calls (parallel_tool_calls)
                    schema = WEATHER if call["name"] == "get_weather" else ALARM
                    jsonschema.validate(json.loads(call["arguments"]), schema)
                shown = "; ".join(f"{c['name']}({c['arguments']})" for c in out.tool_calls)
                print(f"ok   {label:18s} {prompt!r:45s} -> {shown}")
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                failures += 1
                print(f"FAIL {label:18s} {prompt!r:45s} {e}")
    outs = llm.generate(prompt_token_ids=[chat(f"Describe {p} as JSON.") for p in PEOPLE],
                        sampling_params=SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                                       structured=StructuredOutput.json(PERSON)))
    for person, out in zip(PEOPLE, outs):
        try:
            jsonschema.validate(json.loads(out.text), PERSON)
            print(f"ok   {'json_schema':18s} {person!r:45s} -> {out.text}")
        except (ValueError, jsonschema.ValidationError) as e:
            failures += 1
            print(f"FAIL {'json_schema':18s} {person!r:45s} {e}: {out.text!r}")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
