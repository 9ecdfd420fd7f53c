"""Draft distillation (server.model_files.training.distill) on the tiny pair, in seconds."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load

from server.model_files.tokenizer_builder import stdlib_files
from server.model_files.training import distill


def test_distillation_lowers_kl_with_a_frozen_embedding_and_saves_a_loadable_draft(
        tiny_pair, tmp_path):
    target, tokenizer, config = load(str(tiny_pair[0]), return_config=True)
    draft = distill.build_draft(target, config, [0, 3])
    assert draft.args.num_hidden_layers == 2
    np.testing.assert_array_equal(np.array(draft.model.layers[1].mlp.up_proj.weight),
                                  np.array(target.model.layers[3].mlp.up_proj.weight))
    embedding = np.array(draft.model.embed_tokens.weight)

    x = mx.array(np.random.default_rng(0).integers(3, 500, (2, 33)))
    teacher = nn.log_softmax(target(x), axis=-1)
    loss_and_grad = nn.value_and_grad(draft, distill.kl_loss)
    opt = optim.Adam(learning_rate=1e-2)
    losses = []
    for _ in range(5):
        loss, grads = loss_and_grad(draft, x, teacher)
        opt.update(draft, grads)
        mx.eval(loss, draft.parameters(), opt.state)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    np.testing.assert_array_equal(np.array(draft.model.embed_tokens.weight), embedding)

    out = tmp_path / "draft"
    distill.save_draft(draft, tiny_pair[0], out, bits=4, card={"seed": 0})
    saved, saved_tokenizer = load(str(out))
    saved_config = json.loads((out / "config.json").read_text())
    assert saved_config["num_hidden_layers"] == 2
    assert saved_config["quantization"] == {"group_size": 32, "bits": 4}
    assert (out / "tokenizer.json").read_bytes() == (tiny_pair[0] / "tokenizer.json").read_bytes()
    assert saved_tokenizer.get_vocab() == tokenizer.get_vocab()
    assert all(v.dtype in (mx.uint32, mx.float16) for _, v in tree_flatten(saved.parameters()))
    saved.set_dtype(mx.float32)
    agree = (saved(x).argmax(-1) == draft(x).argmax(-1)).mean().item()
    assert agree > 0.8  # 4-bit layers: the quantized draft still predicts as it was trained


def test_training_text_is_chat_rendered_and_windowed(tiny_pair):
    _, tokenizer = load(str(tiny_pair[0]))
    files = stdlib_files()[:3]
    docs = distill.documents(files, tokenizer)
    assert any(d.startswith("<|im_start|>user\n") and "```python\n" in d for d in docs)
    windows = distill.token_windows(docs, tokenizer, 64, seed=0)
    assert windows.shape[1] == 65 and len(windows) > 10
    again = distill.token_windows(docs, tokenizer, 64, seed=0)
    np.testing.assert_array_equal(windows, again)
