"""Tool calls streamed as they are written (``jaxserve/tool_format/call_stream.py``):
fed the markup filter's call spans piece by piece, a ``CallStream`` knows each call's
name once it is complete and its arguments so far, always a prefix of what the format's
parser returns when the turn closes; what it cannot promise that of is held."""

from __future__ import annotations

import json
import random

import pytest

from jaxserve.tool_format import get_format

FORMATS = ["hermes", "mistral", "llama3_json"]


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 7, 10 ** 30, -(2 ** 63)])
    if kind == "float":
        return rng.choice([0.5, -0.0, 1e-7, 3.25e21, 1e300 * 10, float("nan")])
    if kind == "str":
        return "".join(rng.choice(['a', 'é', '"', '\\', '\n', '\t', '\x01', '/', '😀', '\u2028', ' ', '{', '}'])
                       for _ in range(rng.randint(0, 6)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {"k" + str(i) + rng.choice(["", "é", '"']): random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def write_json(rng: random.Random, value) -> str:
    """``value`` as a model might write it: compact or spaced, escaped or not."""
    style = rng.randrange(3)
    if style == 0:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)
    if style == 1:
        return json.dumps(value, ensure_ascii=True)
    return json.dumps(value, indent=rng.choice([None, 1]), ensure_ascii=False)


def write_turn(rng: random.Random, fmt_name: str, calls: list[tuple[str, object]]) -> str:
    """The generated text of a turn of ``calls`` (name, arguments value) in ``fmt_name``."""
    key = "parameters" if fmt_name == "llama3_json" else "arguments"
    objects = []
    for name, args in calls:
        pairs = [f'"name": {json.dumps(name)}', f'"{key}": {write_json(rng, args)}']
        if rng.random() < 0.3:
            pairs.reverse()   # arguments before the name
        objects.append("{" + rng.choice([",", ", ", ",\n "]).join(pairs) + "}")
    if fmt_name == "hermes":
        return "Let me check. " + "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)
    if fmt_name == "mistral":
        return "[TOOL_CALLS][" + ", ".join(objects) + "]"
    body = objects[0] if len(objects) == 1 else "[" + ", ".join(objects) + "]"
    return rng.choice(["", "<|python_tag|>"]) + body


def feed(fmt_name: str, text: str, rng: random.Random, hidden=frozenset(), check=True):
    """Feed ``text`` in random pieces to the format's parser, filter and call stream; at
    every piece, what the stream holds is a prefix of what the parser returns in the end.
    Returns ``(parsed calls, stream)``."""
    fmt = get_format(fmt_name)
    parser, markup, calls = fmt.parser(), fmt.markup_filter(), fmt.call_stream(hidden)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, len(text) // 2 + 1))))
    snapshots, parsed = [], []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        parsed += parser.feed(text[start:end])
        markup.feed(text[start:end])
        calls.update(markup.spans)
        snapshots.append([(c.name, c.arguments) for c in calls.calls])
    markup.flush()
    calls.update(markup.spans)
    calls.finish()
    snapshots.append([(c.name, c.arguments) for c in calls.calls])
    if check:
        for snapshot in snapshots:
            assert len(snapshot) <= len(parsed)
            for (name, arguments), call in zip(snapshot, parsed):
                assert name == call.name and call.arguments.startswith(arguments), (snapshot, parsed)
    return parsed, calls


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_streamed_calls_are_prefixes_of_the_parsed_calls_and_end_equal(fmt_name):
    """Random arguments (escapes, surrogate pairs, NaN, big numbers, nesting), written
    compact or spaced, names before or after arguments, one call or several, cut into
    random pieces: at every piece the stream's calls are prefixes of the parser's, and
    when the turn is written they are equal."""
    rng = random.Random(f"calls-{fmt_name}")
    for _ in range(150):
        n = rng.randint(1, 3)
        calls = [(rng.choice(["get_weather", "f", "añadir"]),
                  {"k" + str(i): random_value(rng) for i in range(rng.randint(0, 3))}) for _ in range(n)]
        text = write_turn(rng, fmt_name, calls)
        parsed, stream = feed(fmt_name, text, rng)
        assert [c.name for c in parsed] == [name for name, _ in calls]
        assert [(c.name, c.arguments) for c in stream.calls] == [(c.name, c.arguments) for c in parsed]
        assert not stream.held


def test_arguments_given_as_a_string_stream_as_its_text():
    rng = random.Random(1)
    text = '<tool_call>{"name": "f", "arguments": "{\\"q\\": \\"\\u00e9\\ud83d\\ude00\\"}"}</tool_call>'
    parsed, stream = feed("hermes", text, rng)
    assert [(c.name, c.arguments) for c in stream.calls] == [("f", '{"q": "é😀"}')] == \
        [(c.name, c.arguments) for c in parsed]


@pytest.mark.parametrize("text, streamed", [
    # a server-side tool's call, and what follows it in the turn
    ('<tool_call>{"name": "calculator", "arguments": {"e": "1+1"}}</tool_call>\n'
     '<tool_call>{"name": "f", "arguments": {}}</tool_call>', []),
    # a client call, then a server-side one: the first streams, the rest of the turn waits
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', [("f", "{}")]),
    # not a call: the name is not a string, arguments neither an object nor a string, no name, a list
    ('<tool_call>{"name": 5, "arguments": {"a": 1}}</tool_call>', []),
    ('<tool_call>{"arguments": [1], "name": "f"}</tool_call>', []),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', []),
    ('<tool_call>[{"name": "f", "arguments": {}}]</tool_call>', []),
    # a raw control character inside a string (the parser is strict): what came before it stays sent
    ('<tool_call>{"name": "f", "arguments": {"a": "x\ny"}}</tool_call>', [("f", '{"a": "x')]),
    # text after the object, inside the block: the parser refuses the body
    ('<tool_call>{"name": "f", "arguments": {}} x</tool_call>\n<tool_call>{"name": "g"}</tool_call>', [("f", "{}")]),
])
def test_what_the_stream_holds(text, streamed):
    """Calls the parser would not return as read, or that a server-side tool runs, are held
    (the response lists what the parser returns when the turn ends)."""
    _, stream = feed("hermes", text, random.Random(0), hidden=frozenset({"calculator"}), check=False)
    assert [(c.name, c.arguments) for c in stream.calls] == streamed
    assert stream.held


def test_a_key_written_twice_stops_the_stream_where_it_is_written():
    """The parser keeps the last of two equal keys in the first one's place: from the
    second, nothing more of the turn is streamed."""
    text = '<tool_call>{"name": "f", "arguments": {"x": 1, "y": 2, "x": 3}}</tool_call>'
    parsed, stream = feed("hermes", text, random.Random(0), check=False)
    assert parsed[0].arguments == '{"x": 3, "y": 2}'
    assert stream.held and stream.calls[0].arguments == '{"x": 1, "y": 2, "x"'


def test_a_number_is_sent_only_once_it_cannot_grow():
    fmt = get_format("mistral")
    markup, stream = fmt.markup_filter(), fmt.call_stream()
    sent = []
    for piece in ['[TOOL_CALLS][{"name": "f", "arguments": {"x": 1', '.5', 'e', '2', '}}]']:
        markup.feed(piece)
        stream.update(markup.spans)
        sent.append(stream.calls[0].arguments)
    assert sent == ['{"x": ', '{"x": ', '{"x": ', '{"x": ', '{"x": 150.0}']


def test_a_new_turn_numbers_its_calls_afresh():
    """After a turn of server-side calls the model goes on: the next turn's calls are the
    stream's calls, and a span the last turn left half read is not read again."""
    fmt = get_format("hermes")
    markup, stream = fmt.markup_filter(), fmt.call_stream(frozenset({"calculator"}))
    markup.feed('<tool_call>{"name": "calculator", "arguments": {"e": "2"}}</tool_call>')
    stream.update(markup.spans)
    assert stream.held and not stream.calls
    stream.new_turn()
    markup.feed('Result: 2. <tool_call>{"name": "f", "arguments": {"a": ["' + "z" * 20)
    stream.update(markup.spans)   # (the filter holds back what may be the start of "</tool_call>")
    assert not stream.held and [(c.name, c.arguments) for c in stream.calls] == [("f", '{"a": ["' + "z" * 9)]


def test_a_call_is_announced_once_its_arguments_are_of_a_kind_it_takes():
    """Llama 3 reads bare JSON with a ``name`` as content when its arguments are neither an
    object nor a string: such JSON is never announced as a call; a call without arguments
    (the parser gives it ``{}``) is announced when the output ends, as text after its
    object could still make the parser refuse it."""
    _, content = feed("llama3_json", '{"name": "Bob", "parameters": [1]}', random.Random(0), check=False)
    assert content.calls == [] and content.held
    fmt = get_format("llama3_json")
    markup, stream = fmt.markup_filter(), fmt.call_stream()
    markup.feed('{"name": "f"')
    stream.update(markup.spans)
    assert stream.calls == []   # (the name alone: not yet)
    markup.feed("}")
    stream.update(markup.spans)
    assert stream.calls == []   # (its object closed, but "}" may follow)
    stream.finish()
    assert [(c.name, c.arguments) for c in stream.calls] == [("f", "")]


@pytest.mark.parametrize("text", ['<tool_call>{"name": "f"}}</tool_call>', '<tool_call>{"name": "f"} x</tool_call>'])
def test_a_call_without_arguments_the_parser_then_refuses_is_never_streamed(text):
    """A call whose object closes without arguments is sent only once the text after it
    in its span is what the parser takes: a stray ``}`` or word after it in its block
    makes the parser refuse the block, and the stream sent nothing of it."""
    rng = random.Random(0)
    for _ in range(20):
        parsed, stream = feed("hermes", text, rng, check=False)
        assert not any(c.name for c in parsed)   # (the parser reports no call: an unnamed record at most)
        assert stream.calls == [] and stream.held


def test_a_call_without_arguments_streams_when_its_block_closes():
    """In Hermes blocks, a bare call (and the calls after it in its block) is sent once
    the next block opens, before the turn ends; equal to what the parser returns."""
    fmt = get_format("hermes")
    markup, stream, parser = fmt.markup_filter(), fmt.call_stream(), fmt.parser()
    text = '<tool_call>{"name": "f"}</tool_call>\n<tool_call>{"name": "g", "arguments": {"a": "' + "z" * 20
    parsed = parser.feed(text)
    markup.feed(text)
    stream.update(markup.spans)
    assert [c.name for c in stream.calls] == ["f", "g"] and stream.calls[0].arguments == ""
    parsed += parser.feed('"}}</tool_call>')
    markup.feed('"}}</tool_call>')
    stream.update(markup.spans)
    stream.finish()
    assert [(c.name, c.arguments or "{}") for c in stream.calls] == [(c.name, c.arguments) for c in parsed]
