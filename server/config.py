"""Settings: `config.yaml`, then `MLX_SPEC_*` environment variables, then CLI flags.

Split as llama-cpp-python does: what the HTTP server needs, what the models need, and the
defaults a request gets when it leaves a field out. Each default lives here and only here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.engine.config import DistributedConfig, EngineConfig
from server.engine.distributed.service import launched_layout
from server.engine.kv.disk_cache import DEFAULT_DISK_MAX_GB
from server.engine.kv.prefix_cache import cache_budget_bytes
from server.engine.params import HYBRID_MIN_MATCH, Acceptance, DraftSource
from server.engine.prompts import RESERVED_TEMPLATE_KWARGS
from server.engine.scheduling.scheduler import (
    DEFAULT_IDLE_PREFILL_CHUNK,
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_PREFILL_CHUNK,
    SchedulerConfig,
)
from server.engine.scheduling.switching import TargetEntry
from server.engine.speculation.forward_source import DEFAULT_BUDGET_S
from server.engine.speculation.policy import (
    DEFAULT_BATCH_DRAFT_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_SPEC_MAX_BATCH,
)
from server.engine.speculation.prompt_lookup import DEFAULT_MAX_NGRAM
from server.engine.speculation.suffix import DEFAULT_SUFFIX_MAX_MB


class ServerSettings(BaseModel):
    host: str = Field("127.0.0.1", description="Interface to bind.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port.")
    api_key: str | None = Field(None, description="Bearer key required on every /v1 endpoint"
                                " (MLX_SPEC_SERVER__API_KEY keeps it out of the process list).")
    admin_api_key: str | None = Field(
        None,
        description="Bearer key required to load or unload models (admin endpoints). Without"
        " it, a server bound beyond loopback refuses model changes (403).",
    )
    max_queue_size: int = Field(
        64, ge=1, le=4096,
        description="Requests that may wait for a batch slot; beyond it: 503 with Retry-After.",
    )
    responses_store_size: int = Field(
        256, ge=0, le=100_000,
        description="Responses API: finished responses kept (least recently used out first;"
        " in memory, and in state_dir) for GET /v1/responses/{id} and previous_response_id,"
        " and as many conversations (/v1/conversations); 0 keeps none.",
    )
    max_body_mb: float = Field(
        8.0, gt=0,
        description="The largest request body in MB (10^6 bytes): a 413, in the API's error"
        " shape, before a larger one is read (by its Content-Length, or as its bytes arrive)."
        " 8 MB holds a 1M-token context's text. A batch's requests (POST /v1/files,"
        " POST /v1/messages/batches) are bounded by files_max_gb instead.",
    )
    files_max_gb: float = Field(
        1.0, ge=0,
        description="Files API: bytes of uploaded files (a batch's requests) kept until"
        " deleted (in memory, and in state_dir); an upload beyond it is a 413. Batches' output"
        " files are kept beside it.",
    )
    state_dir: str | None = Field(
        None,
        description="A folder where stored responses, conversations, files and batches are"
        " also written (SQLite), so they survive restarts; a batch or background response a"
        " restart interrupted goes on when the server starts again. One server per folder;"
        " null: in memory only.",
    )
    batch_concurrency: int | None = Field(
        None, ge=1, le=4096,
        description="Requests of running batches (OpenAI's Batch API, Anthropic's Message"
        " Batches) in flight at once, all batches together; null: half of"
        " engine.max_batch_size, leaving the rest to other clients.",
    )
    log_level: str = Field("info", description="uvicorn log level.")
    log_format: Literal["text", "json"] = Field(
        "text", description="text lines, or json: one JSON object per line (time, level,"
        " logger, message; a generation's request_id, endpoint, finish_reason and stats).")
    ui: bool = Field(
        True,
        description="Serve the playground page at GET / (chat with draft tokens coloured,"
        " compare with and without speculation, load/unload the draft); false: / is a 404.",
    )
    cors_origins: list[str] | None = Field(
        None,
        description="Origins whose web pages may call the API from a browser (CORS), such as"
        ' ["https://chat.example.org"], or ["*"] for any; default (null): pages served from'
        " this machine (http or https on localhost, 127.0.0.1 or [::1], any port); [] for none."
        " The admin endpoints never answer another origin's page.",
    )
    ssl_certfile: str | None = Field(
        None, description="A PEM certificate (chain) file: serve HTTPS instead of HTTP, with"
        " ssl_keyfile.")
    ssl_keyfile: str | None = Field(None, description="The certificate's PEM private key file.")

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("server.ssl_certfile and server.ssl_keyfile go together: give both"
                             " or neither")
        return self


class MoreTarget(BaseModel):
    """A target besides `models.model` that requests may name (`models.more_targets`)."""

    model_config = {"extra": "forbid"}

    model: str = Field(..., min_length=1, description="Local mlx_lm folder, GGUF file or hub id.")
    model_name: str | None = Field(None, description="Its name in `model`; default: the path.")
    draft_model: str | None = Field(None, description="A draft for it ('auto' as for"
                                    " models.draft_model); default: none.")
    num_draft_tokens: int | None = Field(None, ge=1, le=64,
                                         description="Its k; default: models.num_draft_tokens.")
    adapter_path: str | None = Field(None, description="Adapters folded into it, as"
                                     " models.adapter_path.")
    chat_template: str | None = Field(None, description="Its chat template, as"
                                      " models.chat_template.")

    @model_validator(mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        return {"model": value} if isinstance(value, str) else value

    @property
    def name(self) -> str:
        return self.model_name or self.model


class ModelSettings(BaseModel):
    model: str = Field(
        "models/demo/target", description="Target model: local mlx_lm folder or hub id."
    )
    model_name: str | None = Field(
        None, description="Name clients use in `model` (the path works too), such as"
        " smollm2-135m-instruct: agents (the OpenAI Agents SDK) refuse a path's prefix; defaults"
        " to the `model` path or id. A config file's name is dropped when a flag or the"
        " environment gives another model without one."
    )
    draft_model: str | None = Field(
        "models/demo/draft", description="Draft model path or hub id; null or 'none' for none;"
        " 'auto': the smallest model under model_roots with the target's tokenizer and at most a"
        " third of its weights (none if there is none).",
    )
    model_aliases: list[str] = Field(
        default_factory=list, description="More names clients may send as `model` for the"
        ' target, such as those an agent hard-codes ("gpt-4o-mini", "claude-haiku-4-5");'
        ' ["*"]: any name. Replies still name the served model.',
    )
    more_targets: list[MoreTarget] = Field(
        default_factory=list, description="More targets requests may name in `model`, each a"
        " path or {model, model_name, draft_model, num_draft_tokens, adapter_path,"
        " chat_template}: the server serves one target at a time and switches to the one a"
        " request names once the requests running on the current one have finished"
        " (llama-swap's and mlx_lm.server's rule).",
    )
    discover_targets: bool = Field(
        False, description="Every other local model under model_roots (an mlx_lm folder) is a"
        " standby target too, as more_targets are: named by its folder (org/name in a Hugging"
        " Face cache), listed by GET /v1/models, with an automatic draft (draft_model: auto).",
    )
    adapter_path: str | None = Field(
        None, description="A fine-tune of the target: the adapter folder `mlx_lm.lora` writes"
        " (LoRA, DoRA or full), folded into the target's weights at load. The draft is not"
        " adapted; the output is the fine-tune's, token for token.",
    )
    chat_template: str | None = Field(
        None, description="A Jinja chat template, or the path of a file holding one, used"
        " instead of the target tokenizer's (for models without one, or to fix one).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Variables every chat is rendered with, such as"
        ' {"enable_thinking": false}; a request\'s chat_template_kwargs win.',
    )
    embedding_model: str | None = Field(
        None, description="A model for POST /v1/embeddings, loaded beside the target (a decoder"
        " embedding model mlx_lm loads, as Qwen3-Embedding's conversions); null: none.",
    )
    embedding_pooling: Literal["last", "mean"] = Field(
        "last", description="How its hidden states become one vector: the last token's (the"
        " decoder embedding models') or the mean; L2-normalized either way.",
    )
    num_draft_tokens: int = Field(
        DEFAULT_NUM_DRAFT_TOKENS, ge=1, le=64,
        description="Draft tokens per round (the maximum when adaptive)."
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights dtype; auto = float32 on CPU (16-bit matmuls are slow there)."
    )
    dequantize: bool | Literal["auto"] = Field(
        "auto", description="Quantized models (mlx-community's 4- and 8-bit ones), target and"
        " draft: auto dequantizes them at load on a CPU device, where quantized matmuls run"
        " ~3x slower, when their float weights fit in half of the memory this process may use"
        " (its cgroup limit, else the machine's); on Metal and CUDA they stay quantized. true"
        " or false forces it. /v1/models and /health say what was done.",
    )
    model_roots: list[str] | None = Field(
        None,
        description="Folders the admin endpoints may load from; default: the start-up models'"
        " folders, models/ and the Hugging Face cache.",
    )
    allow_hub: bool | None = Field(
        None,
        description="Let admin-key holders load hub ids (downloads). Default: true when"
        " server.admin_api_key is set; without an admin key hub ids are always refused.",
    )
    synthetic_fallback: bool = Field(
        True,
        description="If the configured demo models are missing, build a random pair into"
        " models/generated and serve it (offline first run).",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict) -> dict:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value))
        if reserved:
            raise ValueError(f"may not set {', '.join(reserved)} (the renderer sets them)")
        return value

    @model_validator(mode="after")
    def _distinct_names(self) -> ModelSettings:
        names = [self.model_name or self.model] + [t.name for t in self.more_targets]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"more_targets: two targets are named {repeated[0]!r}; give each"
                             " its own model_name")
        return self


class EngineSettings(BaseModel):
    """How the scheduler batches requests and when it speculates."""

    max_batch_size: int = Field(
        DEFAULT_MAX_BATCH_SIZE, ge=1, le=256,
        description="Requests prefilling or decoding at once; more wait.",
    )
    prefill_chunk: int = Field(
        DEFAULT_PREFILL_CHUNK, ge=16, le=8192,
        description="Prompt tokens (padding included) prefilled per scheduler step, between"
        " decoding rounds: the most a new prompt stalls the running streams.",
    )
    idle_prefill_chunk: int = Field(
        DEFAULT_IDLE_PREFILL_CHUNK, ge=16, le=65536,
        description="Prompt tokens prefilled per step while no request decodes (nothing to"
        " stall), while more prompts wait than rows decode, or for a wave (2+ prompts, one per"
        " 4 decoding rows, 2,048 tokens at most), which is prefilled back to back, the running"
        " streams waiting for it once.",
    )
    spec_max_batch: int = Field(
        DEFAULT_SPEC_MAX_BATCH, ge=0, le=256,
        description="A cap: rows speculate only while at most this many requests run; above"
        " it, plain batched decoding (0: never speculate). Within the caps the cost model"
        " decides.",
    )
    spec_batch_draft_tokens: int = Field(
        DEFAULT_BATCH_DRAFT_TOKENS, ge=1, le=64,
        description="A cap: the most tokens a request drafts per round while other requests"
        " decode too (alone, its own k). Within the caps the cost model decides.",
    )
    suffix_max_mb: float = Field(
        DEFAULT_SUFFIX_MAX_MB, ge=0.0, le=65536.0,
        description="Suffix drafting (draft: suffix, and in hybrid): the answers this server"
        " served (each with its prompt's last 32 tokens), kept in memory for the requests that"
        " follow (a repeated request drafts its earlier answer), per API key when keys are set,"
        " within this many MB (the oldest leave first; about 360 bytes per token); emptied"
        " when the target changes. 0 turns suffix drafting off.",
    )
    cost_model: bool = Field(
        True,
        description="Let the models' forward times (rows x tokens) and each row's acceptance"
        " choose how many tokens each row drafts per round. The server is ready at once, with"
        " prior times (a stored table of this model, else of a model of similar size, else a"
        " formula from its parameters and the device), and measures the times in idle moments"
        " (cost_model_budget_s), stored per model and machine under ~/.cache/mlx-spec-server."
        " Off: every row drafts up to the caps.",
    )
    cost_model_budget_s: float = Field(
        DEFAULT_BUDGET_S, ge=0.0, le=3600.0,
        description="Machine time the forward-time measurement may take per start, one forward"
        " at a time while no request waits or runs (a request that arrives waits for one"
        " forward at most); larger row counts than it pays for are extrapolated. 0: never"
        " measure (the prior, corrected by real rounds).",
    )
    drain_timeout_s: float = Field(
        10.0, ge=0.0, le=600.0,
        description="On SIGTERM, how long running streams may go on before they are ended.",
    )
    fuse_projections: bool = Field(
        False,
        description="Stack each layer's q/k/v and gate/up projections into one matmul at load"
        " (target and draft). Same output; faster on some machines, not on others.",
    )
    memory_budget_gb: float | None = Field(
        None, gt=0.0,
        description="GB the KV caches (the running requests' of target and draft, and the"
        " prefix cache's) may hold together. A request joins the batch only when its KV fits"
        " beside the running rows' (else it waits in the queue); rows that outgrow it are"
        " paused, newest first, and resume later with the same text; a request whose prompt"
        " and max_tokens could never fit is a 400. Default (null): detected at start, the"
        " memory limit (the cgroup's, else physical memory, on Linux; Metal's recommended"
        " working set; a CUDA device's memory) less what the process holds once its models"
        " are loaded, less memory_margin_gb. /health shows it.",
    )
    memory_margin_gb: float | None = Field(
        None, ge=0.0,
        description="GB of the detected memory limit kept free for what a forward allocates"
        " for a moment (activations, attention scores: on a CPU they grow with the context,"
        " idle_prefill_chunk x context x heads x 4 bytes); default (null): 10% of the limit."
        " Ignored when memory_budget_gb is set.",
    )


class CacheSettings(BaseModel):
    """The prefix cache: KV states reused across requests by longest token prefix."""

    max_gb: float | None = Field(
        None, ge=0.0,
        description="Byte budget in GB (0 disables), shared with the running requests' KV:"
        " the cache keeps at most what they leave of it and of the memory budget"
        " (engine.memory_budget_gb), so it gives way before any request is paused; default:"
        " an eighth of the memory budget.",
    )
    disk_dir: str | None = Field(
        None,
        description="Folder where prefix-cache entries are also written (mlx_lm's prompt-cache"
        " files), so they survive restarts; null: no disk cache. Entries of other models or"
        " other weights may share it: they are never used for this one.",
    )
    disk_max_gb: float = Field(
        DEFAULT_DISK_MAX_GB, gt=0.0,
        description="Size bound of disk_dir's cache files in GB; the least recently used"
        " are deleted beyond it.",
    )


class DistributedSettings(BaseModel):
    """A target sharded over the processes of `mlx.launch` (ignored when run without it)."""

    mode: Literal["tensor", "pipeline"] = Field(
        "tensor", description="tensor: every rank holds a share of every layer's heads"
        " (`model.shard`); pipeline: every rank holds a run of layers (models with"
        " `PipelineMixin`).",
    )
    timeout_s: float = Field(
        60.0, gt=0.0, le=3600.0,
        description="A collective that does not complete within this (a rank died or hangs):"
        " rank 0 answers 503 to every request and exits; a follower that hears nothing from"
        " rank 0 for this long exits.",
    )
    heartbeat_s: float = Field(
        5.0, gt=0.0, le=600.0,
        description="Rank 0 messages the other ranks at least this often (and refreshes each"
        " rank's memory figure in /health).",
    )


class GenerationDefaults(BaseModel):
    """What a request gets for a field it leaves out."""

    max_tokens: int = Field(
        512, ge=1, description="Default max_tokens of chat and text completions (a Responses"
        " request without max_output_tokens may fill the context, as at OpenAI).")
    fit_max_tokens: bool = Field(
        False, description="Cut a max_tokens (max_output_tokens) larger than the room the"
        " prompt leaves in the context to that room, instead of a 400: agents ask for more"
        " than small contexts hold (Claude Code always asks for 32,000).")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Default temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Default top_p.")
    top_k: int = Field(0, ge=0, description="Default top_k (0: off; more than the vocabulary"
                       " keeps every token), such as a model card's recommended 20.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Default min_p.")
    draft: DraftSource = Field(
        DraftSource.HYBRID,
        description="Default drafter: model, prompt_lookup, suffix (what this server served"
        " before, engine.suffix_max_mb) or hybrid (each round the one of prompt lookup, suffix"
        " and the draft model expected to have the most tokens accepted).")
    acceptance: Acceptance = Field(
        "rejection", description="Default acceptance rule at temperature > 0."
    )
    adaptive: bool = Field(True, description="Adapt the draft length per round by default.")
    draft_p_min: float = Field(
        0.0, ge=0.0, le=1.0, description="Stop drafting a round below this draft probability."
    )
    hybrid_min_match: int = Field(
        HYBRID_MIN_MATCH, ge=1, le=DEFAULT_MAX_NGRAM,
        description="Hybrid drafts by prompt lookup only where the context's last this-many"
        " tokens occurred before; elsewhere the draft model drafts.",
    )


ENV_PREFIX = "MLX_SPEC_"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__")

    server: ServerSettings = Field(default_factory=ServerSettings)
    models: ModelSettings = Field(default_factory=ModelSettings)
    defaults: GenerationDefaults = Field(default_factory=GenerationDefaults)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    distributed: DistributedSettings = Field(default_factory=DistributedSettings)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides) -> Settings:
        """Read YAML (if any), let `MLX_SPEC_*` variables win over it, then apply `overrides`
        (the CLI flags) as {"section": {"field": value}}: flags > environment > file."""
        data: dict = {}
        if path is not None:
            data = yaml.safe_load(Path(path).read_text()) or {}
        _name_follows_model(data, overrides)
        for section, values in list(data.items()):
            if isinstance(values, dict):  # a key set in the environment is left to it
                data[section] = {k: v for k, v in values.items()
                                 if _env_name(section, k) not in os.environ}
        for section, values in overrides.items():
            data.setdefault(section, {}).update(values)
        return cls(**data)


def _bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * 1e9)


def _name_follows_model(data: dict, overrides: dict) -> None:
    """The file's `models.model_name` names the file's `models.model`: a model another source
    gives (a flag, the environment) is served under its own path, unless a name comes with it
    (`python -m server --config config.yaml --model M` does not serve M as SmolLM2)."""
    models = data.get("models")
    if not isinstance(models, dict) or "model_name" not in models:
        return
    given = overrides.get("models", {})
    elsewhere = {key for key in ("model", "model_name")
                 if key in given or _env_name("models", key) in os.environ}
    if elsewhere == {"model"}:
        data["models"] = {k: v for k, v in models.items() if k != "model_name"}


def _env_name(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section}__{key}".upper()


def engine_config(settings: Settings, *, draft: str | None,
                  more_targets: list[TargetEntry]) -> EngineConfig:
    """The engine `settings` ask for, with `draft` and `more_targets` as resolved by the
    caller (an "auto" draft, discovered targets). On rank 0 of `mlx.launch`, a sharded one."""
    m, e = settings.models, settings.engine
    layout = launched_layout(settings.distributed.mode)
    if layout is not None and more_targets:
        raise ValueError("models.more_targets, discover_targets: a sharded target cannot be"
                         " switched")
    return EngineConfig(
        model=m.model, draft_model=draft, model_name=m.model_name,
        model_aliases=tuple(m.model_aliases), adapter_path=m.adapter_path,
        chat_template=m.chat_template, chat_template_kwargs=dict(m.chat_template_kwargs),
        embedding_model=m.embedding_model, embedding_pooling=m.embedding_pooling,
        num_draft_tokens=m.num_draft_tokens, dtype=m.dtype, dequantize=m.dequantize,
        scheduler=SchedulerConfig(
            max_batch_size=e.max_batch_size, max_queue_size=settings.server.max_queue_size,
            prefill_chunk=e.prefill_chunk, idle_prefill_chunk=e.idle_prefill_chunk),
        spec_max_batch=e.spec_max_batch, spec_batch_draft_tokens=e.spec_batch_draft_tokens,
        prefix_cache_bytes=cache_budget_bytes(settings.cache.max_gb),
        memory_budget_bytes=_bytes(e.memory_budget_gb),
        memory_margin_bytes=_bytes(e.memory_margin_gb),
        fuse_projections=e.fuse_projections, disk_cache_dir=settings.cache.disk_dir,
        disk_cache_bytes=int(settings.cache.disk_max_gb * 1e9), cost_model=e.cost_model,
        cost_model_budget_s=e.cost_model_budget_s,
        suffix_max_bytes=int(e.suffix_max_mb * 1e6),
        more_targets=tuple(more_targets),
        distributed=None if layout is None else DistributedConfig(
            layout, settings.distributed.timeout_s, settings.distributed.heartbeat_s))
