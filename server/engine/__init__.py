"""The engine: models, the worker thread and generation. Knows nothing of HTTP."""
