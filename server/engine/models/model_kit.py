"""The resident models: one target and an optional draft (a facade like mlx-engine's ModelKit).

Every method here touches MLX and so runs on the worker thread only.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model, load_tokenizer

from server.engine.errors import (
    AdapterError,
    IncompatibleDraft,
    ModelLoadError,
    ModelNotFound,
    UnsupportedCache,
)
from server.engine.fim import FimFormat
from server.engine.kv.layers import check_cache_kinds
from server.engine.models.adapters import adapter_identity, apply_adapters
from server.engine.models.batch_compat import adapt_for_batching
from server.engine.models.draft_vocab import wrap_if_sub_vocab
from server.engine.models.fused import fuse_projections
from server.engine.models.quantization import (
    logical_parameters,
    quantization_of,
    should_dequantize,
)
from server.engine.prompts import chat_template_text, check_chat_template

log = logging.getLogger(__name__)

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


KEEP = object()  # `ModelKit.draft_for`: keep the current draft if it can draft for the target


@dataclass
class LoadedModel:
    name: str
    path: str
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    # What its KV states depend on (`model_fingerprint`): the disk prefix cache's key.
    fingerprint: str = ""
    adapter_path: str | None = None  # fine-tuned adapters applied at load (`adapters`)
    quantization: dict | None = None  # the folder's ({"bits", "group_size", "mode"}), if any
    dequantized: bool = False  # its quantized weights were dequantized at load
    loaded_at: int = field(default_factory=lambda: int(time.time()))  # Unix seconds

    @cached_property
    def vocab(self) -> dict[str, int]:
        # get_vocab() builds a dict of the whole vocabulary (22 ms for SmolLM2's 49k tokens):
        # built once, not on every request.
        return self.tokenizer.get_vocab()

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @cached_property
    def fim(self) -> FimFormat | None:
        """Its fill-in-the-middle markers (`server.engine.fim`), or None."""
        return FimFormat.of(self.tokenizer)

    @property
    def context_length(self) -> int | None:
        """The longest context the model was trained for (config's max_position_embeddings)."""
        return context_length_of(self.config)

    def nbytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    def parameter_count(self) -> int:
        """Its parameters, a quantized weight counted by the values it stands for."""
        return logical_parameters(self.model)

    def float_dtype(self) -> str:
        """The dtype of its floating-point weights ("float32", "bfloat16", ...)."""
        return next((str(v.dtype).removeprefix("mlx.core.")
                     for _, v in tree_flatten(self.model.parameters())
                     if mx.issubdtype(v.dtype, mx.floating)), "")


def on_gpu() -> bool:
    """Whether MLX computes on a GPU (Metal, CUDA) rather than the CPU."""
    return mx.default_device() == mx.gpu


def context_length_of(config: dict) -> int | None:
    value = config.get("max_position_embeddings")
    return int(value) if value else None


def folder_context_length(path: str) -> int | None:
    """The context length a local model folder's config.json gives (None: none, or no such
    file, as for a hub id)."""
    try:
        return context_length_of(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return None


def resolve_dtype(name: str) -> mx.Dtype | None:
    """`auto` is float32 on the CPU, where 16-bit matmuls are ~50x slower; else keep the file's."""
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    return DTYPES[name]


def load_model(path: str, *, dtype: str = "auto", name: str | None = None,
               fuse: bool = False, dequantize: bool | str = "auto",
               adapter_path: str | None = None,
               chat_template: str | None = None) -> LoadedModel:
    """Load an `mlx_lm` model folder (or hub id) in `dtype`; `fuse` stacks each layer's q/k/v
    and gate/up projections into one matmul (`server.engine.models.fused`,
    `engine.fuse_projections`: off unless asked, since it paid one day and cost the next).
    `dequantize` (`models.dequantize`: "auto", True, False): whether a quantized model is
    dequantized in memory (`server.engine.models.quantization`: "auto" does on a CPU, where
    quantized matmuls run ~3x slower than float32, when the float weights fit).
    `adapter_path`: an `mlx_lm.lora` adapter folder, folded into the weights
    (`server.engine.models.adapters`). `chat_template`: a Jinja template (or its file) used
    instead of the tokenizer's."""
    local = Path(path).expanduser()
    if not is_hub_id(path) and not local.exists():
        raise ModelNotFound(f"model path not found: {path}")
    try:
        model, tokenizer, config = mlx_load(str(local if local.exists() else path),
                                            return_config=True,
                                            tokenizer_config=template_config(chat_template))
    except FileNotFoundError as e:
        raise ModelNotFound(f"cannot load {path}: {e}") from e
    except Exception as e:  # corrupt weights, unknown architecture, hub errors ...
        raise ModelLoadError(f"cannot load {path}: {type(e).__name__}: {e}") from e
    check_template(tokenizer, chat_template)
    target_dtype = resolve_dtype(dtype)
    dequantized = should_dequantize(dequantize, model, target_dtype, name or path)
    if dequantized:
        model = dequantize_model(model)
    if local.exists():
        try:
            model = wrap_if_sub_vocab(model, local)
        except (ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"cannot load {path}: {e}") from e
    try:
        check_cache_kinds(model)
    except UnsupportedCache as e:
        raise ModelLoadError(f"cannot serve {path} (model_type"
                             f" {config.get('model_type', '?')}): {e}") from e
    adapt_for_batching(model)
    if target_dtype is not None:
        model.set_dtype(target_dtype)
        mx.eval(model.parameters())
    identity = {"dtype": dtype, "fuse": fuse}
    if adapter_path:  # folded in the serving dtype, before the projections are stacked
        try:
            apply_adapters(model, adapter_path)
            identity.update(adapter_identity(adapter_path))
        except (AdapterError, OSError) as e:
            raise ModelLoadError(f"cannot load {path} with adapters: {e}") from e
    if fuse:
        fuse_projections(model)
    identity["dequantized"] = dequantized
    return LoadedModel(name or path, path, model, tokenizer, config,
                       model_fingerprint(local if local.exists() else path, config, identity),
                       adapter_path=adapter_path, quantization=quantization_of(config),
                       dequantized=dequantized)


def template_config(chat_template: str | None) -> dict:
    """The tokenizer settings that replace its chat template (mlx_lm's `tokenizer_config`)."""
    if chat_template is None:
        return {}
    try:
        return {"chat_template": chat_template_text(chat_template)}
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"models.chat_template: {e}") from e


def check_template(tokenizer, chat_template: str | None) -> None:
    """A configured chat template that cannot render a chat fails the load, not a request."""
    if chat_template is not None:
        try:
            check_chat_template(tokenizer)
        except ValueError as e:
            raise ModelLoadError(f"models.chat_template: {e}") from e


def model_fingerprint(path: Path | str, config: dict, identity: dict) -> str:
    """A hash of what a model's KV states depend on: its resolved path, config, weight files
    (names, sizes, modification times), how it was loaded (`identity`: dtype, fusing), the
    device and the MLX versions. Another value means cached KV states of it are stale."""
    import mlx_lm

    folder = Path(path).resolve() if isinstance(path, Path) else _hub_folder(path)
    files = []
    if folder is not None:
        for f in sorted(folder.glob("*.safetensors")):
            st = f.stat()
            files.append([f.name, st.st_size, st.st_mtime_ns])
    facts = {"path": str(folder or path), "config": config, "files": files, **identity,
             "device": str(mx.default_device()), "mlx": mx.__version__,
             "mlx_lm": mlx_lm.__version__}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def _hub_folder(repo: str) -> Path | None:
    """The local snapshot of a hub model that was just loaded, without any download."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo, local_files_only=True)).resolve()
    except Exception:  # noqa: BLE001 - then the id and config alone identify it
        return None


def load_tokenizer_only(path: str) -> TokenizerWrapper:
    local = Path(path).expanduser()
    if not is_hub_id(path) and not local.exists():
        raise ModelNotFound(f"model path not found: {path}")
    try:
        return load_tokenizer(local if local.exists() else path)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer of {path}: {e}") from e


def is_hub_id(ref: str) -> bool:
    """`org/name` that is not a local folder: what mlx_lm.load would download."""
    return ref.count("/") == 1 and not ref.startswith((".", "/", "~")) and not Path(ref).exists()


def tokenizer_mismatch(target: TokenizerWrapper, draft: TokenizerWrapper) -> str | None:
    """None when both map the same strings to the same ids, else a message saying what differs.

    Embedding sizes may differ (checkpoints pad their vocab); only the tokenizers matter.
    """
    tv, dv = target.get_vocab(), draft.get_vocab()
    if tv == dv:
        return None
    differ = sorted(k for k in tv.keys() & dv.keys() if tv[k] != dv[k])
    only_t, only_d = len(tv.keys() - dv.keys()), len(dv.keys() - tv.keys())
    parts = [f"tokenizers differ: target has {len(tv)} tokens, draft has {len(dv)}"]
    if differ:
        ex = ", ".join(f"{k!r}: {tv[k]} vs {dv[k]}" for k in differ[:3])
        parts.append(f"{len(differ)} shared tokens map to different ids (e.g. {ex})")
    if only_t or only_d:
        parts.append(f"{only_t} tokens only in the target, {only_d} only in the draft")
    return "; ".join(parts)


class ModelKit:
    """Holds the target and the optional draft; swaps the draft at runtime."""

    def __init__(self, target: LoadedModel, *, dtype: str = "auto", fuse: bool = False,
                 dequantize: bool | str = "auto"):
        self.target = target
        self.draft: LoadedModel | None = None
        self.dtype = dtype
        self.fuse = fuse  # drafts are loaded as the target was: fused or not
        self.dequantize = dequantize  # and dequantized by the same rule (`models.dequantize`)

    def check_draft(self, path: str) -> str | None:
        """The reason `path` cannot draft for the target, or None if it can."""
        return tokenizer_mismatch(self.target.tokenizer, load_tokenizer_only(path))

    def load_draft(self, path: str) -> LoadedModel:
        """Load and install a draft; on any failure the previous draft stays installed."""
        reason = self.check_draft(path)
        if reason is not None:
            raise IncompatibleDraft(reason)
        candidate = load_model(path, dtype=self.dtype, fuse=self.fuse,
                               dequantize=self.dequantize)
        previous, self.draft = self.draft, candidate
        if previous is not None:
            del previous
            self._free()
        log.info("draft model loaded: %s", path)
        return candidate

    def draft_for(self, target: LoadedModel, draft: str | None | object) -> LoadedModel | None:
        """The draft to serve with a new `target`: `draft` loaded (IncompatibleDraft when its
        tokenizer differs from the target's), none for None, or for KEEP the current one if it
        can draft for the target."""
        if draft is KEEP:
            if self.draft is None or tokenizer_mismatch(target.tokenizer, self.draft.tokenizer):
                return None
            return self.draft
        if draft is None:
            return None
        reason = tokenizer_mismatch(target.tokenizer, load_tokenizer_only(draft))
        if reason is not None:
            raise IncompatibleDraft(reason)
        return load_model(draft, dtype=self.dtype, fuse=self.fuse, dequantize=self.dequantize)

    def install(self, target: LoadedModel, draft: LoadedModel | None) -> None:
        """Serve `target` and `draft` from now on; the models they replace are freed."""
        self.target, self.draft = target, draft
        self._free()
        log.info("target model loaded: %s (draft: %s)", target.path,
                 draft.path if draft is not None else None)

    def unload_draft(self) -> bool:
        if self.draft is None:
            return False
        self.draft = None
        self._free()
        log.info("draft model unloaded")
        return True

    @staticmethod
    def _free() -> None:
        gc.collect()
        mx.clear_cache()
