"""jaxserve: a JAX/Pallas LLM inference engine for requests that call tools mid-generation."""

from jaxserve.config import EngineConfig
from jaxserve.constraints import StructuredOutput
from jaxserve.outputs import ApiCall, ApiCallOutput, RequestOutput, TokenLogprob
from jaxserve.sampling_params import SamplingParams
from jaxserve.tools import Tool

__all__ = ["LLM", "LLMEngine", "AsyncEngine", "EngineConfig", "SamplingParams", "ApiCall", "ApiCallOutput",
           "RequestOutput", "StructuredOutput", "TokenLogprob", "Tool"]


def __getattr__(name: str):
    # Engine classes import JAX and the models; load them on first use so the
    # simulator and trace tools stay light.
    if name == "LLM":
        from jaxserve.llm import LLM
        return LLM
    if name == "LLMEngine":
        from jaxserve.engine import LLMEngine
        return LLMEngine
    if name == "AsyncEngine":
        from jaxserve.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
