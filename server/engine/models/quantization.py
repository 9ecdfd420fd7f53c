"""Quantized weights (`mlx_lm.convert -q`, mlx-community's 4- and 8-bit models): how big a
model is in the values its weights stand for, and whether to serve it dequantized
(`models.dequantize`).

On a CPU, MLX's quantized matmuls unpack every weight for every token fed: a forward of a 4-bit
91M target took 88 ms at one row and grew linearly with rows and tokens, while the same model
in float32 took 29.5 ms (2-core x86, OpenBLAS). `auto` therefore dequantizes on a CPU device
when the float weights fit comfortably: in half of what this process may use
(`server.engine.memory`), leaving the rest to the KV caches and the prefix cache. On
Metal and CUDA the quantized kernels read fewer bytes, which is what a GPU forward waits for:
the weights stay quantized.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from server.engine.memory import memory_limit

log = logging.getLogger(__name__)

# `auto` dequantizes when the float weights take at most this share of the process's memory.
DEQUANTIZE_MEMORY_SHARE = 0.5


def quantized_modules(model: nn.Module) -> list[nn.Module]:
    """The layers holding packed quantized weights (any of MLX's and mlx_lm's kinds: they
    all carry `bits`, `group_size` and `scales`)."""
    return [m for _, m in model.named_modules()
            if hasattr(m, "bits") and hasattr(m, "group_size") and "scales" in m]


def logical_parameters(model: nn.Module) -> int:
    """Parameters as the values the weights stand for: a packed 4-bit weight counts 8 values
    per uint32, and its scales and biases count for nothing."""
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    for m in quantized_modules(model):
        total += m.weight.size * 32 // m.bits - m.weight.size - m.scales.size
        if m.get("biases") is not None:
            total -= m.biases.size
    return total


def dequantized_bytes(model: nn.Module, dtype: mx.Dtype | None) -> int:
    """Bytes of its weights once dequantized to `dtype` (None: its scales' dtype, what
    `mx.dequantize` gives)."""
    modules = quantized_modules(model)
    if dtype is None:
        dtype = modules[0].scales.dtype if modules else mx.float32
    return logical_parameters(model) * dtype.size


def should_dequantize(setting: bool | str, model: nn.Module, dtype: mx.Dtype | None,
                      name: str) -> bool:
    """Whether to dequantize `model` (loaded quantized) to serve it in `dtype`: `setting`
    True or False forces it; "auto" dequantizes on a CPU device when the float weights fit in
    `DEQUANTIZE_MEMORY_SHARE` of the process's memory. Says what it decided in the log."""
    if not quantized_modules(model):
        return False
    if setting is not True and setting is not False and setting != "auto":
        raise ValueError(f"models.dequantize: expected auto, true or false, got {setting!r}")
    if setting != "auto":
        log.info("%s: quantized weights %s (models.dequantize: %s)", name,
                 "dequantized" if setting else "kept", str(setting).lower())
        return bool(setting)
    if mx.default_device() != mx.cpu:
        log.info("%s: quantized weights kept on the GPU (models.dequantize: auto)", name)
        return False
    need, limit = dequantized_bytes(model, dtype), memory_limit().bytes
    fits = need <= DEQUANTIZE_MEMORY_SHARE * limit
    log.info("%s: quantized weights %s on the CPU (models.dequantize: auto): %.2f GB dequantized,"
             " %s half of the %.1f GB this process may use", name,
             "dequantized" if fits else "kept", need / 1e9,
             "within" if fits else "more than", limit / 1e9)
    return fits


def quantization_of(config: dict) -> dict | None:
    """The folder's quantization as `mlx_lm` writes it in config.json ({"bits",
    "group_size", "mode"}; per-layer overrides left out), or None for a float model."""
    q = config.get("quantization") or config.get("quantization_config")
    if not isinstance(q, dict) or "bits" not in q:
        return None
    return {k: q[k] for k in ("bits", "group_size", "mode") if k in q}
