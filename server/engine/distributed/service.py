"""A target sharded over several processes with `mlx.core.distributed`, drafted for on rank 0.

`mlx.launch --backend ring -n 2 -- python -m server ...` starts one process per rank. Each
loads only its part of the target with `mlx_lm`'s `sharded_load` (tensor parallel by default:
`model.shard(group)`, every rank holding every layer's share of the heads; or pipeline: each
rank a run of layers). Rank 0 serves HTTP and runs the engine as in one process: scheduler,
sampling, verification and the draft, which is small and stays whole on rank 0. Its target is a
`MirroredTarget`: every target forward first sends the step's cache operations and inputs
to the other ranks (`server.engine.distributed.mirror`), which follow
(`server.engine.distributed.follower`).

A tensor-parallel forward costs two `all_sum`s per layer whether it carries 1 token or k + 1,
so verifying a draft block costs about the communication of decoding one token.

Failures end cleanly: a collective that does not complete within `timeout_s` (a rank died or
hangs) makes rank 0 answer 503 to every request and exit; a heartbeat every `heartbeat_s`
lets idle followers notice a vanished rank 0 the same way. Stopping rank 0 stops every rank.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from server.engine.config import EngineConfig
from server.engine.distributed.mirror import Mirror, MirroredKVCache, OpChannel
from server.engine.errors import InvalidRequest, ModelLoadError, ShuttingDown
from server.engine.models.head import _Split, set_split, split_of
from server.engine.models.model_kit import (
    LoadedModel,
    ModelKit,
    check_template,
    resolve_dtype,
    template_config,
)
from server.engine.scheduling.scheduler import Scheduler
from server.engine.service import InferenceEngine

log = logging.getLogger(__name__)

MODES = ("tensor", "pipeline")
EXIT_RANK_LOST = 3
_FLUSH_BEFORE_EXIT_S = 1.0


class RankLost(ShuttingDown):
    """A rank stopped answering: every request gets a 503 and rank 0 exits."""


@dataclass(frozen=True)
class DistributedLayout:
    rank: int
    world_size: int
    backend: str
    mode: str
    group: mx.distributed.Group


def launched_backend() -> str | None:
    """The backend `mlx.launch` (or mpirun) started this process with; None when it did not."""
    env = os.environ
    if "MLX_JACCL_COORDINATOR" in env or "MLX_IBV_DEVICES" in env:
        return "jaccl-ring" if env.get("MLX_JACCL_RING") == "1" else "jaccl"
    if "MLX_HOSTFILE" in env and "MLX_RANK" in env:
        return "ring"
    if "MLX_WORLD_SIZE" in env and "MLX_RANK" in env:
        return "nccl"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    return None


def launched_layout(mode: str = "tensor") -> DistributedLayout | None:
    """This process's place in a distributed launch, or None when it runs alone."""
    backend = launched_backend()
    if backend is None:
        return None
    if mode not in MODES:
        raise ValueError(f"distributed mode must be one of {MODES}, not {mode!r}")
    group = mx.distributed.init(strict=True, backend=backend.removesuffix("-ring"))
    if group.size() < 2:
        return None
    return DistributedLayout(group.rank(), group.size(), backend, mode, group)


# -- loading ---------------------------------------------------------------------------------


def sharding_architectures(kind: str) -> list[str]:
    """The `mlx_lm` architectures that support `kind` (tensor: `shard()`, pipeline:
    `PipelineMixin`), read from mlx_lm's model sources without importing them."""
    import mlx_lm.models

    marker = "def shard(" if kind == "tensor" else "PipelineMixin"
    folder = Path(mlx_lm.models.__file__).parent
    return sorted(p.stem for p in folder.glob("*.py")
                  if p.stem != "pipeline" and marker in p.read_text(errors="ignore"))


def load_sharded(path: str, layout: DistributedLayout, *, dtype: str = "auto",
                 chat_template: str | None = None):
    """(model, tokenizer, config) of this rank's part of the target (every rank calls it)."""
    from mlx_lm.utils import sharded_load

    groups = ({"tensor_group": layout.group} if layout.mode == "tensor"
              else {"pipeline_group": layout.group})
    local = Path(path).expanduser()
    try:
        model, tokenizer, config = sharded_load(
            str(local if local.exists() else path), return_config=True,
            tokenizer_config=template_config(chat_template), **groups)
    except ValueError as e:
        if "does not support" not in str(e):
            raise ModelLoadError(f"cannot load {path} sharded: {e}") from e
        names = ", ".join(sharding_architectures(layout.mode))
        raise ModelLoadError(
            f"cannot serve {path} over {layout.world_size} ranks in {layout.mode} mode: its"
            f" architecture does not support it ({e}); architectures that do: {names}") from e
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - missing files, bad weights, hub errors
        raise ModelLoadError(f"cannot load {path} sharded: {type(e).__name__}: {e}") from e
    check_template(tokenizer, chat_template)
    layers = config.get("num_hidden_layers", 0)
    if layout.mode == "pipeline" and layers % layout.world_size:
        # Every rank keeps one cache per layer it runs; rank 0 names them for all ranks.
        raise ModelLoadError(f"cannot serve {path} pipeline parallel: its {layers} layers do"
                             f" not split evenly over {layout.world_size} ranks")
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)
                    if not isinstance(c, KVCache)})
    if kinds:  # the followers mirror rank 0's KV operations, not window or state rollbacks
        raise ModelLoadError(
            f"cannot serve {path} sharded: its layers use {', '.join(kinds)} (sliding windows"
            " or recurrent states), which the ranks cannot keep in step yet; serve it in one"
            " process")
    target_dtype = resolve_dtype(dtype)
    if target_dtype is not None:
        model.set_dtype(target_dtype)
        mx.eval(model.parameters())
    split_of(model)  # runs two forwards: every rank together, before any request
    return model, tokenizer, config


def body_and_head(model: nn.Module) -> tuple:
    """(body, head): the forward every rank runs, and what rank 0 alone applies after it."""
    split = split_of(model)
    if split.body is None:
        return model, None
    return split.body, split.head


def rank_memory(channel: OpChannel) -> list[float]:
    """Every rank's MLX active memory in GB (every rank calls it)."""
    return [round(v / 1e9, 4) for v in channel.gather(float(mx.get_active_memory()))]


# -- rank 0 ----------------------------------------------------------------------------------


class MirroredTarget(nn.Module):
    """Rank 0's sharded target: each forward is sent to the followers before it runs.

    Every rank evaluates the body's output at once, so each runs the same `all_sum`s in the
    same order; the head (replicated) runs on rank 0 only, lazily, as the engine wants it.
    """

    def __init__(self, model: nn.Module, mirror: Mirror, guard):
        super().__init__()
        self.inner = model
        body, head = body_and_head(model)
        object.__setattr__(self, "_mirror", mirror)
        object.__setattr__(self, "_guard", guard)
        object.__setattr__(self, "_body", body)
        object.__setattr__(self, "_head", head)
        set_split(self, _Split(self.body, head) if head is not None else _Split(None))

    @property
    def layers(self):
        return self.inner.layers

    def make_cache(self) -> list[MirroredKVCache]:
        return MirroredKVCache.create(len(make_prompt_cache(self.inner)))

    def body(self, inputs: mx.array, cache: list) -> mx.array:
        self._mirror.send(("forward", np.array(inputs.astype(mx.uint32)),
                           [c.handle for c in cache]))
        with self._guard("a target forward"):
            hidden = self._body(inputs, cache=cache)
            mx.eval(hidden)
        return hidden

    def __call__(self, inputs: mx.array, cache: list | None = None, **_) -> mx.array:
        hidden = self.body(inputs, cache)
        return self._head(hidden) if self._head is not None else hidden


class Watchdog:
    """Bounds every collective: past `timeout_s`, `on_timeout(what)` (which does not return).
    Also notices the launcher going away (the parent changes) and calls `on_orphaned` once."""

    def __init__(self, timeout_s: float, on_timeout, on_orphaned=None):
        self.timeout_s = timeout_s
        self._on_timeout = on_timeout
        self._on_orphaned = on_orphaned
        self._parent = os.getppid()
        self._since: float | None = None
        self._what = ""
        self._thread = threading.Thread(target=self._watch, name="dist-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str):
        self._since, self._what = time.monotonic(), what
        try:
            yield
        except Exception as e:  # a collective that failed (a closed connection): a lost rank
            self._on_timeout(f"{what} failed: {type(e).__name__}: {e}")
            raise
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.5, self.timeout_s / 4))
            since = self._since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._on_timeout(f"{self._what} did not complete within {self.timeout_s:.0f} s")
            if self._on_orphaned is not None and os.getppid() != self._parent:
                callback, self._on_orphaned = self._on_orphaned, None
                callback()


class DistributedEngine(InferenceEngine):
    """`InferenceEngine` on rank 0 of a distributed launch (see the module docstring)."""

    def __init__(self, config: EngineConfig):
        if config.fuse_projections:
            raise ValueError("engine.fuse_projections cannot be combined with a sharded target")
        super().__init__(config)
        self.layout: DistributedLayout = config.distributed.layout
        self.timeout_s = config.distributed.timeout_s
        self.heartbeat_s = config.distributed.heartbeat_s
        self.channel = OpChannel(self.layout.group)
        self.watchdog: Watchdog | None = None
        self.mirror: Mirror | None = None
        self.rank_memory_gb: list[float] = []
        self._lost = threading.Event()
        self._stopped = False

    @property
    def distributed(self) -> dict:
        return {"world_size": self.layout.world_size, "backend": self.layout.backend,
                "mode": self.layout.mode, "rank_memory_gb": self.rank_memory_gb}

    async def load_target(self, *_, **__):
        raise InvalidRequest("the target cannot be replaced while it is sharded over several"
                             " processes: restart mlx.launch with the new one")

    def _load_initial(self) -> None:
        if self._embedding[0]:
            raise ModelLoadError("models.embedding_model is not served beside a sharded target")
        if self._adapter_path:  # sharded_load takes no adapters
            raise ModelLoadError("adapters are not applied to a sharded target: fold them into"
                                 " its weights first (`mlx_lm.fuse --adapter-path`)")
        self.watchdog = Watchdog(self.timeout_s, self._rank_lost, self._orphaned)
        self.mirror = Mirror(self.channel, self.watchdog.guard)
        MirroredKVCache.mirror = self.mirror
        log.info("loading target model %s: rank 0 of %d, %s parallel over %s",
                 self._target_path, self.layout.world_size, self.layout.mode,
                 self.layout.backend)
        # Not bounded by the watchdog: loading a large shard may take minutes; a rank that
        # fails to load exits, and mlx.launch then stops the others.
        model, tokenizer, config = load_sharded(self._target_path, self.layout,
                                                dtype=self.dtype,
                                                chat_template=self._chat_template)
        with self.watchdog.guard("gathering rank memory"):
            self.rank_memory_gb = rank_memory(self.channel)
        wrapped = MirroredTarget(model, self.mirror, self.watchdog.guard)
        target = LoadedModel(self.model_name, self._target_path, wrapped, tokenizer, config)
        self.kit = ModelKit(target, dtype=self.dtype)
        if self._draft_path:
            log.info("loading draft model %s (rank 0 only)", self._draft_path)
            self.kit.load_draft(self._draft_path)
        self.scheduler = Scheduler(self.kit, self.scheduler_config, self.policy, self.observers)
        if self.disk_cache_dir:  # followers' shards would not see what rank 0 reads from disk
            log.warning("cache.disk_dir is not used with a sharded target: memory cache only")
        # The budget sizes the prefix cache; requests are not admitted by it (no KV layout
        # is probed: a probe's forward would need every rank).
        self._price_memory()
        if self._prefix_cache_max() > 0:
            from server.engine.kv.prefix_cache import PrefixCache

            self.scheduler.prefix_cache = PrefixCache(self._prefix_cache_max())
        self._keep_suffix_index()
        threading.Thread(target=self._heartbeat, name="dist-heartbeat", daemon=True).start()

    def _price_memory(self) -> None:
        """The budget alone (see `_load_initial`): no KV layout is probed."""
        self._measure_budget()

    def _heartbeat(self) -> None:
        """Between steps, every `heartbeat_s`: a message (idle followers know rank 0 lives;
        rank 0 learns a follower died) that also refreshes each rank's memory figure."""
        while not self._stopped and not self._lost.is_set():
            time.sleep(self.heartbeat_s)
            scheduler = self.scheduler
            if scheduler is None or self._stopped:
                return
            scheduler.call(self._beat, lambda result, error: None)

    def _beat(self) -> None:
        if self._stopped:
            return
        self.mirror.send(("memory",))
        with self.watchdog.guard("gathering rank memory"):
            self.rank_memory_gb = rank_memory(self.channel)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine, then every follower (the MLX thread is parked: no step runs)."""
        super().stop(timeout)
        if self._stopped or self._lost.is_set() or self.mirror is None:
            return
        self._stopped = True
        log.info("stopping the other %d ranks", self.layout.world_size - 1)
        self.mirror.send(("stop",))

    def _rank_lost(self, reason: str) -> None:
        """A collective timed out or failed: answer 503 to everything, then exit."""
        if self._lost.is_set():
            return
        self._lost.set()
        log.critical("a rank stopped answering (%s): ending every request and exiting", reason)
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.begin_drain()
            error = RankLost(f"a rank of the distributed target stopped answering ({reason})")
            rows = list(scheduler.target.rows) + list(scheduler.prefilling) + \
                list(scheduler.waiting)
            for seq in rows:
                if seq.finish_reason is None and seq.error is None:
                    seq.error = error
                    seq.finish()
        time.sleep(_FLUSH_BEFORE_EXIT_S)
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)

    @staticmethod
    def _orphaned() -> None:
        log.warning("mlx.launch went away: draining and stopping every rank")
        os.kill(os.getpid(), signal.SIGTERM)
