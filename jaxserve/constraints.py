"""What a request's output must look like (``SamplingParams.structured``):
a JSON value matching a JSON Schema, any JSON object, a forced tool call, or
(vLLM's structured outputs) text matching a regular expression, one of given
choices, or a context-free grammar.

Pure Python (no JAX, no grammar library), so ``SamplingParams`` can validate
a constraint at the edge: JSON Schemas are checked against their metaschema
with ``jsonschema``, tool names against the tools given. Errors are
``ValueError`` naming the request field first (``response_format: ...``,
``tools: ...``, ``tool_choice: ...``) so the server answers 400 with ``param``.
The grammar itself is compiled by ``jaxserve.structured`` when the engine
queues the request.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import jsonschema

KINDS = ("json_schema", "json_object", "tool_call", "regex", "choice", "grammar")
JSON_KINDS = ("json_schema", "json_object")
THINKING_FIRST_KINDS = (*JSON_KINDS, "regex", "choice")   # answers a reasoning block may come before
MAX_PATTERN_CHARS = 16_384      # a regex or a grammar's text
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 65_536       # all choices together


@dataclass(frozen=True)
class ToolSchema:
    """One function a forced call may name, with its arguments' JSON Schema."""

    name: str
    parameters: dict


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text.

    ``json_schema``: the text is one JSON value valid against ``schema``.
    ``json_object``: the text is one JSON object (any keys).
    ``tool_call``: the text is a turn of tool calls in the engine's tool-call
    format (e.g. Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
    each to one of ``tools``, its arguments valid against that tool's
    ``parameters``. Once the turn is complete the constraint ends: the request
    pauses on its calls and, after their results, continues unconstrained.
    ``parallel``: the OpenAI ``parallel_tool_calls`` flag: one or more calls in
    the turn (the model decides how many), else exactly one. ``optional``: the
    turn may instead be text with no call in it, or text and then the calls
    (OpenAI ``tool_choice: {"type": "allowed_tools", "mode": "auto"}``): the
    model decides whether to call, and calls only ``tools``; the request then
    pauses on its calls as the parser finds them, as without a constraint, and
    after server-side tools' results the next turn is held to ``tools`` again.
    ``regex``: the text matches ``pattern`` (Rust ``regex`` syntax, whole text).
    ``choice``: the text is one of ``choices``. ``grammar``: the text is in the
    language of ``grammar``, a Lark grammar (llguidance's dialect: ``start`` its
    start rule, ``%json {schema}`` for embedded JSON; a GBNF grammar is refused).
    ``field``: the request field these come from (for errors; default
    ``structured_outputs``, vLLM's).

    Build with ``json(schema)``, ``json_object()``, ``tool_call(tools, name)``,
    ``regex(pattern)``, ``choice(options)`` or ``lark(grammar)``.
    """

    kind: Literal["json_schema", "json_object", "tool_call", "regex", "choice", "grammar"]
    schema: dict | None = None
    tools: tuple[ToolSchema, ...] = ()
    parallel: bool = True
    optional: bool = False              # tool_call: text with no call is allowed too
    pattern: str | None = None          # regex, or grammar text
    choices: tuple[str, ...] = ()
    field: str | None = None

    @classmethod
    def json(cls, schema: dict) -> "StructuredOutput":
        return cls("json_schema", schema=schema)

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str, field: str | None = None) -> "StructuredOutput":
        return cls("regex", pattern=pattern, field=field)

    @classmethod
    def choice(cls, options, field: str | None = None) -> "StructuredOutput":
        return cls("choice", choices=tuple(options) if isinstance(options, (list, tuple)) else options, field=field)

    @classmethod
    def lark(cls, grammar: str, field: str | None = None) -> "StructuredOutput":
        return cls("grammar", pattern=grammar, field=field)

    @classmethod
    def tool_call(cls, tools: list[dict] | dict[str, dict], name: str | None = None,
                  parallel: bool = True, optional: bool = False) -> "StructuredOutput":
        """``tools``: OpenAI tool definitions (``{"type": "function", "function": {"name",
        "parameters"}}`` or just the ``function`` part), or ``{name: parameters}``.
        ``name``: force this function (``tool_choice`` naming one); None: any of them
        (``tool_choice: "required"``). ``optional``: text with no call is allowed too
        (``allowed_tools`` in mode ``auto``)."""
        if isinstance(tools, dict):
            specs = [ToolSchema(n, p if p is not None else {"type": "object"}) for n, p in tools.items()]
        else:
            specs = []
            for t in tools:
                fn = t.get("function", t) if isinstance(t, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError("tools: each tool needs a function name")
                specs.append(ToolSchema(fn["name"], fn.get("parameters") or {"type": "object", "properties": {}}))
        if name is not None:
            chosen = [s for s in specs if s.name == name]
            if not chosen:
                known = ", ".join(s.name for s in specs) or "none"
                raise ValueError(f"tool_choice: function {name!r} is not among the tools ({known})")
            specs = chosen
        return cls("tool_call", tools=tuple(specs), parallel=parallel, optional=optional)

    @property
    def may_reason_first(self) -> bool:
        """Whether a reasoning block may open the turn before the constrained answer
        (``jaxserve.structured.thinking_first_lark``): JSON, regex and choice answers
        (``THINKING_FIRST_KINDS``), and optional tool calls (text or calls)."""
        return self.kind in THINKING_FIRST_KINDS or self.optional

    @property
    def param(self) -> str:
        """The request field an error in this constraint belongs to."""
        if self.kind == "tool_call":
            return "tools"
        return self.field or ("response_format" if self.kind in JSON_KINDS else "structured_outputs")

    def validate(self) -> None:
        """Raise ``ValueError`` (field name first) if the constraint is malformed."""
        if self.kind not in KINDS:
            raise ValueError(f"structured: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.optional and self.kind != "tool_call":
            raise ValueError(f"structured: optional applies to tool calls, not to {self.kind}")
        if self.kind == "json_schema":
            check_schema(self.schema, self.param)
        elif self.kind == "tool_call":
            if not self.tools:
                raise ValueError("tool_choice: a forced tool call needs at least one tool")
            if len({t.name for t in self.tools}) != len(self.tools):
                raise ValueError("tools: two tools have the same name")
            for t in self.tools:
                check_schema(t.parameters, "tools", f"parameters of {t.name!r}")
        if self.kind in ("regex", "grammar", "choice"):
            try:
                "".join([self.pattern or "", *(c for c in self.choices if isinstance(c, str))]).encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"{self.param}: text must be valid Unicode (no lone surrogates)") from None
        if self.kind in ("regex", "grammar"):
            what = "a regular expression" if self.kind == "regex" else "a grammar"
            if not isinstance(self.pattern, str) or not 0 < len(self.pattern) <= MAX_PATTERN_CHARS:
                raise ValueError(f"{self.param}: {what} must be a non-empty string of at most "
                                 f"{MAX_PATTERN_CHARS} characters")
        elif self.kind == "choice":
            choices = self.choices
            if (not isinstance(choices, tuple) or not 0 < len(choices) <= MAX_CHOICES
                    or any(not isinstance(c, str) or not c for c in choices)
                    or sum(map(len, choices)) > MAX_CHOICE_CHARS):
                raise ValueError(f"{self.param}: choice must be 1 to {MAX_CHOICES} non-empty strings "
                                 f"({MAX_CHOICE_CHARS} characters in all)")

    def key(self) -> str:
        """A stable key for caching compiled grammars: the SHA-256 (hex) of the constraint
        as sorted JSON, so a cache of 256 grammars holds no schema texts (a request
        body may carry megabytes of schema)."""
        text = json.dumps([self.kind, self.schema, [[t.name, t.parameters] for t in self.tools], self.parallel,
                           self.pattern, list(self.choices), self.optional], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def check_schema(schema, param: str, what: str = "schema") -> None:
    """Raise ``ValueError("<param>: ...")`` unless ``schema`` is a valid JSON Schema object.
    Checking against the metaschema takes ~20 ms, so valid schemas are remembered."""
    if not isinstance(schema, dict):
        raise ValueError(f"{param}: {what} must be a JSON object, got {type(schema).__name__}")
    try:
        key = json.dumps(schema, sort_keys=True)
        json.dumps(schema, ensure_ascii=False).encode("utf-8")   # a lone surrogate cannot be encoded
    except UnicodeEncodeError:
        raise ValueError(f"{param}: {what} must be valid Unicode (no lone surrogates)") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{param}: {what} is not JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{param}: {what} is not a valid JSON Schema at (root): {TOO_DEEP}") from None
    error = _schema_error(key)
    if error is not None:
        raise ValueError(f"{param}: {what} {error}")


TOO_DEEP = "nested too deeply to check (a few hundred levels at most)"
SCHEMA_CHECKS_KEPT = 1024   # schemas whose check is remembered
_schema_checks: OrderedDict[bytes, str | None] = OrderedDict()   # SHA-256 of the sorted JSON -> ``_schema_error``
_schema_checks_lock = threading.Lock()   # (requests are validated on several threads)


def _schema_error(schema_json: str) -> str | None:
    """Why the schema (as sorted JSON text) is refused, and where: it breaks its metaschema,
    or bounds an integer beyond what the grammar library holds; None if valid. The last ``SCHEMA_CHECKS_KEPT`` answers are kept by the text's SHA-256, not
    by the text: a request body may carry megabytes of schema, and keeping 1,024 of
    those texts could hold gigabytes for as long as the server runs."""
    digest = hashlib.sha256(schema_json.encode()).digest()
    with _schema_checks_lock:
        if digest in _schema_checks:
            _schema_checks.move_to_end(digest)
            return _schema_checks[digest]
    schema = json.loads(schema_json)
    error = None
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        error = f"is not a valid JSON Schema at {'/'.join(str(p) for p in e.absolute_path) or '(root)'}: " \
                f"{e.message[:300]}"
    except RecursionError:   # (the metaschema check recurses a few frames per level)
        error = f"is not a valid JSON Schema at (root): {TOO_DEEP}"
    if error is None and (bound := _integer_bound_error(schema)) is not None:
        error = (f"bounds an integer beyond 64 bits at {bound} (the grammar library would clamp it, and write "
                 "values the schema forbids)")
    with _schema_checks_lock:
        _schema_checks[digest] = error
        if len(_schema_checks) > SCHEMA_CHECKS_KEPT:
            _schema_checks.popitem(last=False)
    return error


INT64_RANGE = (-(2 ** 63), 2 ** 63 - 1)   # the integers the grammar library can bound (it clamps others)
# an exclusive bound may lie one past the range: its values are still inside it
_INTEGER_BOUNDS = {"minimum": INT64_RANGE, "maximum": INT64_RANGE,
                   "exclusiveMinimum": (INT64_RANGE[0] - 1, INT64_RANGE[1]),
                   "exclusiveMaximum": (INT64_RANGE[0], INT64_RANGE[1] + 1)}
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})   # values there are data, not schemas
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _integer_bound_error(schema) -> str | None:
    """Where (a path of keys) an ``integer`` schema bounds its values beyond 64-bit
    integers, and the bound; None if nowhere. Data (``const``, ``enum``...) is not read."""
    stack = [((), schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, list):
            stack.extend(((*path, i), item) for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
            for name, (low, high) in _INTEGER_BOUNDS.items():
                bound = node.get(name)
                if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not low <= bound <= high:
                    return f"{'/'.join(map(str, (*path, name)))}: {bound!r}"
        for key, value in node.items():
            if key in DATA_KEYWORDS:
                continue
            if key in NAMED_SCHEMAS and isinstance(value, dict):   # (names -> schemas; a name is not a keyword)
                stack.extend(((*path, key, name), sub) for name, sub in value.items())
            else:
                stack.append(((*path, key), value))
    return None
