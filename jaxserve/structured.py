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

from jaxserve.constraints import StructuredOutput
from jaxserve.tool_format.base import ToolFormat

log = logging.getLogger("jaxserve")

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
    ``active`` is False once the turn is complete or the matcher stopped;
    inactive grammars constrain no row.
    """

    def __init__(self, matcher, forced_call: bool = False, ends_with_eos: bool = False) -> None:
        self.matcher = matcher
        self.forced_call = forced_call
        self.ends_with_eos = ends_with_eos
        self.active = True
        self.turn_complete = False
        self.calls: list = []   # ParsedToolCall of the forced turn so far

    def accept(self, token: int) -> str | None:
        """Advance by a generated token. Returns a finish reason when the request
        must end here: ``"stop"`` when the grammar is complete (nothing can follow,
        or its stop token was taken), ``"length"`` when it cannot continue (the token broke it, or the
        grammar hit the library's limits): no allowed text fits, as when
        ``max_tokens`` runs out."""
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
            return "stop"
        return None


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
        self.words = (vocab_size + 31) // 32
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

    def grammar(self, spec: StructuredOutput) -> str:
        """The llguidance grammar text for ``spec``. Raises ``ValueError`` naming the
        request field when the library rejects or cannot satisfy it."""
        import llguidance
        spec.validate()
        if spec.kind == "json_schema":
            text = llguidance.LLMatcher.grammar_from_json_schema(spec.schema, defaults=_JSON_OPTIONS)
        elif spec.kind == "json_object":
            text = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        else:
            text = tool_call_lark(spec, self.tool_format, self._markup)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, self.llg_tokenizer)
        if is_error:
            raise ValueError(f"{spec.param}: the schema cannot be compiled: {messages[0][:300]}")
        return text

    def start(self, spec: StructuredOutput) -> RequestGrammar:
        """A fresh matcher for one request (one per choice when n > 1): a copy of the
        constraint's cached matcher at its start (~2 us; building one is ~1 ms)."""
        import llguidance
        key = spec.key()
        pristine = self._pristine.get(key)
        if pristine is None:
            pristine = llguidance.LLMatcher(self.llg_tokenizer, self.grammar(spec), log_level=0)
            if pristine.is_error():
                raise ValueError(f"{spec.param}: the schema cannot be compiled: {pristine.get_error()[:300]}")
            self._pristine[key] = pristine
            if len(self._pristine) > self._cache_size:
                self._pristine.popitem(last=False)
        else:
            self._pristine.move_to_end(key)
        forced_call = spec.kind == "tool_call"
        return RequestGrammar(pristine.deep_copy(), forced_call,
                              ends_with_eos=forced_call and self.tool_format.turn_ends_with_eos(spec.parallel))

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
        rows = [(g.matcher, i) for i, g in enumerate(grammars) if g is not None and g.active]
        if not rows:
            return None
        return lambda: self.fill(rows, num_rows)

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


def tool_call_lark(spec: StructuredOutput, fmt: ToolFormat, markup: Callable[[str], str]) -> str:
    """Lark grammar (llguidance dialect) for a turn of tool calls in format ``fmt`` to
    ``spec.tools`` (one call, or one or more with ``spec.parallel``): each call object
    ``{"name": NAME, <fmt.args_key>: ARGS}``, ARGS valid against that tool's
    ``parameters``. ``markup(text)`` renders the format's fixed markup as lark terminals."""
    alternatives, rules = [], []
    for i, tool in enumerate(spec.tools):
        call = {"type": "object", "properties": {"name": {"const": tool.name}, fmt.args_key: tool.parameters},
                "required": ["name", fmt.args_key], "additionalProperties": False,
                "x-guidance": _JSON_OPTIONS}
        alternatives.append(f"call_{i}")
        rules.append(f"call_{i}: %json {json.dumps(call)}")
    return "\n".join([fmt.forced_call_grammar("call", spec.parallel, markup),
                      f"call: {' | '.join(alternatives)}", *rules])
