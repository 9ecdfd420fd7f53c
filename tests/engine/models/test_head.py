"""The output head applied to the last positions only gives the model's own logits."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from server.engine.models.fused import fuse_projections
from server.engine.models.head import last_logits, split_of

INPUTS = [[5, 9, 31, 7], [40, 41, 42, 43]]
COLUMNS = [3, 1]


def _llama(tied: bool) -> llama.Model:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100,
        tie_word_embeddings=tied))
    mx.eval(model.parameters())
    return model


class _Scaled(llama.Model):
    """Not head(body(x)): the split must be refused and the whole model run."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return 2.0 * super().__call__(inputs, cache, input_embeddings)


def _expected(model):
    logits = model(mx.array(INPUTS), cache=make_prompt_cache(model))
    return logits[mx.arange(len(INPUTS)), mx.array(COLUMNS)]


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_the_head_on_the_last_positions_gives_the_models_logits(tied, fused):
    model = _llama(tied)
    if fused:
        fuse_projections(model)
    assert split_of(model).body is not None
    got = last_logits(model, mx.array(INPUTS), make_prompt_cache(model), mx.array(COLUMNS))
    assert mx.allclose(got, _expected(model), atol=1e-5).item()


def test_a_model_that_is_not_head_of_body_runs_whole():
    base = _llama(False)
    model = _Scaled(base.args)
    model.update(base.parameters())
    assert split_of(model).body is None
    got = last_logits(model, mx.array(INPUTS), make_prompt_cache(model), mx.array(COLUMNS))
    assert mx.allclose(got, _expected(model), atol=1e-5).item()
