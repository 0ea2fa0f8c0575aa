"""Grammar-constrained decoding on the host, with llguidance.

``StructuredDecoding`` (one per engine) compiles a request's
``StructuredOutput`` into an llguidance grammar (JSON Schema, any JSON object,
or a forced turn of tool calls in the engine's tool-call format: one call, or
one or more with ``parallel``) and gives the request a
``RequestGrammar``: its matcher state, kept in the engine's request record, so
it survives API pauses (returned tokens are context, never fed to it) and
preemption. Every step, ``bitmask_fn`` returns a function that fills the packed
token bitmask of the batch's constrained rows; the runner calls it after
dispatching the forward, so the host fills masks while the device computes,
then applies the mask in the jitted sampler (``jaxserve.sampling.sample_masked``).
A step with no constrained row returns ``None`` and takes the unmasked path.

Bitmask layout (llguidance's and xgrammar's): ``int32 [rows, ceil(vocab / 32)]``,
bit ``j`` of word ``i`` set = token ``32 * i + j`` allowed; unconstrained rows
are all ones (-1).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from typing import Callable

import numpy as np

from jaxserve.constraints import DATA_KEYWORDS, JSON_KINDS, NAMED_SCHEMAS, StructuredOutput
from jaxserve.reasoning import ReasoningFormat
from jaxserve.tool_format.base import ToolFormat, regex_literal

log = logging.getLogger("jaxserve")


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32

# Fixed separators as json.dumps / chat templates write them (what models saw most),
# and no other whitespace (a model cannot stall in endless spaces).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class RequestGrammar:
    """One request's position in its grammar.

    ``forced_call``: the grammar is a turn of tool calls. When the turn is
    complete (``turn_complete``) the constraint ends: the engine pauses on the
    calls parsed from it (``calls``, kept here by the engine) and, after their
    results, the request continues unconstrained. ``ends_with_eos``: the turn is
    complete only when the model ends it with an EOS token (parallel Hermes
    blocks: after a block, another may follow); otherwise when its text is.
    ``close_token``: in a parallel turn, the token that ends it after a complete
    call (EOS for Hermes blocks, ``]`` for a list); at such a point, when the
    tokens left would not fit another call of the average size so far and its
    close before the last token, the next token is forced to it
    (``forced_token``), so a model that keeps calling still returns its
    complete calls. ``active`` is False once the turn is complete or
    the matcher stopped; inactive grammars constrain no row. ``dormant``: the grammar
    waits for the model's reasoning to end (``sleep``, then ``wake``); until then it is
    inactive and takes no token. ``thinks_first``: the grammar itself lets the turn open
    with a reasoning block before the constrained answer (``thinking_first_lark``).
    ``optional_calls``: the turn is text with no call, or (text and then) calls
    (``StructuredOutput.optional``, ``optional_call_lark``); the engine pauses on the
    calls as the parser finds them, as without a grammar; after server-side tools' results
    the grammar starts over (``rearm``: every turn of the request may call the allowed
    tools only), after a client's it ends (they open a new response).
    """

    def __init__(self, matcher, forced_call: bool = False, ends_with_eos: bool = False,
                 close_token: int | None = None, string_token: int | None = None,
                 optional_calls: bool = False) -> None:
        self.matcher = matcher
        self.forced_call = forced_call
        self.optional_calls = optional_calls
        self.ends_with_eos = ends_with_eos
        self.close_token = close_token
        self.string_token = string_token   # '"': allowed inside no call boundary, only around strings
        self.active = True
        self.dormant = False
        self.turn_complete = False
        self.thinks_first = False
        self.calls: list = []   # ParsedToolCall of the forced turn so far
        self.forced_token: int | None = None
        self._tokens = 0        # tokens of the turn so far
        self._boundaries = 0    # points after a complete call where the turn could close

    def rearm(self) -> None:
        """Constrain the next turn as the first (``optional_calls``: after a turn's calls)."""
        self.matcher.reset()
        self.active, self.dormant = True, False

    def sleep(self) -> None:
        """Constrain nothing until ``wake`` (the turn reasons first: the answer is constrained)."""
        self.active, self.dormant = False, True

    def wake(self) -> None:
        """The reasoning ended: constrain the tokens from the next one on."""
        if self.dormant:
            self.active, self.dormant = True, False

    def accept(self, token: int, tokens_left: int | None = None) -> str | None:
        """Advance by a generated token (``tokens_left``: of ``max_tokens``, after it).
        Returns a finish reason when the request must end here: ``"stop"`` when the
        grammar is complete (nothing can follow, or its stop token was taken),
        ``"length"`` when it cannot continue (the token broke it, or the grammar hit
        the library's limits): no allowed text fits, as when ``max_tokens`` runs out."""
        if not self.active:
            return None
        m = self.matcher
        if not m.consume_token(int(token)) or m.is_error():
            log.warning("structured output: grammar cannot continue (%s); ending with 'length'",
                        m.get_error()[:200])
            self.active = False
            return "length"
        if self.forced_call and (m.is_stopped() or (m.is_accepting() and not self.ends_with_eos)):
            self.active = False   # the forced turn is complete: the engine pauses on its calls, then free text
            self.turn_complete = True
            return None
        if m.is_stopped():
            self.active = False
            return None if self.optional_calls else "stop"   # (calls end the turn: the engine pauses on them)
        self._tokens += 1
        if self.close_token is not None and tokens_left is not None and self._at_call_boundary():
            self._boundaries += 1
            # room for another call of the average size, its close, and one token to spare (a call is
            # judged by its turn's average size: a longer one would be cut)
            if tokens_left < self._tokens / self._boundaries + 2:
                self.forced_token = self.close_token
        return None

    def _at_call_boundary(self) -> bool:
        """Right after a complete call of a parallel turn: the close token is allowed
        (and, for a list, no string is open or about to open, where ``]`` is text too)."""
        m = self.matcher
        return m.validate_tokens([self.close_token]) == 1 and \
            (self.string_token is None or m.validate_tokens([self.string_token]) == 0)


class StructuredDecoding:
    """Compiles constraints for one tokenizer and fills batch bitmasks.

    ``vocab_size``: the model's logits width (may exceed the tokenizer's; extra
    ids are never allowed). ``eos_token_ids``: the ids that end a completed
    grammar. ``tool_format``: the format forced tool calls are written in
    (``jaxserve.tool_format``). The llguidance tokenizer (about 0.6 s for a 49k vocabulary) is
    built on the first constrained request, so engines that never see one pay
    nothing.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int] | list[int], tool_format: ToolFormat,
                 cache_size: int = 256) -> None:
        self.hf_tokenizer = tokenizer
        self.tool_format = tool_format
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.eos_token_ids = sorted(eos_token_ids)
        self._llg_tokenizer = None
        self._pristine: OrderedDict[str, object] = OrderedDict()   # constraint key -> matcher at its start
        self._cache_size = cache_size
        self.fill_s = 0.0        # host seconds spent filling bitmasks (all steps)
        self.rows_filled = 0     # constrained rows filled (all steps)

    # ----------------------------------------------------------- compiling
    @property
    def llg_tokenizer(self):
        if self._llg_tokenizer is None:
            import llguidance
            import llguidance.hf
            self._llg_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids)
        return self._llg_tokenizer

    def grammar(self, spec: StructuredOutput, reasoning: ReasoningFormat | None = None) -> str:
        """The llguidance grammar text for ``spec`` (``reasoning``: an answer that may follow
        a reasoning block in that format, ``thinking_first_lark``). Raises ``ValueError``
        naming the request field when the library rejects or cannot satisfy it."""
        import llguidance
        spec.validate()
        try:
            text = self._grammar_text(spec, reasoning)
        except ValueError as e:   # (the library's own refusals name no field)
            raise ValueError(f"{spec.param}: {_what(spec)} cannot be compiled: {str(e)[:300]}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.llg_tokenizer)
        if is_error:
            raise ValueError(f"{spec.param}: {_what(spec)} cannot be compiled: {messages[0][:300]}")
        return text

    def _grammar_text(self, spec: StructuredOutput, reasoning: ReasoningFormat | None) -> str:
        """``grammar``'s text before the library validates it (its converters may raise ``ValueError``)."""
        import llguidance
        if reasoning is not None and spec.may_reason_first:
            return thinking_first_lark(spec, reasoning, self._markup, self.tool_format)
        elif spec.optional:
            return optional_call_lark(spec, self.tool_format, self._markup)
        elif spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.schema, defaults=_JSON_OPTIONS)
        elif spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        elif spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.pattern)
        elif spec.kind == "choice":
            return f"start: {_alternatives(spec.choices)}"
        elif spec.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(spec.pattern)
        else:
            return tool_call_lark(spec, self.tool_format, self._markup)

    def start(self, spec: StructuredOutput, reasoning: ReasoningFormat | None = None) -> RequestGrammar:
        """A fresh matcher for one request (one per choice when n > 1): a copy of the
        constraint's cached matcher at its start (~2 us; building one is ~1 ms).
        ``reasoning``: the turn may open with a reasoning block in that format before
        the answer the constraint asks for (``StructuredOutput.may_reason_first``; ``thinks_first``;
        ignored for other kinds)."""
        if not spec.may_reason_first:   # (``thinking_first_lark``'s answers)
            reasoning = None
        pristine = self._pristine_matcher(spec, reasoning)
        if spec.optional or spec.kind != "tool_call":
            grammar = RequestGrammar(pristine.deep_copy(), optional_calls=spec.optional)
            grammar.thinks_first = reasoning is not None
            return grammar
        ends_with_eos = self.tool_format.turn_ends_with_eos(spec.parallel)
        close = self.eos_token_ids[0] if ends_with_eos else self._single_token("]") if spec.parallel else None
        return RequestGrammar(pristine.deep_copy(), True, ends_with_eos, close,
                              None if ends_with_eos else self._single_token('"'))

    def _pristine_matcher(self, spec: StructuredOutput, reasoning: ReasoningFormat | None):
        """The constraint's cached matcher at its start, compiled on first use. A language with
        no text at all (``{"$ref": "#"}``: its first mask errs) is a ``ValueError`` naming the
        field; with ``reasoning``, the answer's own language is checked (the reasoning block
        before it always has text)."""
        import llguidance
        key = spec.key() if reasoning is None else json.dumps([spec.key(), reasoning.start, reasoning.end])
        pristine = self._pristine.get(key)
        if pristine is not None:
            self._pristine.move_to_end(key)
            return pristine
        if reasoning is not None:
            self._pristine_matcher(spec, None)
        pristine = llguidance.LLMatcher(self.llg_tokenizer, self.grammar(spec, reasoning), log_level=0)
        if pristine.is_error():
            raise ValueError(f"{spec.param}: {_what(spec)} cannot be compiled: {pristine.get_error()[:300]}")
        probe = pristine.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():   # (the library's message goes on with its whole state: its first line is why)
            raise ValueError(f"{spec.param}: no text satisfies {_what(spec)} "
                             f"({probe.get_error().splitlines()[0][:200]})")
        self._pristine[key] = pristine
        if len(self._pristine) > self._cache_size:
            self._pristine.popitem(last=False)
        return pristine

    def _single_token(self, text: str) -> int | None:
        """The id of ``text`` when the tokenizer has it as one token, else None."""
        ids = self.hf_tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _markup(self, text: str) -> str:
        """A lark terminal for tool-call markup: the token itself when the tokenizer
        has it as one added token (llguidance treats those as special), else the text."""
        ids = self.hf_tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in getattr(self.hf_tokenizer, "added_tokens_decoder", {}):
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    # ------------------------------------------------------------ per step
    def bitmask_fn(self, grammars: list[RequestGrammar | None], num_rows: int) -> Callable[[], np.ndarray] | None:
        """For a batch whose row ``i`` belongs to ``grammars[i]`` (None: unconstrained),
        padded to ``num_rows``: a function returning the ``int32 [num_rows, words]``
        bitmask, or ``None`` when no row is constrained."""
        rows = [(g.matcher, i) for i, g in enumerate(grammars)
                if g is not None and g.active and g.forced_token is None]
        forced = [(i, g.forced_token) for i, g in enumerate(grammars)
                  if g is not None and g.active and g.forced_token is not None]
        if not rows and not forced:
            return None
        if not forced:
            return lambda: self.fill(rows, num_rows)
        return lambda: _force_tokens(self.fill(rows, num_rows), forced)

    def fill(self, rows: list[tuple[object, int]], num_rows: int) -> np.ndarray:
        """Fill the masks of ``rows`` (matcher, row index) on the host, one after the
        other, each matcher writing straight into its row (the call
        ``llguidance.numpy.fill_next_token_bitmask`` makes, without its per-row checks
        and slicing: 1.3 us a row less). About 5-10 us a row for JSON Schemas over the
        demo vocabulary; llguidance's thread-pool fill (``fill_next_token_bitmask_par``)
        waits for its pool thread, which on a busy 2-core machine cost more than it saved."""
        start = time.perf_counter()
        bitmask = np.full((num_rows, self.words), -1, np.int32)
        base, row_bytes = bitmask.ctypes.data, bitmask.strides[0]   # C-contiguous int32 rows
        for matcher, row in rows:
            matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
        self.fill_s += time.perf_counter() - start
        self.rows_filled += len(rows)
        return bitmask


def _what(spec: StructuredOutput) -> str:
    """How an error names ``spec``'s constraint: "the schema" (JSON, tool parameters), else its kind."""
    return "the schema" if spec.kind in JSON_KINDS or spec.kind == "tool_call" else f"the {spec.kind}"


def _force_tokens(bitmask: np.ndarray, forced: list[tuple[int, int]]) -> np.ndarray:
    """Rows ``(row, token)`` of ``bitmask`` allow that one token only."""
    for row, token in forced:
        bitmask[row] = 0
        bitmask[row, token >> 5] = np.uint32(1 << (token & 31)).view(np.int32)
    return bitmask


def tool_call_lark(spec: StructuredOutput, fmt: ToolFormat, markup: Callable[[str], str],
                   opener: str | None = None) -> str:
    """Lark grammar (llguidance dialect) for a turn of tool calls in format ``fmt`` to
    ``spec.tools`` (one call, or one or more with ``spec.parallel``): each call object
    ``{"name": NAME, <fmt.args_key>: ARGS}``, ARGS valid against that tool's
    ``parameters``. ``markup(text)`` renders the format's fixed markup as lark terminals;
    ``opener`` replaces the turn's first opening markup (``ToolFormat.forced_call_grammar``)."""
    alternatives, rules = [], []
    for i, tool in enumerate(spec.tools):
        parameters = _rebased_refs(tool.parameters, f"#/properties/{fmt.args_key}")
        call = {"type": "object", "properties": {"name": {"const": tool.name}, fmt.args_key: parameters},
                "required": ["name", fmt.args_key], "additionalProperties": False,
                "x-guidance": _JSON_OPTIONS}
        alternatives.append(f"call_{i}")
        rules.append(f"call_{i}: %json {json.dumps(call)}")
    return "\n".join([fmt.forced_call_grammar("call", spec.parallel, markup, opener),
                      f"call: {' | '.join(alternatives)}", *rules])


def _rebased_refs(schema, prefix: str):
    """``schema`` with its JSON-pointer references to its own root (``$ref`` "#" and
    "#/..."; pydantic's and ``openai.pydantic_function_tool``'s ``#/$defs/...``)
    rebased to ``prefix``, the pointer of where it sits inside a larger schema (a
    copy). Anchors ("#name") are left alone, as is a subschema with an ``$id``: its
    references resolve against itself, wherever it sits."""
    if isinstance(schema, list):
        return [_rebased_refs(item, prefix) for item in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = prefix + value[1:]
        elif key in DATA_KEYWORDS:
            out[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):   # names (maybe "enum", "$ref") -> schemas
            out[key] = {name: _rebased_refs(sub, prefix) for name, sub in value.items()}
        else:
            out[key] = _rebased_refs(value, prefix)
    return out


def optional_call_lark(spec: StructuredOutput, fmt: ToolFormat, markup: Callable[[str], str],
                       rule: str = "start", not_opening: str | None = None) -> str:
    """Lark grammar (llguidance dialect) for a turn that is text in which ``fmt``'s parser
    finds no call (it matches none of ``fmt.call_starts``), or a turn of calls to
    ``spec.tools`` as ``tool_call_lark`` writes it, after text where the format lets calls
    follow text (``fmt.call_opener``). When the opener is a special token, the text ends
    where it comes; when it is text, one lexeme holds the text and the opener (its only
    occurrence, at its end), since llguidance does not end a lexeme where another may
    begin inside it. ``rule``: the name of the grammar's top rule. ``not_opening``: text
    the turn's text may not open with (a reasoning start tag written as text: the turn
    then reasons, ``thinking_first_lark``)."""
    opening = () if not_opening is None else (f"(?s:{regex_literal(not_opening)}.*)",)
    text = "TEXT: /(?s:.+)/" + _excluding((*fmt.call_starts, *opening))
    opener = None
    if fmt.call_opener is not None:
        tag = markup(fmt.call_opener)
        if _is_token(tag):
            opener, lead = "lead", f"lead: TEXT? {tag}"
        else:
            literal = regex_literal(fmt.call_opener)
            opener, lead = "LEAD", f"LEAD: /(?s:.*{literal})/" + _excluding((f"(?s:.*{literal}.+)", *opening))
        text += "\n" + lead
    calls = tool_call_lark(spec, fmt, markup, opener).replace("start:", "calls:", 1)
    return "\n".join([f"{rule}: TEXT | calls", text, calls])


def _excluding(patterns) -> str:
    """Lark terminal operators (llguidance's ``&`` and ``~``) that take out of the terminal
    before them every text matching one of ``patterns`` (Rust regexes, whole text)."""
    return "".join(f" & ~/{pattern}/" for pattern in patterns)


def _is_token(terminal: str) -> bool:
    """Whether ``terminal`` (what ``StructuredDecoding._markup`` renders) is a special token
    (``<[id]>``), which no text terminal can hold, rather than text."""
    return terminal.startswith("<[")


def _alternatives(choices: tuple[str, ...]) -> str:
    """A lark rule's body that matches exactly one of ``choices``."""
    return " | ".join(json.dumps(choice) for choice in choices)


def thinking_first_lark(spec: StructuredOutput, fmt: ReasoningFormat, markup: Callable[[str], str],
                        tool_format: ToolFormat) -> str:
    """Lark grammar (llguidance dialect) for a turn that may open with a reasoning block
    (``fmt.start``, any text, ``fmt.end``, up to 4 newlines: what the reasoning split skips;
    a space would be the answer's) and then gives the answer ``spec`` asks for
    (``may_reason_first``: JSON, a regex, a choice, text or calls): a thinking model
    (Qwen3) reasons as it would, and only the answer is constrained.
    ``markup(text)`` renders the tags: a special token (the text before it can never
    hold it) or text (the reasoning stops at its first occurrence). ``tool_format``: the
    format an optional turn of calls is written in."""
    import llguidance
    if spec.kind == "regex":   # (llguidance's own rendering of a regex as lark: ``start: /.../``, escaped)
        lark = json.loads(llguidance.LLMatcher.grammar_from_regex(spec.pattern))["grammars"][0]["lark_grammar"]
        answer = "answer:" + lark.removeprefix("start:")
    elif spec.kind == "choice":
        answer = f"answer: {_alternatives(spec.choices)}"
    elif spec.optional:   # (its text may not open with a start tag written as text: that opens the reasoning)
        tag = None if _is_token(markup(fmt.start)) else fmt.start
        answer = optional_call_lark(spec, tool_format, markup, "answer", tag)
    else:
        schema = spec.schema if spec.kind == "json_schema" else {"type": "object"}
        answer = f"answer: %json {json.dumps({**schema, 'x-guidance': schema.get('x-guidance', _JSON_OPTIONS)})}"
    start, end = markup(fmt.start), markup(fmt.end)
    if _is_token(end):
        think = [f"think: {start} /(?s:.*)/ {end} /\\n{{0,4}}/"]
    else:
        think = [f"think: {start} thought /\\n{{0,4}}/", f"thought[stop={end}]: /(?s:.*)/"]
    return "\n".join(["start: think? answer", *think, answer])
