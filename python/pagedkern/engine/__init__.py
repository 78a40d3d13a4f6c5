"""The serving engine: request state, paged KV block pool, continuous-batching scheduler, model
runner, sampling, incremental detokenization and stop conditions.

    engine = Engine.from_config(EngineConfig())
    for out in engine.stream(messages=[{"role": "user", "content": "Hi"}]):
        print(out.text, end="")

    LLM().generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
"""

from .block_pool import BlockPool
from .config import EngineConfig
from .engine import Engine, RequestOutput
from .llm import LLM, Generation
from .request import FinishReason, Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import RequestRejected, Scheduler, SchedulerConfig

__all__ = [
    "LLM",
    "BlockPool",
    "Engine",
    "EngineConfig",
    "FinishReason",
    "Generation",
    "Request",
    "RequestOutput",
    "RequestRejected",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
]
