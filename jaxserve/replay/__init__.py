"""Trace replay: load workload traces, generate arrivals, run them through the
scheduler on a simulator (``run_simulation``) or the real engine, and report
metrics. Importing this package does not import JAX; only the real-engine
runner (``jaxserve.replay.engine_replay``) does.
"""

from jaxserve.replay.cluster import ROUTERS, ClusterResult, run_resend
from jaxserve.replay.metrics import RequestMetrics, Slo, aggregate, request_metrics, summary_table
from jaxserve.replay.mooncake import CacheBounds, cache_bounds
from jaxserve.replay.page_keys import PageNamer
from jaxserve.replay.simulate import SimConfig, SimResult, SimulationStalled, build_scheduler, run_simulation
from jaxserve.replay.trace import (TraceEntry, TraceError, bundled_trace_path, load_trace, parse_infercept,
                                   parse_jsonl, parse_mooncake, scale_entries)
from jaxserve.replay.workload import WorkloadItem, WorkloadSpec, make_workload

__all__ = [
    "CacheBounds", "ClusterResult", "PageNamer", "ROUTERS", "cache_bounds", "parse_mooncake", "run_resend",
    "RequestMetrics", "SimConfig", "SimResult", "SimulationStalled", "Slo", "TraceEntry",
    "TraceError", "WorkloadItem", "WorkloadSpec", "aggregate", "build_scheduler", "bundled_trace_path",
    "load_trace", "make_workload", "parse_infercept", "parse_jsonl", "request_metrics", "run_simulation", "scale_entries",
    "summary_table",
]
