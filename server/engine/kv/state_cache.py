"""A recurrent layer's batch cache (Gated DeltaNet, Mamba, short convolutions): `mlx_lm`'s
`ArraysCache`, whose state can be taken back to just after any token of the last round.

A recurrent state has no positions to trim: after a verify forward of `1 + k` tokens it holds
all of them, rejected drafts included. Two ways back, chosen by the round's shape:

- forwards of one token each (the draft model's drafting steps) keep the state after each one
  (`StateHistory`: references to arrays that exist anyway); going back is picking one;
- a forward of several tokens (the target's verify forward) records the inputs of the layer
  that owns the state (the module the model calls with the cache), and going back replays
  that layer alone, from the state before the forward, over each row's kept tokens. Only the
  layer runs again, not the model: its input is what the forward gave it.

A row fed right-padded (a ragged prefill, the draft's catch-up) gets its `lengths` before the
forward instead, and `finalize` after it: its state then stops at its last real token.
"""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList


class StateCache(ArraysCache):
    """An `ArraysCache` of a batch; `mixer` replays the layer that owns it (`Mixers`)."""

    def __init__(self, size: int, left_padding: list[int] | None = None):
        super().__init__(size, left_padding)
        self.recording = False
        self.recorded: tuple | None = None  # (mixer, bound arguments) of the last forward

    @classmethod
    def merge(cls, caches) -> StateCache:
        merged = super().merge(caches)
        merged.left_padding = None
        return merged

    def pad_left(self, left: list[int]) -> None:
        """Rows fed left-padded: the padding positions leave the state as it was."""
        self.left_padding = mx.array(left) if any(left) else None

    def set_valid(self, valid: list[int] | None) -> None:
        """Each row's real tokens in the next forward (the rest is right padding), or None."""
        self.lengths = mx.array(valid) if valid is not None else None

    def finalize(self) -> None:
        self.lengths = None
        self.left_padding = None

    def snapshot(self) -> list:
        return list(self.cache)

    def restore(self, arrays: list) -> None:
        self.cache = list(arrays)

    def is_trimmable(self) -> bool:
        return False

    def arrays(self) -> list[mx.array]:
        return [a for a in self.cache if a is not None]


class StateHistory:
    """The states of a batch's recurrent caches since a checkpoint: `states[j]` after the j-th
    forward (0: the checkpoint), each forward's width, and its recorded mixer calls."""

    def __init__(self, caches: list[StateCache]):
        self.caches = caches
        self.states = [[c.snapshot() for c in caches]]
        self.widths: list[int] = []
        self.calls: list[list] = []

    def after_forward(self, width: int) -> None:
        self.widths.append(width)
        self.calls.append([c.recorded for c in self.caches])
        self.states.append([c.snapshot() for c in self.caches])

    def rewind(self, kept: list[int]) -> None:
        """Set row i's states to just after its first `kept[i]` tokens since the checkpoint."""
        ends = [0]
        for width in self.widths:
            ends.append(ends[-1] + width)
        if all(k == ends[-1] for k in kept):
            return
        for layer, cache in enumerate(self.caches):
            cache.restore(self._layer_states(layer, kept, ends))

    def _layer_states(self, layer: int, kept: list[int], ends: list[int]) -> list:
        """Layer `layer`'s arrays for every row: picked where a row's count ends a forward,
        replayed over the part of one forward where it does not."""
        picks = {}
        for row, k in enumerate(kept):
            j = max(i for i, end in enumerate(ends) if end <= k)
            picks[row] = (j, k - ends[j])
        replays = {j for j, part in picks.values() if part}
        replayed = {j: self._replay(layer, j, picks) for j in replays}
        arrays = []
        for slot in range(len(self.states[0][layer])):
            rows = [(replayed[j] if part else self.states[j][layer])[slot][row: row + 1]
                    for row, (j, part) in sorted(picks.items())]
            arrays.append(mx.concatenate(rows) if rows[0] is not None else None)
        return arrays

    def _replay(self, layer: int, j: int, picks: dict) -> list:
        """Layer `layer`'s arrays after replaying forward `j + 1` from its start, each row
        over the tokens `picks` gives it there (the whole forward for rows not ending in it):
        the rows that keep the same number of tokens are replayed together over those tokens
        alone. Cut to its rows' own tokens, the layer needs no padding mask, so every kind of
        state layer replays the same way (some ignore `mlx_lm`'s right-padding `lengths` in
        part: OLMo-hybrid's convolutions)."""
        call = self.calls[j][layer]
        if call is None:
            raise RuntimeError("a recurrent layer's forward was not recorded: cannot rewind")
        mixer, arguments = call
        self.caches[layer].recording = False
        width = self.widths[j]
        lengths = [part if (jj == j and part) else width for jj, part in
                   (picks[row] for row in sorted(picks))]
        before, after = self.states[j][layer], self.states[j + 1][layer]
        rows = len(lengths)
        out = [[a[r: r + 1] if a is not None else None for a in after] for r in range(rows)]
        for length in sorted(set(lengths) - {width}):
            index = mx.array([r for r in range(rows) if lengths[r] == length])
            part = ArraysCache(len(before))
            part.cache = [a[index] if a is not None else None for a in before]
            sliced = {k: _rows_tokens(v, index, length, rows, width)
                      for k, v in arguments.items()}
            if "mask" in sliced:
                sliced["mask"] = None
            mixer(**{**sliced, "cache": part})
            for i, r in enumerate(index.tolist()):
                out[r] = [a[i: i + 1] if a is not None else None for a in part.cache]
        return [mx.concatenate([row[s] for row in out]) if out[0][s] is not None else None
                for s in range(len(after))]


def _rows_tokens(value, index: mx.array, length: int, rows: int, width: int):
    """A recorded argument cut to some rows and their first `length` tokens (the (B, T, ...)
    inputs); anything else as it is."""
    if isinstance(value, mx.array) and value.ndim >= 2 and value.shape[:2] == (rows, width):
        return value[index, :length]
    return value


def install_recorders(model: nn.Module, caches: list) -> None:
    """Find, for each recurrent cache in `caches` (a fresh `make_prompt_cache(model)`), the
    module that owns it (the innermost one the model calls with it: `linear_attn`, `mamba`,
    `conv`, `mixer`, ...) and wrap that module so that, while its cache is `recording`, its
    call's arguments are kept (once per model)."""
    if getattr(model, "_recorders_installed", False):
        return
    for owner in _find_owners(model, caches):
        _record_calls(owner)
    model._recorders_installed = True


def _find_owners(model: nn.Module, caches: list) -> list[nn.Module]:
    """The innermost module called with each recurrent cache, by a one-token probe forward."""
    leaves = [leaf for c in caches for leaf in (c.caches if isinstance(c, CacheList) else [c])]
    targets = {id(c): i for i, c in enumerate(leaves) if isinstance(c, ArraysCache)}
    found: dict[int, tuple[int, nn.Module]] = {}
    depth = [0]
    patched = []
    for module in _modules(model):
        original = type(module).__call__
        if "cache" not in inspect.signature(original).parameters or id(module) in patched:
            continue

        def probe(self, *args, __original=original, **kwargs):
            bound = inspect.signature(__original).bind(self, *args, **kwargs)
            cache = bound.arguments.get("cache")
            depth[0] += 1
            try:
                if id(cache) in targets:
                    index = targets[id(cache)]
                    if index not in found or found[index][0] < depth[0]:
                        found[index] = (depth[0], self)
                return __original(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        _swap_call(module, probe)
        patched.append(module)
    try:
        model(mx.array([[0]], mx.uint32), cache=caches)
    finally:
        for module in patched:
            _unswap_call(module)
    missing = sorted(set(targets.values()) - set(found))
    if missing:
        raise ValueError(f"no module owns the recurrent caches of layers {missing}")
    return [found[i][1] for i in sorted(found)]


def _modules(model: nn.Module) -> list[nn.Module]:
    seen, out = set(), []
    for module in model.modules():
        if id(module) not in seen:
            seen.add(id(module))
            out.append(module)
    return out


def _swap_call(module: nn.Module, call) -> None:
    """Give one module instance its own `__call__` (a subclass made for it)."""
    base = type(module)
    module.__class__ = type(base.__name__, (base,), {"__call__": call, "_swapped_from": base})


def _unswap_call(module: nn.Module) -> None:
    module.__class__ = type(module)._swapped_from


def _record_calls(module: nn.Module) -> None:
    """Wrap `module` so that a call with a recording `StateCache` keeps its arguments."""
    if getattr(type(module), "_records", False):
        return
    original = type(module).__call__
    signature = inspect.signature(original)

    def call(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        cache = bound.arguments.get("cache")
        if isinstance(cache, StateCache) and cache.recording:
            arguments = dict(bound.arguments)
            owner = arguments.pop("self")
            cache.recorded = (owner, arguments)
        return original(self, *args, **kwargs)

    base = type(module)
    module.__class__ = type(base.__name__, (base,), {"__call__": call, "_records": True,
                                                     "_swapped_from": base})
