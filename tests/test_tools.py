"""Tools, the tool-call parser and the API executor (no model needed)."""

from __future__ import annotations

import asyncio
import time

import pytest

from jaxserve.api_calls import ApiCalls
from jaxserve.tool_format import get_format
from jaxserve.tool_format.hermes import HermesParser
from jaxserve.tools import Tool, calculator, evaluate_arithmetic, normalize_tools


@pytest.mark.parametrize("expr, value", [("2 + 3 * (4 - 1)", 11), ("-2 ** 3", -8), ("7 // 2", 3),
                                         ("sqrt(16) + abs(-1)", 5.0), ("1 / 4", 0.25)])
def test_calculator_evaluates_arithmetic(expr, value):
    assert evaluate_arithmetic(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "open('x')", "a + 1", "2 ** 1000", "1 / 0", "[1, 2]",
                                  "(lambda: 1)()", "x" * 2000])
def test_calculator_rejects_everything_else(expr):
    with pytest.raises(ValueError):
        evaluate_arithmetic(expr)


def test_calculator_tool_text():
    assert calculator("6*7") == "42"
    assert "calculator" in normalize_tools(None)


def test_hermes_parser_fires_once_per_complete_call_across_deltas():
    parser = get_format("hermes").parser()
    text = 'sure <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call> ok'
    fired = [c for ch in text for c in parser.feed(ch)]
    assert len(fired) == 1 and fired[0].name == "calculator"
    assert fired[0].arguments == '{"expression": "6*7"}'
    [bad] = HermesParser().feed("<tool_call>{not json}</tool_call>")
    assert bad.name == ""


def wait_results(ex: ApiCalls, n: int, timeout: float = 5.0):
    out, start = [], time.monotonic()
    while len(out) < n and time.monotonic() - start < timeout:
        out += ex.poll(time.monotonic())
        time.sleep(0.01)
    return out


def test_executor_runs_sync_and_async_tools_and_reports_failures_and_timeouts():
    async def async_tool(x):
        await asyncio.sleep(0.01)
        return f"async {x}"

    def failing():
        raise RuntimeError("boom")

    def slow():
        time.sleep(2)
        return "late"

    ex = ApiCalls()
    now = time.monotonic()
    ex.call_tools("a", [(Tool("calc", calculator), '{"expression": "1+1"}')], now)
    ex.call_tools("b", [(Tool("async", async_tool), '{"x": 3}')], now)
    ex.call_tools("c", [(Tool("fail", failing), "{}")], now)
    ex.call_tools("d", [(Tool("slow", slow, timeout_s=0.1), "{}")], now)
    ex.call_tools("e", [(Tool("calc", calculator), "[1]")], now)
    ex.call_simulated("f", now + 0.05, [1, 2])
    results = {r.request_id: r for r in wait_results(ex, 6)}
    ex.shutdown()
    assert results["a"].outputs[0].text == "2" and results["b"].outputs[0].text == "async 3"
    # the tool's own exception text is for the log, not the model
    assert results["c"].outputs[0].error == "tool 'fail' failed (internal error)" and "timed out" in results["d"].outputs[0].error
    assert "JSON object" in results["e"].outputs[0].error and results["f"].token_ids == [1, 2]


def test_external_resume_and_cancel():
    ex = ApiCalls()
    ex.expect_external("x")
    assert ex.is_waiting_external("x")
    ex.resume("x", text="result")
    with pytest.raises(KeyError):
        ex.resume("x", text="twice")
    assert ex.poll(time.monotonic())[0].outputs[0].text == "result"
    ex.call_simulated("y", time.monotonic() + 10, [1])
    ex.cancel("y")
    assert ex.next_due() is None
    ex.shutdown()


def test_ready_after_is_when_poll_ready_can_turn_true():
    ex = ApiCalls()
    assert ex.ready_after() == float("inf")
    ex.call_simulated("a", 7.0, [1])
    ex.call_simulated("b", 3.0, None, num_tokens=2)
    assert ex.ready_after() == 3.0 and not ex.poll_ready(2.999) and ex.poll_ready(3.0)
    ex.expect_external("c")   # a resume may come from another thread any moment
    assert ex.ready_after() == float("-inf")
    ex.resume("c", text="done")
    assert ex.ready_after() == float("-inf") and ex.poll_ready(0.0)
    ex.shutdown()


def test_async_tool_called_with_wrong_arguments_becomes_an_error_result():
    async def needs_x(x):
        return x

    ex = ApiCalls()
    ex.call_tools("a", [(Tool("needs_x", needs_x), '{"y": 1}')], time.monotonic())
    [result] = wait_results(ex, 1)
    ex.shutdown()
    assert result.request_id == "a" and "wrong arguments" in result.outputs[0].error
