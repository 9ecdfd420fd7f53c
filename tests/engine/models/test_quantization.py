"""Quantized models as `mlx_lm.convert -q` writes them (4- and 8-bit, target and draft):
`models.dequantize`, and the served text against `mlx_lm.generate` on the same files."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from support.http import chat_body
from support.models import mlx_lm_chat
from support.servers import served

from server.engine.memory import MemoryLimit
from server.engine.models import quantization
from server.engine.models.model_kit import load_model
from server.engine.models.quantization import (
    dequantized_bytes,
    logical_parameters,
    quantized_modules,
)

pytestmark = pytest.mark.anyio

BITS = [4, 8]
MAX = 24
PROMPT = "Write a function"


def dtypes(model) -> set[str]:
    return {str(v.dtype) for _, v in tree_flatten(model.parameters())}


@pytest.mark.parametrize("bits", BITS)
def test_auto_dequantizes_on_the_cpu_and_keeps_the_files_logits(quantized_pairs, tiny_pair,
                                                                 bits):
    target = quantized_pairs[bits][0]
    served_model = load_model(str(target))  # dequantize: auto, on this CPU
    assert served_model.dequantized and not quantized_modules(served_model.model)
    assert dtypes(served_model.model) == {"mlx.core.float32"}
    assert served_model.quantization == {"bits": bits, "group_size": 64, "mode": "affine"}
    reference, _ = load(str(target))  # mlx_lm's, quantized
    assert quantized_modules(reference)
    assert logical_parameters(reference) == load_model(str(tiny_pair[0])).parameter_count()
    x = mx.array([[5, 17, 3, 99, 42, 7, 250, 11]])
    want, got = reference(x), served_model.model(x)
    assert mx.allclose(want, got, atol=1e-4).item(), mx.abs(want - got).max().item()


@pytest.mark.parametrize("setting", [False, True])
def test_true_and_false_force_it(quantized_pairs, setting):
    loaded = load_model(str(quantized_pairs[4][0]), dequantize=setting)
    assert loaded.dequantized is setting
    assert bool(quantized_modules(loaded.model)) is not setting
    assert loaded.quantization["bits"] == 4


def test_auto_keeps_weights_quantized_that_would_not_fit_in_half_the_memory(
        quantized_pairs, monkeypatch):
    """The float32 weights of the 4-bit tiny target take `need` bytes: dequantized when the
    process may use 2 x need, kept when it may use one byte less."""
    target = str(quantized_pairs[4][0])
    need = dequantized_bytes(load(target)[0], mx.float32)
    assert need == logical_parameters(load(target)[0]) * 4
    fingerprints = {}
    for limit, dequantized in ((2 * need, True), (2 * need - 1, False)):
        monkeypatch.setattr(quantization, "memory_limit",
                            lambda limit=limit: MemoryLimit(limit, "test"))
        loaded = load_model(target)
        assert loaded.dequantized is dequantized
        fingerprints[dequantized] = loaded.fingerprint
    assert fingerprints[True] != fingerprints[False]  # their KV states are not shared


def test_a_float_model_is_left_as_it_is(tiny_pair):
    loaded = load_model(str(tiny_pair[0]), dequantize=True)
    assert not loaded.dequantized and loaded.quantization is None


@pytest.mark.parametrize("dequantize", ["auto", False], ids=["dequantized", "quantized"])
@pytest.mark.parametrize("bits", BITS)
async def test_served_quantized_pair_gives_mlx_lms_greedy_text(quantized_pairs, bits,
                                                               dequantize):
    """Greedy text equal to `mlx_lm.generate` on the same quantized files, with the quantized
    draft (which drafts, and whose accepted tokens change nothing) and without it; the prefix
    cache serves the repeated prompt; /v1/models and /health say what was done."""
    target, draft = quantized_pairs[bits]
    expected = mlx_lm_chat(target, PROMPT, MAX)
    async with served(target, draft, models={"dequantize": dequantize}) as (client, _):
        body = chat_body(PROMPT, max_tokens=MAX, temperature=0)
        first = (await client.post("/v1/chat/completions", json=body)).json()
        again = (await client.post("/v1/chat/completions", json=body)).json()
        plain = (await client.post("/v1/chat/completions",
                                   json={**body, "use_draft": False})).json()
        models = (await client.get("/v1/models")).json()["data"]
        health = (await client.get("/health")).json()
    assert first["choices"][0]["message"]["content"] == expected
    assert first["stats"]["draft_tokens_proposed"] > 0
    assert first["stats"]["draft_tokens_accepted"] > 0
    assert again["choices"][0]["message"]["content"] == expected
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert plain["choices"][0]["message"]["content"] == expected
    dequantized = dequantize == "auto"  # on this CPU
    quantized = {"bits": bits, "group_size": 64, "mode": "affine"}
    assert {m["role"]: (m["quantization"], m["dequantized"]) for m in models} == {
        "target": (quantized, dequantized), "draft": (quantized, dequantized)}
    assert health["quantization"] == {role: {**quantized, "dequantized": dequantized}
                                      for role in ("target", "draft")}


async def test_float_models_show_no_quantization(tiny_pair):
    async with served(*tiny_pair) as (client, _):
        models = (await client.get("/v1/models")).json()["data"]
        health = (await client.get("/health")).json()
    assert all("quantization" not in m and "dequantized" not in m for m in models)
    assert "quantization" not in health and "cost_model" not in health


def test_auto_keeps_quantized_weights_on_a_gpu(quantized_pairs, monkeypatch):
    """On Metal or CUDA the quantized kernels read fewer bytes, what a GPU forward waits for:
    auto keeps them (the device is simulated: this machine computes on its CPU)."""
    model = load(str(quantized_pairs[8][0]))[0]
    monkeypatch.setattr(quantization.mx, "default_device", lambda: mx.gpu)
    assert quantization.should_dequantize("auto", model, None, "target") is False
    assert quantization.should_dequantize(True, model, None, "target") is True


async def test_a_quantized_draft_loaded_by_the_admin_endpoint_says_what_was_done(
        tiny_pair, quantized_pairs):
    draft = quantized_pairs[8][1]
    async with served(tiny_pair[0], None, model_roots=[draft.parent]) as (client, _):
        card = (await client.post("/v1/models/draft", json={"model": str(draft)})).json()
        health = (await client.get("/health")).json()
    assert card["quantization"] == {"bits": 8, "group_size": 64, "mode": "affine"}
    assert card["dequantized"] is True  # and its parameters are the values it stands for:
    assert card["parameters"] == load_model(str(tiny_pair[1])).parameter_count()
    assert list(health["quantization"]) == ["draft"]
