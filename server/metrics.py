"""Prometheus metrics, one registry per app.

Gauges and engine counters are read at scrape time from the engine's
published snapshots (``AsyncEngine.usage_snapshot`` / ``stats_snapshot``), so
they are exactly the engine's numbers. Latency histograms are observed by the
server per response (seconds, server clock).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.outputs import RequestOutput

PREFIX = "jaxserve:"
VLLM_PREFIX = "vllm:"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)


class EngineCollector:
    """Exports the engine's usage gauges and cumulative counters."""

    def __init__(self, engine, parked_contexts: Callable[[], int], background_runs: Callable[[], int]) -> None:
        self.engine = engine
        self.parked_contexts = parked_contexts
        self.background_runs = background_runs

    def collect(self):
        usage = self.engine.usage_snapshot
        stats = self.engine.stats_snapshot

        def gauge(name, doc, value, labels=None):
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels) if labels else None)
            if labels:
                for label_values, v in value:
                    fam.add_metric(label_values, v)
            else:
                fam.add_metric([], value)
            return fam

        yield gauge("num_requests_running", "Requests in the running batch.", usage["running"])
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", usage["waiting"])
        yield gauge("num_requests_swapping", "Requests whose KV is being copied host<->device.", usage["swapping"])
        yield gauge("num_requests_paused", "Requests paused in an API call, by handling.",
                    [([h], n) for h, n in sorted(usage["paused"].items())], labels=["handling"])
        yield gauge("num_parked_tool_contexts", "Paused client-side tool-call contexts kept for resumption.",
                    self.parked_contexts())
        yield gauge("num_background_responses", "Background Responses API runs not yet ended (queued or in progress).",
                    self.background_runs())
        yield gauge("kv_pages_used", "KV cache pages in use.",
                    [(["device"], usage["device_pages_used"]), (["host"], usage["host_pages_used"])],
                    labels=["memory"])
        yield gauge("kv_pages_total", "KV cache pages in the pool.",
                    [(["device"], usage["device_pages_total"]), (["host"], usage["host_pages_total"])],
                    labels=["memory"])
        yield gauge("prefix_cache_pages", "Device KV pages holding prefix-cache pages (in use or evictable).",
                    usage["prefix_cached_pages"])
        yield gauge("prefix_cache_host_pages", "Host KV pages holding the prefix cache's host tier (evictable).",
                    usage.get("prefix_cached_host_pages", 0))
        yield gauge("kv_cache_usage_ratio", "Fraction of KV pages in use.",
                    [([m], usage[f"{m}_pages_used"] / max(1, usage[f"{m}_pages_total"])) for m in ("device", "host")],
                    labels=["memory"])

        # The names vLLM-aware routers (llm-d's inference scheduler, ...) read; usage is a fraction 0..1.
        for name, doc, value in (
                ("num_requests_waiting", "Requests waiting to be scheduled (vLLM name).", usage["waiting"]),
                ("num_requests_running", "Requests in the running batch (vLLM name).", usage["running"]),
                ("kv_cache_usage_perc", "Fraction of device KV pages in use, 0..1 (vLLM name).",
                 usage["device_pages_used"] / max(1, usage["device_pages_total"]))):
            fam = GaugeMetricFamily(VLLM_PREFIX + name, doc)
            fam.add_metric([], value)
            yield fam

        def counter(name, doc, value):
            fam = CounterMetricFamily(PREFIX + name, doc)
            fam.add_metric([], value)
            return fam

        yield counter("prompt_tokens", "Prompt tokens of requests added to the engine.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("recomputed_tokens", "Tokens whose KV was computed again (after Discard or preemption).",
                      stats.recomputed_tokens)
        yield counter("swapped_out_pages", "KV pages copied device->host (Swap and the prefix cache's host tier).",
                      stats.swapped_out_pages)
        yield counter("swapped_in_pages", "KV pages copied host->device (Swap and the prefix cache's host tier).",
                      stats.swapped_in_pages)
        yield counter("num_preemptions", "Requests preempted to free KV pages.", usage["preemptions"])
        yield counter("prefix_cache_queries", "Prompt and context tokens looked up in the prefix cache at admission.",
                      usage["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Looked-up tokens whose KV came from the prefix cache.",
                      usage["prefix_cache_hits"])
        yield counter("prefix_cache_host_hits", "Of the prefix cache's hits, tokens copied back from its host tier.",
                      usage.get("prefix_cache_host_hits", 0))
        yield counter("engine_steps", "Engine steps run.", stats.steps)
        fam = CounterMetricFamily(PREFIX + "api_calls", "API calls requests paused on, by the handling chosen "
                                  "when each paused (preserve, discard, swap).", labels=["handling"])
        for handling, n in sorted(usage.get("api_calls", {}).items()):
            fam.add_metric([handling], n)
        yield fam
        fam = CounterMetricFamily(PREFIX + "request_finished", "Requests finished in the engine, by reason.",
                                  labels=["finish_reason"])
        for reason, n in sorted(stats.finished.items()):
            fam.add_metric([reason], n)
        yield fam


class ServerMetrics:
    """The app's registry: engine collector plus per-response histograms and counters."""

    def __init__(self, engine, parked_contexts: Callable[[], int], background_runs: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineCollector(engine, parked_contexts, background_runs))

        def hist(name, doc):
            return Histogram(PREFIX + name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time from receiving a request to its first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between tokens of a response (API pauses excluded).")
        self.e2e = hist("e2e_request_latency_seconds", "Time from receiving a request to its last token.")
        self.queue = hist("request_queue_time_seconds", "Time a request waited before it was first scheduled.")
        self.api_pause = hist("request_api_pause_time_seconds",
                              "Time a request spent paused in one API call (call to return).")
        self.responses = Counter(PREFIX + "responses", "Responses (choices) by finish reason.", ["finish_reason"],
                                 registry=self.registry)
        self.resumed = Counter(PREFIX + "resumed_requests", "Follow-up requests served by resuming a paused "
                               "tool-call context instead of recomputing it.", registry=self.registry)
        self.resumed_context_tokens = Counter(
            PREFIX + "resumed_context_tokens", "Context tokens reused by resumption (not processed again).",
            registry=self.registry)
        self.resume_appended_tokens = Counter(
            PREFIX + "resume_appended_tokens", "New tokens (tool results, next turn) appended on resumption.",
            registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ResponseTimer:
    """Observes the histograms for one choice as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics, start: float, *, resumed: bool = False, calls_seen: int = 0) -> None:
        """``calls_seen``: API calls of the request already observed (by the response that parked it)."""
        self.metrics = metrics
        self.start = start
        self.observe_queue = not resumed
        self.last_token: float | None = None
        self.calls_seen = calls_seen
        self.ended = False

    def on_output(self, out: RequestOutput, now: float) -> None:
        new_pause = False
        for call in out.api_calls[self.calls_seen:]:
            if call.return_time is None:
                break
            self.metrics.api_pause.observe(max(0.0, call.return_time - call.call_time))
            self.calls_seen += 1
            new_pause = True
        if self.observe_queue and out.metrics.get("first_scheduled_time") is not None:  # (the first output with tokens)
            self.metrics.queue.observe(max(0.0, out.metrics["first_scheduled_time"] - out.metrics["arrival_time"]))
            self.observe_queue = False
        if out.delta_token_ids:
            if self.last_token is None:
                self.metrics.ttft.observe(now - self.start)
            elif not new_pause:
                self.metrics.itl.observe((now - self.last_token) / len(out.delta_token_ids))
            self.last_token = now

    def on_end(self, finish_reason: str, now: float) -> None:
        """The choice ended (its final output; or the response ended without it: the
        client left, ``abort``, or the stream failed, ``error``); once per choice."""
        if self.ended:
            return
        self.ended = True
        self.metrics.e2e.observe(now - self.start)
        self.metrics.responses.labels(finish_reason).inc()


def parse_metrics_text(text: str) -> dict[str, float]:
    """A ``/metrics`` scrape as ``{'name{labels}': value}``, keyed by each sample line's
    text up to its value (comments skipped) — for clients, load tests and tests."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out

