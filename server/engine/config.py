"""What an engine is built from: one `EngineConfig`, made from the settings in one place
(`server.config.engine_config`), or by hand by the developer tools."""

from __future__ import annotations

from dataclasses import dataclass, field

from server.engine.kv.prefix_cache import DEFAULT_PREFIX_CACHE_SHARE
from server.engine.scheduling.scheduler import SchedulerConfig
from server.engine.scheduling.switching import TargetEntry
from server.engine.speculation.policy import DEFAULT_NUM_DRAFT_TOKENS

DEFAULT_TIMEOUT_S = 60.0  # a sharded step that takes longer means a rank is gone
DEFAULT_HEARTBEAT_S = 5.0


@dataclass(frozen=True)
class DistributedConfig:
    """A target sharded over the processes of `mlx.launch` (rank 0 serves)."""

    layout: object  # server.engine.distributed.service.DistributedLayout
    timeout_s: float = DEFAULT_TIMEOUT_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S


@dataclass(frozen=True)
class EngineConfig:
    model: str  # the target: a folder or a hub id
    draft_model: str | None = None
    model_name: str | None = None  # the served name (default: `model`)
    model_aliases: tuple[str, ...] = ()  # more names for the target
    adapter_path: str | None = None
    chat_template: str | None = None
    # Variables every chat is rendered with; a request's `chat_template_kwargs` win.
    chat_template_kwargs: dict = field(default_factory=dict)
    embedding_model: str | None = None
    embedding_pooling: str = "last"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    dtype: str = "auto"
    dequantize: bool | str = "auto"  # quantized weights dequantized at load: auto, True, False
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec_max_batch: int | None = None  # None: the policy's default
    spec_batch_draft_tokens: int | None = None
    # The prefix cache's byte budget; None: `prefix_cache_share` of the memory budget.
    prefix_cache_bytes: int | None = 0
    prefix_cache_share: float = DEFAULT_PREFIX_CACHE_SHARE
    # What the KV caches may hold together; None: detected (`server.engine.memory`), the
    # limit less what the loaded process holds and less `memory_margin_bytes` (None: 10%).
    memory_budget_bytes: int | None = None
    memory_margin_bytes: int | None = None
    fuse_projections: bool = False
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    cost_model: bool = False  # forward times (a prior, then measured) choose each row's k
    cost_model_budget_s: float | None = None  # machine time measuring them; None: the default
    suffix_max_bytes: int = 0  # the suffix drafter's index of served texts (0: off)
    more_targets: tuple[TargetEntry, ...] = ()  # configured targets to switch to by name
    distributed: DistributedConfig | None = None
