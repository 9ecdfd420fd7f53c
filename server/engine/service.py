"""`InferenceEngine`: the async facade that routes talk to. Owns the model kit and the worker.

Routes never touch MLX: they call these methods, which run the MLX work on the worker thread.
Read-only attributes (names, the target's tokenizer) are safe to read from the event loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass, replace

import mlx.core as mx

from server.engine.generation import generate_events
from server.engine.model_kit import LoadedModel, ModelKit, load_model
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.worker import GenerationWorker, StreamJob

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """A request the engine cannot serve as asked (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ModelCard:
    id: str
    path: str
    role: str
    parameters: int
    memory_gb: float
    num_draft_tokens: int | None = None


class InferenceEngine:
    def __init__(
        self,
        *,
        model: str,
        draft_model: str | None = None,
        model_name: str | None = None,
        num_draft_tokens: int = 4,
        dtype: str = "auto",
        max_queue_size: int = 16,
    ):
        self._target_path = model
        self._draft_path = draft_model
        self.model_name = model_name or model
        self.num_draft_tokens = num_draft_tokens
        self.dtype = dtype
        self.worker = GenerationWorker(max_queue_size)
        self.kit: ModelKit | None = None

    # -- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker and load the models on it (blocking)."""
        self.worker.start()
        self.worker.run_sync(self._load_initial)

    def _load_initial(self) -> None:
        log.info("loading target model %s", self._target_path)
        target = load_model(self._target_path, dtype=self.dtype, name=self.model_name)
        self.kit = ModelKit(target, dtype=self.dtype)
        if self._draft_path:
            log.info("loading draft model %s", self._draft_path)
            self.kit.load_draft(self._draft_path)

    def stop(self) -> None:
        self.worker.stop()
        self.kit = None  # the parked worker thread keeps no models alive
        gc.collect()

    # -- read-only views (event loop) ---------------------------------------------------
    @property
    def target(self) -> LoadedModel:
        return self.kit.target

    @property
    def draft(self) -> LoadedModel | None:
        return self.kit.draft

    @property
    def tokenizer(self):
        return self.kit.target.tokenizer

    def card(self, model: LoadedModel, role: str) -> ModelCard:
        return ModelCard(
            id=model.name, path=model.path, role=role, parameters=model.parameter_count(),
            memory_gb=model.nbytes() / 1e9,
            num_draft_tokens=self.num_draft_tokens if role == "draft" else None,
        )

    # -- requests -----------------------------------------------------------------------
    def resolve_speculation(
        self,
        *,
        use_draft: bool | None,
        num_draft_tokens: int | None,
        defaults: SpeculationParams,
    ) -> SpeculationParams:
        """Decide how this request drafts. `defaults` carries the configured source/rule."""
        lookup = defaults.source == "prompt_lookup"
        has_drafter = lookup or self.draft is not None
        if use_draft is False or num_draft_tokens == 0:
            return replace(defaults, num_draft_tokens=0)
        if not has_drafter:
            if use_draft or num_draft_tokens:
                raise InvalidRequest(
                    "no draft model is loaded: load one with POST /v1/models/draft, "
                    "use draft='prompt_lookup', or omit num_draft_tokens/use_draft",
                    "num_draft_tokens" if num_draft_tokens else "use_draft",
                )
            return replace(defaults, num_draft_tokens=0)
        k = num_draft_tokens if num_draft_tokens is not None else self.num_draft_tokens
        return replace(defaults, num_draft_tokens=k)

    def stream(self, params: GenerationParams) -> StreamJob:
        """Queue a generation; iterate the returned job for events. Raises QueueFull."""
        job = StreamJob(lambda cancelled: self._generate(params, cancelled),
                        asyncio.get_running_loop())
        self.worker.submit(job)
        return job

    def _generate(self, params: GenerationParams, cancelled):
        spec = params.speculation
        if spec.num_draft_tokens and spec.source == "model" and self.kit.draft is None:
            raise InvalidRequest("the draft model was unloaded before this request ran",
                                 "num_draft_tokens")
        return generate_events(self.kit, params, cancelled=cancelled)

    # -- admin --------------------------------------------------------------------------
    async def load_draft(self, path: str, num_draft_tokens: int | None = None) -> ModelCard:
        def load():
            draft = self.kit.load_draft(path)
            if num_draft_tokens is not None:
                self.num_draft_tokens = num_draft_tokens
            return self.card(draft, "draft")

        return await self.worker.call_soon(load)

    async def unload_draft(self) -> bool:
        return await self.worker.call_soon(self.kit.unload_draft)

    async def check_draft(self, path: str) -> str | None:
        return await self.worker.call_soon(lambda: self.kit.check_draft(path))

    async def memory(self) -> dict:
        return await self.worker.call_soon(
            lambda: {"active_gb": mx.get_active_memory() / 1e9,
                     "cache_gb": mx.get_cache_memory() / 1e9}
        )

