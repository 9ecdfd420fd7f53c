"""Fixtures of the model-file tests."""

from __future__ import annotations

import pytest
from support.gguf_writer import write_gguf


@pytest.fixture(scope="module")
def source(tiny_pair):
    """(mlx_lm folder, its config, its weights, a GGUF written from it)."""
    folder = tiny_pair[0]
    path = folder.parent / "tiny.gguf"
    config, weights = write_gguf(folder, path)
    return folder, config, weights, path
