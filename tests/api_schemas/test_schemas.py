"""The wire schemas stay in step with the engine's types."""

from dataclasses import fields

from api_schemas.openai import Stats
from server.engine.events import GenerationStats


def test_stats_schema_has_every_engine_stat():
    assert list(Stats.model_fields) == [f.name for f in fields(GenerationStats)]


def test_api_schemas_import_no_mlx():
    import subprocess
    import sys

    code = "import sys, api_schemas.openai, api_schemas.admin; print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
