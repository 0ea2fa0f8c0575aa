"""Request and response bodies of the OpenAI-compatible routes (pydantic v2).

Requests ignore unknown fields (clients send many) and read a field sent as
``null`` as its default (OpenAI types them "or null"); fields we know but do
not implement are rejected when set to a non-default value, so a client is
never silently given something other than what it asked for. Types are
strict, as the OpenAI contract says, not Python's truthiness: ``"yes"`` is not
a boolean, ``true`` is not an integer, an integer is a valid number. Every
numeric field is bounded by what the engine can hold (``jaxserve.sampling_params``)
and every string must be valid Unicode (no lone surrogates such as ``"\ud800"``).
Responses are serialized with ``exclude_none`` so no ``null`` fields reach the client.
"""

from __future__ import annotations

import base64
import binascii
import time
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from jaxserve.sampling_params import (INT32_MAX, MAX_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_STOP_CHARS,
                                      REPETITION_RANGE)
from jaxserve.chat import RESERVED_TEMPLATE_KWARGS, TOOL_NAME, function_tool, template_message

MAX_N = 16
MAX_STOP_TOKEN_IDS = 64


def _valid_unicode(v: str) -> str:
    """Reject strings the tokenizer cannot encode (lone UTF-16 surrogates survive JSON decoding)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (no lone surrogates)") from None
    return v


Text = Annotated[str, AfterValidator(_valid_unicode)]


def joined_text(content) -> str:
    """A message's content as one string: a string as is, text parts joined."""
    return content if isinstance(content, str) else "".join(part.text for part in content)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """A field sent as ``null`` takes its default, as OpenAI's API reads it (clients that
        serialize every field send ``"logprobs": null``, ``"temperature": null``...)."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# OpenAI's reasoning efforts (chat ``reasoning_effort``, Responses ``reasoning.effort``)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: the schema the answer must validate against."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only allowed with it")
        return self


class ToolChoiceFunction(_Request):
    name: str


class ToolChoice(_Request):
    """``{"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"]
    function: ToolChoiceFunction


class AllowedTools(_Request):
    """``mode``: ``"required"``, one or more calls to ``tools``; ``"auto"``, the model
    answers in text or calls some of them. ``tools``: ``{"type": "function",
    "function": {"name": ...}}`` each, names among the request's (or the server's) tools."""

    mode: Literal["auto", "required"]
    tools: list[ToolChoice] = Field(min_length=1)


class AllowedToolsChoice(_Request):
    """``{"type": "allowed_tools", "allowed_tools": {...}}``: the model may call only
    these tools; every tool stays in the prompt (so its prefix stays cached)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class StructuredOutputsParams(_Request):
    """vLLM's ``structured_outputs`` (exactly one of them): ``json`` (a JSON Schema),
    ``json_object``, ``regex``, ``choice`` or ``grammar`` (Lark, llguidance's dialect)."""

    json_: dict | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None


# OpenAI's ``service_tier`` as a priority class (``_PriorityFields``): "flex" after the default tier,
# "priority" before it.
SERVICE_TIER_PRIORITY = {"auto": 0, "default": 0, "flex": 1, "priority": -1}


class _PriorityFields(_Request):
    """Where a request stands in the engine's queue: ``priority`` (vLLM's extra
    parameter; lower is admitted first and preempted last, the scheduling policy ranks
    requests within a class), or OpenAI's ``service_tier`` when ``priority`` is not given."""

    priority: int | None = Field(default=None, ge=-INT32_MAX, le=INT32_MAX)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None

    @property
    def priority_class(self) -> int:
        """The engine request's ``priority``."""
        return self.priority if self.priority is not None else SERVICE_TIER_PRIORITY[self.service_tier or "auto"]

    @property
    def served_tier(self) -> str | None:
        """The ``service_tier`` a response reports (OpenAI's: only when asked; "auto" is served
        as "default")."""
        return None if self.service_tier is None else ("default" if self.service_tier == "auto" else self.service_tier)


class _SamplingFields(_PriorityFields):
    model: Text
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)   # (vLLM's extra parameter)
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    stop: Text | list[Annotated[Text, Field(max_length=MAX_STOP_CHARS)]] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True   # (vLLM's extra parameter) False: special tokens stay in the text
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)
    # token id (a string, as JSON keys are) -> bias; checked against the vocabulary by the engine
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS, allow_inf_nan=False)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    repetition_penalty: float = Field(default=1.0, ge=REPETITION_RANGE[0], le=REPETITION_RANGE[1],
                                      allow_inf_nan=False)   # (vLLM's extra parameter)
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)   # (vLLM's extra parameter)
    # (vLLM's extra parameter) token ids that end the output as EOS does (finish_reason "stop"; not in the text)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False   # (vLLM's extra parameter) the text keeps the stop string or token
    user: Text | None = Field(default=None, max_length=256)
    response_format: ResponseFormat | None = None
    # (vLLM's extra parameters) constraints beyond response_format; the guided_* ones are its older names
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[int, float] | None:
        if v is None:
            return None
        out = {}
        for key, bias in v.items():
            if not key.isascii() or not key.isdigit() or len(key) > 10 or int(key) > INT32_MAX:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if int(key) in out:
                raise ValueError(f"token {int(key)} is given twice")
            out[int(key)] = bias
        return out

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 8 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most 8 non-empty stop strings of at most {MAX_STOP_CHARS} characters")
        return stops

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self


class CompletionRequest(_SamplingFields):
    prompt: Union[Text, list[Text], list[TokenId], list[list[TokenId]]]
    # 0 with ``echo``: score the prompt only (the engine samples one token, which is not returned)
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    echo: bool = False   # the text starts with the prompt's; with logprobs, the prompt's tokens are scored too
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)   # alternatives per token (0: the token's own)
    suffix: Text | None = None
    best_of: int | None = None   # refused above 1: one sample per choice is all this server draws

    @model_validator(mode="after")
    def _zero_tokens_only_to_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only for scoring a prompt: it needs echo")
        return self

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, str) and not v:
            raise ValueError("must not be empty")
        if isinstance(v, list) and (not v or any(isinstance(p, (str, list)) and not p for p in v)):
            raise ValueError("must not be empty")
        return v

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported(cls, v, info):
        unsupported = v is not None and v != 1 if info.field_name == "best_of" else v
        if unsupported:
            raise ValueError("not supported")
        return v


class FunctionCall(_Request):
    name: Text
    arguments: Text | dict = "{}"


class ToolCall(_Request):
    id: Text = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    # An assistant message's reasoning as this server returned it (either name): templates that
    # show the current turn's reasoning (Qwen3's) read ``reasoning_content``.
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    def template_dict(self) -> dict:
        """The message as the chat template sees it (``jaxserve.chat.template_message``)."""
        return template_message(self.model_dump(exclude_none=True))


class FunctionDef(_Request):
    name: str = Field(pattern=TOOL_NAME.pattern)
    description: Text | None = None
    parameters: dict | None = None


class ToolDef(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef

    def schema_dict(self) -> dict:
        return function_tool(self.function.name, self.function.description, self.function.parameters)


class _ChatTemplateFields(_Request):
    """How ``messages`` are rendered (vLLM's extra parameters): ``add_generation_prompt``
    opens the assistant's turn after them; ``continue_final_message`` leaves the last
    message open instead, so the model continues it (an assistant prefill; the reply
    holds only the continuation); ``chat_template_kwargs`` are extra variables for the
    chat template (e.g. ``{"enable_thinking": false}``). ``reasoning_effort`` (OpenAI's)
    reaches the template as the variable ``reasoning_effort`` (gpt-oss's templates read
    it); ``"none"`` and ``"minimal"`` also set ``enable_thinking: false`` (Qwen3's templates
    then write an empty thinking block: the model answers without thinking), unless
    ``chat_template_kwargs`` set these themselves."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    reasoning_effort: ReasoningEffort | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, v: dict | None) -> dict | None:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(v or ()))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is set by the server, not by chat_template_kwargs")
        return v

    @model_validator(mode="after")
    def _one_way_to_end(self):
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message and add_generation_prompt: not both (the reply either "
                             "continues the last message or opens a new one)")
        return self

    @property
    def generation_prompt(self) -> bool:
        """Whether the rendering opens the assistant's turn (not when continuing the last message)."""
        return self.add_generation_prompt and not self.continue_final_message

    def template_options(self) -> dict:
        """``apply_chat_template`` keyword arguments for the rendering these fields ask for."""
        effort = {}
        if self.reasoning_effort is not None:
            effort["reasoning_effort"] = self.reasoning_effort
            if self.reasoning_effort in ("none", "minimal"):
                effort["enable_thinking"] = False
        return {**effort, **(self.chat_template_kwargs or {}), "add_generation_prompt": self.generation_prompt,
                "continue_final_message": self.continue_final_message}


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | AllowedToolsChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    parallel_tool_calls: bool | None = None
    # (an extension, the Responses API's: server-side tool calls this request may run in all)
    max_tool_calls: int | None = Field(default=None, ge=0, le=INT32_MAX)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed with logprobs: true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: alternatives per token, or None when not asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_ChatTemplateFields):
    """``POST /tokenize`` (vLLM's): a completions ``prompt``, or chat ``messages`` (with
    ``tools`` and ``tool_choice``) rendered exactly as ``/v1/chat/completions`` renders them."""

    model: Text
    prompt: Text | None = None
    add_special_tokens: bool = True   # (a prompt: as completions encode it)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | AllowedToolsChoice | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one of them")
        if self.prompt is not None and self.model_fields_set & {"add_generation_prompt", "continue_final_message",
                                                                "chat_template_kwargs"}:
            raise ValueError("prompt cannot take add_generation_prompt, continue_final_message or "
                             "chat_template_kwargs (they render messages)")
        return self


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's): token ids to text."""

    model: Text
    tokens: list[TokenId] = Field(min_length=1)
    skip_special_tokens: bool = True


# ------------------------------------------------------------------ responses
class _Response(BaseModel):
    def dump(self) -> dict:
        return self.model_dump(exclude_none=True)


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None   # when some tokens were reasoning


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jaxserve"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------ Responses API
MAX_STORED_METADATA = 16   # ``metadata`` pairs (OpenAI's limit)


class ResponseInputText(_Request):
    """A text part of an input message (``input_text``; an earlier turn's ``output_text``)."""

    type: Literal["input_text", "output_text"]
    text: Text


class ResponseMessageItem(_Request):
    """``{"role", "content"}`` (``type: "message"`` optional): a message of the conversation."""

    type: Literal["message"] = "message"
    id: Text | None = Field(default=None, max_length=256)   # kept as given (an earlier output item's)
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[ResponseInputText]


class ResponseFunctionCallItem(_Request):
    """A tool call the model made in an earlier turn (as a response's ``output`` lists it)."""

    type: Literal["function_call"]
    id: Text | None = Field(default=None, max_length=256)
    call_id: Text = Field(min_length=1, max_length=256)
    name: Text = Field(min_length=1, max_length=64)
    arguments: Text


class ResponseFunctionCallOutputItem(_Request):
    """The client's result for the tool call ``call_id``."""

    type: Literal["function_call_output"]
    id: Text | None = Field(default=None, max_length=256)
    call_id: Text = Field(min_length=1, max_length=256)
    output: Text | list[ResponseInputText]

    @property
    def text(self) -> str:
        return joined_text(self.output)


class ResponseReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: Text


_REASONING_TOKEN = "jxr1."          # ``reasoning_token``'s prefix (its format's version)


def reasoning_token(text: str) -> str:
    """A reasoning item's ``encrypted_content`` (``include: ["reasoning.encrypted_content"]``):
    its text in an opaque string a stateless client sends back with the item (base64 of
    its UTF-8; not encrypted: the text is what the client may read in ``content`` anyway;
    not compressed, so a token never unpacks to more than it weighs)."""
    return _REASONING_TOKEN + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def reasoning_from_token(token: str) -> str:
    """The text ``reasoning_token`` packed; ``ValueError`` for anything else."""
    try:
        if not token.startswith(_REASONING_TOKEN):
            raise ValueError
        return base64.urlsafe_b64decode(token[len(_REASONING_TOKEN):].encode("ascii")).decode("utf-8")
    except (ValueError, binascii.Error, UnicodeError):
        raise ValueError("encrypted_content: not one this server wrote (or cut short)") from None


class ResponseReasoningItem(_Request):
    """The reasoning of an earlier turn (as a response's ``output`` lists it, before that
    turn's message and calls): its ``content``, else its ``encrypted_content`` (this
    server's ``reasoning_token``); ``summary`` is not read."""

    type: Literal["reasoning"]
    id: Text | None = Field(default=None, max_length=256)
    content: list[ResponseReasoningText] | None = None
    encrypted_content: Text | None = None

    @model_validator(mode="after")
    def _unpack_encrypted_content(self):
        if not self.content and self.encrypted_content is not None:
            text = reasoning_from_token(self.encrypted_content)
            self.content = [ResponseReasoningText(type="reasoning_text", text=text)]
        return self

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


def _input_item_type(item) -> str | None:
    """The tag of an input item: its ``type``, ``message`` when it has none (``{"role", "content"}``)."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


ResponseInputItem = Annotated[Union[Annotated[ResponseMessageItem, Tag("message")],
                                    Annotated[ResponseFunctionCallItem, Tag("function_call")],
                                    Annotated[ResponseFunctionCallOutputItem, Tag("function_call_output")],
                                    Annotated[ResponseReasoningItem, Tag("reasoning")]],
                              Discriminator(_input_item_type, custom_error_type="invalid_input_item",
                                            custom_error_message="an input item's type must be message, "
                                            "function_call, function_call_output or reasoning (others are not "
                                            "supported by this server)")]


MAX_ITEMS_PER_CALL = 20   # items one Conversations API call may add (OpenAI's limit)
Metadata = dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]]   # (OpenAI's limits)


class ConversationRef(_Request):
    """``{"id": "conv_..."}``: the conversation a Responses request continues."""

    id: Text = Field(min_length=1, max_length=256)


class ConversationCreateRequest(_Request):
    """``POST /v1/conversations``: its first ``items`` (input items, up to 20) and ``metadata``."""

    items: list[ResponseInputItem] | None = Field(default=None, max_length=MAX_ITEMS_PER_CALL)
    metadata: Metadata | None = Field(default=None, max_length=MAX_STORED_METADATA)


FILE_EXPIRY_RANGE_S = (3600, 30 * 24 * 3600)   # the ``expires_after.seconds`` OpenAI takes: an hour to 30 days


class ExpiresAfter(_Request):
    """OpenAI's file expiry: deleted ``seconds`` (an hour to 30 days) after its creation."""

    anchor: Literal["created_at"]
    seconds: int = Field(ge=FILE_EXPIRY_RANGE_S[0], le=FILE_EXPIRY_RANGE_S[1])


class BatchCreateRequest(_Request):
    """``POST /v1/batches``: a batch of the requests in a file uploaded for ``"batch"``, all to
    ``endpoint``, with OpenAI's ``completion_window`` ("24h"), ``metadata`` and
    ``output_expires_after`` (the expiry of its output and error files)."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Metadata | None = Field(default=None, max_length=MAX_STORED_METADATA)
    output_expires_after: ExpiresAfter | None = None


class ConversationUpdateRequest(_Request):
    """``POST /v1/conversations/{id}``: its new ``metadata`` (replaces the old; null or left out: none)."""

    metadata: Metadata | None = Field(default=None, max_length=MAX_STORED_METADATA)


class ConversationItemsRequest(_Request):
    """``POST /v1/conversations/{id}/items``: items to add at its end (1 to 20)."""

    items: list[ResponseInputItem] = Field(min_length=1, max_length=MAX_ITEMS_PER_CALL)


class ResponseFunctionTool(_Request):
    """``{"type": "function", "name", "description", "parameters", "strict"}`` (the Responses
    API's flat form of a chat completions tool)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME.pattern)
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponseToolChoiceFunction(_Request):
    type: Literal["function"]
    name: str


class ResponseAllowedTools(_Request):
    """The Responses API's ``{"type": "allowed_tools", "mode", "tools": [{"type": "function",
    "name"}, ...]}`` (``AllowedToolsChoice``, flat)."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[ResponseToolChoiceFunction] = Field(min_length=1)


class ResponseTextFormat(_Request):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "name", "schema", "strict", "description"}``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self):
        if (self.type == "json_schema") != (self.schema_ is not None and self.name is not None):
            raise ValueError("schema and name are required with type 'json_schema' and only allowed with it")
        return self


class ResponseTextConfig(_Request):
    format: ResponseTextFormat | None = None


class ResponseReasoningConfig(_Request):
    """``reasoning``: taken when the server splits reasoning (``--reasoning-parser``);
    ``effort`` reaches the chat template as chat's ``reasoning_effort`` does (``"none"`` and
    ``"minimal"`` turn Qwen3's thinking off); ``summary`` is not acted on (it stays empty)."""

    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_PriorityFields):
    """``POST /v1/responses``: OpenAI's Responses API over the chat machinery (function
    tools, ``previous_response_id`` conversations, ``text.format``, ``reasoning`` with a
    reasoning parser, ``background`` runs, ``truncation: "auto"``, ``max_tool_calls`` of the
    server's tools). Fields of the API this server does not implement are refused when set
    (``include`` values other than ``message.output_text.logprobs`` and ``reasoning.encrypted_content``,
    ``prompt``). ``conversation``: a Conversations API conversation it continues (``server.conversations``)."""

    model: Text
    input: Text | list[ResponseInputItem] = Field(min_length=1)
    instructions: Text | None = None
    previous_response_id: Text | None = Field(default=None, max_length=256)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoiceFunction | ResponseAllowedTools | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseTextConfig | None = None
    user: Text | None = Field(default=None, max_length=256)
    metadata: Metadata | None = Field(default=None, max_length=MAX_STORED_METADATA)
    reasoning: ResponseReasoningConfig | None = None
    background: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # "message.output_text.logprobs": each output token's log-probability (and ``top_logprobs`` alternatives);
    # "reasoning.encrypted_content": reasoning items carry their text for a stateless client to send back
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    conversation: Annotated[Text, Field(min_length=1, max_length=256)] | ConversationRef | None = None
    prompt: dict | None = None
    max_tool_calls: int | None = Field(default=None, ge=0, le=INT32_MAX)

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per output token when log-probabilities are asked (``include`` or
        ``top_logprobs``), else None."""
        asked = self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or ())
        return (self.top_logprobs or 0) if asked else None

    @property
    def conversation_id(self) -> str | None:
        """The id of the conversation this request continues (``conversation``), if any."""
        return self.conversation.id if isinstance(self.conversation, ConversationRef) else self.conversation

    @model_validator(mode="after")
    def _refuse_what_is_not_implemented(self):
        if self.prompt is not None:
            raise ValueError("prompt is not supported by this server")
        if self.conversation is not None and self.previous_response_id is not None:
            raise ValueError("conversation and previous_response_id cannot both be given: a response continues "
                             "one or the other")
        if self.background and not self.store:
            raise ValueError("background responses must be stored (store: true): they are read back with "
                             "GET /v1/responses/{id}")
        return self


class ResponsesInputTokensRequest(ResponsesRequest):
    """``POST /v1/responses/input_tokens``: a Responses request whose prompt tokens are
    counted (``model`` may be left out; ``input`` too, after ``previous_response_id``)."""

    model: Text | None = None
    input: Text | list[ResponseInputItem] = Field(default_factory=list)
