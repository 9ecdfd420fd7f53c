"""Settings precedence: CLI flags > MLX_SPEC_* environment > config file > defaults."""

from __future__ import annotations

import os

import yaml
from support.paths import ROOT

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
    from server.engine.speculation.policy import SpeculationPolicy
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


def test_the_shipped_config_yaml_keeps_the_defaults_but_the_models_and_drafter(monkeypatch):
    """`config.yaml` lists every setting a user may want to change; its values are the
    defaults (one source of truth: `server/config.py`) except the default pair and its
    drafter, which `make serve` chooses on purpose."""
    for name in [k for k in os.environ if k.startswith("MLX_SPEC_")]:
        monkeypatch.delenv(name)
    shipped = yaml.safe_load((ROOT / "config.yaml").read_text())
    defaults = Settings().model_dump()
    chosen = {("models", "model"), ("models", "model_name"), ("models", "draft_model"),
              ("defaults", "draft")}
    differ = [(section, key, value) for section, values in shipped.items()
              for key, value in values.items()
              if (section, key) not in chosen and defaults[section][key] != value]
    assert differ == []


def test_every_flag_sets_its_key(tmp_path):
    from server.__main__ import parse_args, settings_from_args

    config = tmp_path / "config.yaml"
    config.write_text("models:\n  model_name: from-file\n  num_draft_tokens: 2\n")
    args = parse_args(["--config", str(config), "--model", "m", "--model-name", "served",
                       "--draft-model", "none", "--num-draft-tokens", "3", "--host", "0.0.0.0",
                       "--port", "9001", "--distributed-mode", "pipeline",
                       "--adapter-path", "adapters", "--chat-template", "t.jinja",
                       "--chat-template-args", '{"enable_thinking": false}'])
    s = settings_from_args(args)
    assert (s.models.model, s.models.model_name, s.models.draft_model,
            s.models.num_draft_tokens, s.models.adapter_path) == ("m", "served", "none", 3,
                                                                  "adapters")
    assert (s.server.host, s.server.port, s.distributed.mode) == ("0.0.0.0", 9001, "pipeline")
    assert (s.models.chat_template, s.models.chat_template_kwargs) == \
        ("t.jinja", {"enable_thinking": False})
    assert settings_from_args(parse_args(["--config", str(config)])).models.model_name == \
        "from-file"


def test_every_setting_has_a_flag_that_reads_its_type():
    """Each key of every section is a flag (`--KEY`; `--cache-KEY`, `--distributed-KEY`),
    its value read as the setting's type; mlx_lm.server's --temp is --temperature."""
    from server.__main__ import parse_args, settings_from_args
    from server.settings_flags import flag, settings

    s = settings_from_args(parse_args([
        "--temp", "0.7", "--max-batch-size", "16", "--cache-max-gb", "0.5", "--ui", "false",
        "--fuse-projections", "--model-aliases", "[gpt-4o, claude]", "--cors-origins", '["*"]',
        "--api-key", "123", "--draft", "prompt_lookup", "--distributed-timeout-s", "5",
        "--more-targets", '[{"model": "other", "model_name": "b"}]', "--allow-hub", "null"]))
    assert (s.defaults.temperature, s.engine.max_batch_size, s.cache.max_gb) == (0.7, 16, 0.5)
    assert (s.server.ui, s.engine.fuse_projections, s.models.allow_hub) == (False, True, None)
    assert s.models.model_aliases == ["gpt-4o", "claude"] and s.server.cors_origins == ["*"]
    assert (s.server.api_key, s.defaults.draft, s.distributed.timeout_s) == (
        "123", "prompt_lookup", 5.0)  # text stays text
    assert s.models.more_targets[0].model_name == "b"
    flags = [flag(section, key) for section, key, _ in settings()]
    assert len(flags) == len(set(flags)) == sum(
        len(f.annotation.model_fields) for f in Settings.model_fields.values())
    for section, key, _ in settings():  # each flag reaches its own key
        args = parse_args([flag(section, key), "x"])
        assert getattr(args, f"{section}.{key}") == "x"


def test_the_files_model_name_names_the_files_model_only(tmp_path, monkeypatch):
    """config.yaml serves SmolLM2 as `smollm2-135m-instruct`; a model given by a flag or the
    environment is served under its own path, not under SmolLM2's name, unless a name comes
    with it."""
    for name in [k for k in os.environ if k.startswith("MLX_SPEC_")]:
        monkeypatch.delenv(name)
    shipped = Settings.load(ROOT / "config.yaml").models
    assert shipped.model_name == "smollm2-135m-instruct"
    assert Settings.load(ROOT / "config.yaml", models={"model": "m"}).models.model_name is None
    named = Settings.load(ROOT / "config.yaml", models={"model": "m", "model_name": "mine"})
    assert named.models.model_name == "mine"
    monkeypatch.setenv("MLX_SPEC_MODELS__MODEL", "m")
    assert Settings.load(ROOT / "config.yaml").models.model_name is None
    monkeypatch.setenv("MLX_SPEC_MODELS__MODEL_NAME", "env-name")
    assert Settings.load(ROOT / "config.yaml").models.model_name == "env-name"
