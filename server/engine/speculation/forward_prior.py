"""Forward times before any is measured: a formula from a model's size and the device.

A forward reads every weight once and does two flops per parameter per token fed, after a
fixed cost (the host, kernel launches):

    t(rows, tokens) = fixed + weight bytes / bandwidth + 2 x parameters x rows x tokens / flops

The constants are rough on purpose: the prior only has to order the choices sensibly until
real rounds correct it (`cost_model.RoundCalibration`) and the measured table replaces it
(`forward_source`). The CPU's were fitted on a 2-core x86 (AMD EPYC, OpenBLAS, float32):
SmolLM2-135M took 58 ms at (1 row, 1 token) and 269 ms at (16, 5), its 18.9M draft 8.7 and
46.5 ms; the formula says 59 / 325 ms and 10 / 47 ms. Quantized weights on a CPU are unpacked
for every token fed: a 4-bit 91M target took 88 ms per token at any batch size on that machine.
The GPUs' are public figures of an M1-class Mac (Metal) and a data-centre card (CUDA).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from server.engine.models.quantization import logical_parameters, quantized_modules
from server.engine.speculation.forward_times import PROFILE_ROWS, PROFILE_TOKENS, ForwardTimes


@dataclass(frozen=True)
class ModelSize:
    """What a model's forward costs depend on, as it is served."""

    parameters: int  # the values its weights stand for (`logical_parameters`)
    weight_bytes: int  # what a forward reads
    kind: str  # its float dtype, and "-q<bits>" where weights are still quantized

    @classmethod
    def of(cls, model: nn.Module) -> ModelSize:
        weights = [v for _, v in tree_flatten(model.parameters())]
        floating = next((str(v.dtype).removeprefix("mlx.core.") for v in weights
                         if mx.issubdtype(v.dtype, mx.floating)), "")
        quantized = quantized_modules(model)
        kind = floating + (f"-q{quantized[0].bits}" if quantized else "")
        return cls(logical_parameters(model), sum(v.nbytes for v in weights), kind)

    @property
    def quantized(self) -> bool:
        return "-q" in self.kind


@dataclass(frozen=True)
class DeviceSpeed:
    name: str
    fixed_s: float  # a forward's cost beyond its weights and tokens
    bytes_per_s: float  # weights read
    flops_per_s: float  # float matmuls
    quantized_flops_per_s: float  # matmuls over quantized weights


CPU_FIXED_S = 2e-3
CPU_BYTES_PER_S = 10e9
CPU_FLOPS_PER_CORE = 40e9
CPU_QUANTIZED_FLOPS_PER_CORE = 1e9
METAL = DeviceSpeed("metal", 2e-3, 100e9, 3e12, 3e12)
CUDA = DeviceSpeed("cuda", 1e-3, 1e12, 3e13, 3e13)


def device_speed() -> DeviceSpeed:
    """The constants of the device MLX computes on."""
    if mx.default_device() == mx.gpu:
        return METAL if mx.metal.is_available() else CUDA
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    return DeviceSpeed(f"cpu ({cores} cores)", CPU_FIXED_S, CPU_BYTES_PER_S,
                       CPU_FLOPS_PER_CORE * cores, CPU_QUANTIZED_FLOPS_PER_CORE * cores)


def formula_seconds(size: ModelSize, speed: DeviceSpeed, rows: int, tokens: int) -> float:
    flops = speed.quantized_flops_per_s if size.quantized else speed.flops_per_s
    return (speed.fixed_s + size.weight_bytes / speed.bytes_per_s
            + 2 * size.parameters * rows * tokens / flops)


def formula_times(size: ModelSize, speed: DeviceSpeed, rows=PROFILE_ROWS,
                  tokens=PROFILE_TOKENS) -> ForwardTimes:
    """The formula's table on the measured grid."""
    return ForwardTimes.of(rows, tokens, [[formula_seconds(size, speed, r, t) for t in tokens]
                                          for r in rows])


def scaled_to(table: ForwardTimes, measured: ModelSize, size: ModelSize,
              speed: DeviceSpeed) -> ForwardTimes:
    """A table measured for a model of `measured` size, scaled to one of `size`: beyond the
    fixed cost, time grows with the parameters (weights read and flops alike)."""
    return table.scaled(size.parameters / max(measured.parameters, 1), speed.fixed_s)
