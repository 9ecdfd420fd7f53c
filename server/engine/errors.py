"""Every exception the engine raises to its callers, in one place. HTTP maps each to a status
(`server/http/common/errors.py`); none of them is a bug."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine cannot serve as asked (maps to HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class MemoryBudgetExceeded(InvalidRequest):
    """A request whose KV cache could never fit the memory budget, even alone (HTTP 400)."""


class GrammarError(ValueError):
    """A schema or tool list that cannot be compiled into a grammar (the client's fault)."""


class XmlCallError(ValueError):
    """The functions cannot be written as XML calls (a name that is not a plain word)."""


class QueueFull(Exception):
    """Too many requests are waiting: the caller should answer 503 with Retry-After."""


class ShuttingDown(Exception):
    """The server is draining: no new requests (503), and running ones are being ended."""


class EngineFailed(Exception):
    """The MLX worker died (an MLX error, a bug): every request ends with this (503), and the
    process exits so that its supervisor starts it again."""


class ModelReplaced(Exception):
    """The target was replaced while the request waited or ran (its prompt was tokenized for
    the previous one): 503, to be sent again."""


class RequestCancelled(Exception):
    """Delivered to a cancelled request's sink: its client went away or it was cancelled."""


class TargetUnavailable(Exception):
    """A configured target could not be switched to (its load failed)."""


class ModelLoadError(Exception):
    """A model could not be loaded (missing, corrupt, unsupported)."""


class ModelNotFound(ModelLoadError):
    """No model at that path or hub id."""


class IncompatibleDraft(Exception):
    """The draft's tokenizer does not map the same strings to the same ids."""


class AdapterError(ValueError):
    """An adapter folder that cannot be applied to this model."""


class UnsupportedCache(ValueError):
    """The model's cache cannot be batched and trimmed (rotating, SSM): refuse it at load."""
