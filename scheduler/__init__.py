"""Pure-Python scheduling: requests, page accounting, policies, cost model.

Imports no JAX and nothing from the engine, so it runs (and is tested and
benchmarked) with plain Python objects.
"""

from scheduler.config import SchedulerConfig
from scheduler.cost_model import BUILTIN_PROFILES, CostModel, load_profile
from scheduler.kv_manager import KVManager
from scheduler.pages import OutOfPagesError, PageAllocator
from scheduler.plan import CACHE_OWNER, DecodeChunk, EventKind, MemoryView, RequestEvent, ScheduledChunk, StepPlan, StepResult, SwapOp
from scheduler.policies import Policy, PolicyContext, available_policies, make_policy, register_policy
from scheduler.predictors import Predictor, available_predictors, make_predictor
from scheduler.request import ApiCallRecord, Handling, Request, RequestState, Segment
from scheduler.scheduler import Scheduler

__all__ = [
    "ApiCallRecord", "BUILTIN_PROFILES", "CACHE_OWNER", "CostModel", "EventKind", "Handling", "KVManager", "RequestEvent", "StepResult", "MemoryView", "OutOfPagesError",
    "DecodeChunk", "PageAllocator", "Policy", "PolicyContext", "Predictor", "Request", "RequestState", "ScheduledChunk", "Scheduler",
    "SchedulerConfig", "Segment", "StepPlan", "SwapOp", "available_policies", "available_predictors",
    "load_profile", "make_policy", "make_predictor", "register_policy",
]
