"""Tool-call formats (``jaxserve.tool_format``): parsing streamed calls, hiding their
markup from chat text, wrapping results, detection, and tools for templates without
tool support. No model needed."""

from __future__ import annotations

import json

import pytest

from jaxserve.tool_format import (FORMATS, detect_format, get_format, prepare_chat, select_format,
                                  template_supports_tools)

ARGS = {"expression": "6*7", "note": "a } and a \" in a string"}
CALL_TEXT = {
    "hermes": f'<tool_call>{{"name": "calculator", "arguments": {json.dumps(ARGS)}}}</tool_call>',
    "llama3_json": f'{{"name": "calculator", "parameters": {json.dumps(ARGS)}}}',
    "mistral": f'[TOOL_CALLS][{{"name": "calculator", "arguments": {json.dumps(ARGS)}}}]',
}
PROSE = {"hermes": "Let me compute. ", "llama3_json": "", "mistral": "Let me compute. "}


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_parser_fires_once_per_complete_call_in_any_split(name, size):
    parser = get_format(name).parser()
    text = PROSE[name] + CALL_TEXT[name]
    fired = [(i, c) for i, p in enumerate(pieces(text, size)) for c in parser.feed(p)]
    assert len(fired) == 1
    index, call = fired[0]
    assert index == len(pieces(text, size)) - 1          # fires on the delta that completes the call
    assert call.name == "calculator" and json.loads(call.arguments) == ARGS


@pytest.mark.parametrize("name, text", [
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("mistral", "[TOOL_CALLS][{bad json}]"),
    ("mistral", "[TOOL_CALLS] no json here"),
    ("llama3_json", '<|python_tag|>{"nam": "x"}'),
])
def test_malformed_calls_are_reported_as_nameless(name, text):
    parser = get_format(name).parser()
    fired = [c for ch in text for c in parser.feed(ch)]
    assert len(fired) == 1 and fired[0].name == ""


@pytest.mark.parametrize("text", ["The answer is 42.", '{"city": "Paris"} is JSON, not a call.', "  {\"a\": [1, {}]}"])
def test_llama3_plain_text_and_plain_json_are_not_calls(text):
    parser = get_format("llama3_json").parser()
    assert all(parser.feed(ch) == [] for ch in text)


def test_llama3_second_call_after_a_result_fires_again():
    parser = get_format("llama3_json").parser()
    first = [c for ch in CALL_TEXT["llama3_json"] for c in parser.feed(ch)]
    second = [c for ch in ' {"name": "search", "parameters": {"q": "x"}}' for c in parser.feed(ch)]
    assert [c.name for c in first + second] == ["calculator", "search"]


PARALLEL_TEXT = {   # two calls in one turn, as each format writes them
    "hermes": '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
              '<tool_call>{"name": "b", "arguments": {"s": "]}"}}</tool_call>',
    "llama3_json": '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"s": "]}"}}]',
    "mistral": '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"s": "]}"}}]',
}


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("size", [1, 7, 1000])
def test_parser_returns_every_call_of_a_parallel_turn_in_order(name, size):
    parser = get_format(name).parser()
    calls = [c for p in pieces(PROSE[name] + PARALLEL_TEXT[name], size) for c in parser.feed(p)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {"s": "]}"})]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_markup_filter_hides_a_parallel_turn(name):
    filt = get_format(name).markup_filter()
    assert "".join(filt.feed(p) for p in pieces(PROSE[name] + PARALLEL_TEXT[name], 3)) + filt.flush() == PROSE[name]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_render_calls_of_a_parallel_turn_is_what_the_parser_reads(name):
    fmt = get_format(name)
    calls = fmt.parser().feed(fmt.render_calls([("a", '{"x": 1}'), ("b", "{}")]))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]


def test_llama3_list_that_is_not_calls_is_content():
    parser = get_format("llama3_json").parser()
    assert [c for ch in '[1, 2, {"name": "x"}]' for c in parser.feed(ch)] == []


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_markup_filter_shows_prose_and_hides_the_call(name, size):
    filt = get_format(name).markup_filter()
    text = PROSE[name] + CALL_TEXT[name]
    visible = "".join(filt.feed(p) for p in pieces(text, size)) + filt.flush()
    assert visible == PROSE[name]


@pytest.mark.parametrize("name, text", [
    ("mistral", "Brackets [like this] and [TOOL_CALL are fine."),
    ("llama3_json", '{"city": "Paris", "country": "France"}'),
    ("llama3_json", "Use {braces} in text."),
    ("hermes", "1 < 2 and <b>bold</b>"),
])
def test_markup_filter_leaves_ordinary_text_alone(name, text):
    for size in (1, 4, 1000):
        filt = get_format(name).markup_filter()
        assert "".join(filt.feed(p) for p in pieces(text, size)) + filt.flush() == text


def test_partial_suffix_is_the_longest_tail_that_starts_the_tag():
    """Checked against trying every length, on random texts and tags over a small alphabet."""
    import random

    from jaxserve.tool_format.base import partial_suffix
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab<") for _ in range(rng.randint(0, 12)))
        tag = "".join(rng.choice("ab<") for _ in range(rng.randint(1, 8)))
        slow = next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)
        assert partial_suffix(text, tag) == slow, (text, tag)


def test_markup_filter_hides_the_start_of_a_tag_the_turn_was_cut_in():
    """SmolLM2 writes ``</tool_call><tool_call>`` with one ``><`` token: a turn paused on the
    first call ends in ``<``, the start of the next tag, which is markup, not content."""
    for cut in ("<", "\n<tool", " <tool_ca"):
        filt = get_format("hermes").markup_filter()
        assert filt.feed('Sure. <tool_call>{"name": "a", "arguments": {}}</tool_call' + ">" + cut) \
            + filt.flush() == "Sure. "


@pytest.mark.parametrize("name, template, expect", [
    ("hermes", "<|im_start|>{{ m }}", "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"),
    ("hermes", "[INST]", "<tool_response>42</tool_response>"),
    ("llama3_json", "<|start_header_id|>", "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
                                           "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("mistral", "[INST]", '[TOOL_RESULTS]{"content": "42"}[/TOOL_RESULTS]'),
    ("mistral", "<|im_start|>", "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"),
])
def test_wrap_results_of_one_call(name, template, expect):
    assert get_format(name).wrap_results(["42"], template) == expect


@pytest.mark.parametrize("name, template, expect", [
    ("hermes", "<|im_start|>", "<|im_end|>\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n"
                               "<|im_start|>assistant\n"),
    ("hermes", "[INST]", "<tool_response>1</tool_response><tool_response>2</tool_response>"),
    ("llama3_json", "<|start_header_id|>", "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n1<|eot_id|>"
                                           "<|start_header_id|>ipython<|end_header_id|>\n\n2<|eot_id|>"
                                           "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("mistral", "[INST]", '[TOOL_RESULTS]{"content": "1"}[/TOOL_RESULTS][TOOL_RESULTS]{"content": "2"}[/TOOL_RESULTS]'),
])
def test_wrap_results_of_a_parallel_turn_in_call_order(name, template, expect):
    assert get_format(name).wrap_results(["1", "2"], template) == expect


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_render_call_is_what_the_parser_reads(name):
    fmt = get_format(name)
    [call] = fmt.parser().feed(fmt.render_calls([("calculator", json.dumps(ARGS))]))
    assert call.name == "calculator" and json.loads(call.arguments) == ARGS


@pytest.mark.parametrize("template, name", [
    ("{% for t in tools %}...<tool_call>{{ t }}</tool_call>{% endfor %}", "hermes"),
    ("{{ '<|python_tag|>' }} ipython", "llama3_json"),
    ("{{ '[TOOL_CALLS]' }}", "mistral"),
    ("<|im_start|>{{ message['content'] }}", "hermes"),
    (None, "hermes"),
])
def test_detect_format_from_template(template, name):
    assert detect_format(template).name == name
    assert select_format(None, template).name == name
    assert select_format("mistral", template).name == "mistral"


def test_unknown_parser_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tool-call parser 'xml'.*hermes"):
        get_format("xml")
    assert get_format("qwen").name == "hermes"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
NO_TOOLS_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_template_without_tools_gets_definitions_in_a_system_message(name):
    fmt = get_format(name)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out, tools = prepare_chat(messages, TOOLS, fmt, NO_TOOLS_TEMPLATE)
    assert tools is None and not template_supports_tools(NO_TOOLS_TEMPLATE)
    assert out[0]["role"] == "system" and fmt.system_prompt(TOOLS) == out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"] and '"city"' in out[0]["content"]
    [call] = fmt.parser().feed(out[2]["content"])
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert out[3] == {"role": "tool", "content": "sunny"}
    assert messages[1]["content"] is None        # the caller's messages are not modified


def test_a_conversation_with_calls_renders_when_no_tools_are_offered():
    """``tool_choice: "none"`` offers no tools, but the conversation may hold calls and
    results: on a template without tool support they become text as when tools are
    offered (a call message with no content reached the template, which refused it),
    and no tool prompt is added."""
    fmt = get_format("hermes")
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out, tools = prepare_chat(messages, None, fmt, NO_TOOLS_TEMPLATE)
    assert tools is None and [m["role"] for m in out] == ["user", "assistant", "tool"]
    [call] = fmt.parser().feed(out[1]["content"])
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert out[2] == {"role": "tool", "content": "sunny"} and "tool_calls" in messages[1]


def test_system_message_is_extended_and_tool_templates_are_left_alone():
    fmt = get_format("hermes")
    out, _ = prepare_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                          TOOLS, fmt, NO_TOOLS_TEMPLATE)
    assert len(out) == 2 and out[0]["content"].startswith("Be brief.\n\n") and "get_weather" in out[0]["content"]
    msgs = [{"role": "user", "content": "hi"}]
    assert prepare_chat(msgs, TOOLS, fmt, "{% if tools %}{{ tools }}{% endif %}") == (msgs, TOOLS)
    assert prepare_chat(msgs, None, fmt, NO_TOOLS_TEMPLATE) == (msgs, None)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_a_parsed_call_renders_back_to_what_the_model_wrote_non_ascii_included(name):
    """A follow-up re-renders the call from its parsed arguments: "München" must not come
    back as "M\\u00fcnchen" (the paused context would no longer match)."""
    fmt = get_format(name)
    written = fmt.render_calls([("get_weather", '{"city": "München"}')])
    [call] = fmt.parser().feed(written)
    assert call.arguments == '{"city": "München"}'
    assert fmt.render_calls([(call.name, call.arguments)]) == written


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_markup_filter_shows_a_span_never_closed(size):
    """The model quoted the tag (or ran out of tokens inside a call): that text was no call,
    so it is shown at the end as written (it used to vanish with everything after it)."""
    text = "The tag <tool_call> starts a call."
    filt = get_format("hermes").markup_filter()
    assert "".join(filt.feed(p) for p in pieces(text, size)) + filt.flush() == text


@pytest.mark.parametrize("tail", ["</", "</tool_", "</tool_call"])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_call_cut_inside_its_end_tag_reads_as_the_complete_call(tail, size):
    """``max_tokens`` ended the text inside ``</tool_call>``: the held-back start of the
    end tag joined the span, so the call stream refused the call and the server returned
    the turn's markup as the message (streamed: the call and the markup). The span is the
    complete call; the text shown, if it is shown, is still the text as written."""
    fmt = get_format("hermes")
    call = '{"name": "get_time", "arguments": {"tz": "UTC"}}'
    text = "<tool_call>" + call + tail
    filt, stream = fmt.markup_filter(), fmt.call_stream(set())
    shown = "".join(filt.feed(p) for p in pieces(text, size))
    flushed = filt.flush()
    stream.update(filt.spans)
    assert shown == "" and flushed == text and filt.spans == [call]
    assert not stream.held and [(c.name, c.arguments) for c in stream.calls] == [("get_time", '{"tz": "UTC"}')]


@pytest.mark.parametrize("tail", ["<", "</", "</tool_call"])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_call_cut_inside_a_string_keeps_what_looks_like_an_end_tag(tail, size):
    """``max_tokens`` ended the text inside a string of the call's arguments, on text that
    could start ``</tool_call>``: the call's JSON is still open, so that text is part of its
    arguments (the cut call's partial arguments keep it), not an end tag the turn was cut in."""
    fmt = get_format("hermes")
    call = '{"name": "html", "arguments": {"markup": "a ' + tail
    filt, stream = fmt.markup_filter(), fmt.call_stream(set())
    shown = "".join(filt.feed(p) for p in pieces("<tool_call>" + call, size))
    flushed = filt.flush()
    stream.update(filt.spans)
    assert shown == "" and flushed == "<tool_call>" + call and filt.spans == [call]
    assert [(c.name, c.arguments) for c in stream.calls] == [("html", '{"markup": "a ' + tail)]


MARKED_CALL = {   # a call after prose, in the marked form of each JSON format
    "mistral": PROSE["mistral"] + CALL_TEXT["mistral"],
    "llama3_json": "Let me compute. <|python_tag|>" + CALL_TEXT["llama3_json"],
}


def _visible(name: str, text: str, sizes) -> tuple[str, list]:
    """What the markup filter shows of ``text`` fed in pieces of ``sizes`` (cycled), and
    the calls the parser reports for the same pieces."""
    filt, parser = get_format(name).markup_filter(), get_format(name).parser()
    out, calls, i, k = [], [], 0, 0
    while i < len(text):
        piece = text[i:i + sizes[k % len(sizes)]]
        out.append(filt.feed(piece))
        calls += parser.feed(piece)
        i, k = i + len(piece), k + 1
    return "".join(out) + filt.flush(), calls


@pytest.mark.parametrize("name", sorted(MARKED_CALL))
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_json_markup_filter_shows_a_call_cut_off_mid_json(name, size):
    """The output ended inside the call's JSON (finish by length): the parser reports no call,
    so the filter shows the text as written at the end (it used to vanish)."""
    text = MARKED_CALL[name]
    marker = "[TOOL_CALLS]" if name == "mistral" else "<|python_tag|>"
    after_marker = text.index(marker) + len(marker)
    in_string = text.index(" and a") + 1   # just after the "}" inside the note string
    for cut in (after_marker, after_marker + 1, after_marker + 5, in_string, len(text) - 1):
        visible, calls = _visible(name, text[:cut], [size])
        assert calls == [] and visible == text[:cut], cut


@pytest.mark.parametrize("name, text", [
    ("mistral", MARKED_CALL["mistral"]),
    ("mistral", PROSE["mistral"] + PARALLEL_TEXT["mistral"]),
    ("mistral", "Let me compute. [TOOL_CALLS][{bad json}]"),               # a malformed call: hidden too
    ("llama3_json", MARKED_CALL["llama3_json"]),
    ("llama3_json", 'Let me compute. <|python_tag|>{"nam": "x"}'),          # a malformed call: hidden too
    ("llama3_json", '{"name": "x", "parameters": {}, "arguments": 5}'),     # "parameters" first, as the parser
])
@pytest.mark.parametrize("size", [1, 2, 1000])
def test_json_markup_filter_hides_a_complete_call_the_parser_reports(name, text, size):
    visible, calls = _visible(name, text, [size])
    assert calls and visible == ("Let me compute. " if "Let me" in text else "")


@pytest.mark.parametrize("name, text, expect", [
    ("mistral", f'Before. {CALL_TEXT["mistral"]} After. [TOOL_CALLS][{{"name": "b", "argu',
     'Before.  After. [TOOL_CALLS][{"name": "b", "argu'),
    ("llama3_json", f'Before. <|python_tag|>{CALL_TEXT["llama3_json"]} After. <|python_tag|>{{"name": "b"',
     'Before.  After. <|python_tag|>{"name": "b"'),
    ("llama3_json", f'{CALL_TEXT["llama3_json"]} After. {{"name": "b", "parameters": {{}}}} is quoted. {{"na',
     ' After. {"name": "b", "parameters": {}} is quoted. {"na'),
])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_json_markup_filter_shows_text_before_and_after_a_call(name, text, expect, size):
    """Only the complete call is hidden: prose before and after it is shown, and so is a
    second call the output was cut in."""
    visible, calls = _visible(name, text, [size])
    assert [c.name for c in calls] == ["calculator"] and visible == expect


@pytest.mark.parametrize("name, text, expect, n_calls", [
    ("mistral", MARKED_CALL["mistral"], PROSE["mistral"], 1),
    ("mistral", MARKED_CALL["mistral"][:-9], MARKED_CALL["mistral"][:-9], 0),
    ("mistral", "ok [TOOL_CALLS]  ", "ok [TOOL_CALLS]  ", 0),
    ("mistral", "Brackets [like this] and [TOOL_CALL are fine.", "Brackets [like this] and [TOOL_CALL are fine.", 0),
    ("mistral", "[TOOL_CALLS] no json here", " no json here", 1),       # a malformed call (the marker alone)
    ("llama3_json", CALL_TEXT["llama3_json"], "", 1),
    ("llama3_json", CALL_TEXT["llama3_json"][:-9], CALL_TEXT["llama3_json"][:-9], 0),
    ("llama3_json", MARKED_CALL["llama3_json"], "Let me compute. ", 1),
    ("llama3_json", MARKED_CALL["llama3_json"][:-9], MARKED_CALL["llama3_json"][:-9], 0),
    ("llama3_json", "<|python_tag|>print(6*7)", "<|python_tag|>print(6*7)", 0),   # no JSON: no call to the parser
    ("llama3_json", '{"city": "Paris"} is JSON.', '{"city": "Paris"} is JSON.', 0),
])
def test_json_markup_filter_streams_small_deltas_as_one_feed(name, text, expect, n_calls):
    """Deltas of 1-3 characters, split anywhere, show what one feed shows; what is hidden is
    exactly what the parser reports as calls."""
    import random

    rng = random.Random(0)
    splits = [[1], [2], [3], [1000]] + [[rng.randint(1, 3) for _ in range(len(text))] for _ in range(20)]
    for sizes in splits:
        visible, calls = _visible(name, text, sizes)
        assert (visible, len(calls)) == (expect, n_calls), sizes
