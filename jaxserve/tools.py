"""Server-side tools: Python callables the engine runs when the model calls them,
and the built-in ``calculator`` (arithmetic parsed with ``ast``, never ``eval``)."""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable


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
        return inspect.iscoroutinefunction(self.fn)

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
    math functions. Anything else is a ``ValueError``. Exponents are capped so a
    request cannot make the server compute a gigantic power."""
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
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Name) and node.id in _CONSTS:
            return _CONSTS[node.id]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS \
                and not node.keywords:
            return _FUNCS[node.func.id](*[ev(a) for a in node.args])
        raise ValueError(f"unsupported element in expression: {ast.dump(node)[:60]}")

    try:
        return ev(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None


def calculator(expression: str) -> str:
    value = evaluate_arithmetic(expression)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


CALCULATOR = Tool(
    name="calculator", fn=calculator, api_type="math", timeout_s=5.0,
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
