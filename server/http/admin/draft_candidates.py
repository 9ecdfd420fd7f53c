"""The local models that could draft for the target (`GET /v1/models/draft/candidates`,
`draft_model: auto`), and the local models that may be targets (`models.discover_targets`).

A candidate is an `mlx_lm` folder (`config.json`, `*.safetensors`, `tokenizer.json`) under one of
the admin endpoints' model roots, with smaller weights than the target's and a tokenizer that
maps the same strings to the same ids (what `POST /v1/models/draft` then checks in full).
Folders are looked for up to `MAX_DEPTH` levels below a root (a Hugging Face cache keeps its
models 4 down: `models--org--name/snapshots/<commit>/`), smallest first.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

MAX_DEPTH = 4
MAX_FOLDERS = 5_000  # folders visited per root at most: a huge tree is not scanned whole
SKIPPED = {"blobs", ".git", ".locks", "__pycache__", ".venv", "node_modules"}
AUTO = "auto"  # `draft_model: auto`
AUTO_MAX_SHARE = 1 / 3  # an automatic draft has at most this share of its target's weights


def draft_candidates(roots: list[Path], target, draft) -> list[dict]:
    """`{"path", "size_gb", "loaded"}` for each candidate; `target`, `draft`: the loaded
    models (`LoadedModel`)."""
    limit = _weights_bytes(Path(target.path)) or float("inf")  # a hub id: no local files
    loaded = _real(Path(draft.path)) if draft is not None else None
    return [{"path": _shown(folder), "size_gb": round(size / 1e9, 3),
             "loaded": _real(folder) == loaded}
            for size, folder in _candidates(roots, target.vocab, limit, Path(target.path))]


def auto_draft(target: str, roots: list[Path]) -> str | None:
    """`draft_model: auto`: the smallest candidate with at most `AUTO_MAX_SHARE` of the weights
    of `target` (a local folder); None when there is none, or `target` is no local folder."""
    folder = Path(target).expanduser()
    size, vocab = _weights_bytes(folder), _vocab(folder)
    if not size or vocab is None:
        return None
    found = _candidates(roots, vocab, size * AUTO_MAX_SHARE, folder)
    return _shown(found[0][1]) if found else None


def discover_targets(roots: list[Path], known: list[str]) -> list[tuple[str, Path]]:
    """(name, folder) of every model under `roots` but the `known` ones (paths): named by its
    folder, `org/name` for a Hugging Face cache's snapshot, or by its path when two share a
    name."""
    seen = {_real(Path(k)) for k in known}
    found = []
    for folder in (f for root in roots for f in model_folders(root)):
        if _real(folder) not in seen:
            seen.add(_real(folder))
            found.append((_cache_name(folder) or folder.name, folder))
    names = [name for name, _ in found]
    return [(name if names.count(name) == 1 else _shown(folder), folder)
            for name, folder in found]


def _cache_name(folder: Path) -> str | None:
    """`org/name` for `.../models--org--name/snapshots/<commit>`."""
    parts = folder.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return None


def _candidates(roots: list[Path], vocab: dict, limit: float,
                target: Path) -> list[tuple[int, Path]]:
    """(weights bytes, folder) of the models under `roots` with the tokenizer vocabulary
    `vocab` and fewer weights than `limit`, `target` left out; smallest first."""
    found, seen = [], {_real(target)}
    for folder in (f for root in roots for f in model_folders(root)):
        real = _real(folder)
        if real in seen:
            continue
        seen.add(real)
        size = _weights_bytes(folder)
        if 0 < size < limit and _vocab(folder) == vocab:
            found.append((size, folder))
    return sorted(found, key=lambda c: (c[0], _shown(c[1])))


def model_folders(root: Path) -> Iterator[Path]:
    """Folders under `root` (itself included) that hold an mlx_lm model with its tokenizer."""
    root = Path(root).expanduser()
    visited = 0
    for current, dirs, files in os.walk(root, followlinks=False):
        visited += 1
        if visited > MAX_FOLDERS:
            return
        folder = Path(current)
        depth = len(folder.relative_to(root).parts)
        dirs[:] = [] if depth >= MAX_DEPTH else sorted(d for d in dirs if d not in SKIPPED)
        if "config.json" in files and "tokenizer.json" in files and \
                any(f.endswith(".safetensors") for f in files):
            yield folder


def _weights_bytes(folder: Path) -> int:
    try:
        return sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    except OSError:
        return 0


def _vocab(folder: Path) -> dict | None:
    file = folder / "tokenizer.json"
    try:
        return _read_vocab(str(file.resolve()), file.stat().st_mtime_ns)
    except OSError:
        return None


@functools.lru_cache(maxsize=256)
def _read_vocab(file: str, mtime_ns: int) -> dict | None:
    """A tokenizer file's vocabulary, read once per version of the file (discovering targets
    compares each model's with every other's)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(file).get_vocab(with_added_tokens=True)
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is not a candidate
        return None


def _real(path: Path) -> Path:
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError):
        return path


def _shown(folder: Path) -> str:
    """The folder relative to the working directory when under it, else as found."""
    try:
        return str(folder.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(folder)
