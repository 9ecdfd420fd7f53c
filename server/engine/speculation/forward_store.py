"""Forward-time tables kept on disk, one file per model (as loaded) and machine, under
$XDG_CACHE_HOME/mlx-spec-server/forward-times.

Each file also says which machine and what size of model it was measured for, so that a model
never measured here starts from the table of the nearest model in size on the same machine
(`TableStore.similar`), scaled, rather than from the formula (`forward_prior`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
from pathlib import Path

import mlx.core as mx

from server.engine.speculation.forward_prior import ModelSize
from server.engine.speculation.forward_times import ForwardTimes

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) \
    / "mlx-spec-server" / "forward-times"
# A stored table stands in for a model at most this many times larger or smaller.
SIMILAR_SIZE_RATIO = 2.0


def _machine_facts() -> list[str]:
    return [platform.node(), platform.machine(), platform.processor(), str(os.cpu_count()),
            mx.__version__, str(mx.default_device())]


def machine_id() -> str:
    """This machine (and MLX version and device), as tables are compared across models."""
    return hashlib.sha256("|".join(_machine_facts()).encode()).hexdigest()[:16]


def machine_key(model_path: str, variant: str = "") -> str:
    """Which model (loaded how: `variant`) on which machine a table belongs to."""
    facts = [str(Path(model_path).resolve()), variant, *_machine_facts()]
    weights = Path(model_path) / "model.safetensors"
    if weights.exists():
        facts.append(str(weights.stat().st_mtime_ns))
    return hashlib.sha256("|".join(facts).encode()).hexdigest()[:16]


class TableStore:
    """The tables in `folder` (None: nothing is kept)."""

    def __init__(self, folder: Path | None = DEFAULT_CACHE_DIR):
        self.folder = folder

    def path(self, key: str) -> Path | None:
        return self.folder / f"{key}.json" if self.folder is not None else None

    def load(self, key: str) -> ForwardTimes | None:
        path = self.path(key)
        if path is None or not path.exists():
            return None
        try:
            return ForwardTimes.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("ignoring an unreadable forward-time table %s", path)
            return None

    def save(self, key: str, table: ForwardTimes, size: ModelSize, model_path: str) -> None:
        path = self.path(key)
        if path is None:
            return
        data = table.to_json() | {"machine": machine_id(), "model": {
            "path": model_path, "parameters": size.parameters,
            "weight_bytes": size.weight_bytes, "kind": size.kind}}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")  # readers never see half
            partial.write_text(json.dumps(data))
            partial.replace(path)
        except OSError:
            log.warning("could not store the forward-time table in %s", path)

    def similar(self, size: ModelSize) -> tuple[ForwardTimes, ModelSize, str] | None:
        """The table of the model nearest `size` in parameters (of the same kind, measured on
        this machine, within `SIMILAR_SIZE_RATIO`), its model's size and path; None if none."""
        if self.folder is None or not self.folder.is_dir():
            return None
        here, best, best_distance = machine_id(), None, math.log(SIMILAR_SIZE_RATIO)
        for file in sorted(self.folder.glob("*.json")):
            try:
                data = json.loads(file.read_text())
                model = data["model"]
                other = ModelSize(int(model["parameters"]), int(model["weight_bytes"]),
                                  str(model["kind"]))
                if data["machine"] != here or other.kind != size.kind or other.parameters <= 0:
                    continue
                distance = abs(math.log(size.parameters / other.parameters))
                if distance <= best_distance:
                    best = (ForwardTimes.from_json(data), other, str(model["path"]))
                    best_distance = distance
            except (OSError, ValueError, KeyError, TypeError):
                continue  # tables of earlier versions say nothing of their model: not similar
        return best
