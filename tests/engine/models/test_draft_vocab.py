"""Drafts that predict a subset of the target's vocabulary (server.engine.models.draft_vocab), on
the
tiny pair (the recipe that trains one: tests/test_training.py)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from server.engine.errors import ModelLoadError
from server.engine.events import TokenEvent
from server.engine.generation import generate_events
from server.engine.models.draft_vocab import (
    VOCAB_FILE,
    SubVocabModel,
    write_vocab,
)
from server.engine.models.head import last_logits, split_of
from server.engine.models.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams, SamplingParams, SpeculationParams

KEPT = [*range(0, 120), *range(200, 330)]  # 250 of the tiny vocabulary's 512 ids


def sliced_draft(draft_dir, out, kept):
    """The tiny draft with only the `kept` rows of its embedding and head (+ a zero row)."""
    model, _, config = load(str(draft_dir), return_config=True)
    params = dict(tree_flatten(model.parameters()))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = params[name]
        params[name] = mx.concatenate([w[mx.array(kept)], mx.zeros((1, w.shape[1]), w.dtype)])
    config = {**config, "vocab_size": len(kept) + 1}
    small = llama.Model(llama.ModelArgs.from_dict(config))
    small.load_weights(list(params.items()))
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(small.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    for f in draft_dir.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    write_vocab(out, kept, 512)
    return model


def test_logits_over_the_kept_ids_are_the_full_drafts_and_the_rest_is_blocked(tiny_pair,
                                                                               tmp_path):
    full = sliced_draft(tiny_pair[1], tmp_path / "small", KEPT)
    wrapped = load_model(str(tmp_path / "small")).model
    assert isinstance(wrapped, SubVocabModel)
    x = mx.array([KEPT[5::7][:20]])  # inputs the small draft knows
    got, expected = wrapped(x), full(x)
    assert got.shape == expected.shape
    np.testing.assert_allclose(np.array(got[..., mx.array(KEPT)]),
                               np.array(expected[..., mx.array(KEPT)]), rtol=1e-5, atol=1e-5)
    blocked = np.setdiff1d(np.arange(512), KEPT)
    assert np.all(np.isneginf(np.array(got[..., mx.array(blocked)])))

    assert wrapped.vocab_size == 512
    assert wrapped.inner.args.vocab_size == len(KEPT) + 1  # the rows of its own embedding


def test_a_prefill_widens_only_the_last_positions_to_the_targets_vocabulary(tiny_pair,
                                                                             tmp_path):
    """`last_logits` splits a sub-vocabulary draft into body and head, as a plain model: the
    logits it gives are the wrapped model's at those positions."""
    sliced_draft(tiny_pair[1], tmp_path / "small", KEPT)
    wrapped = load_model(str(tmp_path / "small")).model
    assert split_of(wrapped).body is not None
    x = mx.array([KEPT[5::7][:12], KEPT[9::5][:12]])
    columns = mx.array([11, 6])
    got = last_logits(wrapped, x, make_prompt_cache(wrapped), columns)
    whole = wrapped(x, cache=make_prompt_cache(wrapped))[mx.arange(2), columns]
    np.testing.assert_allclose(np.array(got), np.array(whole), rtol=1e-5, atol=1e-5)


def test_serving_with_a_sub_vocab_draft_keeps_greedy_output_and_drafts_only_kept_ids(
        tiny_pair, tmp_path):
    sliced_draft(tiny_pair[1], tmp_path / "small", KEPT)
    kit = ModelKit(load_model(str(tiny_pair[0])))
    kit.load_draft(str(tmp_path / "small"))
    prompt = tuple(kit.target.tokenizer.encode("def hello(world):\n    return"))
    plain = GenerationParams(prompt, 40, sampling=SamplingParams())
    drafted = GenerationParams(prompt, 40, speculation=SpeculationParams(num_draft_tokens=4))
    alone = [e for e in generate_events(kit, plain) if isinstance(e, TokenEvent)]
    events = [e for e in generate_events(kit, drafted) if isinstance(e, TokenEvent)]
    assert [e.token for e in events] == [e.token for e in alone]
    from_draft = [e.token for e in events if e.from_draft]
    assert from_draft and set(from_draft) <= set(KEPT)


def test_a_bad_vocab_file_is_a_load_error(tiny_pair, tmp_path):
    sliced_draft(tiny_pair[1], tmp_path / "small", KEPT)
    (tmp_path / "small" / VOCAB_FILE).write_text(json.dumps(
        {"target_vocab_size": 512, "target_ids": [1, 2, 600]}))
    with pytest.raises(ModelLoadError, match="target_ids"):
        load_model(str(tmp_path / "small"))
