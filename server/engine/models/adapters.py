"""Fine-tuned adapters, as `mlx_lm.lora` writes them, applied to the target at load.

An adapter folder holds `adapter_config.json` and `adapters.safetensors`: LoRA or DoRA
low-rank updates, or a full fine-tune's weights. `apply_adapters` loads them with `mlx_lm`'s own
`load_adapters`, then folds each low-rank update into its base layer (`layer.fuse()`, what
`mlx_lm.fuse` does), so serving a fine-tune costs nothing per token. Layers over quantized
weights keep their update beside them: folding would re-quantize W + BA and write other text
than `mlx_lm.generate --adapter-path` does.

The draft is never adapted: it keeps proposing the base model's text, and the target verifies
every token, so the output is the fine-tune's exactly (only the acceptance may change).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.tuner.utils import load_adapters

from server.engine.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"


def apply_adapters(model: nn.Module, folder: str | Path) -> int:
    """Apply the adapters in `folder` to `model` in place; the number of layers folded."""
    folder = Path(folder).expanduser()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise AdapterError(f"adapter folder {folder} has no {name}"
                               " (mlx_lm.lora writes both)")
    try:
        load_adapters(model, str(folder))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise AdapterError(f"cannot apply the adapters in {folder}: {e}") from e
    fused = [(name, module.fuse()) for name, module in model.named_modules()
             if hasattr(module, "fuse") and not _quantized(module)]
    if fused:
        model.update_modules(tree_unflatten(fused))
    model.eval()  # the unfused layers' dropout is for training only
    mx.eval(model.parameters())
    return len(fused)


def adapter_identity(folder: str | Path) -> dict:
    """What the adapted model's KV states depend on: the folder, its config and a hash of its
    weights file (part of the model's fingerprint, so a cache of other weights is never used)."""
    folder = Path(folder).expanduser().resolve()
    digest = hashlib.sha256()
    with open(folder / WEIGHTS_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"adapter": str(folder),
            "adapter_config": json.loads((folder / CONFIG_FILE).read_text()),
            "adapter_weights": digest.hexdigest()}


def _quantized(module: nn.Module) -> bool:
    base = getattr(module, "linear", None) or getattr(module, "embedding", None)
    return base is not None and hasattr(base, "scales")
