"""Bodies of the model admin endpoints and /health (our extensions to /v1/models)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from api_schemas.openai import OpenAIBaseModel, RequestModel


class Quantization(OpenAIBaseModel):
    """A model folder's quantization, as `mlx_lm.convert -q` writes it in config.json."""

    bits: int
    group_size: int | None = None
    mode: str | None = None


class ModelEntry(OpenAIBaseModel):
    """OpenAI's model object, plus our `role` and `path`."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="When this server loaded it (Unix seconds; a standby"
                         " target: when the server started).")
    owned_by: str = "local"
    role: Literal["target", "draft", "embedding", "standby"] = Field(
        description="standby: one of `models.more_targets`, served once a request names it.")
    path: str
    adapter_path: str | None = Field(None, exclude_if=lambda v: v is None,
                                     description="The target's fine-tuned adapters, if any.")
    max_model_len: int | None = Field(None, description="vLLM's name: its context length in"
                                      " tokens (prompt and output together).")
    quantization: Quantization | None = Field(
        None, exclude_if=lambda v: v is None,
        description="The quantization of its weight files; absent for float weights.")
    dequantized: bool | None = Field(
        None, exclude_if=lambda v: v is None,
        description="A loaded quantized model: whether its weights were dequantized at load"
        " (models.dequantize).")


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelEntry]


class LoadDraftRequest(RequestModel):
    model: str = Field(..., min_length=1, description="Local mlx_lm folder or hub id.")
    num_draft_tokens: int | None = Field(None, ge=1, le=64)


class LoadTargetRequest(RequestModel):
    model: str = Field(..., min_length=1, description="Local mlx_lm folder, GGUF file or hub id.")
    model_name: str | None = Field(None, min_length=1, max_length=1024,
                                   description="The name clients send as `model` (default: its"
                                   " path).")
    draft_model: str | None = Field(
        None, min_length=1, description="A draft for it; null or \"none\": none; left out: the"
        " current draft, if its tokenizer matches the new target's.")
    num_draft_tokens: int | None = Field(None, ge=1, le=64)


class CompatibilityRequest(RequestModel):
    model: str = Field(..., min_length=1)


class CompatibilityResponse(OpenAIBaseModel):
    compatible: bool
    reason: str | None = None


class DraftCard(ModelEntry):
    parameters: int
    memory_gb: float
    num_draft_tokens: int


class TargetCard(ModelEntry):
    parameters: int
    memory_gb: float
    draft: DraftCard | None = Field(description="The draft now serving with it, if any.")


class DraftCandidate(OpenAIBaseModel):
    path: str = Field(description="What to send as `model` to POST /v1/models/draft.")
    size_gb: float = Field(description="Its weight files, in GB.")
    loaded: bool = Field(description="It is the draft serving now.")


class DraftCandidates(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[DraftCandidate]


class UnloadResponse(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


class DistributedLayout(OpenAIBaseModel):
    world_size: int = Field(description="Processes (ranks) serving the target.")
    backend: str = Field(
        description="mlx.core.distributed backend: ring, jaccl, jaccl-ring, mpi or nccl.")
    mode: Literal["tensor", "pipeline"] = Field(description="How the target is sharded.")
    rank_memory_gb: list[float] = Field(
        description="Each rank's MLX active memory (weights, caches; rank 0 also the draft),"
        " refreshed every `distributed.heartbeat_s`.")


class MemoryStatus(OpenAIBaseModel):
    budget_bytes: int = Field(description="What the KV caches (the running requests' and the"
                              " prefix cache's) may hold together (engine.memory_budget_gb).")
    limit_bytes: int | None = Field(description="The memory limit it was derived from; null"
                                    " when the budget is configured.")
    limit_source: str = Field(description='Where the limit comes from: "cgroup v2 (FILE)",'
                              ' "cgroup v1 (FILE)", "physical memory", "Metal recommended'
                              ' working set", "GPU device memory", or "configured".')
    reserved_bytes: int = Field(description="What the process held once its models were"
                                " loaded (weights; on a CPU the runtime too).")
    margin_bytes: int = Field(description="Kept free for what forwards allocate for a moment"
                              " (engine.memory_margin_gb).")
    transient_bytes: int = Field(0, description="The most a step has allocated for a moment"
                                 " (activations, attention scores); what exceeds the margin"
                                 " comes off the budget.")
    kv_bytes: int = Field(description="What the running requests' KV caches hold now.")
    max_request_tokens: int = Field(description="The most tokens (prompt and output) one"
                                    " request may hold: more is a 400.")
    preemptions: int = Field(description="Requests paused for memory since the start (they"
                             " resume with the same text).")
    paused: int = Field(description="Requests paused now, waiting for memory to resume.")


class QuantizedModel(Quantization):
    dequantized: bool = Field(description="Its weights were dequantized at load"
                              " (models.dequantize).")


class CostModelStatus(OpenAIBaseModel):
    """Where the forward times that choose each row's k come from (engine.cost_model)."""

    target: Literal["formula", "similar", "stored", "measured"] = Field(
        description="formula: from its parameters and the device; similar: a stored table of a"
        " model of similar size, scaled; stored: its own table from an earlier start;"
        " measured: by this process.")
    draft: Literal["formula", "similar", "stored", "measured"] | None = None
    measuring: bool = Field(description="A measurement (or a stored table's spot check) is"
                            " still to run, in idle moments.")
    measured_s: float = Field(description="Machine time measuring took so far.")
    budget_s: float | None = Field(description="engine.cost_model_budget_s.")


class Health(OpenAIBaseModel):
    status: Literal["ok", "draining", "failed"] = Field(
        "ok", description='"draining" (with HTTP 503) once shutdown began: send no new'
        ' requests; "failed" (503): the inference engine died and the process is exiting, for'
        ' its supervisor to start it again.')
    target: str
    draft: str | None
    queue_depth: int = Field(description="Requests waiting for a batch slot.")
    batch_size: int = Field(0, description="Requests prefilling or decoding now.")
    cache_entries: int = Field(0, description="Prefix-cache entries.")
    cache_bytes: int = Field(0, description="Bytes the prefix cache holds.")
    disk_cache_entries: int = Field(0, description="Prefix-cache files on disk (cache.disk_dir).")
    disk_cache_bytes: int = Field(0, description="Bytes of the prefix-cache files on disk.")
    distributed: DistributedLayout | None = Field(
        None, description="The layout of a target sharded with `mlx.launch`; absent in one"
        " process.")
    quantization: dict[Literal["target", "draft"], QuantizedModel] | None = Field(
        None, description="The quantized models among the target and the draft, and whether"
        " each was dequantized; absent when neither is quantized.")
    cost_model: CostModelStatus | None = Field(
        None, description="Absent with engine.cost_model off.")
    memory: MemoryStatus | None = Field(
        None, description="The memory budget that admits and pauses requests; absent without"
        " one (a sharded target).")


class CacheCleared(OpenAIBaseModel):
    entries: int = Field(description="Prefix-cache entries removed from memory.")
    disk_entries: int = Field(0, description="Prefix-cache files deleted from disk"
                              " (cache.disk_dir; 0 without one).")
    suffix_answers: int = Field(0, description="Served answers suffix drafting forgot"
                                " (engine.suffix_max_mb; 0 when off).")
