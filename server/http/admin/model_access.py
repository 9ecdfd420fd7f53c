"""Which models the admin endpoints may load, and what a client's `model` string names.

A string is a hub id only when it looks like one (`org/name`), hub access is on and no local
folder claims its first part (so `models/x` is a missing path, a 404, never a download). Anything
else is a path: it must lie under an allowed root (403) and exist (404). A NUL byte or a `~user`
that does not exist is a 400. Messages never show the server's absolute paths.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from server.http.common.errors import APIError

log = logging.getLogger(__name__)

MAX_REF_CHARS = 1024
# The Hub's rule for repo ids: two names of letters, digits, `-`, `_`, `.`, at most 96 each.
HUB_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
def hf_cache_dir() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")
    return Path(home) / "hub"


def hub_allowed(allow_hub: bool | None, admin_api_key: str | None) -> bool:
    """Hub downloads are for admin-key holders only, so they need an admin key configured."""
    if not admin_api_key:
        if allow_hub:
            log.warning("allow_hub is ignored: hub downloads need server.admin_api_key")
        return False
    return True if allow_hub is None else allow_hub


@dataclass(frozen=True)
class ModelRef:
    """What a client's `model` string names: a local `path` (as given) or a hub id."""

    text: str
    hub: bool


class ModelAccessPolicy:
    def __init__(self, roots: list[str | Path], *, allow_hub: bool):
        self.roots = [Path(r).expanduser().resolve() for r in roots]
        self.allow_hub = allow_hub

    @classmethod
    def from_settings(cls, settings) -> ModelAccessPolicy:
        m, server = settings.models, settings.server
        start_up = [m.model, m.draft_model] + [r for t in m.more_targets
                                               for r in (t.model, t.draft_model)]
        roots = m.model_roots if m.model_roots is not None else cls.default_roots(start_up)
        return cls(roots, allow_hub=hub_allowed(m.allow_hub, server.admin_api_key))

    @classmethod
    def default_roots(cls, start_up_models: list[str | None]) -> list[Path]:
        roots = [Path("models"), hf_cache_dir()]
        for ref in start_up_models:
            if ref and ref.lower() not in ("none", "auto") and not _looks_like_hub_id(ref):
                roots.append(Path(ref).expanduser().resolve().parent)
        return roots

    def check(self, ref: str) -> ModelRef:
        """What `ref` names, or the 400/403/404 APIError that says why it may not be loaded."""
        _check_text(ref)
        if _looks_like_hub_id(ref):
            if not self.allow_hub:
                raise APIError(403, f"{ref!r} is not a local model folder, and loading hub ids is "
                               "disabled on this server (it needs server.admin_api_key and "
                               "models.allow_hub)", param="model", code="model_not_allowed")
            return ModelRef(ref, hub=True)
        path = _resolve(ref)
        if not any(path == root or root in path.parents for root in self.roots):
            raise APIError(403, f"{ref!r} is outside the allowed model roots (models.model_roots "
                           "in the server's configuration)", param="model",
                           code="model_not_allowed")
        if not _exists(path):
            raise APIError(404, f"model not found: {ref!r}", param="model",
                           code="model_not_found")
        return ModelRef(ref, hub=False)


def _check_text(ref: str) -> None:
    if "\x00" in ref:
        raise APIError(400, "model must not contain NUL bytes", param="model",
                       code="invalid_value")
    if len(ref) > MAX_REF_CHARS:
        raise APIError(400, f"model is longer than {MAX_REF_CHARS} characters", param="model",
                       code="invalid_value")


def _looks_like_hub_id(ref: str) -> bool:
    """`org/name` whose `org` is not a local folder (that makes it a relative path)."""
    if not HUB_ID.fullmatch(ref):
        return False
    try:
        return not Path(ref.split("/")[0]).exists()
    except (OSError, ValueError):
        return False


def _resolve(ref: str) -> Path:
    try:
        return Path(ref).expanduser().resolve()
    except RuntimeError as e:  # `~nosuchuser`: no home directory to expand to
        raise APIError(400, f"cannot expand the user in {ref.split('/')[0]!r}", param="model",
                       code="invalid_value") from e
    except (OSError, ValueError) as e:
        raise _invalid_path(e) from e


def _invalid_path(e: Exception) -> APIError:
    reason = getattr(e, "strerror", None) or type(e).__name__  # never the path itself
    return APIError(400, f"invalid model path: {reason}", param="model", code="invalid_value")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError) as e:  # a name too long, a loop of links
        raise _invalid_path(e) from e


# ------------------------------------------------------------------------- hub downloads
async def local_model_path(ref: ModelRef) -> str:
    """A local folder for `ref`: hub ids are fetched here, on a thread (never the MLX one)."""
    if not ref.hub:
        return ref.text
    return await asyncio.to_thread(_download, ref.text)


def _download(repo_id: str) -> str:
    from huggingface_hub.errors import HFValidationError
    from mlx_lm.utils import hf_repo_to_path

    try:
        return str(hf_repo_to_path(repo_id))
    except HFValidationError as e:
        raise APIError(400, f"invalid hub id {repo_id!r}", param="model",
                       code="invalid_value") from e
    except Exception as e:  # not on the hub, gated, offline: nothing to load either way
        log.warning("hub download of %s failed: %s", repo_id, e)
        raise APIError(404, f"cannot fetch {repo_id!r} from the hub ({type(e).__name__})",
                       param="model", code="model_not_found") from e


# -------------------------------------------------------------------------- weight files
SAFETENSORS_HEADER_LIMIT = 100_000_000


def weights_problem(path: str) -> str | None:
    """Why the weights at `path` cannot load (missing, unreadable, truncated), or None.

    Reads only headers and sizes, never the tensors: cheap enough for the compatibility check.
    """
    folder = Path(path).expanduser()
    try:
        if folder.is_file():
            return None if folder.suffix == ".gguf" and _has_magic(folder, b"GGUF") else \
                "not a model folder (an mlx_lm folder or a .gguf file)"
        if not (folder / "config.json").is_file():
            return "config.json is missing"
        if not isinstance(json.loads((folder / "config.json").read_text()), dict):
            return "config.json is not a JSON object"
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            return "no weights: no *.safetensors file"
        for f in files:
            problem = _safetensors_problem(f)
            if problem:
                return f"{f.name}: {problem}"
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"cannot read the model files ({type(e).__name__})"
    return None


def _has_magic(file: Path, magic: bytes) -> bool:
    with file.open("rb") as f:
        return f.read(len(magic)) == magic


def _safetensors_problem(file: Path) -> str | None:
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "truncated (no header)"
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, SAFETENSORS_HEADER_LIMIT):
            return "corrupt header"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "corrupt header"
    if not isinstance(header, dict):
        return "corrupt header"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v]
    if 8 + n + max(ends, default=0) > size:
        return "truncated (the header describes more data than the file holds)"
    return None
