"""How far a draft that reads the target's features would get: a measurement, not a drafter.

    python -m server.model_files.training.feature_probe [--answers FILE] [--train 600]
        [--epochs 4] [--vocab 8192] [--token-weight 0.1] [--features CACHE.npz]
        [--init last|first] [--seed 0]

The llama drafts of `distill` see only tokens. An EAGLE-style draft (Li et al., 2024) also reads
the target's last hidden state: at position t it takes the target's (final-norm) feature f_t and
the next token x_{t+1}, runs one transformer layer over them and predicts f_{t+1}, whose tokens
come from the target's own head. This trains such a head on the first `--train` answers of
`target_answers`' file (the target's features computed here, once) and reports its held-out
top-1 agreement with the target on the same held-out answers (the last 5%), over the same kept
vocabulary, as `distill` reports for its drafts:

- first token: from the target's real feature (the first draft token of a round);
- second token: from the head's own predicted feature (every later one).

The engine does not run such a draft: this says whether building one would pay.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.models import llama

from server.engine.draft_vocab import draft_index
from server.model_files.training import target_answers
from server.model_files.training.distill import (
    DEFAULT_VOCAB,
    Example,
    _rows,
    answer_split,
    frequent_ids,
    steps_per_epoch,
    top1_hits,
)

DEFAULT_TRAIN = 600
TOKEN_WEIGHT = 0.1  # EAGLE's loss: feature regression (smooth L1) + 0.1 x token CE


def target_features(target, examples: list[Example], batch: int = 4) -> list[np.ndarray]:
    """Per example, the target's final-norm hidden state at every position (float16)."""
    from tqdm import tqdm

    out = []
    for start in tqdm(range(0, len(examples), batch), desc="target features", unit="batch"):
        seqs = [p + a for p, a in examples[start: start + batch]]
        width = max(len(s) for s in seqs)
        x = mx.array([s + [0] * (width - len(s)) for s in seqs], mx.uint32)
        h = target.model(x).astype(mx.float16)
        mx.eval(h)
        out += [np.array(h[i, : len(s)]) for i, s in enumerate(seqs)]
    return out


def cached_features(target, examples: list[Example], path: Path | None) -> list[np.ndarray]:
    """target_features, kept in `path` (.npz) for the next run on the same answers."""
    if path is not None and path.exists():
        with np.load(path) as saved:
            feats = [saved[f"f{i}"] for i in range(len(saved.files))]
        if [len(f) for f in feats] == [len(p) + len(a) for p, a in examples]:
            return feats
    feats = target_features(target, examples)
    if path is not None:
        np.savez(path, **{f"f{i}": f for i, f in enumerate(feats)})
    return feats


class FeatureHead(nn.Module):
    """f_{t+1} ~ layer(fc([embed(x_{t+1}), f_t])); tokens from the target's head rows."""

    def __init__(self, args: llama.ModelArgs, embed: mx.array, head: mx.array):
        super().__init__()
        d = args.hidden_size
        self.fc = nn.Linear(2 * d, d)
        self.body = llama.LlamaModel(args)  # one layer, its own final norm
        self.body.embed_tokens.freeze()  # unused: the input is fc's
        self._embed, self._head = embed, head  # frozen: the target's (kept) rows

    def __call__(self, tokens: mx.array, feats: mx.array) -> mx.array:
        x = self.fc(mx.concatenate([self._embed[tokens], feats], axis=-1))
        return self.body(None, input_embeddings=x)

    def logits(self, feats: mx.array) -> mx.array:
        return feats @ self._head.T


def build_head(target, config: dict, kept: list[int], init: str = "last") -> FeatureHead:
    """The head, its layer a copy of the target's last layer under a random fc (`init="last"`),
    or of its first layer under an fc that passes the token's embedding through and reads no
    feature yet (`init="first"`: at step 0 it is a 1-layer token draft, initialised as
    `distill` initialises one, so training can only add what the features tell)."""
    fields = {k: v for k, v in config.items()
              if k in llama.ModelArgs.__dataclass_fields__ and k != "quantization"}
    fields.update(num_hidden_layers=1)
    params = dict(tree_flatten(target.parameters()))
    embed = _rows(params["model.embed_tokens.weight"], kept)
    head = embed if config.get("tie_word_embeddings", True) else _rows(
        params["lm_head.weight"], kept)
    model = FeatureHead(llama.ModelArgs(**fields), embed, head)
    source = 0 if init == "first" else config["num_hidden_layers"] - 1
    prefix = f"model.layers.{source}."
    weights = {f"body.layers.0.{k[len(prefix):]}": v.astype(mx.float32)
               for k, v in params.items() if k.startswith(prefix)}
    weights["body.norm.weight"] = params["model.norm.weight"].astype(mx.float32)
    if init == "first":
        d = config["hidden_size"]
        weights["fc.weight"] = mx.concatenate([mx.eye(d), mx.zeros((d, d))], axis=1)
        weights["fc.bias"] = mx.zeros((d,))
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    return model


def batches(examples, feats, index: np.ndarray, batch: int, rng):
    """(tokens x_{t+1}, features f_t, next features f_{t+1}, labels x_{t+2}, mask): the mask
    keeps positions whose label is an answer token."""
    order = rng.permutation(len(examples)) if rng is not None else np.arange(len(examples))
    for start in range(0, len(order), batch):
        picked = order[start: start + batch]
        width = max(len(examples[i][0]) + len(examples[i][1]) for i in picked) - 2
        d = feats[picked[0]].shape[1]
        tok = np.zeros((len(picked), width), np.uint32)
        f = np.zeros((len(picked), width, d), np.float16)
        f_next = np.zeros_like(f)
        y = np.zeros((len(picked), width), np.uint32)
        m = np.zeros((len(picked), width), np.float32)
        for i, e in enumerate(picked):
            prompt, answer = examples[e]
            s = index[np.asarray(prompt + answer)]
            n = len(s) - 2
            tok[i, :n], y[i, :n] = s[1:-1], s[2:]
            f[i, :n], f_next[i, :n] = feats[e][:-2], feats[e][1:-1]
            m[i, max(len(prompt) - 2, 0): n] = 1.0
        yield (mx.array(tok), mx.array(f).astype(mx.float32),
               mx.array(f_next).astype(mx.float32), mx.array(y), mx.array(m))


def loss_fn(model, tok, f, f_next, y, m, token_weight=TOKEN_WEIGHT):
    pred = model(tok, f)
    reg = nn.losses.smooth_l1_loss(pred, f_next, reduction="none").mean(-1)
    ce = nn.losses.cross_entropy(model.logits(pred), y, reduction="none")
    return ((reg + token_weight * ce) * m).sum() / m.sum()


def agreement(model, examples, feats, index: np.ndarray, other: int) -> tuple[float, float]:
    """Held-out top-1 agreement, (first token, second token); "other" is never proposed. The
    second token's pass feeds the head its own predicted features at every position (in a real
    round the earlier positions hold the target's), so it errs low."""
    hits, totals = np.zeros(2), np.zeros(2)
    for tok, f, _, y, m in batches(examples, feats, index, 8, None):
        pred = model(tok, f)
        second = model(tok[:, 1:], pred[:, :-1])  # predicted f_{t+1} for the real one
        for j, (p, yy, mm) in enumerate(((pred, y, m), (second, y[:, 1:], m[:, 1:]))):
            hit, n = top1_hits(model.logits(p), yy, mm, other)
            hits[j] += hit
            totals[j] += n
    return hits[0] / totals[0], hits[1] / totals[1]


def main(argv=None) -> None:
    from tqdm import tqdm

    from server.model_files.default_model import target_folder

    ap = argparse.ArgumentParser(prog="python -m server.model_files.training.feature_probe",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", type=Path, default=target_answers.DEFAULT_OUT)
    ap.add_argument("--target", default=None)
    ap.add_argument("--train", type=int, default=DEFAULT_TRAIN, help="Training answers.")
    ap.add_argument("--epochs", type=float, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=DEFAULT_VOCAB)
    ap.add_argument("--held-out", type=int, default=None,
                    help="Use only this many of the held-out answers (a quick check).")
    ap.add_argument("--token-weight", type=float, default=TOKEN_WEIGHT,
                    help="Weight of the token cross-entropy beside the feature regression.")
    ap.add_argument("--features", type=Path, default=None,
                    help="Keep the target's features in this .npz and reuse them next run.")
    ap.add_argument("--init", choices=("last", "first"), default="last",
                    help="last: the target's last layer under a random fc (EAGLE's shape); "
                         "first: its first layer under an fc that starts as the token's "
                         "embedding alone (a 1-layer token draft at step 0).")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    target, tokenizer, config = mlx_load(str(target_folder(args.target)), return_config=True)
    target.set_dtype(mx.float32)
    training, held_out = answer_split(args.answers)
    # The vocabulary distill keeps (from all its training answers); the held-out set is its.
    kept = frequent_ids(training, args.vocab, set(tokenizer.eos_token_ids))
    index = draft_index(kept, int(config["vocab_size"]))
    train, val = training[: args.train], held_out[: args.held_out]
    feats = cached_features(target, train + val, args.features)
    train_f, val_f = feats[: len(train)], feats[len(train):]
    model = build_head(target, config, kept, args.init)
    del target
    before = agreement(model, val, val_f, index, len(kept))
    steps = int(args.epochs * steps_per_epoch(len(train), args.batch))
    opt = optim.AdamW(learning_rate=optim.cosine_decay(args.lr, steps, args.lr / 20),
                      weight_decay=0.0)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    bar = tqdm(total=steps, desc="feature head", unit="step")
    step, losses, start, epoch = 0, [], time.time(), 0
    while step < steps:
        for batch in batches(train, train_f, index, args.batch, rng):
            loss, grads = loss_and_grad(model, *batch, args.token_weight)
            opt.update(model, grads)
            mx.eval(loss, model.parameters(), opt.state)
            losses.append(loss.item())
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}", refresh=False)
            if step >= steps:
                break
        epoch += 1
        if step < steps:  # the learning curve: is it still climbing?
            first, second = agreement(model, val, val_f, index, len(kept))
            bar.write(f"epoch {epoch} (step {step}): first token {first:.3f}, "
                      f"second {second:.3f}, loss {np.mean(losses[-50:]):.3f}")
    bar.close()
    first, second = agreement(model, val, val_f, index, len(kept))
    print(f"{len(train)} training answers, {len(val)} held out; {step} steps, "
          f"{(time.time() - start) / 60:.1f} min; token weight {args.token_weight}; "
          f"init {args.init}")
    print(f"held-out top-1 agreement, first token: {before[0]:.3f} -> {first:.3f}; "
          f"second token (from its own feature): {before[1]:.3f} -> {second:.3f}")


if __name__ == "__main__":
    main()
