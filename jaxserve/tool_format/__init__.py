"""Tool-call formats, one module per model family, chosen by name
(``--tool-call-parser``) or detected from the chat template.

- ``hermes`` (alias ``qwen``): ``<tool_call>{json}</tool_call>`` (Hermes, Qwen, SmolLM…);
- ``llama3_json``: a bare ``{"name", "parameters"}`` JSON turn, or a list of them (Llama 3.x);
- ``mistral``: ``[TOOL_CALLS][{json}, …]``.

Every format can write several calls in one turn (``parallel_tool_calls``).

``prepare_chat`` makes tools usable with templates that have no tool support:
the definitions go into a system message in the chosen format, past calls into
the assistant's text.
"""

from __future__ import annotations

from jaxserve.tool_format.base import ParsedToolCall, ToolFormat
from jaxserve.tool_format.hermes import HermesFormat
from jaxserve.tool_format.llama3 import Llama3Format
from jaxserve.tool_format.mistral import MistralFormat

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HermesFormat(), Llama3Format(), MistralFormat())}
ALIASES = {"qwen": "hermes", "llama3": "llama3_json", "llama": "llama3_json"}
DEFAULT_FORMAT = "hermes"


def get_format(name: str) -> ToolFormat:
    """The format called ``name`` (or an alias); unknown names are a ``ValueError`` listing the known ones."""
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        known = ", ".join(sorted([*FORMATS, *ALIASES]))
        raise ValueError(f"unknown tool-call parser {name!r}; available: {known}")
    return FORMATS[key]


def detect_format(chat_template: str | None) -> ToolFormat:
    """The format whose markers the chat template uses; ``hermes`` when none matches."""
    template = chat_template or ""
    for fmt in FORMATS.values():
        if any(m in template for m in fmt.template_markers):
            return fmt
    return FORMATS[DEFAULT_FORMAT]


def select_format(name: str | None, chat_template: str | None) -> ToolFormat:
    """``name`` when given, else detected from ``chat_template``."""
    return get_format(name) if name else detect_format(chat_template)


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the chat template renders a ``tools`` argument at all."""
    return "tools" in (chat_template or "")


def prepare_chat(messages: list[dict], tools: list[dict] | None, fmt: ToolFormat,
                 chat_template: str | None) -> tuple[list[dict], list[dict] | None]:
    """``(messages, tools)`` to hand to ``apply_chat_template``.

    A template with tool support gets them unchanged. Otherwise assistant
    ``tool_calls`` become text in the format (``fmt.render_calls``) and
    ``tool`` messages keep their role with their content as text, tools
    offered or not (a conversation with calls in it, continued with
    ``tool_choice: "none"``, offers none), and the tool definitions, if any,
    go into the system message (``fmt.system_prompt``, appended to an existing
    one); ``tools`` comes back ``None``.
    """
    if template_supports_tools(chat_template):
        return messages, tools
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = fmt.render_calls([(c["function"]["name"], _args_text(c["function"].get("arguments")))
                                      for c in m.pop("tool_calls")])
            m["content"] = (m.get("content") or "") + calls
        m.pop("tool_call_id", None)
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if not tools:
        return out, None
    prompt = fmt.system_prompt(tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _args_text(arguments) -> str:
    import json

    if arguments is None:
        return "{}"
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


__all__ = ["DEFAULT_FORMAT", "FORMATS", "ParsedToolCall", "ToolFormat", "detect_format", "get_format",
           "prepare_chat", "select_format", "template_supports_tools"]
