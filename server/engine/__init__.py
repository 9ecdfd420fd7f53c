"""The engine: models, the MLX worker thread and generation. Knows nothing of HTTP.

This module is the engine's one public door: the HTTP layer imports only what is named here
(`make lint` checks it). The subpackages behind it:

- `scheduling/`: the scheduler loop on the MLX thread, sequences, the one decoding round,
  sampling, stop strings, switching between targets;
- `speculation/`: drafters (prompt lookup, predictions), verification, the k per row and round
  (policy, cost model);
- `kv/`: the batch's caches, the prefix cache in memory and on disk;
- `structured/`: grammars (JSON schemas, tool calls), reasoning budgets;
- `models/`: loading, adapters, fused projections, heads, draft vocabularies, embeddings;
- `distributed/`: a target sharded over `mlx.launch`'s processes.
"""

from __future__ import annotations

from server.engine.config import DistributedConfig, EngineConfig
from server.engine.distributed.service import DistributedEngine, launched_layout
from server.engine.errors import (
    AdapterError,
    EngineFailed,
    GrammarError,
    IncompatibleDraft,
    InvalidRequest,
    MemoryBudgetExceeded,
    ModelLoadError,
    ModelNotFound,
    ModelReplaced,
    QueueFull,
    RequestCancelled,
    ShuttingDown,
    TargetUnavailable,
    UnsupportedCache,
)
from server.engine.events import Finished, GenerationStats, TokenEvent
from server.engine.fim import FimFormat, supported_markers
from server.engine.kv.prefix_cache import cache_budget_bytes
from server.engine.models.model_kit import KEEP, folder_context_length, on_gpu
from server.engine.params import DraftSource, GenerationParams, SamplingParams, SpeculationParams
from server.engine.prompts import RESERVED_TEMPLATE_KWARGS, chat_tokens, text_tokens
from server.engine.scheduling.scheduler import SchedulerConfig, SchedulerObserver
from server.engine.scheduling.switching import TargetEntry
from server.engine.scoring import PromptLogprobs
from server.engine.service import InferenceEngine, ModelCard, RequestHandle
from server.engine.structured.grammar import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    call_key,
    grammars_for,
)
from server.engine.structured.lazy_grammar import lazy_tool_calls
from server.engine.structured.reasoning_budget import opens_reasoning, reasoning_budget


def build_engine(config: EngineConfig) -> InferenceEngine:
    """The engine `config` describes, not started: a sharded one on rank 0 of `mlx.launch`."""
    return (InferenceEngine if config.distributed is None else DistributedEngine)(config)


__all__ = [
    "KEEP", "RESERVED_TEMPLATE_KWARGS", "TOOL_CALL_END", "TOOL_CALL_START",
    "AdapterError", "DistributedConfig", "DistributedEngine", "DraftSource", "EngineConfig",
    "EngineFailed", "FimFormat", "Finished", "GenerationParams", "GenerationStats",
    "GrammarError", "IncompatibleDraft", "InferenceEngine", "InvalidRequest",
    "MemoryBudgetExceeded", "ModelCard", "ModelLoadError",
    "ModelNotFound", "ModelReplaced", "PromptLogprobs", "QueueFull", "RequestCancelled",
    "RequestHandle", "SamplingParams", "SchedulerConfig", "SchedulerObserver", "ShuttingDown",
    "SpeculationParams", "TargetEntry", "TargetUnavailable", "TokenEvent", "UnsupportedCache",
    "build_engine", "cache_budget_bytes", "call_key", "chat_tokens", "folder_context_length",
    "grammars_for", "launched_layout", "lazy_tool_calls", "on_gpu", "opens_reasoning",
    "reasoning_budget", "supported_markers", "text_tokens",
]
