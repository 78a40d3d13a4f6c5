"""The serving engine: request state, paged KV block pool, continuous-batching scheduler, model
runner, sampling, incremental detokenization and stop conditions.

    engine = Engine.from_config(EngineConfig())
    for out in engine.stream(messages=[{"role": "user", "content": "Hi"}]):
        print(out.text, end="")

    LLM().generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
"""

from ..ops.shadow import ShadowDivergence, ShadowReport
from .block_pool import BlockPool
from .config import ConfigField, EngineConfig, engine_fields
from .engine import Engine
from .llm import LLM, Generation
from .outputs import EngineStats, RequestMetrics, RequestOutput
from .request import FinishReason, Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import RequestRejected, Scheduler, SchedulerConfig
from .validation import ParameterTypeError

__all__ = [
    "ShadowDivergence",
    "ShadowReport",
    "LLM",
    "BlockPool",
    "ConfigField",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "Generation",
    "ParameterTypeError",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestRejected",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "engine_fields",
]
