"""The replica router (``jaxserve.distributed.routing``, no Ray) and the Ray-free single-engine path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.config import EngineConfig
from jaxserve.distributed.routing import ReplicaRouter, RoutingHints, page_hashes, read_hints


def _hints(text: str, **body) -> RoutingHints:
    return read_hints({"messages": [{"role": "user", "content": text}], **body}, {}, None, page_size=8)


def test_page_hashes_are_chained_over_full_pages():
    a = page_hashes(list(range(10)), 4)
    b = page_hashes(list(range(8)) + [99, 98, 97, 96], 4)
    assert len(a) == 2 and a == b[:2] and len(b) == 3
    assert page_hashes([5, 1, 2, 3] + list(range(4, 8)), 4)[1] != a[1]   # page 1's hash covers page 0


def test_affinity_order_parked_then_session_then_prefix_then_least_loaded():
    router = ReplicaRouter(["r0", "r1"])
    long = "a conversation long enough for several pages"
    first, reason = router.choose(_hints(long))
    assert (first, reason) == ("r0", "least_loaded")
    router.routed(first, _hints(long))
    # The next turn starts with this one: the deepest cached prefix wins over load.
    assert router.choose(_hints(long + " and the next turn")) == ("r0", "prefix")
    other = _hints("something else entirely, also long")
    assert router.choose(other) == ("r1", "least_loaded")   # r0 has one in flight
    router.routed("r1", _hints("x", user="bob"))
    assert router.choose(_hints("unrelated text that is long", user="bob")) == ("r1", "session")
    router.parked("r0", ["call_abc"])
    follow = read_hints({"user": "bob", "messages": [
        {"role": "assistant", "tool_calls": [{"id": "call_abc", "type": "function"}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "ok"}]}, {}, None, 4)
    assert router.choose(follow) == ("r0", "parked")


def test_session_header_wins_over_body_keys():
    hints = read_hints({"user": "u", "session_id": "s", "messages": []}, {"x-session-affinity": "h"}, None, 16)
    assert hints.session_key == "h"
    assert read_hints({"user": "u", "prompt_cache_key": "k"}, {}, None, 16).session_key == "k"


def test_prefix_affinity_yields_to_load_and_dead_replicas_are_forgotten():
    router = ReplicaRouter(["r0", "r1"], max_imbalance=2)
    shared = _hints("the same long shared system prompt for everyone")
    router.routed("r0", shared)
    router.routed("r0", shared)
    assert router.choose(shared) == ("r1", "least_loaded")   # r0 is 2 requests ahead
    router.finished("r0")
    assert router.choose(shared) == ("r0", "prefix")
    router.set_alive("r0", False)
    assert router.choose(shared) == ("r1", "least_loaded")
    router.set_alive("r0", True)
    assert router.choose(shared) == ("r1", "least_loaded")   # its cache was forgotten (and r0 has 1 in flight)
    assert not router.prefixes["r0"]
    router.set_alive("r0", False)
    router.set_alive("r1", False)
    with pytest.raises(RuntimeError, match="no replica is up"):
        router.choose(shared)


def test_a_shallow_shared_prefix_does_not_pin_new_conversations():
    router = ReplicaRouter(["r0", "r1"])
    router.routed("r0", _hints("Agent 1: the same header, then conversation one"))
    router.finished("r0")
    # Only the first page or two ("<user>Agent 1: t...") match: under half of the new prompt's pages.
    assert router.choose(_hints("Agent 1: the other conversation, which is much longer than the header")) \
        == ("r0", "least_loaded")   # both idle: the first replica, by load, not by prefix
    assert router.routed_by == {"least_loaded": 1}


def test_round_robin_and_bounded_maps():
    router = ReplicaRouter(["r0", "r1", "r2"], "round_robin", hashes_per_replica=3, max_keys=2)
    assert [router.choose(RoutingHints())[0] for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    router.routed("r0", RoutingHints(page_hashes=[b"1", b"2", b"3", b"4"]))
    assert list(router.prefixes["r0"]) == [b"2", b"3", b"4"]
    router.parked("r1", ["a", "b", "c"])
    assert list(router.parked_calls) == ["b", "c"]


def test_a_response_continuing_stored_state_names_it_for_routing():
    """``previous_response_id``, or ``conversation`` (an id or ``{"id": ...}``), is the state a
    Responses request needs: the hint that sends it to the replica holding it."""
    assert read_hints({"previous_response_id": "resp_1"}, {}, None, 16).stored_response == "resp_1"
    assert read_hints({"conversation": "conv_1"}, {}, None, 16).stored_response == "conv_1"
    assert read_hints({"conversation": {"id": "conv_2"}}, {}, None, 16).stored_response == "conv_2"
    assert read_hints({"conversation": 7}, {}, None, 16).stored_response is None


def test_odd_bodies_give_no_hints():
    assert read_hints({"messages": "nope", "prompt": 3}, {}, None, 16) == RoutingHints()
    # A body the replica will reject still keeps the hints it has (the session key).
    assert read_hints({"messages": 5, "user": "bob"}, {}, None, 16).session_key == "bob"
    assert read_hints({"user": "bob", "messages": [{"role": "assistant", "tool_calls": 5}]},
                      {}, None, 16).session_key == "bob"
    assert read_hints({"prompt": list(range(40))}, {}, None, 16).page_hashes == page_hashes(list(range(40)), 16)


def test_replica_settings_are_validated():
    assert not EngineConfig().replicated
    assert EngineConfig(data_parallel_size=2).replicated
    assert EngineConfig(prefill_replicas=1, decode_replicas=2).replicated
    for bad, match in (({"data_parallel_size": 0}, "data_parallel_size"),
                       ({"prefill_replicas": 1}, "go together"),
                       ({"prefill_replicas": -1, "decode_replicas": 1}, "prefill_replicas"),
                       ({"prefill_replicas": 1, "decode_replicas": 1, "data_parallel_size": 2}, "either"),
                       ({"replica_router": "random"}, "replica_router"),
                       ({"ray_address": ""}, "ray_address")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**bad)


def test_single_engine_path_imports_no_ray():
    code = ("import sys, jaxserve, server, server.app, server.cli, jaxserve.async_engine; "
            "from jaxserve.cli import build_parser; build_parser(); "
            "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if m.startswith('ray'))")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_prefixes_are_held_to_what_the_replica_reports_it_caches():
    """A replica whose cache holds fewer pages than the front remembers routing to it
    stops attracting the oldest prefixes; what was routed since its last report stays."""
    router = ReplicaRouter(["r0", "r1"], max_imbalance=100)
    old, new = _hints("an old conversation, long enough for pages"), _hints("a new conversation, also long")
    router.routed("r0", old)
    router.finished("r0")
    router.set_capacity("r0", len(old.page_hashes))   # the report after ``old`` was cached
    router.routed("r0", new)                          # routed since: kept whatever the next report says
    router.finished("r0")
    assert router.choose(old) == ("r0", "prefix") and router.choose(new) == ("r0", "prefix")
    router.set_capacity("r0", len(new.page_hashes))   # evicted under load: room for one conversation
    assert router.choose(new) == ("r0", "prefix")
    assert router.choose(old)[1] == "least_loaded"    # forgotten: no longer routed by its prefix
    router.set_capacity("r0", 0)                      # emptied (restarted): nothing left to follow
    assert router.choose(new)[1] == "least_loaded"


def test_only_the_hashed_pages_text_is_tokenized():
    """A prompt of megabytes is cut to what its hashed pages can span before the front
    tokenizes it (a 12 MB body took ~8 s to route); the hashes are those of the full text."""
    from jaxserve.distributed.routing import MAX_CHARS_PER_TOKEN, MAX_HASHED_PAGES
    seen = []

    def tokenize(text):
        seen.append(len(text))
        return [ord(c) for c in text]

    huge = "word " * 400_000
    body = {"messages": [{"role": "user", "content": huge}]}
    hints = read_hints(body, {}, tokenize, page_size=16)
    assert seen == [MAX_HASHED_PAGES * 16 * MAX_CHARS_PER_TOKEN]
    from jaxserve.distributed.routing import prompt_text
    assert hints.page_hashes == page_hashes([ord(c) for c in prompt_text(body)], 16)   # of the whole text
    assert len(hints.page_hashes) == MAX_HASHED_PAGES


def test_a_stored_response_is_served_where_it_is_stored_under_every_policy():
    """Responses API: ``previous_response_id`` (and GET/DELETE of a stored response) go to the
    replica whose store holds it, whatever the policy; its function calls park like chat's; its
    ``input`` gives prefix and tool-call hints as chat messages do."""
    for policy in ("affinity", "least_loaded", "round_robin"):
        router = ReplicaRouter(["r0", "r1"], policy)
        router.stored("r1", ["resp_1"])
        follow = read_hints({"previous_response_id": "resp_1", "input": [
            {"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]}, {}, None, 4)
        assert follow.stored_response == "resp_1" and follow.tool_call_ids == ["call_9"]
        assert router.choose(follow) == ("r1", "stored")
        router.set_alive("r1", False)   # its store restarted empty: nothing to find there
        router.set_alive("r1", True)
        assert "resp_1" not in router.stored_responses and router.choose(follow)[1] != "stored"
    router = ReplicaRouter(["r0", "r1"])
    router.parked("r1", ["call_9"])
    assert router.choose(read_hints({"input": [{"type": "function_call_output", "call_id": "call_9",
                                                "output": "x"}]}, {}, None, 4)) == ("r1", "parked")
    chat = read_hints({"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "a question long enough"}]}, {}, None, 4)
    responses = read_hints({"instructions": "Be brief.", "input": "a question long enough"}, {}, None, 4)
    assert responses.page_hashes == chat.page_hashes and len(chat.page_hashes) > 4
    call = {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = read_hints({"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]}, {}, None, 4)
    responses = read_hints({"input": [{"role": "user", "content": "weather?"},
                                      {"type": "function_call", "call_id": "call_9", "name": "f", "arguments": "{}"},
                                      {"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]},
                           {}, None, 4)
    assert responses.page_hashes == chat.page_hashes and responses.tool_call_ids == chat.tool_call_ids


def test_the_front_notes_stored_responses_and_responses_function_calls():
    from jaxserve.distributed.frontend import _CALL_ID, _CONVERSATION_PATH, _STORED_ID, _STORED_PATH
    body = ('{"id":"resp_0a1b","object":"response","output":[{"type":"function_call","id":"fc_call_7",'
            '"call_id":"call_7","name":"f","arguments":"{}"}],"conversation":{"id":"conv_9f"}}')
    assert _STORED_ID.findall(body) == ["resp_0a1b", "conv_9f"] and _CALL_ID.findall(body) == ["call_7"]
    for path in ("/v1/conversations/conv_9f", "/v1/conversations/conv_9f/items",
                 "/v1/conversations/conv_9f/items/msg_1"):
        assert _CONVERSATION_PATH.match(path).group(1) == "conv_9f"
    assert _CONVERSATION_PATH.match("/v1/conversations") is None
    assert _CALL_ID.findall('{"tool_calls":[{"id":"call_3","type":"function"}]}') == ["call_3"]
    assert _STORED_PATH.match("/v1/responses/resp_0a1b").group(1) == "resp_0a1b"
    assert _STORED_PATH.match("/v1/responses") is None
