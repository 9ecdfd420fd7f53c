"""The models `make serve` uses: the bundled demo pair, or a generated pair if it is missing."""

from __future__ import annotations

import logging
from pathlib import Path

from server.config import Settings
from server.model_files.synthetic import ensure_pair

log = logging.getLogger(__name__)

DEMO_DIR = Path("models/demo")
GENERATED_DIR = Path("models/generated")


def _missing(ref: str | None) -> bool:
    return ref is not None and ref.startswith(str(DEMO_DIR)) and not Path(ref).exists()


def ensure_default_models(settings: Settings) -> Settings:
    """Swap in the generated pair when the configured demo models are not on disk."""
    m = settings.models
    if not m.synthetic_fallback or not (_missing(m.model) or _missing(m.draft_model)):
        return settings
    log.warning("%s not found: building a random demo pair into %s (first run only)",
                DEMO_DIR, GENERATED_DIR)
    target, draft = ensure_pair(GENERATED_DIR, "small")
    draft_ref = str(draft) if m.draft_model and m.draft_model.lower() != "none" else m.draft_model
    models = m.model_copy(update={"model": str(target), "draft_model": draft_ref})
    return settings.model_copy(update={"models": models})
