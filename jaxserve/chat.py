"""What a chat template is given, in one place for the server's ``/v1/chat/completions``
and ``LLM.chat``: OpenAI-style messages and function tools, checked and normalized
(``template_message``, ``function_tools``), and the token ids they render to
(``render_chat``). Bad input is a ``ValueError`` whose message starts with the field."""

from __future__ import annotations

import re

from jaxserve.constraints import check_schema
from jaxserve.tool_format import ToolFormat, prepare_chat

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")   # OpenAI's function names (the server's FunctionDef too)
# ``apply_chat_template``'s own arguments: ``chat_template_kwargs`` may not set them (the
# template, the tools and the rendering mode are the caller's to choose).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def template_message(message: dict, where: str = "messages") -> dict:
    """``message`` as a chat template sees it: text parts joined, ``developer`` as
    ``system``, reasoning (``reasoning_content`` or ``reasoning``) kept on assistant
    messages only, each tool call ``{"id", "type": "function", "function": {"name",
    "arguments"}}``. ``ValueError`` naming ``where`` for a message that is not one."""
    if not isinstance(message, dict):
        raise ValueError(f"{where}: a message is a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role: must be one of {', '.join(ROLES)}, got {role!r}")
    out: dict = {"role": "system" if role == "developer" else role, "content": _text(message.get("content"), where)}
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if reasoning is not None and role == "assistant":
        if not isinstance(reasoning, str):
            raise ValueError(f"{where}.reasoning_content: must be a string")
        out["reasoning_content"] = reasoning
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls: must be a list of tool calls")
        out["tool_calls"] = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise ValueError(f"{where}.{key}: must be a string")
            out[key] = message[key]
    return out


def _text(content, where: str) -> str | None:
    """A message's content as one string (None stays None): text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ValueError(f"{where}.content: a string or a list of {{'type': 'text', 'text': str}} parts "
                     f"(this server reads text only)")


def _tool_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
            or not isinstance(fn.get("arguments", "{}"), (str, dict)):
        raise ValueError(f"{where}: expected {{'function': {{'name': str, 'arguments': str | dict}}}}")
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        raise ValueError(f"{where}.id: must be a string")
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}}


def function_tool(name: str, description: str | None = None, parameters: dict | None = None) -> dict:
    """An OpenAI function tool as a chat template is handed it: ``description`` only when
    given, ``parameters`` an empty object schema when not."""
    fn = {"name": name}
    if description is not None:
        fn["description"] = description
    fn["parameters"] = parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def function_tools(tools, field: str = "tools") -> list[dict]:
    """OpenAI tool dicts (``{"type": "function", "function": {"name", "description"?,
    "parameters"?}}``, names as OpenAI allows them, each once) as ``function_tool`` writes
    them, with ``parameters`` a valid JSON Schema; ``ValueError`` naming ``field`` otherwise."""
    if not isinstance(tools, list):
        raise ValueError(f"{field}: a list of tools, got {type(tools).__name__}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.match(fn["name"]) \
                or not isinstance(fn.get("description", ""), (str, type(None))) \
                or not isinstance(fn.get("parameters", {}), (dict, type(None))):
            raise ValueError(f"{field}[{i}]: expected {{'type': 'function', 'function': {{'name': 1-64 of "
                             f"A-Za-z0-9_.-, 'description'?: str, 'parameters'?: JSON Schema}}}}, got {tool!r}"[:300])
        if fn.get("parameters") is not None:   # (the server's check: a schema its grammar could compile)
            check_schema(fn["parameters"], f"{field}[{i}].function.parameters", "parameters")
        if fn["name"] in seen:
            raise ValueError(f"{field}[{i}]: a second tool named {fn['name']!r}")
        seen.add(fn["name"])
        out.append(function_tool(fn["name"], fn.get("description"), fn.get("parameters")))
    return out


def advertised_tools(declared: list[dict], registered: dict) -> list[dict]:
    """The tools a chat is rendered with: ``declared`` (the request's, as ``function_tool``
    writes them), then the ``registered`` ones (``jaxserve.Tool``s by name) they do not shadow."""
    names = {t["function"]["name"] for t in declared}
    return declared + [t.openai_schema() for name, t in registered.items() if name not in names]


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, tool_format: ToolFormat,
                options: dict) -> list[int]:
    """Token ids of ``messages`` (``template_message``'s) rendered with ``tokenizer``'s chat
    template, ``tools`` advertised (through the template's tool support, or the format's
    system prompt for a template without: ``prepare_chat``), ``options`` given to
    ``apply_chat_template``. The template's own errors (jinja's) propagate."""
    rendered, tool_defs = prepare_chat(messages, tools or None, tool_format, tokenizer.chat_template)
    text = tokenizer.apply_chat_template(rendered, tools=tool_defs, tokenize=False, **options)
    return tokenizer.encode(text, add_special_tokens=False)
