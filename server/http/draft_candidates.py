"""The local models that could draft for the target: `GET /v1/models/draft/candidates`.

A candidate is an `mlx_lm` folder (`config.json`, `*.safetensors`, `tokenizer.json`) under one of
the admin endpoints' model roots, with smaller weights than the target's and a tokenizer that
maps the same strings to the same ids (what `POST /v1/models/draft` then checks in full).
Folders are looked for up to `MAX_DEPTH` levels below a root (a Hugging Face cache keeps its
models 4 down: `models--org--name/snapshots/<commit>/`), smallest first.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

MAX_DEPTH = 4
MAX_FOLDERS = 5_000  # folders visited per root at most: a huge tree is not scanned whole
SKIPPED = {"blobs", ".git", ".locks", "__pycache__", ".venv", "node_modules"}


def draft_candidates(roots: list[Path], target, draft) -> list[dict]:
    """`{"path", "size_gb", "loaded"}` for each candidate; `target`, `draft`: the loaded
    models (`LoadedModel`)."""
    vocab = target.vocab
    limit = _weights_bytes(Path(target.path)) or float("inf")  # a hub id: no local files
    exclude = {_real(Path(target.path))}
    loaded = _real(Path(draft.path)) if draft is not None else None
    found, seen = [], set()
    for folder in (f for root in roots for f in model_folders(root)):
        real = _real(folder)
        if real in seen or real in exclude:
            continue
        seen.add(real)
        size = _weights_bytes(folder)
        if 0 < size < limit and _vocab(folder) == vocab:
            found.append({"path": _shown(folder), "size_gb": round(size / 1e9, 3),
                          "loaded": real == loaded})
    return sorted(found, key=lambda c: (c["size_gb"], c["path"]))


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
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab(
            with_added_tokens=True)
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
