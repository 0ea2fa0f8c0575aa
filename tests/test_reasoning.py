"""Reasoning split from the answer (``--reasoning-parser``): the splitter on its own,
then the real engine and server on the demo model, whose greedy answer is cut at a
tag taken from that answer (the demo model thinks in no known format)."""

from __future__ import annotations

import json
import re

import pytest

from jaxserve.config import EngineConfig
from jaxserve.reasoning import ReasoningFormat, ReasoningSplit, get_reasoning_format


def split_stream(fmt: ReasoningFormat | str, pieces: list[str]) -> tuple[str, str, str]:
    """Feed ``pieces`` as a request's text grows; checks every shown reasoning and answer
    only grows; returns the final ``(reasoning, content, text the tool parser got)``."""
    split = ReasoningSplit(get_reasoning_format(fmt) if isinstance(fmt, str) else fmt)
    text, shown, fed = "", ("", ""), ""
    for piece in pieces:
        text += piece
        split.scan(text)
        fed += split.take_content(text)
        now = split.reasoning(text, len(text), False), split.content(text, len(text), False)
        assert now[0].startswith(shown[0]) and now[1].startswith(shown[1]), (piece, now, shown)
        shown = now
    split.finish(text)
    fed += split.take_content(text)
    final = split.reasoning(text, len(text), True), split.content(text, len(text), True)
    assert final[0].startswith(shown[0]) and final[1].startswith(shown[1])
    return final[0], final[1], fed


@pytest.mark.parametrize("pieces, want", [
    (["<think>", "\n", "Let me", " add.", "\n", "</think>", "\n\n", "It is", " 4."], ("Let me add.", "It is 4.")),
    (["<", "think>\nhm\n</th", "ink>\n\nok"], ("hm", "ok")),                     # tags cut across tokens
    (["The", " answer"], ("", "The answer")),                                      # no <think>: all answer
    (["<", "tool_call>{}"], ("", "<tool_call>{}")),                               # "<" was not a tag after all
    (["<"], ("", "<")),                                                            # ... nor at the end
    (["<think>\nabc </thi", "s is not"], ("abc </this is not", "")),              # unclosed: all reasoning
    (["<think>\n\n</think>\n\nHi"], ("", "Hi")),                                   # an empty block
])
def test_qwen3_splits_a_turn_that_starts_with_think(pieces, want):
    reasoning, content, fed = split_stream("qwen3", pieces)
    assert (reasoning, content) == want
    assert fed == content   # the tool-call parser sees the answer and nothing else


@pytest.mark.parametrize("fmt, pieces, want", [
    ("qwen3", ["<think>", "\n", "a", "b", "\n", "</think>", "\n\n", "x", "y"], 6),   # tags and newlines in it
    ("qwen3", ["<", "think>", "a", "</think>", "x"], 4),   # the undecided "<" counts once decided
    ("qwen3", ["<", "tool", "x"], 0),
    ("deepseek_r1", ["a", "b", "</think>", "x"], 3),
    ("deepseek_r1", ["<"], 1),                             # undecided to the end: the turn opens inside
])
def test_reasoning_tokens_are_counted_as_they_come(fmt, pieces, want):
    split, text = ReasoningSplit(get_reasoning_format(fmt)), ""
    for piece in pieces:
        text += piece
        split.on_token(text)
    split.finish(text)
    assert split.reasoning_tokens == want


@pytest.mark.parametrize("pieces, want", [
    (["Let me", " see</think>", "\n\nYes"], ("Let me see", "Yes")),
    (["<think>\nLet me", " see"], ("Let me see", "")),   # an explicit opening tag is passed over
])
def test_deepseek_r1_turns_start_inside_the_reasoning(pieces, want):
    reasoning, content, fed = split_stream("deepseek_r1", pieces)
    assert (reasoning, content) == want and fed == content


def test_each_turn_after_a_pause_may_think_again():
    split = ReasoningSplit(get_reasoning_format("qwen3"))
    text = "<think>\ncall it\n</think>\n\n<tool_call>x</tool_call>"
    split.scan(text)
    assert split.take_content(text) == "<tool_call>x</tool_call>"
    split.new_turn(len(text))
    text += "<think>\ngot it\n</think>\n\nDone."
    split.scan(text)
    assert split.take_content(text) == "Done."
    split.finish(text)
    assert split.reasoning(text, len(text), True) == "call it\n\ngot it"   # turns apart by a blank line
    assert split.content(text, len(text), True) == "<tool_call>x</tool_call>Done."


def test_a_turn_whose_prompt_opened_the_reasoning_starts_inside_it():
    """A resumed turn whose tool results end with the template's ``<think>`` (the client
    re-rendered R1's template) starts inside the reasoning even under qwen3."""
    split = ReasoningSplit(get_reasoning_format("qwen3"))
    split.scan("<tool_call>x</tool_call>")
    split.new_turn(24)
    split.reopen_inside()
    text = "<tool_call>x</tool_call>weigh it</think>Done."
    split.scan(text)
    split.finish(text)
    assert split.reasoning(text, len(text), True) == "weigh it" and split.content(text, len(text), True) == \
        "<tool_call>x</tool_call>Done."
    assert ReasoningSplit(get_reasoning_format("qwen3"), opens_inside=True).fmt.name == "qwen3"


def test_a_stop_string_that_cuts_the_text_before_the_end_tag_leaves_the_reasoning_open():
    """The stop string ``"\n</think>\n"`` completes after ``</think>`` was found: the text
    is cut back before it, short of the spans found; nothing may index past it."""
    split = ReasoningSplit(get_reasoning_format("qwen3"))
    text = ""
    for piece in ["<think>", "ab", "\n", "</think>", "\n\n"]:
        text += piece
        split.scan(text)
    text = "<think>ab"   # (what the detokenizer keeps)
    split.scan(text)
    split.finish(text)
    assert (split.reasoning(text, len(text), True), split.content(text, len(text), True)) == ("ab", "")


def test_a_stream_holds_back_what_may_be_a_tag_or_the_newline_before_one():
    split = ReasoningSplit(get_reasoning_format("qwen3"))
    text = "<think>\nplan\n</th"
    split.scan(text)
    assert split.reasoning(text, len(text), False) == "plan"   # not the newline, not "</th"
    text = "<thi"
    split = ReasoningSplit(get_reasoning_format("qwen3"))
    split.scan(text)
    assert (split.reasoning(text, 4, False), split.content(text, 4, False), split.take_content(text)) == ("", "", "")


def test_an_unknown_reasoning_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="reasoning_parser.*qwen3, deepseek_r1"):
        EngineConfig(reasoning_parser="o1")


# ------------------------------------------------------------- engine and server
@pytest.fixture(scope="module")
def served():
    """``(TestClient, AsyncEngine, raw answer, its format, its reasoning, its answer)`` on the
    demo model: the greedy chat answer to one question, and tags cut from it."""
    from fastapi.testclient import TestClient

    from jaxserve import AsyncEngine
    from server import create_app
    engine = AsyncEngine("demo", page_size=8, num_pages=64, max_num_batched_tokens=64, max_model_len=256,
                         warmup=False)
    try:
        with TestClient(create_app(engine, served_model_name="demo", max_model_len=256)) as client:
            raw = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
            # The end tag: three characters first seen mid-answer (a turn opens inside the reasoning, as R1's).
            cut = next(i for i in range(6, len(raw) - 6) if raw.find(raw[i:i + 3]) == i
                       and not set(raw[i:i + 3]) & {"\ufffd", "\n"})
            fmt = ReasoningFormat("test", start="<think>", end=raw[cut:cut + 3], opens_inside=True)
            engine.engine.reasoning_format = fmt   # what EngineConfig.reasoning_parser sets, with this tag
            yield client, engine, raw, raw[:cut].strip("\n"), raw[cut + 3:].lstrip("\n")
    finally:
        engine.shutdown()


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 24,
        "temperature": 0}


def sse(response) -> list:
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_chat_returns_the_reasoning_apart_from_the_answer(served):
    client, _, raw, reasoning, content = served
    message = client.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    assert message["content"] == content and message["reasoning"] == message["reasoning_content"] == reasoning
    chunks = sse(client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == reasoning
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == content
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any(d.get("reasoning") for d in deltas[first_answer:])   # the reasoning comes first
    # completions are not chats: the text stays whole
    completion = client.post("/v1/completions", json={"model": "demo", "prompt": "Why", "max_tokens": 8}).json()
    assert "reasoning" not in completion["choices"][0]


def test_the_engine_output_keeps_tokens_and_splits_text(served):
    """``RequestOutput``: the same token ids either way; ``text`` the answer and
    ``reasoning`` the thinking with a parser, and their deltas add up to them."""
    import asyncio

    from jaxserve import SamplingParams
    client, engine, raw, reasoning, content = served
    ids = client.post("/tokenize", json={"model": "demo", "messages": CHAT["messages"]}).json()["tokens"]

    async def run(parse):
        return [out async for out in engine.generate(prompt_token_ids=ids, parse_reasoning=parse,
                                                     sampling_params=SamplingParams(max_tokens=24, temperature=0))]
    whole, split = asyncio.run(run(False)), asyncio.run(run(None))
    assert whole[-1].token_ids == split[-1].token_ids
    assert (whole[-1].text, whole[-1].reasoning) == (raw, "")
    assert (split[-1].text, split[-1].reasoning) == (content, reasoning)
    assert "".join(o.delta_reasoning for o in split) == reasoning and "".join(o.delta_text for o in split) == content
    # reasoning tokens: up to the one that completes the end tag
    tok, ids_out, end = engine.engine.tokenizer, whole[-1].token_ids, engine.engine.reasoning_format.end
    thinking = next(k for k in range(1, len(ids_out) + 1) if end in tok.decode(ids_out[:k]))
    assert split[-1].num_reasoning_tokens == thinking and whole[-1].num_reasoning_tokens == 0
    usage = client.post("/v1/chat/completions", json=CHAT).json()["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": thinking}
    response = client.post("/v1/responses", json={"model": "demo", "input": CHAT["messages"], "max_output_tokens": 24,
                                                  "temperature": 0}).json()
    assert response["usage"]["output_tokens_details"] == {"reasoning_tokens": thinking}


def test_responses_lists_a_reasoning_item_before_the_message(served):
    client, _, raw, reasoning, content = served
    body = {"model": "demo", "input": CHAT["messages"], "max_output_tokens": 24, "temperature": 0}
    response = client.post("/v1/responses", json=body).json()
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "message"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": reasoning}]
    assert response["output"][1]["content"][0]["text"] == content
    r = client.post("/v1/responses", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == reasoning
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == reasoning
    # a reasoning input item is taken back; ``reasoning`` settings are taken (and echoed) with a parser
    follow = client.post("/v1/responses", json={"model": "demo", "max_output_tokens": 4,
                                               "reasoning": {"effort": "low"}, "input": [
        *CHAT["messages"], {"type": "reasoning", "id": "rs_1", "summary": [],
                            "content": [{"type": "reasoning_text", "text": reasoning}]},
        {"role": "assistant", "content": content}, {"role": "user", "content": "And at night?"}]})
    assert follow.status_code == 200, follow.text
    assert follow.json()["reasoning"] == {"effort": "low", "summary": None}


def test_a_reasoning_input_item_belongs_to_the_assistant_turn_right_after_it():
    from server.protocol import ResponsesRequest
    from server.responses import input_messages

    def messages(items):
        return input_messages(ResponsesRequest.model_validate({"model": "m", "input": items}).input)
    thought = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "R"}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    assert messages([{"role": "user", "content": "q"}, thought, call]) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}], "reasoning_content": "R"}]
    # a reasoning item followed by a user message belongs to no answer; a trailing one neither
    assert messages([{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, thought,
                     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}, thought]) == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]


class _LaterReasoningEngine:
    """Stands in for ``AsyncEngine`` (the wire is under test): an answer that reasons,
    answers, then reasons again (a later turn's, after server-side tool results)."""

    def __init__(self):
        from transformers import AutoTokenizer

        from jaxserve.core import EngineStats
        from jaxserve.demo import demo_dir
        self.is_alive = True
        self.tokenizer = AutoTokenizer.from_pretrained(str(demo_dir()))
        self.stats_snapshot = EngineStats()
        self.usage_snapshot = {"running": 0, "waiting": 0, "swapping": 0, "paused": {}, "device_pages_used": 0,
                               "device_pages_total": 8, "host_pages_used": 0, "host_pages_total": 8,
                               "preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                               "prefix_cached_pages": 0}
        self.engine = self   # what the app reads the reasoning format from
        self.reasoning_format = get_reasoning_format("qwen3")

    async def generate(self, prompt=None, sampling_params=None, request_id=None, **kw):
        from jaxserve.outputs import RequestOutput
        pieces = [("R1", ""), ("", "x"), ("\n\nR2", ""), ("", "y")]
        for k, (reasoning, text) in enumerate(pieces):
            yield RequestOutput(request_id=request_id, prompt_token_ids=kw["prompt_token_ids"],
                                token_ids=list(range(k + 1)), text="", delta_token_ids=[k], delta_text=text,
                                delta_reasoning=reasoning, finish_reason="stop" if k == len(pieces) - 1 else None)

    async def abort(self, request_id):
        return False


def test_reasoning_after_the_answer_started_is_an_item_of_its_own_after_the_message():
    """The streamed items and the final response agree: the first reasoning item holds what
    was streamed before the message; what came after is a second item, after the message."""
    from fastapi.testclient import TestClient

    from server import create_app
    with TestClient(create_app(_LaterReasoningEngine(), served_model_name="m", max_model_len=4096)) as client:
        body = {"model": "m", "input": "hi"}
        whole = client.post("/v1/responses", json=body).json()["output"]
        assert [(i["type"], (i.get("content") or [{}])[0].get("text")) for i in whole] == [
            ("reasoning", "R1\n\nR2"), ("message", "xy")]
        r = client.post("/v1/responses", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    done = [(e["output_index"], e["item"]["type"], e["item"]["content"][0]["text"])
            for e in events if e["type"] == "response.output_item.done"]
    assert done == [(0, "reasoning", "R1"), (1, "message", "xy"), (2, "reasoning", "R2")]
    final = events[-1]["response"]["output"]
    assert [(i["id"], i["content"][0]["text"]) for i in final] == [
        (e["item"]["id"], e["item"]["content"][0]["text"]) for e in events if e["type"] == "response.output_item.done"]


def test_a_resumed_turn_shows_its_own_reasoning_and_counts_its_own_tokens():
    """A request paused on a client-side call and resumed with the client's context
    ending in ``<think>``: the next turn starts inside the reasoning, and the resumed
    continuation's reasoning deltas start with that turn's text (not with the blank
    line that joins it to the first turn's) and its token count starts from 0."""
    from jaxserve import SamplingParams
    from jaxserve.engine import LLMEngine
    from jaxserve.tool_format.base import ParsedToolCall
    engine = LLMEngine("demo", page_size=8, num_pages=64, max_num_batched_tokens=64, max_model_len=256, warmup=False)
    try:
        engine.reasoning_format = ReasoningFormat("test", start="<think>", end="\u2603\u2603", opens_inside=True)
        rid = engine.add_request(prompt_token_ids=[5, 6, 7, 8], sampling_params=SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True))
        request = engine.scheduler.requests[rid]
        first = []
        while request.num_generated < 6:
            first += engine.step()
        engine._pause_for_tools(request, [ParsedToolCall("lookup", "{}", "")], engine.clock.now())
        [paused] = engine.outputs([request])
        assert paused.finish_reason == "tool_calls" and paused.reasoning and paused.num_reasoning_tokens == 6
        resumed_ids = engine.tokenizer.encode("result<think>\n", add_special_tokens=False)
        engine.resume(rid, token_ids=resumed_ids, max_tokens=5)
        deltas, final = [], None
        while final is None:
            for out in engine.step():
                deltas.append(out.delta_reasoning)
                final = out if out.finished else None
        second = "".join(deltas)
        assert second and not second.startswith("\n") and final.reasoning == paused.reasoning + "\n\n" + second
        assert final.num_reasoning_tokens == 5 and final.text == paused.text   # all of turn 2 was reasoning
    finally:
        engine.shutdown()


def test_a_response_format_constrains_the_answer_after_the_reasoning(served):
    """A turn that opens inside the reasoning reasons freely (the same tokens as without a
    format), and the JSON object grammar takes over after the end tag: the answer is JSON
    from its first character, where the free answer was not."""
    client, _, raw, reasoning, content = served
    assert not content.startswith("{")
    message = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40,
                                                        "response_format": {"type": "json_object"}}).json()
    answer = message["choices"][0]["message"]
    assert answer["reasoning"] == reasoning and answer["content"].startswith("{")
    assert answer["content"] != content[:len(answer["content"])]


def _greedy_texts(client, engine, messages) -> list[str]:
    """The greedy chat answer's text after each of its tokens (24 at most), its reasoning
    not split: what the tests below cut their tags from."""
    import asyncio

    from jaxserve import SamplingParams
    ids = client.post("/tokenize", json={"model": "demo", "messages": messages}).json()["tokens"]

    async def greedy():
        return [out async for out in engine.generate(prompt_token_ids=ids, parse_reasoning=False,
                                                     sampling_params=SamplingParams(max_tokens=24, temperature=0))]
    tokens = asyncio.run(greedy())[-1].token_ids
    return [engine.engine.tokenizer.decode(tokens[:k]) for k in range(1, len(tokens) + 1)]


def test_answer_text_in_the_token_that_ends_the_reasoning_is_held_to_the_format(served):
    """An end tag written as text may end inside a token that goes on into the answer
    (SmolLM2's ``>"`` closes ``</think>`` and opens a JSON string). The grammar woke after
    that token and wrote a whole answer after the text it carried (``""yes"``, invalid);
    it now takes that text first. Here the tag ends inside a greedy token, and a regex
    that starts with the rest of that token's text must match the whole answer."""
    client, engine, *_ = served
    llm = engine.engine
    texts = _greedy_texts(client, engine, CHAT["messages"])
    raw = texts[-1]

    def clean(t: str) -> bool:
        return bool(t) and not set(t) & {"\ufffd", "\n", "\r"}
    # a token k of at least 3 characters: the tag is its first 2 characters after 1 before them,
    # first seen there; the rest of the token is the carried answer text
    k, at = next((k, len(texts[k - 1]) - 1) for k in range(3, len(texts) - 2)
                 if len(texts[k]) - len(texts[k - 1]) >= 3 and clean(texts[k][len(texts[k - 1]) - 1:])
                 and raw.find(texts[k][len(texts[k - 1]) - 1:len(texts[k - 1]) + 2]) == len(texts[k - 1]) - 1)
    tag, carried = texts[k][at:at + 3], texts[k][at + 3:]
    pattern = "".join(f"\\x{{{ord(c):X}}}" for c in carried) + "[0-9]{3}"
    kept = llm.reasoning_format
    llm.reasoning_format = ReasoningFormat("test-carried", start="<think>", end=tag, opens_inside=True)
    try:
        answer = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40, "guided_regex": pattern}
                             ).json()["choices"][0]
        assert answer["message"]["reasoning"] == raw[:at].strip("\n")
        assert re.fullmatch(re.escape(carried) + "[0-9]{3}", answer["message"]["content"]), answer
        assert answer["finish_reason"] == "stop"
    finally:
        llm.reasoning_format = kept


def test_a_turn_that_may_think_first_reasons_freely_then_answers_in_the_format(served):
    """A format whose turns are not known to open inside the reasoning (Qwen3's: the model
    starts with the start tag when it thinks): a ``response_format`` grammar (or a
    choice, or a regex) lets the turn open with a reasoning block, so the model reasons as without a format (the same
    reasoning), and only the answer after the end tag is constrained (JSON from its first
    character, where the free answer was not). The tags here are cut from the greedy
    answer at token boundaries: its first tokens open the reasoning."""
    client, engine, *_ = served
    llm = engine.engine
    chat = {**CHAT, "messages": [{"role": "user", "content": "Hello"}]}   # (its answer starts with clean text)
    texts = _greedy_texts(client, engine, chat["messages"])
    raw = texts[-1]
    # the start tag: the answer's first whole tokens that spell clean text
    first = next(k for k, t in enumerate(texts) if t.strip() and "\ufffd" not in t)
    start = texts[first]
    # the end tag: the three characters that end a later token, first seen there
    end_at = next(len(t) for t in texts[first + 2:-4] if raw.find(t[-3:]) == len(t) - 3
                  and not set(t[-3:]) & {"\ufffd", "\n"} and len(t) - 3 > len(start))
    end = raw[end_at - 3:end_at]
    kept = llm.reasoning_format
    llm.reasoning_format = ReasoningFormat("test-first", start=start, end=end)
    try:
        free = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]
        assert free["reasoning"] == raw[len(start):end_at - 3].strip("\n") and free["reasoning"]
        assert not free["content"].startswith("{")
        shaped = client.post("/v1/chat/completions", json={**chat, "max_tokens": 40,
                                                           "response_format": {"type": "json_object"}}).json()
        answer = shaped["choices"][0]["message"]
        assert answer["reasoning"] == free["reasoning"] and answer["content"].startswith("{")
        for fields, ok in [({"structured_outputs": {"choice": ["alpha", "beta gamma"]}},
                            lambda t: t in ("alpha", "beta gamma")),
                           ({"guided_regex": r"[0-9]{3}/[a-z]"}, lambda t: re.fullmatch(r"[0-9]{3}/[a-z]", t))]:
            other = client.post("/v1/chat/completions", json={**chat, "max_tokens": 40, **fields}).json()
            answer = other["choices"][0]["message"]
            assert answer["reasoning"] == free["reasoning"] and ok(answer["content"]), (fields, answer)
    finally:
        llm.reasoning_format = kept


def test_encrypted_reasoning_content_lets_a_stateless_client_send_the_reasoning_back():
    """``include: ["reasoning.encrypted_content"]``: each reasoning item (whole and streamed)
    carries its text packed in ``encrypted_content``; an input reasoning item with only
    that reads as the same reasoning; a string this server did not write is a 400."""
    from fastapi.testclient import TestClient

    from server import create_app
    from server.protocol import ResponsesRequest
    from server.responses import input_messages
    body = {"model": "m", "input": "hi", "store": False, "include": ["reasoning.encrypted_content"]}
    with TestClient(create_app(_LaterReasoningEngine(), served_model_name="m", max_model_len=4096)) as client:
        items = [i for i in client.post("/v1/responses", json=body).json()["output"] if i["type"] == "reasoning"]
        r = client.post("/v1/responses", json={**body, "stream": True})
        streamed = [json.loads(line[6:])["item"] for line in r.text.splitlines()
                    if line.startswith("data: ") and '"response.output_item.done"' in line]
        assert "encrypted_content" not in client.post("/v1/responses", json={"model": "m", "input": "hi"}).json()[
            "output"][0]
        bad = client.post("/v1/responses", json={"model": "m", "input": [
            {"type": "reasoning", "encrypted_content": "gAAAAB-not-ours"}, {"role": "user", "content": "q"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("input.0")
    assert [i["content"][0]["text"] for i in items] == ["R1\n\nR2"]
    assert [i["content"][0]["text"] for i in streamed if i["type"] == "reasoning"] == ["R1", "R2"]
    for item in items + [i for i in streamed if i["type"] == "reasoning"]:
        sent_back = {"type": "reasoning", "id": item["id"], "summary": [], "encrypted_content": item["encrypted_content"]}
        request = ResponsesRequest.model_validate({"model": "m", "input": [
            {"role": "user", "content": "q"}, sent_back, {"role": "assistant", "content": "a"}]})
        assert input_messages(request.input)[1]["reasoning_content"] == item["content"][0]["text"]
    from server.protocol import reasoning_from_token, reasoning_token
    assert reasoning_from_token(reasoning_token("é thought")) == "é thought"
    assert len(reasoning_token("x" * 3000)) < 4100   # (never more text out than it weighs: no compression bombs)
    for bad in (reasoning_token("cut")[:-3], "jxr1.\u00e9", "jxr1." + "_" * 5, "other"):
        with pytest.raises(ValueError, match="encrypted_content"):
            reasoning_from_token(bad)
