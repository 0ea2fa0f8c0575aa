"""Server-side tools: Python callables the engine runs when the model calls them,
the built-in ``calculator`` (arithmetic parsed with ``ast``, never ``eval``, run
in a killable worker process), and the cut of an over-long tool result to a
token budget."""

from __future__ import annotations

import ast
import inspect
import json
import logging
import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from jaxserve.tool_worker import IsolatedFunction, ToolError

log = logging.getLogger(__name__)

MAX_TOOL_RESULT_TOKENS = 1024  # a tool result's share of the context, by default
MAX_INT_BITS = 10_000          # largest integer the calculator computes (about 3,000 digits)
TRUNCATION_MARK = "\n[tool result truncated: {dropped} of {total} characters omitted]"
LONE_SURROGATE = re.compile("[\ud800-\udfff]")   # (in a Python str every surrogate code point is a lone one)


@dataclass(frozen=True)
class Tool:
    """A callable tool. ``fn(**arguments)`` returns text (or something ``str()``-able);
    it may be sync or async. ``api_type`` groups it for scheduling predictions."""

    name: str
    fn: Callable[..., Any]
    api_type: str = "tool"
    timeout_s: float = 30.0
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    @property
    def is_async(self) -> bool:
        """An ``async def`` function, or an object whose ``__call__`` is one. (Anything else runs
        on a thread of its own, and an awaitable it returns, as a decorator around an async
        function returns, is awaited there: ``ApiCalls``. A sync wrapper is never called on the
        engine's thread.)"""
        fn = self.fn
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))

    def openai_schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "log": math.log,
          "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan}
_CONSTS = {"pi": math.pi, "e": math.e}


def evaluate_arithmetic(expression: str) -> float | int:
    """Evaluate ``+ - * / // % **``, parentheses, numbers, ``pi``/``e`` and a few
    math functions. Anything else is a ``ValueError``. Exponents are capped, and
    so is the size of every integer result (``MAX_INT_BITS``, checked before a
    power is computed), so a request cannot make it compute a gigantic number."""
    if not isinstance(expression, str) or len(expression) > 1000:
        raise ValueError("expression must be a string of at most 1000 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if abs(right) > 100:
                    raise ValueError("exponent too large")
                if isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > MAX_INT_BITS:
                    raise ValueError("result too large")
            return _check_size(_BINARY[type(node.op)](left, right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _check_size(_UNARY[type(node.op)](ev(node.operand)))
        if isinstance(node, ast.Name) and node.id in _CONSTS:
            return _CONSTS[node.id]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS \
                and not node.keywords:
            return _check_size(_FUNCS[node.func.id](*[ev(a) for a in node.args]))
        raise ValueError(f"unsupported element in expression: {ast.dump(node)[:60]}")

    try:
        return ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except (OverflowError, TypeError) as e:   # float overflow, math domain/arity errors
        raise ValueError(f"cannot evaluate: {e}") from None


def _check_size(value):
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError("result too large")
    return value


def calculator_text(expression: str) -> str:
    """The calculator's answer as text, computed in this process (the worker's entry point).
    A bad expression is a ``ToolError`` whose message the model sees."""
    try:
        value = evaluate_arithmetic(expression)
    except ValueError as e:
        raise ToolError(str(e)) from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


CALCULATOR_TIMEOUT_S = 5.0
_CALCULATOR_WORKERS = IsolatedFunction("jaxserve.tools", "calculator_text", workers=2, max_result_chars=4_000)


def calculator(expression: str) -> str:
    """The built-in tool: ``calculator_text`` in a worker process, killed after
    ``CALCULATOR_TIMEOUT_S`` seconds; the server's threads never run the arithmetic."""
    if not isinstance(expression, str) or len(expression) > 1000:
        raise ToolError("expression must be a string of at most 1000 characters")
    return _CALCULATOR_WORKERS.call(expression, CALCULATOR_TIMEOUT_S)


CALCULATOR = Tool(
    name="calculator", fn=calculator, api_type="math", timeout_s=CALCULATOR_TIMEOUT_S + 1.0,
    description="Evaluate an arithmetic expression.",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)


def normalize_tools(tools: dict | list | None) -> dict[str, Tool]:
    """Accept ``{"name": callable | Tool}`` or ``[Tool, ...]``; always includes ``calculator``."""
    out = {CALCULATOR.name: CALCULATOR}
    if tools is None:
        return out
    items = tools.items() if isinstance(tools, dict) else [(t.name, t) for t in tools]
    for name, tool in items:
        if isinstance(tool, Tool):
            out[name] = tool
        elif callable(tool):
            out[name] = Tool(name=name, fn=tool)
        else:
            raise ValueError(f"tool {name!r} must be a callable or a jaxserve.Tool")
    return out


def call_arguments(arguments: str) -> dict:
    """Parse a call's JSON arguments into a dict (``ValueError`` if it is not an object)."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"tool arguments are not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError("tool arguments must be a JSON object")
    return args


class ResultEncoder:
    """Tool results as context tokens for one tokenizer, never as control: a control token
    written inside a result (a special token such as ``<|im_end|>`` or ``<|eot_id|>``, or an
    added token the chat template or tool format uses as markup, as Qwen's
    ``</tool_response>``) is encoded as the characters it is, so a fetched page holding
    ``<|im_end|>\n<|im_start|>system`` cannot forge a turn. The tokenizer splits text at
    added tokens before anything else, so each such token is replaced in place by its
    characters' tokens and the rest stays as encoded. Other added tokens (whitespace runs,
    words a fine-tune added) stay as the tokenizer writes them. ``markup``: the chat
    template and the tool format's markup text, where control tokens are looked for."""

    def __init__(self, tokenizer, markup: str) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.control = {i: t.content for i, t in added.items() if t.special or t.content in markup}
        self._anchor = tokenizer.encode("\n", add_special_tokens=False) if self.control else []
        self._warned = False

    def encode(self, wrapped: str, spans: list[tuple[int, int]]) -> list[int]:
        """``tokenizer.encode(wrapped, add_special_tokens=False)`` with the control tokens inside
        ``spans`` (the results' text, ``ToolFormat.result_spans``) encoded as text."""
        tokenizer = self.tokenizer
        if not any(token in wrapped[a:b] for a, b in spans for token in self.control.values()):
            return tokenizer.encode(wrapped, add_special_tokens=False)
        try:
            encoded = tokenizer(wrapped, add_special_tokens=False, return_offsets_mapping=True)
            offsets = encoded["offset_mapping"]
        except (KeyError, ValueError, NotImplementedError):   # (a slow tokenizer: no offsets)
            if not self._warned:
                log.warning("this tokenizer gives no offsets: control tokens inside tool results stay control tokens")
                self._warned = True
            return tokenizer.encode(wrapped, add_special_tokens=False)
        ids = []
        for token, (start, end) in zip(encoded["input_ids"], offsets):
            if token in self.control and any(a <= start and end <= b for a, b in spans):
                ids += self._as_text(wrapped[start:end])
            else:
                ids.append(token)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """``text`` (one result) as ``encode`` encodes it inside the wrapper."""
        return self.encode(text, [(0, len(text))])

    def _as_text(self, piece: str) -> list[int]:
        """The ids of ``piece`` (a control token's text) as plain text: after a newline whose
        ids are then dropped (a SentencePiece tokenizer would start a piece of its own with a
        space); special tokens are split by the tokenizer itself, others by cutting the piece
        before its second character, so that no part of it is the token any more."""
        tokenizer, anchor = self.tokenizer, self._anchor
        ids = tokenizer.encode("\n" + piece, add_special_tokens=False, split_special_tokens=True)
        ids = ids[len(anchor):] if ids[:len(anchor)] == anchor else \
            tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)
        if len(piece) < 2 or not any(i in self.control for i in ids):
            return ids
        return self._as_text(piece[:1]) + self._as_text(piece[1:])


def truncate_tool_result(text: str, max_tokens: int, tokenizer, total_chars: int | None = None,
                         encode: Callable[[str], list[int]] | None = None) -> tuple[str, bool]:
    """Cut a tool's rendered result text to at most about ``max_tokens`` tokens, before it is
    wrapped in the chat template's tool turn (so the wrapper stays intact), ending with a
    note of what was dropped. ``total_chars``: the result's full length when ``text`` is
    already a prefix of it. ``encode``: how the result will be encoded (``ResultEncoder.encode_text``;
    default the tokenizer's ``encode``), so the cut counts its tokens as they will be. Returns
    ``(text, truncated)``. Only a prefix of at most ``16 * max_tokens`` characters is ever
    tokenized, however long ``text`` is."""
    total = max(total_chars or 0, len(text))
    head = text[:16 * max(0, max_tokens) + 1]
    encode = encode or (lambda t: tokenizer.encode(t, add_special_tokens=False))   # (``ResultEncoder.encode_text``)
    ids = encode(head) if max_tokens > 0 else []
    if max_tokens > 0 and len(ids) <= max_tokens and len(head) == total:
        return text, False
    mark_tokens = len(tokenizer.encode(TRUNCATION_MARK.format(dropped=total, total=total), add_special_tokens=False))
    if mark_tokens > max_tokens:   # not even the note fits: the shortest one, or nothing
        short = "[truncated]" if len(tokenizer.encode("[truncated]", add_special_tokens=False)) <= max_tokens else ""
        return short, True
    keep = tokenizer.decode(ids[:max_tokens - mark_tokens], skip_special_tokens=False)
    return keep + TRUNCATION_MARK.format(dropped=total - len(keep), total=total), True
