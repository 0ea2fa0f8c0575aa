"""Compare xgrammar and llguidance as the engine's grammar library, on this machine.

For each tokenizer (the demo model's, and a real one such as SmolLM2's) and each
JSON schema: tokenizer set-up time, schema compile time (first compile, no cache),
and the host time to fill one row of the packed token bitmask per generated
token, measured while walking a valid JSON instance of the schema token by token
(the work the engine does per constrained row per step). Coverage: for each JSON
Schema feature the issue lists, a seeded random walk over the allowed tokens
(uniform among them) until the grammar accepts; the text is checked with
``jsonschema``. A library "covers" a feature when every walk validates.

    python3 tools/compare_grammar_libs.py --model demo --model /work/cache/smollm2-hf
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import numpy as np

BENCH_SCHEMAS = {
    "flat": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "ok": True}),
    "tool_args": ({"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 6}},
        "required": ["city", "unit"], "additionalProperties": False},
        {"city": "Paris", "unit": "celsius", "days": 3, "hours": [6, 12, 18]}),
    "nested": ({"type": "object", "$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1},
        "price": {"type": "number"}}, "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "properties": {"order_id": {"type": "string"}, "items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                                   "minItems": 1},
                       "status": {"anyOf": [{"const": "open"}, {"const": "shipped"}]}},
        "required": ["order_id", "items", "status"], "additionalProperties": False},
        {"order_id": "A17", "items": [{"sku": "ABC-1234", "qty": 2, "price": 9.5},
                                      {"sku": "XYZ-0001", "qty": 1, "price": 120.0}], "status": "open"}),
    "json_object": ({"type": "object"}, {"answer": "yes", "n": [1, 2, 3], "nested": {"a": None}}),
}

COVERAGE = {
    "object+required": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                          "b": {"type": "boolean"}}, "required": ["a", "b"],
                        "additionalProperties": False},
    "enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "integer min/max": {"type": "integer", "minimum": -5, "maximum": 37},
    "boolean": {"type": "boolean"},
    "string min/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "array min/maxItems": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    "additionalProperties false": {"type": "object", "properties": {"x": {"type": "boolean"}},
                                   "additionalProperties": False},
    "number exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "pattern": {"type": "string", "pattern": "^[a-c]{2}[0-9]$"},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "boolean"}]},
    "$ref/$defs": {"$defs": {"b": {"type": "boolean"}}, "type": "array", "items": {"$ref": "#/$defs/b"},
                   "maxItems": 3},
    "const": {"const": "fixed"},
    "format date": {"type": "string", "format": "date"},
}


# ------------------------------------------------------------------ adapters
class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int) -> None:
        import xgrammar as xgr
        self.xgr, self.vocab = xgr, vocab
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[tok.eos_token_id])
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                  separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: np.ndarray) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        self.llg, self.np_ = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        err = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if err:
            raise ValueError(err)
        return grammar

    def matcher(self, compiled):
        m = self.llg.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m, bitmask: np.ndarray) -> None:
        self.np_.fill_next_token_bitmask(m, bitmask, 0)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()

    def done(self, m) -> bool:
        return m.is_stopped()


def allowed(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def bench(lib, tok, vocab: int, eos: int, repeats: int) -> dict:
    out = {}
    for name, (schema, instance) in BENCH_SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = tok.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False) + [eos]
        times, ok = [], True
        bitmask = np.zeros((1, (vocab + 31) // 32), np.int32)
        for _ in range(repeats):
            m = lib.matcher(compiled)
            for t in ids:
                s = time.perf_counter()
                lib.fill(m, bitmask)
                times.append(time.perf_counter() - s)
                if not (bitmask[0, t // 32] >> (t % 32)) & 1 or not lib.accept(m, t):
                    ok = False
                    break
        out[name] = {"compile_ms": compile_ms, "mask_us_median": statistics.median(times) * 1e6,
                     "mask_us_p99": float(np.percentile(times, 99)) * 1e6, "tokens": len(ids), "walk_ok": ok}
    return out


def coverage(lib, tok, vocab: int, seeds: int, max_steps: int = 200) -> dict:
    out = {}
    for feature, schema in COVERAGE.items():
        try:
            compiled = lib.compile(schema)
        except Exception as e:  # noqa: BLE001 - a feature the library rejects
            out[feature] = f"compile error: {str(e)[:60]}"
            continue
        valid = 0
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            m, ids = lib.matcher(compiled), []
            bitmask = np.zeros((1, (vocab + 31) // 32), np.int32)
            for _ in range(max_steps):
                if lib.done(m):
                    break
                lib.fill(m, bitmask)
                choices = allowed(bitmask[0], vocab)
                if len(choices) == 0:
                    break
                t = int(rng.choice(choices))
                if not lib.accept(m, t):
                    break
                ids.append(t)
            text = tok.decode([t for t in ids if t not in tok.all_special_ids])
            try:
                jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        out[feature] = f"{valid}/{seeds}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", default=None, help="'demo' or a checkpoint dir (repeatable)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from jaxserve.model_source import resolve_model
    for model in args.model or ["demo"]:
        d = resolve_model(model)
        tok = AutoTokenizer.from_pretrained(str(d))
        vocab = json.loads((d / "config.json").read_text())["vocab_size"]
        print(f"== {model}: vocab {vocab}")
        for cls in (XGrammar, LLGuidance):
            t0 = time.perf_counter()
            lib = cls(tok, vocab)
            setup_ms = (time.perf_counter() - t0) * 1e3
            print(f"  {cls.name}: tokenizer set-up {setup_ms:.0f} ms")
            for name, r in bench(lib, tok, vocab, tok.eos_token_id, args.repeats).items():
                print(f"    {name:12s} compile {r['compile_ms']:8.2f} ms  mask/token median {r['mask_us_median']:7.1f} us"
                      f"  p99 {r['mask_us_p99']:7.1f} us  ({r['tokens']} tokens, walk {'ok' if r['walk_ok'] else 'REJECTED'})")
            cov = coverage(lib, tok, vocab, args.seeds)
            print("    coverage: " + ", ".join(f"{k}: {v}" for k, v in cov.items()))


if __name__ == "__main__":
    main()
