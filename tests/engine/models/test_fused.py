"""Fused projections (server.engine.models.fused) against `mlx_lm`'s unfused models."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from server.engine.models.fused import FusedPart, fuse_projections
from server.engine.models.model_kit import load_model


def _nbytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def _same_logits(plain, fused, tol=1e-5):
    """Prefill 9 tokens, then 3 single-token steps: the logits agree at every step."""
    caches = make_prompt_cache(plain), make_prompt_cache(fused)
    steps = [mx.array([[5, 17, 3, 99, 42, 7, 250, 11, 64]]), mx.array([[8]]), mx.array([[300]]),
             mx.array([[2]])]
    for x in steps:
        a, b = plain(x, cache=caches[0]), fused(x, cache=caches[1])
        assert a.shape == b.shape
        assert mx.allclose(a, b, atol=tol, rtol=tol).item(), mx.abs(a - b).max().item()
        assert mx.array_equal(a.argmax(-1), b.argmax(-1)).item()


def test_fused_float32_model_gives_the_same_logits(tiny_pair):
    plain, _ = load(str(tiny_pair[0]))
    fused, _ = load(str(tiny_pair[0]))
    before = _nbytes(fused)
    groups = fuse_projections(fused)
    assert groups == 2 * len(fused.layers)  # q/k/v and gate/up in every layer
    assert isinstance(fused.layers[0].self_attn.q_proj, FusedPart)
    assert _nbytes(fused) == before  # the stacked weights replace the separate ones
    _same_logits(plain, fused)
    assert fuse_projections(fused) == 0  # fusing twice changes nothing


def test_fused_quantized_model_with_biases_gives_the_same_logits():
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=512, attention_bias=True,
                           mlp_bias=True)
    mx.random.seed(3)
    plain = llama.Model(args)
    nn.quantize(plain, group_size=32, bits=4)
    fused = llama.Model(args)
    nn.quantize(fused, group_size=32, bits=4)
    fused.load_weights(list(tree_flatten(plain.parameters())))
    assert fuse_projections(fused) == 4
    assert isinstance(fused.layers[0].self_attn.fused_q_k_v, nn.QuantizedLinear)
    _same_logits(plain, fused)


def test_projections_that_differ_are_left_alone(tiny_pair):
    model, _ = load(str(tiny_pair[0]))
    attention = model.layers[0].self_attn
    attention.k_proj = nn.QuantizedLinear.from_linear(attention.k_proj, 32, 8)  # q, v not
    # The first layer's attention stays as it was; its MLP and the other layers are fused.
    assert fuse_projections(model) == 2 * len(model.layers) - 1
    assert not isinstance(attention.q_proj, FusedPart)
    assert isinstance(model.layers[0].mlp.gate_proj, FusedPart)


def test_models_load_unfused_unless_fuse_projections_is_set(tiny_pair):
    from server.config import Settings
    from server.engine.models.model_kit import ModelKit

    assert Settings().engine.fuse_projections is False
    plain = ModelKit(load_model(str(tiny_pair[0])))
    plain.load_draft(str(tiny_pair[1]))
    for model in (plain.target.model, plain.draft.model):
        assert type(model.layers[0].mlp.up_proj) is nn.Linear
    fused = ModelKit(load_model(str(tiny_pair[0]), fuse=True), fuse=True)
    fused.load_draft(str(tiny_pair[1]))  # the draft as the target: fused
    for model in (fused.target.model, fused.draft.model):
        assert isinstance(model.layers[0].mlp.up_proj, FusedPart)
