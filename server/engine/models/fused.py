"""Fused projections: one matmul where a layer applies several linear maps to the same input.

Attention reads its input through three projections (`q_proj`, `k_proj`, `v_proj`) and a
gated MLP through two (`gate_proj`, `up_proj`). On a CPU each matmul is a separate BLAS call
over a small batch of rows, so `fuse_projections` stacks each group's weights into one matrix
(as vLLM's `QKVParallelLinear` and `MergedColumnParallelLinear` do) and leaves, in place of each
projection, a `FusedPart` that returns its slice of the one product. The model's own code runs
unchanged, for any architecture whose layers name their projections this way.

Each output row is the same dot products over the same inputs, so the logits are bit-for-bit
those of the unfused model (`tests/test_fused.py` checks float32 and quantized models against
`mlx_lm`'s; with OpenBLAS, small-row matmuls may round differently, ~1e-6).

On a 2-core CPU one forward took 0.92x the unfused time one day and 1.01-1.05x the next (a
decoding step there is 78% matrix-vector products bound by memory bandwidth, which fusing does
not change), so the engine fuses only when `engine.fuse_projections` asks.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Product:
    """The group's fused linear and its last product, kept until every part has read it."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        self.linear = linear
        self.splits = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
        self.count = len(sizes)
        self.input: mx.array | None = None
        self.parts: list[mx.array] = []
        self.unread: set[int] = set()

    def part(self, x: mx.array, index: int) -> mx.array:
        if self.input is not x or index not in self.unread:
            self.parts = mx.split(self.linear(x), self.splits, axis=-1)
            self.input, self.unread = x, set(range(self.count))
        self.unread.discard(index)
        out = self.parts[index]
        if not self.unread:  # every part read: hold no activations between calls
            self.input, self.parts = None, []
        return out


class FusedPart(nn.Module):
    """Stands where one projection of a fused group was: its slice of the group's product."""

    def __init__(self, product: _Product, index: int):
        super().__init__()
        self._product = product  # a plain attribute: the weights belong to the parent
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._product.part(x, self._index)


def _concat_linear(parts: list[nn.Module]) -> nn.Module | None:
    """One linear layer whose output is the parts' outputs side by side, or None when the
    parts differ in kind, input size, quantization or bias."""
    first = parts[0]
    kind = type(first)
    if kind not in (nn.Linear, nn.QuantizedLinear) or any(type(p) is not kind for p in parts):
        return None
    keys = set(first.keys())
    if any(set(p.keys()) != keys for p in parts):
        return None
    if any(p["weight"].shape[1:] != first["weight"].shape[1:]
           or p["weight"].dtype != first["weight"].dtype for p in parts):
        return None
    if kind is nn.QuantizedLinear:
        quant = (first.group_size, first.bits, first.mode)
        if any((p.group_size, p.bits, p.mode) != quant for p in parts):
            return None
        in_dims = first["weight"].shape[1] * 32 // first.bits
        fused = nn.QuantizedLinear(in_dims, 1, bias=False, group_size=first.group_size,
                                   bits=first.bits, mode=first.mode)
    else:
        fused = nn.Linear(1, 1, bias=False)
    for key in list(fused.keys()):
        fused.pop(key)
    for key in keys:
        fused[key] = mx.concatenate([p[key] for p in parts], axis=0)
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse every group of projections found in `model` (in place); returns how many groups."""
    fused_groups = 0
    for _, module in list(model.named_modules()):
        for names in GROUPS:
            parts = [module.get(n) for n in names]
            if any(not isinstance(p, nn.Module) or isinstance(p, FusedPart) for p in parts):
                continue
            linear = _concat_linear(parts)
            if linear is None:
                continue
            sizes = [p["weight"].shape[0] for p in parts]
            product = _Product(linear, sizes)
            setattr(module, "fused_" + "_".join(n.split("_")[0] for n in names), linear)
            for i, n in enumerate(names):
                setattr(module, n, FusedPart(product, i))
            fused_groups += 1
    if fused_groups:
        mx.eval(model.parameters())
    return fused_groups
