"""Fine-tuned adapters (`models.adapter_path`) against `mlx_lm.load(..., adapter_path=...)`."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from fastapi.testclient import TestClient
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.tuner.utils import linear_to_lora_layers
from support.http import chat_body
from support.models import mlx_lm_chat
from support.servers import make_settings

from server.engine.errors import ModelLoadError
from server.engine.models.adapters import apply_adapters
from server.engine.models.model_kit import load_model

MAX = 24
PROMPT = [{"role": "user", "content": "Write a function"}]


def write_adapter(base, folder, *, kind="lora", layers=2, seed=0):
    """What `mlx_lm.lora` writes after training: the config and the adapter weights, here with
    random low-rank updates big enough to change the greedy text."""
    model, _ = load(str(base))
    params = {"rank": 4, "scale": 4.0, "dropout": 0.0}
    mx.random.seed(seed)
    if kind == "full":  # every weight, changed
        weights = {name: value * (1 + 0.2 * mx.random.normal(value.shape))
                   for name, value in tree_flatten(model.parameters())}
    else:
        linear_to_lora_layers(model, layers, params, use_dora=kind == "dora")
        weights = {name: value if name.endswith(".m") else
                   mx.random.normal(value.shape) * (0.3 / value.shape[0] ** 0.5)
                   for name, value in tree_flatten(model.parameters())
                   if name.endswith(("lora_a", "lora_b", ".m"))}
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    config = {"fine_tune_type": kind, "num_layers": layers, "lora_parameters": params}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def adapter(tiny_pair, tmp_path_factory):
    return write_adapter(tiny_pair[0], tmp_path_factory.mktemp("adapters") / "lora")


def mlx_lm_text(target, adapter_path=None):
    return mlx_lm_chat(target, PROMPT, MAX, adapter_path=adapter_path)


@pytest.mark.parametrize("kind", ["lora", "dora", "full"])
def test_folded_adapters_give_mlx_lm_logits(tiny_pair, tmp_path, kind):
    folder = write_adapter(tiny_pair[0], tmp_path / kind, kind=kind)
    reference, _ = load(str(tiny_pair[0]), adapter_path=str(folder))
    plain, _ = load(str(tiny_pair[0]))
    folded = load_model(str(tiny_pair[0]), adapter_path=str(folder)).model
    assert not any(hasattr(m, "fuse") for _, m in folded.named_modules())  # all folded
    x = mx.array([[5, 17, 3, 99, 42, 7, 250, 11]])
    want, got = reference(x), folded(x)
    assert mx.allclose(want, got, atol=1e-4).item(), mx.abs(want - got).max().item()
    assert not mx.allclose(want, plain(x), atol=1e-2).item()  # the adapter changes the model


def test_quantized_layers_keep_their_update_beside_them(tiny_pair, adapter):
    quantized, _ = load(str(tiny_pair[0]))
    nn.quantize(quantized, group_size=32, bits=8)
    reference, _ = load(str(tiny_pair[0]))
    nn.quantize(reference, group_size=32, bits=8)
    reference.load_weights(list(tree_flatten(quantized.parameters())))
    from mlx_lm.tuner.utils import load_adapters

    load_adapters(reference, str(adapter))
    reference.eval()
    assert apply_adapters(quantized, adapter) == 0  # every adapted layer is quantized
    x = mx.array([[5, 17, 3, 99]])
    assert mx.array_equal(reference(x), quantized(x)).item()


def test_greedy_text_is_the_fine_tunes_with_and_without_the_draft(tiny_pair, adapter):
    from server.http.app import build_engine, create_app

    settings = make_settings(*tiny_pair)
    settings.models.adapter_path = str(adapter)
    expected = mlx_lm_text(tiny_pair[0], adapter)
    assert expected != mlx_lm_text(tiny_pair[0])  # else the test could not fail
    engine = build_engine(settings)
    engine.start()
    try:
        with TestClient(create_app(settings, engine)) as client:
            for extra in ({"num_draft_tokens": 4}, {"use_draft": False},
                          {"draft": "prompt_lookup"}):
                r = client.post("/v1/chat/completions",
                                json=chat_body(max_tokens=MAX, temperature=0, **extra))
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == expected, extra
                if "num_draft_tokens" in extra:  # the base model's draft proposed tokens
                    assert r.json()["stats"]["draft_tokens_accepted"] > 0
            models = client.get("/v1/models").json()["data"]
        assert [m.get("adapter_path") for m in models] == [str(adapter), None]
        assert engine.target.fingerprint != load_model(str(tiny_pair[0])).fingerprint
    finally:
        engine.stop()


def test_a_folder_without_adapters_is_a_clear_load_error(tiny_pair, tmp_path):
    with pytest.raises(ModelLoadError, match="has no adapter_config.json"):
        load_model(str(tiny_pair[0]), adapter_path=str(tmp_path))
    other = write_adapter(tiny_pair[0], tmp_path / "wide")
    config = json.loads((other / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 8  # the weights were written with rank 4
    (other / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="does not match"):
        load_model(str(tiny_pair[0]), adapter_path=str(other))
