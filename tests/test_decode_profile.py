"""server.bench.decode_profile: every way it times a decoding step gives `mlx_lm`'s tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from server.bench import decode_profile as dp
from server.engine.model_kit import ModelKit, load_model


@pytest.fixture(scope="module")
def models(tiny_pair):
    return {"unfused": load_model(str(tiny_pair[0])).model,
            "fused": load_model(str(tiny_pair[0]), fuse=True).model}


def test_every_runner_gives_the_mlx_lm_models_greedy_tokens(models):
    prompt = mx.array([[3, 17, 42, 8, 99, 5, 23, 61]], dtype=mx.uint32)
    reference, _ = dp.plain_steps(models["unfused"], prompt, 12)
    assert len(reference) == dp.WARMUP + 12
    for name, (which, runner) in dp.RUNNERS.items():
        tokens, seconds = runner(models[which], prompt, 12)
        assert seconds > 0
        assert tokens == reference, name
    # the MLPs are given back after their compiled turn
    assert not any(isinstance(layer.mlp, dp.CompiledMLP) for layer in models["fused"].layers)


def test_static_cache_masks_what_it_has_not_written():
    cache = dp.StaticCache(mx.zeros((1, 2, 6, 4)), mx.zeros((1, 2, 6, 4)), mx.array(2))
    keys, _ = cache.update_and_fetch(mx.ones((1, 2, 2, 4)), mx.ones((1, 2, 2, 4)))
    assert keys[0, 0, :, 0].tolist() == [0, 0, 1, 1, 0, 0]
    assert cache.make_mask(2).tolist() == [[True, True, True, False, False, False],
                                           [True, True, True, True, False, False]]


def test_layer_ops_count_one_matmul_per_projection_group(models):
    prompt = mx.array([[3, 17, 42, 8]], dtype=mx.uint32)
    unfused, fused = (dp.layer_ops(models[w], prompt)["Matmul"] for w in ("unfused", "fused"))
    # attention's two products (q.k and p.v, the CPU's fallback for the fused kernel) plus
    # q, k, v, o, gate, up, down unfused; q/k/v, o, gate/up, down fused
    assert (unfused, fused) == (2 + 7, 2 + 4)


def test_weight_bytes_and_evals_per_round(tiny_pair, models):
    model = models["unfused"]
    every = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    untied = getattr(model, "lm_head", None) is not None
    assert dp.weight_bytes(model) == every - (model.model.embed_tokens.weight.nbytes
                                              if untied else 0)
    kit = ModelKit(load_model(str(tiny_pair[0])))
    kit.load_draft(str(tiny_pair[1]))
    assert dp.evals_per_round(kit, "none", 16, 6) == (1.0, 0.0)
    # a draft-model round reads its draft tokens back, then the verification
    evals, proposed = dp.evals_per_round(kit, "model", 16, 12)
    assert evals == 2.0 and 0 < proposed <= 4
    evals, proposed = dp.evals_per_round(kit, "prompt_lookup", 16, 12)
    assert evals == 1.0 and proposed <= 4
    with pytest.raises(ValueError):  # done within its prefill's step: no round to count
        dp.evals_per_round(kit, "none", 16, 1)


def test_main_prints_each_section(tiny_pair, capsys):
    dp.main(["--model", str(tiny_pair[0]), "--draft-model", str(tiny_pair[1]), "--steps", "3",
             "--reps", "1", "--context", "8"])
    out = capsys.readouterr().out
    assert all(name in out for name in dp.SYNC_CASES.values())
    for name in dp.RUNNERS:
        assert name in out
    assert "ops per layer" in out and "mx.eval calls per decoding round" in out
    assert "a draft-model round (k = 4)" in out


def test_a_draft_round_verifies_the_same_tokens_with_one_sync_or_two(tiny_pair, models):
    draft = load_model(str(tiny_pair[1])).model
    prompt = mx.array([[3, 17, 42, 8, 99, 5]], dtype=mx.uint32)
    round_ = dp.DraftRound(models["unfused"], draft, prompt)
    two = round_.two_syncs()
    assert len(two) == 5 and round_.one_sync() == two == round_.two_syncs()  # caches trimmed back
    # its first token is the target's greedy next token after the prompt, by mlx_lm alone
    assert two[0] == mx.argmax(models["unfused"](prompt)[0, -1]).item()
    assert set(dp.round_syncs_ms(round_, 2)) == {"two_syncs", "one_sync"}


def test_step_matrices_hold_each_matrix_once(models):
    model = models["unfused"]  # the tiny target: untied, 7 projections per layer
    matrices = dp.step_matrices(model)
    assert len(matrices) == 7 * len(model.layers) + 1
    assert len({id(m) for m in matrices}) == len(matrices)
    assert any(m is model.lm_head.weight for m in matrices)
