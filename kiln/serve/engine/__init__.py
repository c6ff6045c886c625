"""The inference engine: continuous batching over a paged KV cache, one request at a time out.

What callers use (the HTTP server, post-training, eval, `kiln sample`) is imported from here;
the pieces (scheduler, block pool, paged cache, sampling, stop strings, request handles, the
batch-invariant padding, the standalone speculative decoder) are its modules.
"""

from kiln.serve.engine.engine import (
    Engine,
    EngineConfig,
    EngineConfigError,
    EngineFull,
    EngineStats,
    check_servable,
)
from kiln.serve.engine.requests import Completion, RequestHandle, TokenEvent
from kiln.serve.engine.sampling import SamplingParams, SamplingParamsError

__all__ = [
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineConfigError",
    "EngineFull",
    "EngineStats",
    "RequestHandle",
    "SamplingParams",
    "SamplingParamsError",
    "TokenEvent",
    "check_servable",
]
