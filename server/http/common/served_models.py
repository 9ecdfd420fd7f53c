"""The models this server serves, as the model lists of every API show them."""

from __future__ import annotations

from api_schemas.admin import ModelEntry
from server.engine import folder_context_length


def served_models(engine) -> list[ModelEntry]:
    """The target, the draft if one is loaded, the embedding model, then the standby
    targets (`models.more_targets` not serving now)."""
    served = [(engine.model_name, "target", engine.target)]
    if engine.draft is not None:
        served.append((engine.draft.name, "draft", engine.draft))
    if engine.embedder is not None:
        served.append((engine.embedder.model.name, "embedding", engine.embedder.model))
    loaded = [ModelEntry(id=name, role=role, path=model.path, created=model.loaded_at,
                         adapter_path=model.adapter_path, max_model_len=model.context_length,
                         quantization=model.quantization,
                         dequantized=model.dequantized if model.quantization else None)
              for name, role, model in served]
    return loaded + [ModelEntry(id=e.name, role="standby", path=e.path, created=engine.started_at,
                                adapter_path=e.adapter_path,
                                max_model_len=folder_context_length(e.path))
                     for e in engine.switcher.standby()]


def find_served(engine, name: str) -> ModelEntry | None:
    """The entry of `served_models` that `name` names: its id or path, or for the target any
    name it answers to (an alias); None for none."""
    return next((entry for entry in served_models(engine)
                 if name in (entry.id, entry.path)
                 or entry.role == "target" and engine.serves(name)), None)
