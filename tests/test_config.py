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


def test_the_speculation_policy_comes_from_the_engine_settings(tmp_path):
    from server.engine.policy import SpeculationPolicy
    from server.http.app import build_engine

    config = tmp_path / "config.yaml"
    config.write_text("engine:\n  spec_max_batch: 3\n  spec_batch_draft_tokens: 2\n")
    engine = build_engine(Settings.load(config))  # not started: no model is loaded
    assert (engine.policy.spec_max_batch, engine.policy.batch_draft_tokens) == (3, 2)
    default = build_engine(Settings.load(None)).policy
    assert (default.spec_max_batch, default.batch_draft_tokens) == (
        SpeculationPolicy().spec_max_batch, SpeculationPolicy().batch_draft_tokens)


def test_fuse_projections_reaches_the_engine(tmp_path):
    from server.http.app import build_engine

    config = tmp_path / "config.yaml"
    config.write_text("engine:\n  fuse_projections: true\n")
    assert build_engine(Settings.load(config)).fuse_projections is True  # not started
    assert build_engine(Settings.load(None)).fuse_projections is False
