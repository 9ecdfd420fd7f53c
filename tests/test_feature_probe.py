"""`server.model_files.training.feature_probe`: the EAGLE-style head's data is aligned as the
round uses it, its features are the target's, and the whole measurement runs on the tiny pair."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load

from server.model_files.training import feature_probe


def test_batches_pair_each_feature_with_the_next_token_and_label_the_one_after():
    examples = [([5, 6, 7], [8, 9, 10]), ([11, 12], [13])]
    # feature at position t: the vector t, t, ... (t + 100 for the second example)
    feats = [np.full((6, 4), np.arange(6)[:, None], np.float16),
             np.full((3, 4), 100 + np.arange(3)[:, None], np.float16)]
    index = np.arange(20, dtype=np.uint32)
    tok, f, f_next, y, m = next(feature_probe.batches(examples, feats, index, 2, None))
    # position t: the target's feature f_t and token x_{t+1} -> feature f_{t+1}, label x_{t+2}
    assert tok.tolist() == [[6, 7, 8, 9], [12, 0, 0, 0]]
    assert f[:, :, 0].tolist() == [[0, 1, 2, 3], [100, 0, 0, 0]]
    assert f_next[:, :, 0].tolist() == [[1, 2, 3, 4], [101, 0, 0, 0]]
    assert y.tolist() == [[7, 8, 9, 10], [13, 0, 0, 0]]
    # only labels that are answer tokens count: 8, 9, 10 and 13
    assert m.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]


def test_features_are_the_targets_final_norm_states_whatever_the_padding(tiny_pair):
    target, _ = load(str(tiny_pair[0]))
    examples = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10, 11, 12])]
    feats = feature_probe.target_features(target, examples, batch=2)
    for (p, a), got in zip(examples, feats, strict=True):
        alone = np.array(target.model(mx.array([p + a]))[0].astype(mx.float16))
        assert got.shape == alone.shape and np.allclose(got, alone, atol=1e-2)


def random_answers(folder, seed: int, count: int = 40):
    """An answers file of `count` random 6-token prompts with 8-token answers."""
    rng = np.random.default_rng(seed)
    answers = folder / "answers.jsonl"
    answers.write_text("".join(
        json.dumps({"prompt": rng.integers(3, 100, 6).tolist(),
                    "answer": rng.integers(3, 100, 8).tolist()}) + "\n" for _ in range(count)))
    return answers


def test_the_probe_trains_and_reports_agreements_on_the_tiny_pair(tiny_pair, tmp_path, capsys,
                                                                 monkeypatch):
    answers = random_answers(tmp_path, seed=0)
    args = ["--answers", str(answers), "--target", str(tiny_pair[0]), "--train", "30",
            "--epochs", "1", "--vocab", "50", "--features", str(tmp_path / "f.npz")]
    feature_probe.main(args)
    out = capsys.readouterr().out
    assert "30 training answers, 2 held out; 4 steps" in out
    assert (tmp_path / "f.npz").exists()
    def recompute(*_):
        raise AssertionError("the features were kept")

    monkeypatch.setattr(feature_probe, "target_features", recompute)
    feature_probe.main(args)  # the kept features: the same run again
    again = capsys.readouterr().out
    assert again.split("held-out")[1] == out.split("held-out")[1]
    first, second = (float(x.split(" -> ")[1].split(";")[0])
                     for x in out.split("first token: ")[1].split("second token")[:2])
    assert 0 <= first <= 1 and 0 <= second <= 1


def test_the_probe_reports_each_epoch_and_trains_only_its_own_layer(tiny_pair, tmp_path, capsys,
                                                                   monkeypatch):
    answers = random_answers(tmp_path, seed=1)
    built = []
    build = feature_probe.build_head
    monkeypatch.setattr(feature_probe, "build_head", lambda *a: built.append(build(*a)) or built[0])
    feature_probe.main(["--answers", str(answers), "--target", str(tiny_pair[0]), "--train", "16",
                        "--epochs", "3", "--batch", "8", "--vocab", "50"])
    out = capsys.readouterr().out
    # 2 steps an epoch: a line after epochs 1 and 2, the final line after the third
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("epoch")] == [
        "epoch 1 (step 2)", "epoch 2 (step 4)"]
    assert "16 training answers, 2 held out; 6 steps" in out
    trained = {k for k, _ in tree_flatten(built[0].trainable_parameters())}
    assert not any("embed" in k for k in trained) and "fc.weight" in trained


def test_first_init_is_the_targets_first_layer_on_the_token_alone(tiny_pair):
    """--init first: before training the head reads no feature and gives the logits of the
    target cut to its first layer (over the kept rows), the 1-layer token draft's start."""
    target, _ = load(str(tiny_pair[0]))
    config = json.loads((tiny_pair[0] / "config.json").read_text())
    kept = [3, 7, 11, 20, 42, 50]
    head = feature_probe.build_head(target, config, kept, "first")
    rows = mx.array([[0, 4, 2, 5, 1]])
    feats = mx.random.normal((1, 5, config["hidden_size"]))
    got = head.logits(head(rows, feats))[..., : len(kept)]  # the last row: "other"
    cut, _ = load(str(tiny_pair[0]))
    cut.model.layers = cut.model.layers[:1]
    want = cut(mx.array([[kept[r] for r in rows[0].tolist()]]))[..., mx.array(kept)]
    assert np.allclose(np.array(got), np.array(want), atol=1e-4)
