"""Settings precedence: CLI flags > MLX_SPEC_* environment > config file > defaults."""

from __future__ import annotations

from server.config import Settings


def test_environment_wins_over_the_file_and_flags_win_over_both(tmp_path, monkeypatch):
    config = tmp_path / "config.yaml"
    config.write_text("server:\n  admin_api_key: null\n  port: 8000\nengine:\n"
                      "  prefill_chunk: 128\n")
    monkeypatch.setenv("MLX_SPEC_SERVER__ADMIN_API_KEY", "secret")
    monkeypatch.setenv("MLX_SPEC_ENGINE__PREFILL_CHUNK", "512")
    settings = Settings.load(config)
    assert settings.server.admin_api_key == "secret"  # the file's null does not hide it
    assert settings.engine.prefill_chunk == 512
    assert settings.server.port == 8000  # from the file
    flagged = Settings.load(config, engine={"prefill_chunk": 64})
    assert flagged.engine.prefill_chunk == 64


def test_the_file_wins_over_defaults(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("engine:\n  spec_max_batch: 3\n")
    assert Settings.load(config).engine.spec_max_batch == 3
    assert Settings.load(None).engine.spec_max_batch == Settings().engine.spec_max_batch
