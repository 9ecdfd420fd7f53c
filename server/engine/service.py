"""`InferenceEngine`: the async facade that HTTP talks to. Owns the models and the MLX thread.

Routes never touch MLX: they submit requests and calls, which the scheduler runs on its own
thread between steps. Everything HTTP may read (names, tokenizer, queue depth, batch size,
cache figures) is offered here as a read-only view.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np

from server.engine.config import EngineConfig
from server.engine.errors import (
    EngineFailed,
    IncompatibleDraft,
    ModelReplaced,
    ShuttingDown,
)
from server.engine.events import Finished
from server.engine.memory import MemoryBudget, memory_budget
from server.engine.models.embeddings import Embedder, batches
from server.engine.models.model_kit import (
    KEEP,
    LoadedModel,
    ModelKit,
    is_hub_id,
    load_model,
    load_tokenizer_only,
    tokenizer_mismatch,
)
from server.engine.params import DraftSource, GenerationParams, SpeculationParams
from server.engine.scheduling.memory_gate import gate_for
from server.engine.scheduling.scheduler import (
    ObserverList,
    Scheduler,
    SchedulerObserver,
)
from server.engine.scheduling.sequence import Sequence
from server.engine.scheduling.switching import TargetEntry, TargetSwitcher
from server.engine.scoring import PromptLogprobs, PromptScorer
from server.engine.speculation.forward_source import DEFAULT_BUDGET_S
from server.engine.speculation.policy import SpeculationPolicy
from server.engine.speculation.suffix import SuffixIndex

log = logging.getLogger(__name__)

# CPython hands the GIL to a waiting thread only every `switchinterval` (default 5 ms). The
# event loop wakes for every streamed token while the MLX thread builds the next graph; the
# default interval cost ~10% of decode speed through the server, 0.5 ms brought it back.
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass(frozen=True)
class ModelCard:
    id: str
    path: str
    role: str
    parameters: int
    memory_gb: float
    created: int  # when it was loaded (Unix seconds)
    num_draft_tokens: int | None = None
    max_model_len: int | None = None  # its context length
    quantization: dict | None = None  # its folder's ({"bits", "group_size", "mode"})
    dequantized: bool | None = None  # a quantized model: dequantized at load (None: float)


class RequestHandle:
    """One submitted request, seen from the event loop: iterate its events, or cancel it."""

    def __init__(self, engine: InferenceEngine, loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self._events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._pending: list = []
        self._lock = threading.Lock()
        self.sequence: Sequence | None = None

    def sink(self, event: object) -> None:  # MLX thread
        # A speculative round emits a burst of tokens: wake the event loop once per burst,
        # not once per token, so it competes less with the MLX thread for the GIL.
        with self._lock:
            self._pending.append(event)
            first = len(self._pending) == 1
        if first:
            _notify(self._loop, self._flush)

    def _flush(self) -> None:  # event loop
        with self._lock:
            events, self._pending = self._pending, []
        for event in events:
            self._events.put_nowait(event)

    def cancel(self) -> None:
        if self.sequence is not None:
            self._engine.scheduler.cancel(self.sequence)

    async def __aiter__(self):
        while True:
            event = await self._events.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, Finished):
                return


class InferenceEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self._target_path = config.model
        self._draft_path = config.draft_model
        self._adapter_path = config.adapter_path
        self._chat_template = config.chat_template
        self._embedding = (config.embedding_model, config.embedding_pooling)
        self.embedder: Embedder | None = None  # the embedding model, when one is configured
        # Variables every chat is rendered with; a request's `chat_template_kwargs` win.
        self.chat_template_kwargs = dict(config.chat_template_kwargs)
        self.model_name = config.model_name or config.model
        self.model_aliases = frozenset(config.model_aliases)  # more names for the target
        self.dtype = config.dtype
        self.fuse_projections = config.fuse_projections
        self.dequantize = config.dequantize  # quantized weights: "auto", True or False
        self.cost_model = config.cost_model  # forward times choose each row's k
        self.cost_model_budget_s = (DEFAULT_BUDGET_S if config.cost_model_budget_s is None
                                    else config.cost_model_budget_s)
        k = config.num_draft_tokens
        policy = {"spec_max_batch": config.spec_max_batch,
                  "batch_draft_tokens": config.spec_batch_draft_tokens}
        self.policy = SpeculationPolicy(num_draft_tokens=k,
                                        **{k: v for k, v in policy.items() if v is not None})
        self.scheduler_config = config.scheduler
        # The configured targets (`models.model` first), when there are several to switch
        # between; the one serving now, None after an admin loaded another.
        primary = TargetEntry(config.model, self.model_name, config.draft_model, k,
                              config.adapter_path, config.chat_template)
        more = [replace(e, num_draft_tokens=e.num_draft_tokens or k)
                for e in config.more_targets]
        self.switcher = TargetSwitcher(self, [primary, *more] if more else [],
                                       self.scheduler_config.max_queue_size)
        self.serving_entry: TargetEntry | None = primary
        self.started_at = int(time.time())
        self.observers = ObserverList()
        self.prefix_cache_bytes = config.prefix_cache_bytes  # None: a share of the budget
        self.suffix_max_bytes = config.suffix_max_bytes
        self.disk_cache_dir = config.disk_cache_dir if config.disk_cache_bytes > 0 else None
        self.disk_cache_bytes = config.disk_cache_bytes
        self.kit: ModelKit | None = None
        self.scheduler: Scheduler | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._parked = threading.Event()
        self._start_error: BaseException | None = None
        self._failure_callbacks: list[Callable[[EngineFailed], None]] = []
        self._budget: MemoryBudget | None = None  # measured once the models are loaded
        self._thread = threading.Thread(target=self._main, name="mlx-engine", daemon=True)

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the MLX thread and load the models on it (blocking)."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def _main(self) -> None:
        try:
            self._load_initial()
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self.scheduler.run_forever(self._stop)
        except BaseException:  # noqa: BLE001 - the scheduler ended every request (`fail`)
            self._died(self.scheduler.failure)
        else:
            self.kit = self.scheduler = None  # the parked thread keeps no models alive
            gc.collect()
            mx.clear_cache()
        self._parked.set()
        # Never let this OS thread exit: MLX's thread-local compile cache calls into Python from
        # its TLS destructor, which aborts the process if the interpreter is finalizing.
        threading.Event().wait()

    def on_failure(self, callback: Callable[[EngineFailed], None]) -> None:
        """Call `callback(error)` (from the MLX thread) if the worker dies (at once if it has
        died): `python -m server` exits then, so that its supervisor starts it again."""
        self._failure_callbacks.append(callback)
        if self.failed is not None:
            callback(self.failed)

    def _died(self, error: EngineFailed) -> None:
        for callback in self._failure_callbacks:
            try:
                callback(error)
            except Exception:  # noqa: BLE001 - the next one must still run
                log.exception("a failure callback failed")

    def _load_initial(self) -> None:
        start = time.perf_counter()
        log.info("loading target model %s", self._target_path)
        target = load_model(self._target_path, dtype=self.dtype, name=self.model_name,
                            fuse=self.fuse_projections, dequantize=self.dequantize,
                            adapter_path=self._adapter_path, chat_template=self._chat_template)
        self.kit = ModelKit(target, dtype=self.dtype, fuse=self.fuse_projections,
                            dequantize=self.dequantize)
        if self._draft_path:
            log.info("loading draft model %s", self._draft_path)
            self.kit.load_draft(self._draft_path)
        if self._embedding[0]:
            log.info("loading embedding model %s", self._embedding[0])
            self.embedder = Embedder(load_model(self._embedding[0], dtype=self.dtype),
                                     self._embedding[1])
        self._check_more_targets()
        self.scheduler = Scheduler(self.kit, self.scheduler_config, self.policy, self.observers)
        if self.cost_model:  # a prior now; measured in idle moments, never before ready
            self.scheduler.use_cost_model(budget_s=self.cost_model_budget_s)
        self._price_memory()
        if self.caches_prompts:
            self.scheduler.prefix_cache = self._prefix_cache()
            self._register_on_disk(self.kit.target, self.kit.draft)
        self._keep_suffix_index()
        log.info("models loaded in %.1f s", time.perf_counter() - start)

    def _price_memory(self) -> None:
        """Measure the memory budget and the models' KV layouts (at start and after every model
        change, on the MLX thread): the scheduler admits and pauses requests by them, and the
        prefix cache's default budget is a share of it."""
        scheduler = self.scheduler
        budget = self._measure_budget()
        scheduler.memory = gate_for(self.kit, budget, scheduler.config.idle_prefill_chunk)
        log.info("memory: %.3g GB for KV caches (%s); a request holds at most %d tokens",
                 budget.kv_bytes / 1e9, budget.as_dict()["limit_source"],
                 scheduler.memory.room())

    def _measure_budget(self) -> MemoryBudget:
        """The memory budget now (the KV caches held already are part of it); the prefix
        cache's default budget follows it."""
        cache = self.scheduler.prefix_cache
        held = self.scheduler.kv_bytes() + (cache.info()["bytes"] if cache is not None else 0)
        self._budget = memory_budget(configured_bytes=self.config.memory_budget_bytes,
                                     margin_bytes=self.config.memory_margin_bytes,
                                     held_bytes=held)
        if cache is not None:
            cache.resize(self._prefix_cache_max())
        return self._budget

    def _prefix_cache_max(self) -> int:
        if self.prefix_cache_bytes is not None:
            return self.prefix_cache_bytes
        budget = self._budget.kv_bytes if self._budget is not None else 0
        return int(self.config.prefix_cache_share * budget)

    def _keep_suffix_index(self) -> None:
        """Suffix drafting's index of served texts, on the scheduler, when one is configured."""
        if self.suffix_max_bytes > 0:
            self.scheduler.suffix_index = SuffixIndex(self.suffix_max_bytes)

    def _check_more_targets(self) -> None:
        """Fail the start on a configured target that could never serve: no tokenizer there,
        or a draft whose tokenizer differs from its target's."""
        for entry in self.switcher.entries[1:]:
            if is_hub_id(entry.path):
                continue
            tokenizer = load_tokenizer_only(entry.path)
            if entry.draft and not is_hub_id(entry.draft):
                reason = tokenizer_mismatch(tokenizer, load_tokenizer_only(entry.draft))
                if reason is not None:
                    raise IncompatibleDraft(f"{entry.draft} cannot draft for {entry.path}: "
                                            f"{reason}")

    def _prefix_cache(self):
        from server.engine.kv.disk_cache import DiskPromptCache
        from server.engine.kv.prefix_cache import PrefixCache

        disk = None
        if self.disk_cache_dir:
            disk = DiskPromptCache(self.disk_cache_dir, self.disk_cache_bytes)
        return PrefixCache(self._prefix_cache_max(), disk)

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the current step, fail what still runs, and park the MLX thread."""
        scheduler = self.scheduler
        self._stop.set()
        if scheduler is not None:
            scheduler.wake()
            self._parked.wait(timeout)
            disk = scheduler.prefix_cache.disk if scheduler.prefix_cache is not None else None
            if disk is not None:  # entries still queued are written before we return
                disk.close(timeout)

    def drain(self, timeout_s: float, backstop_s: float) -> None:
        """Shut down gracefully (blocking; call it from a thread of its own): stop admitting
        (new and queued requests get ShuttingDown), give running requests `timeout_s` to
        finish, then end what still runs with ShuttingDown and wait up to `backstop_s` for
        their last events."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        scheduler.begin_drain()
        if not _wait(lambda: scheduler.idle, timeout_s):
            error = ShuttingDown("the server is shutting down")
            scheduler.call(lambda: scheduler.fail_running(error), lambda result, e: None)
            _wait(lambda: scheduler.idle, backstop_s)

    def add_observer(self, observer: SchedulerObserver) -> None:
        """Metrics hooks, called on the MLX thread at admission and after every round."""
        self.observers.observers.append(observer)

    # -- read-only views ----------------------------------------------------------------------
    @property
    def target(self) -> LoadedModel:
        return self.kit.target

    @property
    def draft(self) -> LoadedModel | None:
        return self.kit.draft

    def serves(self, name: str | None) -> bool:
        """Whether `name` (a request's `model`) selects the target: its served name, its path,
        an alias, anything under the alias "*", or nothing."""
        return name in (None, "", self.model_name, self.kit.target.path) or \
            name in self.model_aliases or "*" in self.model_aliases

    @property
    def tokenizer(self):
        return self.kit.target.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.kit.target.vocab_size

    @property
    def context_length(self) -> int | None:
        return self.kit.target.context_length

    @property
    def num_draft_tokens(self) -> int:
        return self.policy.num_draft_tokens

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a batch slot."""
        return self.scheduler.queue_depth if self.scheduler is not None else 0

    @property
    def batch_size(self) -> int:
        """Requests prefilling or decoding now."""
        return self.scheduler.batch_size if self.scheduler is not None else 0

    @property
    def caches_prompts(self) -> bool:
        """Whether a prefix cache keeps prompts for the requests that follow."""
        share = self.config.prefix_cache_share if self.prefix_cache_bytes is None else 0
        return bool(self.prefix_cache_bytes or share) or self.disk_cache_dir is not None

    @property
    def failed(self) -> EngineFailed | None:
        """The error the MLX worker died of (every request gets it: 503), else None."""
        return self.scheduler.failure if self.scheduler is not None else None

    def memory_info(self) -> dict | None:
        """The memory budget and what is in use (/health, /metrics); None without one."""
        scheduler = self.scheduler
        memory = scheduler.memory if scheduler is not None else None
        if memory is None:
            return None
        return {**memory.budget.as_dict(), "transient_bytes": memory.transient_bytes,
                "kv_bytes": scheduler.kv_in_use,
                "max_request_tokens": memory.room(), "preemptions": scheduler.preemptions,
                "paused": scheduler.paused_count}

    def check_memory(self, prompt_tokens: int, max_tokens: int, **names: str) -> None:
        """MemoryBudgetExceeded (naming the limit, and the fields by `names`) for a request
        that could never fit the memory budget; nothing without a budget."""
        memory = self.scheduler.memory if self.scheduler is not None else None
        if memory is not None:
            memory.check(prompt_tokens, max_tokens, **names)

    def memory_room(self) -> int | None:
        """The most tokens (prompt and output) one request may hold in the memory budget; None
        without a budget."""
        memory = self.scheduler.memory if self.scheduler is not None else None
        return memory.room() if memory is not None else None

    @property
    def draining(self) -> bool:
        """True once shutdown began: new requests get 503."""
        return self.scheduler is not None and self.scheduler.draining

    @property
    def distributed(self) -> dict | None:
        """The layout of a target sharded over several processes
        (`server.engine.distributed.service`); None in one process."""
        return None

    @property
    def cost_model_status(self) -> dict | None:
        """Where the forward times the cost model reads come from now, per model, and whether
        they are being measured (`forward_source.CostSource.status`); None without it."""
        scheduler = self.scheduler
        source = scheduler.cost_source if scheduler is not None else None
        return source.status() if source is not None else None

    def cache_info(self) -> dict:
        cache = self.scheduler.prefix_cache if self.scheduler is not None else None
        if cache is None:
            return {"entries": 0, "bytes": 0, "max_bytes": 0,
                    "disk_entries": 0, "disk_bytes": 0, "disk_max_bytes": 0}
        return cache.info()

    def suffix_info(self) -> dict:
        """Suffix drafting's index of served answers: texts, tokens, bytes and its bound."""
        index = self.scheduler.suffix_index if self.scheduler is not None else None
        if index is None:
            return {"texts": 0, "tokens": 0, "bytes": 0, "max_bytes": 0}
        return {"texts": len(index), "tokens": index.tokens, "bytes": index.nbytes,
                "max_bytes": index.max_bytes}

    def card(self, model: LoadedModel, role: str) -> ModelCard:
        return ModelCard(
            id=model.name, path=model.path, role=role, parameters=model.parameter_count(),
            memory_gb=model.nbytes() / 1e9, created=model.loaded_at,
            num_draft_tokens=self.num_draft_tokens if role == "draft" else None,
            max_model_len=model.context_length, quantization=model.quantization,
            dequantized=model.dequantized if model.quantization else None,
        )

    # -- requests -----------------------------------------------------------------------------
    def resolve_speculation(self, *, use_draft: bool | None, num_draft_tokens: int | None,
                            defaults: SpeculationParams,
                            draft: DraftSource | None = None) -> SpeculationParams:
        """`defaults`: the server's; `draft`: the drafter the request names, if any."""
        return self.policy.for_request(use_draft=use_draft, num_draft_tokens=num_draft_tokens,
                                       draft=draft, defaults=defaults,
                                       draft_loaded=self.draft is not None,
                                       suffix=self.suffix_max_bytes > 0)

    def submit(self, params: GenerationParams) -> RequestHandle:
        """Queue a generation; iterate the handle for events. Raises QueueFull/ShuttingDown."""
        handle = RequestHandle(self, asyncio.get_running_loop())
        handle.sequence = self.scheduler.submit(params, handle.sink)
        return handle

    async def prompt_logprobs(self, tokens: list[int], top: int, *, cache_prompt: bool = True,
                              target: str = "") -> PromptLogprobs:
        """The target's log-probability of each prompt token after the first (and the `top`
        most likely tokens there), a chunk per call between scheduler steps. With
        `cache_prompt` the work then goes to the prefix cache, for the generation after it.
        `target`: the fingerprint of the target `tokens` were tokenized for (ModelReplaced if
        another one serves before the scoring ends)."""
        model = self.kit.target
        target = target or model.fingerprint
        scorer = PromptScorer(model.model, tokens, top, self.vocab_size,
                              self.scheduler_config.prefill_chunk)

        def step() -> bool:
            if self.kit.target.fingerprint != target:
                raise ModelReplaced("the target model was replaced; send the request again")
            return scorer.step()

        while not await self._call(step):
            pass
        if cache_prompt:
            await self._call(lambda: self.kit.target.fingerprint == target
                             and self.scheduler.keep_prefill(tokens, scorer.cache))
        return scorer.result

    async def embed(self, inputs: list[list[int]],
                    dimensions: int | None = None) -> list[np.ndarray]:
        """The embedding model's normalized vectors of `inputs` (token ids), in order: inputs
        of similar length share a forward, one forward per call between scheduler steps."""
        vectors: list[np.ndarray | None] = [None] * len(inputs)
        for group in batches(inputs, self.scheduler_config.idle_prefill_chunk):
            batch = [inputs[i] for i in group]
            done = await self._call(lambda b=batch: self.embedder.embed_batch(b, dimensions))
            for i, vector in zip(group, done, strict=True):
                vectors[i] = vector
        return vectors

    # -- admin --------------------------------------------------------------------------------
    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await _settled(self.scheduler.call, fn)

    async def _call_when_idle(self, fn: Callable[[], Any]) -> Any:
        return await _settled(self.scheduler.call_when_idle, fn)

    async def load_draft(self, path: str, num_draft_tokens: int | None = None) -> ModelCard:
        path = await self._local_path(path)

        def load():
            draft = self.kit.load_draft(path)
            self._register_on_disk(draft)
            if num_draft_tokens is not None:
                self._set_num_draft_tokens(num_draft_tokens)
            self.scheduler.draft_changed()
            self._price_memory()
            return self.card(draft, "draft")

        return await self._call(load)

    @staticmethod
    async def _local_path(path: str) -> str:
        """`path`, or the local snapshot of a hub id (downloaded here, off the MLX thread)."""
        if not is_hub_id(path):
            return path
        from mlx_lm.utils import _download

        return str(await asyncio.to_thread(_download, path))

    def _register_on_disk(self, *models: LoadedModel | None) -> None:
        cache = self.scheduler.prefix_cache
        if cache is not None and cache.disk is not None:
            for model in models:
                if model is not None:
                    cache.disk.register_model(model.path, model.fingerprint)

    def _set_num_draft_tokens(self, k: int) -> None:
        self.policy = replace(self.policy, num_draft_tokens=k)
        self.scheduler.policy = self.policy

    async def load_target(self, path: str, *, name: str | None = None, draft=KEEP,
                          num_draft_tokens: int | None = None) -> tuple[ModelCard,
                                                                        ModelCard | None]:
        """Serve another target (named `name`, default its path), with `draft` (a path, None
        for none, KEEP: the current draft if its tokenizer matches). Both load before anything
        changes, so a failed load leaves the previous models serving; then every request in
        flight ends with ModelReplaced."""
        path = await self._local_path(path)
        if isinstance(draft, str):
            draft = await self._local_path(draft)
        entry = TargetEntry(path, name or path, draft, num_draft_tokens)
        return await self._call(lambda: self._install(entry, None))

    async def switch_target(self, entry: TargetEntry) -> None:
        """Serve `entry` (a configured target) once no request waits or runs: nothing in
        flight is lost (`TargetSwitcher` holds new requests back meanwhile)."""
        path = await self._local_path(entry.path)
        draft = await self._local_path(entry.draft) if entry.draft else None
        await self._call_when_idle(
            lambda: self._install(replace(entry, path=path, draft=draft), entry))

    def _install(self, entry: TargetEntry, configured: TargetEntry | None
                 ) -> tuple[ModelCard, ModelCard | None]:
        """Load `entry`'s target and draft, then serve them (MLX thread): what ran on the
        previous target ends with ModelReplaced. `configured`: the switcher's entry it is."""
        target = load_model(entry.path, dtype=self.dtype, name=entry.name,
                            fuse=self.fuse_projections, dequantize=self.dequantize,
                            adapter_path=entry.adapter_path, chat_template=entry.chat_template)
        new_draft = self.kit.draft_for(target, entry.draft)
        self.kit.install(target, new_draft)
        self.model_name = target.name
        self.serving_entry = configured
        if entry.num_draft_tokens is not None:
            self._set_num_draft_tokens(entry.num_draft_tokens)
        self._register_on_disk(target, new_draft)
        self.scheduler.target_changed()
        self._price_memory()
        return (self.card(target, "target"),
                self.card(new_draft, "draft") if new_draft is not None else None)

    async def unload_draft(self) -> bool:
        def unload():
            if not self.kit.unload_draft():
                return False
            self.scheduler.draft_changed()
            self._price_memory()
            return True

        return await self._call(unload)

    async def check_draft(self, path: str) -> str | None:
        return await self._call(lambda: self.kit.check_draft(path))

    async def clear_cache(self) -> tuple[int, int, int]:
        """Empty the prefix cache and suffix drafting's index of served answers: (entries
        dropped from memory, files deleted from disk, answers forgotten)."""
        def clear():
            cache, index = self.scheduler.prefix_cache, self.scheduler.suffix_index
            entries = (cache.clear(), cache.clear_disk()) if cache is not None else (0, 0)
            return (*entries, index.clear() if index is not None else 0)

        return await self._call(clear)

    async def memory(self) -> dict:
        return await self._call(
            lambda: {"active_gb": mx.get_active_memory() / 1e9,
                     "cache_gb": mx.get_cache_memory() / 1e9}
        )


def _wait(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `done` until it holds (True) or `timeout_s` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


async def _settled(submit: Callable, fn: Callable[[], Any]) -> Any:
    """`fn`'s result once the scheduler ran it (`submit`: `Scheduler.call` or
    `call_when_idle`), or its error."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    submit(fn, _settler(loop, future))
    return await future


def _settler(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    """A scheduler call's `done(result, error)` that settles `future` on `loop`."""
    def done(result, error):
        def settle():
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        _notify(loop, settle)

    return done


def _notify(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """Run `callback` on `loop` (from the MLX thread). A loop that has closed (its server
    stopped) has nobody left to tell: raising here would fail every running request."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass
