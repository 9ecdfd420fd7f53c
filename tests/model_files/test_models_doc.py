"""docs/models.md is what `scripts/models_matrix.py` makes of the installed `mlx_lm`: every
architecture is on it, and a few of its rows, made again now, are the rows it shows."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import mlx_lm
import pytest
from support.paths import ROOT

SAMPLE = ["llama", "qwen3_5", "gemma3_text"]


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("models_matrix",
                                                  ROOT / "scripts" / "models_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page() -> str:
    return (ROOT / "docs" / "models.md").read_text()


def test_the_page_is_of_the_installed_mlx_lm(page):
    assert f"`mlx_lm` {mlx_lm.__version__}," in page


def test_every_architecture_is_on_the_page(matrix, page):
    listed = set(matrix.parse_rows(page))
    untried = set(re.findall(r"`([\w.-]+)`", page.split("Not tried", 1)[1]))
    assert listed | untried == set(matrix.architectures())
    assert set(SAMPLE) <= listed


@pytest.mark.parametrize("arch", SAMPLE)
def test_a_row_made_now_is_the_pages(matrix, page, arch):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "models_matrix.py"),
                           "--one", arch], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout.splitlines()[-1])
    assert matrix.table_row(row) == matrix.parse_rows(page)[arch]
    assert row["speculate"] == "yes" and row["prefix cache"] == "yes"


def test_update_makes_only_the_given_rows_again(matrix):
    page = "intro\n| `a` | KVCache | ✓ |\n| `b` | KVCache | ✗ old |\nNot tried: `c`.\n"
    row = {"arch": "b", "built": "yes", "caches": "KVCache",
           **{c: "yes" for c in matrix.COLUMNS}}
    new = matrix.updated(page, [row, {"arch": "c", "built": "no: no config"}])
    assert new.splitlines()[1] == "| `a` | KVCache | ✓ |"
    assert new.splitlines()[2] == "| `b` | " + " | ".join(matrix.table_row(row)) + " |"
    assert new.splitlines()[3] == "Not tried: `c`."
