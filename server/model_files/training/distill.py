"""Distil the shipped draft from the target's answers: its whole schedule, seeded, resumable.

The draft is a llama at the target's width: a copy of its layers `LAYERS` and its final norm,
and an embedding and tied head over only the `VOCAB` most frequent answer tokens plus one
"other" row (`server.engine.models.draft_vocab`), so its head costs VOCAB/V of the target's. At each
answer position of `target_answers`' file (the prompt is context only) it learns a mix:
`HARD_WEIGHT` on the token the target wrote (greedy acceptance is the draft's argmax agreeing
with it) and the rest the target's distribution over its top tokens that the draft has.

`SCHEDULE` is the shipped draft's: 2 epochs from lr 1e-3, then two more epochs each a new
cosine from lr 3e-4, every phase with `WARMUP` warmup steps and the gradient clipped to norm
`CLIP_NORM`. Each phase starts from the draft the one before saved (8-bit, dequantized) and
saves over it, with `training.json`: the first phase's settings, and each later one's under
`continued`, steps, tokens and minutes added up. A run goes on from the phases `training.json`
lists. Held-out answers (the file's last 5%) give the draft's top-1 agreement before and after.
"""

from __future__ import annotations

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

from server.engine.models.draft_vocab import draft_index, read_vocab, write_vocab
from server.engine.models.model_kit import load_model
from server.model_files.training import target_answers
from server.model_files.training.target_answers import answer_split, held_out_start  # noqa: F401

DEFAULT_OUT = Path("models/generated/smollm2-draft")
ANSWERS = 3990  # the requests whose answers the shipped draft trained on (5% held out)
LAYERS = (0, 1, 2, 3)  # the target's layers the draft starts from
VOCAB = 8192  # the tokens the draft predicts
BATCH = 8
WARMUP = 50  # steps of linear warmup to each phase's lr, then cosine to a 20th of it
CLIP_NORM = 1.0  # the gradient's global norm at most
HARD_WEIGHT = 0.5  # the written token's share of the training target; the rest: distillation
BITS, QUANT_GROUP = 8, 64  # stored 8-bit; the server dequantizes it to float32 on a CPU
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class Phase:
    epochs: float
    lr: float
    seed: int


SCHEDULE = (Phase(2, 1e-3, 0), Phase(1, 3e-4, 2), Phase(1, 3e-4, 3))

Example = tuple[list[int], list[int]]  # (prompt ids, answer ids), target ids


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


def _rows(matrix: mx.array, kept: list[int]) -> mx.array:
    """The kept rows, then the mean of the others (the "other" row)."""
    matrix = matrix.astype(mx.float32)
    rest = np.ones(matrix.shape[0], dtype=bool)
    rest[kept] = False
    other = matrix[mx.array(np.flatnonzero(rest))].mean(axis=0, keepdims=True)
    return mx.concatenate([matrix[mx.array(kept)], other])


def warm_start(folder: Path) -> tuple[llama.Model, list[int]]:
    """A saved draft, to train further: in float32 (dequantized, as the server loads a draft),
    over its own rows, and the target ids it predicts."""
    loaded = load_model(str(folder), dtype="float32", dequantize=True)
    return loaded.model.inner, read_vocab(Path(folder))[0]


def soft_targets(examples: list[Example], teachers: list, index: np.ndarray,
                 hard_weight: float = HARD_WEIGHT, k: int = target_answers.TOP_K
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
        seqs = [index[np.asarray(examples[e][0] + examples[e][1])] for e in picked]
        shape = (len(seqs), max(len(s) for s in seqs) - 1)
        x, y = np.zeros(shape, np.uint32), np.zeros(shape, np.uint32)
        m = np.zeros(shape, np.float32)
        sid, sp = np.zeros((*shape, k), np.uint32), np.zeros((*shape, k), np.float32)
        for i, (e, s) in enumerate(zip(picked, seqs, strict=True)):
            p = len(examples[e][0])
            x[i, : len(s) - 1], y[i, : len(s) - 1] = s[:-1], s[1:]
            answer = slice(p - 1, len(s) - 1)  # positions predicting answer tokens
            m[i, answer] = 1.0
            if soft:
                sid[i, answer], sp[i, answer] = soft[e]
            else:
                sid[i, answer, 0], sp[i, answer, 0] = s[p:], 1.0
        yield mx.array(x), mx.array(y), mx.array(m), mx.array(sid), mx.array(sp)


def loss_fn(draft, x, y, mask, soft_ids, soft_probs):
    """Cross-entropy to the training target per answer position (KL to the target's
    distribution plus its constant entropy), averaged over the answer positions."""
    logits = draft(x)
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ce = -(soft_probs * mx.take_along_axis(logq, soft_ids, axis=-1)).sum(-1)
    return (ce * mask).sum() / mask.sum()


def agreement(draft, examples: list[Example], index: np.ndarray, other: int) -> float:
    """How often the draft's argmax (never "other") is the target's next answer token."""
    agree = total = 0
    for x, y, m, _, _ in batches(examples, index, 16, None):
        logits = draft(x)
        logits[..., other] = -mx.inf
        agree += int(((logits.argmax(-1) == y) * m).sum().item())
        total += int(m.sum().item())
    return agree / max(total, 1)


def warmup_cosine(peak: float, steps: int, warmup: int, end: float):
    """Linear warmup from 0 over `warmup` steps to `peak`, then cosine decay to `end` at the
    last step; without warmup, the cosine decay alone."""
    decay = optim.cosine_decay(peak, max(steps - warmup, 1), end=end)
    if warmup <= 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(0.0, peak, warmup), decay], [warmup])


def train(draft, train_set: list[Example], soft, index: np.ndarray, steps: int, lr: float,
          warmup: int, seed: int) -> dict:
    """`steps` AdamW updates over seeded shuffles of `train_set`; the run's steps, answer
    tokens seen, minutes and mean loss per 50 steps."""
    from tqdm import tqdm

    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    opt = optim.AdamW(learning_rate=warmup_cosine(lr, steps, warmup, lr / 20), weight_decay=0.0)
    loss_and_grad = nn.value_and_grad(draft, loss_fn)
    start, losses, curve, tokens = time.time(), [], [], 0
    bar = tqdm(total=steps, desc=f"distill lr {lr:g}", unit="step", mininterval=5)
    while len(losses) < steps:
        for batch in batches(train_set, index, BATCH, rng, soft):
            loss, grads = loss_and_grad(draft, *batch)
            grads, _ = optim.clip_grad_norm(grads, CLIP_NORM)
            opt.update(draft, grads)
            mx.eval(loss, draft.parameters(), opt.state)
            losses.append(loss.item())
            tokens += int(batch[2].sum().item())
            bar.update(1)
            if len(losses) % 50 == 0:
                curve.append([len(losses), float(np.mean(losses[-50:]))])
            if len(losses) == steps:
                break
    bar.close()
    return {"steps": steps, "answer_tokens_seen": tokens, "losses": curve,
            "train_minutes": round((time.time() - start) / 60, 1)}


def save(draft, config: dict, target_dir: Path, out: Path, kept: list[int],
         card: dict) -> None:
    """The draft in float16, its matrices quantized to BITS, with its vocabulary map, the
    target's tokenizer and `card` as `training.json`; drops a stale `evaluation.json`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluation.json").unlink(missing_ok=True)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    draft.set_dtype(mx.float16)
    draft, quantized = quantize_model(draft, {}, group_size=QUANT_GROUP, bits=BITS)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(draft.parameters())),
                        metadata={"format": "mlx"})
    config.update(quantization=quantized["quantization"], torch_dtype="float16",
                  num_hidden_layers=draft.args.num_hidden_layers, vocab_size=len(kept) + 1,
                  tie_word_embeddings=draft.args.tie_word_embeddings)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_vocab(out, kept, int(card["target_vocab_size"]))
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, out / name)
    (out / "training.json").write_text(json.dumps(card, indent=2))


def phases_done(out: Path) -> int:
    """How many of SCHEDULE's phases the draft in `out` has had (0 without one)."""
    card = Path(out) / "training.json"
    return 1 + len(json.loads(card.read_text()).get("continued", [])) if card.exists() else 0


def steps_for(phase: Phase, answers: int, steps_scale: float = 1.0) -> int:
    """A phase's updates: its epochs over `answers` training answers (the last batch of an
    epoch may be short), times `steps_scale` (a smoke run's fraction), at least one."""
    return max(1, round(phase.epochs * -(-answers // BATCH) * steps_scale))


def run_phase(n: int, answers: Path, target_dir: Path, out: Path, limit: int,
              steps_scale: float = 1.0) -> dict:
    """SCHEDULE[n]: the first from the target's layers, a later one from `out`'s draft; saves
    the draft and its card to `out` and returns the card."""
    phase = SCHEDULE[n]
    target, tokenizer, config = mlx_load(str(target_dir), return_config=True)
    lines = [line for line in target_answers.read_with_teacher(answers, limit) if line[1]]
    split = held_out_start(lines)
    train_set, val = [line[:2] for line in lines[:split]], [line[:2] for line in lines[split:]]
    if n == 0:
        kept = frequent_ids(train_set, VOCAB, set(tokenizer.eos_token_ids))
        draft = build_draft(target, config, list(LAYERS), kept)
    else:
        draft, kept = warm_start(out)
    index = draft_index(kept, int(config["vocab_size"]))
    soft = soft_targets(train_set, [line[2] for line in lines[:split]], index)
    before = agreement(draft, val, index, len(kept))
    steps = steps_for(phase, len(train_set), steps_scale)
    run = train(draft, train_set, soft, index, steps, phase.lr, round(WARMUP * steps_scale),
                phase.seed)
    after = agreement(draft, val, index, len(kept))
    settings = {"answers": len(lines), "epochs": phase.epochs, "steps_scale": steps_scale,
                "batch": BATCH, "lr": phase.lr, "warmup": round(WARMUP * steps_scale),
                "clip_norm": CLIP_NORM, "seed": phase.seed, "hard_weight": HARD_WEIGHT}
    if n == 0:
        covered = float(np.mean([index[t] < len(kept) for _, a in val for t in a]))
        card = {"target": str(target_dir), "layers_from_target": list(LAYERS),
                "vocab": len(kept), "target_vocab_size": int(config["vocab_size"]),
                "held_out_coverage": covered, **settings, "before": before,
                "soft_targets": sum(line[2] is not None for line in lines[:split]),
                **run, "after": after, "bits": BITS}
    else:
        card = continued_card(json.loads((out / "training.json").read_text()),
                              {**settings, **run, "agreement_before": before,
                               "agreement_after": after})
    save(draft, config, target_dir, out, kept, card)
    return card


def continued_card(previous: dict, run: dict) -> dict:
    """The card after a later phase: the first's, with the agreement now, steps, tokens and
    minutes added up, the loss curve continued and the phase listed under `continued`."""
    card = {**previous, "after": run["agreement_after"]}
    for key in ("steps", "answer_tokens_seen", "train_minutes"):
        card[key] = round(previous[key] + run[key], 1)
    card["losses"] = previous["losses"] + [[previous["steps"] + s, v] for s, v in run["losses"]]
    card["continued"] = [*previous.get("continued", []),
                         {k: v for k, v in run.items() if k not in ("losses",
                                                                    "answer_tokens_seen")}]
    return card


def distill(answers: Path, target_dir: Path, out: Path, limit: int = ANSWERS,
            steps_scale: float = 1.0) -> str:
    """The distill stage: the phases of SCHEDULE that `out`'s draft has not had. Returns what
    it did, in words."""
    done = phases_done(out)
    for n in range(done, len(SCHEDULE)):
        card = run_phase(n, answers, target_dir, out, limit, steps_scale)
        print(f"phase {n + 1}/{len(SCHEDULE)}: held-out agreement {card['after']:.3f}",
              flush=True)
    if done == len(SCHEDULE):
        return f"{out} has had all {len(SCHEDULE)} phases: kept"
    return f"{out}: phases {done + 1}-{len(SCHEDULE)} trained"
