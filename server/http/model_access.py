"""Which models the admin endpoints may load: folders under the allowed roots, and hub ids."""

from __future__ import annotations

import os
from pathlib import Path

from server.engine.model_kit import is_hub_id
from server.http.errors import APIError


def hf_cache_dir() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")
    return Path(home) / "hub"


class ModelAccessPolicy:
    def __init__(self, roots: list[str | Path], *, allow_hub: bool):
        self.roots = [Path(r).expanduser().resolve() for r in roots]
        self.allow_hub = allow_hub

    @classmethod
    def default_roots(cls, start_up_models: list[str | None]) -> list[Path]:
        roots = [Path("models"), hf_cache_dir()]
        for ref in start_up_models:
            if ref and not is_hub_id(ref):
                roots.append(Path(ref).expanduser().resolve().parent)
        return roots

    def check(self, ref: str) -> None:
        """Raise a 403 APIError unless `ref` may be loaded."""
        if is_hub_id(ref):
            if not self.allow_hub:
                raise APIError(403, f"hub ids are not allowed here: {ref}", param="model",
                               code="model_not_allowed")
            return
        path = Path(ref).expanduser().resolve()
        if not any(path == root or root in path.parents for root in self.roots):
            allowed = ", ".join(str(r) for r in self.roots)
            raise APIError(403, f"{ref} is outside the allowed model roots ({allowed})",
                           param="model", code="model_not_allowed")
