"""Measure a draft against the target's answers, teacher-forced: no timing, the same on any machine.

- **agreement**: how often the draft's most likely next token (over the target's vocabulary,
  as the server runs it: dequantized to float32, the tokens it lacks blocked) is the one the
  target wrote, on the held-out answers (the answers file's last 5%, all code requests) and on
  as many training answers (a seeded sample: what it learnt of what it saw);
- **acceptance at k**: greedy speculative decoding of each held-out answer replayed with the
  draft alone proposing k tokens a round. A round at answer position p proposes
  min(k, tokens left) and the target accepts the draft's leading matches, a, then writes one
  token itself: the next round starts at p + a + 1. That is what `mlx_lm`'s speculative
  decoding accepts on these prompts with the answer's length as its token limit, since a
  greedy draft's proposal after an accepted one is its prediction from the target's own text.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from server.engine.models.model_kit import load_model
from server.model_files.training import target_answers
from server.model_files.training.distill import ANSWERS

KS = (1, 2, 4, 6)


def hits(draft, prompt: list[int], answer: list[int]) -> list[bool]:
    """At each answer position: whether the draft's argmax after the text before is the token
    the target wrote there."""
    logits = draft(mx.array(prompt + answer, mx.uint32)[None])[0, len(prompt) - 1: -1]
    return [p == a for p, a in zip(mx.argmax(logits, axis=-1).tolist(), answer, strict=True)]


def replay(hit: list[bool], k: int) -> tuple[int, int, int]:
    """(rounds, proposed, accepted) of greedy speculative decoding of one answer at k, from
    the draft's teacher-forced `hits` (see the module's docstring)."""
    rounds = proposed = accepted = p = 0
    while p < len(hit):
        m = min(k, len(hit) - p)
        a = next((i for i in range(m) if not hit[p + i]), m)
        rounds, proposed, accepted, p = rounds + 1, proposed + m, accepted + a, p + a + 1
    return rounds, proposed, accepted


def measure(draft, examples: list, ks=KS) -> dict:
    """Agreement over `examples` and, per k, their replayed acceptance."""
    from tqdm import tqdm

    per_answer = [hits(draft, p, a) for p, a in tqdm(examples, desc="evaluate", unit="answer",
                                                      mininterval=5)]
    tokens = sum(map(len, per_answer))
    out = {"answers": len(examples), "tokens": tokens,
           "agreement": round(sum(map(sum, per_answer)) / max(tokens, 1), 4), "by_k": {}}
    for k in ks:
        rounds, proposed, accepted = np.sum([replay(h, k) for h in per_answer], axis=0).tolist()
        out["by_k"][str(k)] = {"rounds": rounds, "proposed": proposed, "accepted": accepted,
                               "acceptance": round(accepted / max(proposed, 1), 4),
                               "tokens_per_round": round(tokens / max(rounds, 1), 3)}
    return out


def evaluate(draft_dir: Path, answers: Path, limit: int = ANSWERS, ks=KS) -> dict:
    """The evaluate stage: the draft's measures on the held-out answers and on as many training
    answers, written to `draft_dir/evaluation.json` and returned."""
    draft = load_model(str(draft_dir), dtype="float32", dequantize=True).model
    train, held_out = target_answers.answer_split(answers, limit)
    picked = np.random.default_rng(0).choice(len(train), min(len(held_out), len(train)), False)
    evaluation = {
        "answers_file": str(answers), "answers": len(train) + len(held_out),
        "held_out": measure(draft, held_out, ks),
        "seen": measure(draft, [train[i] for i in sorted(picked)], ()),
    }
    (draft_dir / "evaluation.json").write_text(json.dumps(evaluation, indent=2) + "\n")
    return evaluation
