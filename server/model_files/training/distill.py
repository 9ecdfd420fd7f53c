"""Train a small-vocabulary draft on the target's own answers, in one seeded command.

    python -m server.model_files.training.distill [--answers FILE] [--target PATH]
        [--out models/smollm2-draft] [--layers 0,1,2,3] [--vocab 8192] [--epochs 2]
        [--steps N] [--max-minutes M] [--batch 8] [--lr 1e-3] [--warmup 50] [--clip-norm 1]
        [--hard-weight 0.5] [--seed 0] [--bits 8] [--init-from DRAFT_DIR]
        [--extra-answers FILE]

The data is `target_answers`' JSONL (the target's greedy answers to chat requests, with its
next-token distribution at each answer position): at each answer position (the prompt is
context only) the draft learns a mix, `--hard-weight` on the token the target wrote (greedy
acceptance is the draft's argmax agreeing with it) and the rest the target's distribution over
its top tokens (cross-entropy to it, KL up to a constant: what sampled acceptance rewards).
Lines without the distribution train on the written token alone. `--extra-answers FILE` (a
second `target_answers` file, `--start` past the first's requests) adds its answers to the
training split; the held-out split stays `--answers`' last 5%.

The draft is a llama at the target's width: a copy of some of its layers (`--layers`) and its
final norm, and an embedding and tied head over only the `--vocab` most frequent answer tokens
plus one "other" row (`server.engine.draft_vocab`), so its head costs N/V of the target's.
Held-out answers (5%) give the draft's top-1 agreement with the target, before and after. Saved
8-bit (`--bits`; the server dequantizes it to float32 on a CPU) with `draft_vocab.json`, the
tokenizer and `training.json`.

`--init-from DRAFT_DIR` trains a draft this script saved further (dequantized to float32, its
layers and kept tokens; `--layers` and `--vocab` are then ignored) with a new cosine schedule
from `--lr`; its `training.json` goes on from the earlier run's (steps, tokens and minutes add
up, the loss curve continues, each continuation is listed under `continued`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.models import llama
from mlx_lm.utils import quantize_model

from server.engine.draft_vocab import draft_index, read_vocab, write_vocab
from server.engine.model_kit import load_model as load_draft
from server.model_files.training import target_answers
from server.model_files.training.train import warmup_cosine

DEFAULT_OUT = Path("models/smollm2-draft")
# 4 layers, trained with warmup: held-out agreement 0.651 after 2 epochs, against 0.590 for the
# 3-layer draft shipped before it after 4 (and 0.545 after 2), faster through the server
# (RESULTS/draft-4l-warm-*.txt, draft-4l-ab.txt); 4 layers without warmup: 0.394. The shipped
# draft is these defaults' run and two epochs more (`--init-from`, lr 3e-4, seeds 2 and 3):
# 0.673, then 0.684 (RESULTS/draft-4l-3ep-eval.txt, draft-4l-4ep-training.txt). 5 layers, the
# same way: 0.659, then 0.680, and no faster through the server (RESULTS/draft-5l-ab.txt)
DEFAULT_LAYERS = (0, 1, 2, 3)
DEFAULT_VOCAB = 8192
DEFAULT_EPOCHS = 2  # 948 steps, 50 min on 2 CPU cores
DEFAULT_BATCH = 8
DEFAULT_LR = 1e-3
# Without warmup the first updates spike, from layers taken out of the target's stack into its
# final norm and head, and a 4-layer draft never recovers (RESULTS/draft-warmup.txt)
DEFAULT_WARMUP = 50
DEFAULT_CLIP_NORM = 1.0
DEFAULT_HARD_WEIGHT = 0.5
DEFAULT_BITS = 8  # stored 8-bit: the 4-layer, 8192-token draft is ~38 MB in float16, 20 MB so
QUANT_GROUP = 64
DEFAULT_SEED = 0
VAL_FRACTION = 0.05
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

Example = tuple[list[int], list[int]]  # (prompt ids, answer ids), target ids
Teacher = tuple[list[list[int]], list[list[float]]] | None  # target_answers.read_with_teacher


def held_out_start(examples: list) -> int:
    """Where the held-out answers begin: the answers file's last VAL_FRACTION (every tool that
    reads it splits it here)."""
    return int(len(examples) * (1 - VAL_FRACTION))


def answer_split(path: Path) -> tuple[list[Example], list[Example]]:
    """An answers file's (prompt, answer) lines that have an answer, as (training split,
    held-out split)."""
    lines = target_answers.answered(path)
    split = held_out_start(lines)
    return lines[:split], lines[split:]


def frequent_ids(examples: list[Example], n: int, always: set[int]) -> list[int]:
    """The n most frequent answer tokens (ties by id), `always` (EOS...) included."""
    counts = Counter(t for _, answer in examples for t in answer)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return list(dict.fromkeys([*sorted(always), *ranked]))[:n]


def build_draft(target: nn.Module, config: dict, layer_ids: list[int],
                kept: list[int]) -> llama.Model:
    """The target's chosen layers and final norm; embedding (and head, when the target's is
    not tied) rows of the kept ids, plus an "other" row: the mean of the rest."""
    tied = config.get("tie_word_embeddings", True)
    fields = {k: v for k, v in config.items()
              if k in llama.ModelArgs.__dataclass_fields__ and k != "quantization"}
    fields.update(num_hidden_layers=len(layer_ids), vocab_size=len(kept) + 1,
                  tie_word_embeddings=tied)
    draft = llama.Model(llama.ModelArgs(**fields))
    params = dict(tree_flatten(target.parameters()))
    weights = {"model.embed_tokens.weight": _rows(params["model.embed_tokens.weight"], kept),
               "model.norm.weight": params["model.norm.weight"]}
    if not tied:
        weights["lm_head.weight"] = _rows(params["lm_head.weight"], kept)
    for new, old in enumerate(layer_ids):
        prefix = f"model.layers.{old}."
        weights.update({f"model.layers.{new}.{k[len(prefix):]}": v
                        for k, v in params.items() if k.startswith(prefix)})
    draft.load_weights(list(weights.items()))
    draft.set_dtype(mx.float32)
    mx.eval(draft.parameters())
    return draft


def warm_start(folder: Path) -> tuple[llama.Model, list[int], dict]:
    """A draft this script saved, to train further: the model in float32 (dequantized, as the
    server loads a draft; unfused, over its own rows), the target ids it predicts and its
    `training.json`."""
    folder = Path(folder)
    loaded = load_draft(str(folder), dtype="float32", fuse=False, dequantize=True)
    kept, _ = read_vocab(folder)
    return loaded.model.inner, kept, json.loads((folder / "training.json").read_text())


def continued_card(previous: dict, run: dict) -> dict:
    """The card of a draft trained further: the earlier run's (its data, initialisation and
    settings), with the agreement now, steps, tokens and minutes added up, the loss curve
    continued, and this run listed under `continued`."""
    card = {**previous, "answers": run["answers"], "after": run["after"]}
    for key in ("steps", "answer_tokens_seen", "train_minutes"):
        card[key] = previous[key] + run[key]
    card["train_minutes"] = round(card["train_minutes"], 1)
    card["losses"] = previous["losses"] + [[previous["steps"] + s, v] for s, v in run["losses"]]
    keep = ("answers", "extra_answers", "extra_answers_file", "epochs", "fixed_steps", "steps",
            "batch", "lr", "warmup", "clip_norm", "seed", "hard_weight", "train_minutes")
    card["continued"] = [*previous.get("continued", []),
                         {**{k: run[k] for k in keep if k in run},
                          "agreement_before": run["before"],
                          "agreement_after": run["after"]}]
    return card


def _rows(matrix: mx.array, kept: list[int]) -> mx.array:
    """The kept rows, then the mean of the others (the "other" row)."""
    matrix = matrix.astype(mx.float32)
    rest = np.ones(matrix.shape[0], dtype=bool)
    rest[kept] = False
    other = matrix[mx.array(np.flatnonzero(rest))].mean(axis=0, keepdims=True)
    return mx.concatenate([matrix[mx.array(kept)], other])


def soft_targets(examples: list[Example], teachers: list[Teacher], index: np.ndarray,
                 hard_weight: float, k: int = target_answers.TOP_K
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per example, (ids, probs) of shape (answer length, k) in draft ids, the training target
    at each answer position: `hard_weight` on the target's greedy token (the label; "other"
    when the draft lacks it), the rest spread as the target's distribution over its stored top
    tokens that the draft has, renormalised (the draft never proposes "other"). Without a
    teacher, or where no top token is the draft's: the label alone."""
    other = index.max()
    out = []
    for (_, answer), teacher in zip(examples, teachers, strict=True):
        ids = np.full((len(answer), k), other, np.uint32)
        probs = np.zeros((len(answer), k), np.float32)
        ids[:, 0], probs[:, 0] = index[np.asarray(answer)], 1.0
        for j, (top, logprobs) in enumerate(zip(*teacher, strict=True) if teacher else ()):
            mine = index[np.asarray(top, np.int64)]
            p = np.exp(np.asarray(logprobs, np.float32)) * (mine != other)
            if p.sum() > 0:  # top[0] is the label, so ids[j, 0] stays the label
                ids[j, : len(top)], probs[j, : len(top)] = mine, (1 - hard_weight) * p / p.sum()
                probs[j, 0] += hard_weight
        out.append((ids, probs))
    return out


def batches(examples: list[Example], index: np.ndarray, batch: int, rng, soft=None):
    """(inputs, labels, mask, soft ids, soft probs) in draft ids: right-padded, loss on answer
    positions only; without `soft` (soft_targets), the labels alone."""
    order = rng.permutation(len(examples)) if rng is not None else np.arange(len(examples))
    k = soft[0][0].shape[1] if soft else 1
    for start in range(0, len(order), batch):
        picked = order[start: start + batch]
        chunk = [examples[i] for i in picked]
        seqs = [index[np.asarray(p + a)] for p, a in chunk]
        width = max(len(s) for s in seqs) - 1
        x = np.zeros((len(seqs), width), np.uint32)
        y = np.zeros((len(seqs), width), np.uint32)
        m = np.zeros((len(seqs), width), np.float32)
        sid = np.zeros((len(seqs), width, k), np.uint32)
        sp = np.zeros((len(seqs), width, k), np.float32)
        for i, (e, (p, _), s) in enumerate(zip(picked, chunk, seqs, strict=True)):
            x[i, : len(s) - 1], y[i, : len(s) - 1] = s[:-1], s[1:]
            answer = slice(len(p) - 1, len(s) - 1)  # positions predicting answer tokens
            m[i, answer] = 1.0
            if soft:
                sid[i, answer], sp[i, answer] = soft[e]
            else:
                sid[i, answer, 0], sp[i, answer, 0] = s[len(p):], 1.0
        yield mx.array(x), mx.array(y), mx.array(m), mx.array(sid), mx.array(sp)


def loss_fn(draft, x, y, mask, soft_ids, soft_probs):
    """Cross-entropy to the target's distribution (KL plus its constant entropy) per answer
    position; with one-hot targets, plain cross-entropy on the labels."""
    logits = draft(x)
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ce = -(soft_probs * mx.take_along_axis(logq, soft_ids, axis=-1)).sum(-1)
    return (ce * mask).sum() / mask.sum()


def top1_hits(logits: mx.array, labels: mx.array, mask: mx.array, other: int) -> tuple[int, int]:
    """(positions where the argmax, never "other", is the label; positions), over the mask."""
    logits[..., other] = -mx.inf
    hit = (logits.argmax(-1) == labels) * mask
    return int(hit.sum().item()), int(mask.sum().item())


def agreement(draft, examples: list[Example], index: np.ndarray, other: int) -> float:
    """How often the draft's argmax (never "other") is the target's next answer token."""
    agree = total = 0
    for x, y, m, _, _ in batches(examples, index, 16, None):
        hits, n = top1_hits(draft(x), y, m, other)
        agree, total = agree + hits, total + n
    return agree / max(total, 1)


def save(draft, config: dict, target_dir: Path, out: Path, kept: list[int], card: dict,
         bits: int | None = DEFAULT_BITS) -> None:
    """The draft in float16, its matrices quantized to `bits` (group QUANT_GROUP) unless None;
    the server dequantizes it in memory on a CPU (`server.engine.model_kit.load_model`)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    draft.set_dtype(mx.float16)
    if bits:
        draft, quantized = quantize_model(draft, {}, group_size=QUANT_GROUP, bits=bits)
        config["quantization"] = quantized["quantization"]
    weights = dict(tree_flatten(draft.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config.update(num_hidden_layers=draft.args.num_hidden_layers, vocab_size=len(kept) + 1,
                  tie_word_embeddings=draft.args.tie_word_embeddings, torch_dtype="float16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_vocab(out, kept, int(card["target_vocab_size"]))
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, out / name)
    (out / "training.json").write_text(json.dumps(card, indent=2))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server.model_files.training.distill",
                                description=__doc__.splitlines()[0])
    p.add_argument("--answers", type=Path, default=target_answers.DEFAULT_OUT,
                   help="JSONL written by server.model_files.training.target_answers.")
    p.add_argument("--target", default=None, help="Target folder (default: the default target).")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)),
                   help="Target layers the draft starts from, by index.")
    p.add_argument("--vocab", type=int, default=DEFAULT_VOCAB, help="Tokens the draft predicts.")
    p.add_argument("--epochs", type=float, default=DEFAULT_EPOCHS)
    p.add_argument("--steps", type=int, default=None,
                   help="Train this many steps instead of --epochs' worth.")
    p.add_argument("--max-minutes", type=float, default=None, help="Stop training after this.")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help="Steps of linear warmup to --lr before the cosine decay (0: none).")
    p.add_argument("--clip-norm", type=float, default=DEFAULT_CLIP_NORM,
                   help="Clip the gradient to this global norm (0: no clipping).")
    p.add_argument("--hard-weight", type=float, default=DEFAULT_HARD_WEIGHT,
                   help="Weight of the target's greedy token in the training target; the rest "
                        "is its distribution (0: distillation alone, 1: its answers alone).")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--bits", type=int, choices=[0, 4, 8], default=DEFAULT_BITS,
                   help="Store the matrices quantized to this many bits (0: float16).")
    p.add_argument("--extra-answers", type=Path, default=None,
                   help="More answers (target_answers --start) to train on; the held-out split "
                        "stays --answers'.")
    p.add_argument("--init-from", type=Path, default=None,
                   help="Train this saved draft further (its layers and tokens; --layers and "
                        "--vocab are ignored).")
    return p.parse_args(argv)


@dataclass
class Setup:
    """What a distillation run trains and measures: the draft, its kept tokens and the layers
    it came from, the answers split and in draft ids, the training targets, the target's
    config, the card of the run it continues (None for a new draft) and how many training
    answers carry the target's distribution."""

    draft: llama.Model
    kept: list[int]
    layer_ids: list[int]
    train: list[Example]
    val: list[Example]
    index: np.ndarray
    soft: list[tuple[np.ndarray, np.ndarray]]
    config: dict
    target_dir: Path
    previous: dict | None
    soft_count: int  # training answers with the target's distribution
    extra_count: int  # training answers from --extra-answers


def setup(args: argparse.Namespace) -> Setup:
    """The draft (from the target's layers, or `--init-from`) and its data, for `args`."""
    from server.model_files.default_model import target_folder

    target_dir = target_folder(args.target)
    target, tokenizer, config = mlx_load(str(target_dir), return_config=True)
    lines = target_answers.answered_with_teacher(args.answers)
    examples = [(prompt, answer) for prompt, answer, _ in lines]
    teachers = [teacher for _, _, teacher in lines]
    split = held_out_start(examples)
    train, val = examples[:split], examples[split:]
    extra = target_answers.answered_with_teacher(args.extra_answers) if args.extra_answers else []
    train += [(prompt, answer) for prompt, answer, _ in extra]
    teachers = teachers[:split] + [teacher for _, _, teacher in extra]
    previous = None
    if args.init_from:
        draft, kept, previous = warm_start(args.init_from)
        layer_ids = previous["layers_from_target"]
    else:
        kept = frequent_ids(train, args.vocab, set(tokenizer.eos_token_ids))
        layer_ids = [int(i) for i in args.layers.split(",")]
        draft = build_draft(target, config, layer_ids, kept)
    index = draft_index(kept, int(config["vocab_size"]))
    soft = soft_targets(train, teachers, index, args.hard_weight)
    return Setup(draft, kept, layer_ids, train, val, index, soft, config, target_dir, previous,
                 sum(t is not None for t in teachers), len(extra))


def steps_per_epoch(answers: int, batch: int) -> int:
    """Batches in one pass over `answers` training answers (the last one may be short)."""
    return -(-answers // batch)


def total_steps(args: argparse.Namespace, s: Setup) -> int:
    return args.steps or int(args.epochs * steps_per_epoch(len(s.train), args.batch))


def optimizer(args: argparse.Namespace, steps: int) -> optim.Optimizer:
    """AdamW, `--warmup` steps of linear warmup to `--lr`, then cosine to a 20th of it."""
    return optim.AdamW(learning_rate=warmup_cosine(args.lr, max(steps, 1), args.warmup,
                                                   args.lr / 20), weight_decay=0.0)


def train_step(draft, opt, loss_and_grad, batch, clip_norm: float) -> tuple[mx.array, mx.array]:
    """One update on one batch; (loss, the gradient's global norm before clipping). With
    `clip_norm` > 0 the gradient is scaled down to that norm when above it."""
    loss, grads = loss_and_grad(draft, *batch)
    if clip_norm > 0:
        grads, norm = optim.clip_grad_norm(grads, clip_norm)
    else:
        norm = mx.sqrt(sum((g * g).sum() for _, g in tree_flatten(grads)))
    opt.update(draft, grads)
    mx.eval(loss, norm, draft.parameters(), opt.state)
    return loss, norm


def main(argv=None) -> None:
    from tqdm import tqdm

    args = parse_args(argv)
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    s = setup(args)
    draft, kept, val, index = s.draft, s.kept, s.val, s.index
    covered = np.mean([index[t] < len(kept) for _, a in val for t in a])
    before = agreement(draft, val, index, len(kept))
    print(f"{len(s.train)} train / {len(val)} held-out answers; the {len(kept)} kept tokens "
          f"cover {covered:.1%} of held-out answer tokens; agreement before {before:.3f}",
          flush=True)

    steps = total_steps(args, s)
    opt = optimizer(args, steps)
    loss_and_grad = nn.value_and_grad(draft, loss_fn)
    card = {"target": str(s.target_dir), "answers": len(s.train) - s.extra_count + len(val),
            "layers_from_target": s.layer_ids, "vocab": len(kept),
            "target_vocab_size": int(s.config["vocab_size"]), "held_out_coverage": covered,
            "epochs": (steps / steps_per_epoch(len(s.train), args.batch) if args.steps
                       else args.epochs),
            **({"fixed_steps": args.steps} if args.steps else {}),
            "batch": args.batch, "lr": args.lr, "seed": args.seed,
            "warmup": args.warmup, "clip_norm": args.clip_norm,
            "before": before,
            "soft_targets": s.soft_count,
            "hard_weight": args.hard_weight,
            **({"extra_answers": s.extra_count, "extra_answers_file": str(args.extra_answers)}
               if s.extra_count else {}),
            "losses": []}
    start, losses, step, tokens = time.time(), [], 0, 0
    bar = tqdm(total=steps, desc="distill", unit="step", mininterval=5)
    while step < steps:
        for batch in batches(s.train, index, args.batch, rng, s.soft):
            loss, _ = train_step(draft, opt, loss_and_grad, batch, args.clip_norm)
            losses.append(loss.item())
            tokens += int(batch[2].sum().item())
            step += 1
            bar.update(1)
            bar.set_postfix(ce=f"{np.mean(losses[-50:]):.3f}", refresh=False)
            if step % 50 == 0:
                card["losses"].append([step, float(np.mean(losses[-50:]))])
            over = args.max_minutes is not None and time.time() - start > args.max_minutes * 60
            if step >= steps or over:
                steps = step
                break
    bar.close()
    card.update(steps=step, answer_tokens_seen=tokens,
                train_minutes=round((time.time() - start) / 60, 1),
                after=agreement(draft, val, index, len(kept)))
    print(f"agreement after {card['after']:.3f} ({step} steps, {card['train_minutes']} min)")
    card["bits"] = args.bits
    if s.previous is not None:
        card = continued_card(s.previous, card)
    save(draft, s.config, s.target_dir, args.out, kept, card, args.bits or None)
    print(f"saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
