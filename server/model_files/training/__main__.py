"""Build the demo pair in one reproducible command: tokenizer, models, evaluation, model cards.

    python -m server.model_files.training --config server/model_files/training/tiny_pair.yaml
        [--output-dir DIR] [--only draft|target] [--steps N] [--skip-eval] [--cards-only]

`--steps` overrides every model's step count (a short run to measure tokens/s); `--only`
retrains one model and keeps the other's saved weights and facts for the cards.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path

import yaml

from server.model_files.tokenizer_builder import special_token_ids
from server.model_files.training.card import write_cards
from server.model_files.training.corpus import build_corpus
from server.model_files.training.evaluate import evaluate_pair, format_report
from server.model_files.training.train import (
    TrainConfig,
    build_model,
    model_config,
    save_model,
    train,
)

FACTS_FILE = "training.json"
REPORT_FILE = "evaluation.json"


def machine() -> str:
    return f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores (MLX CPU)"


def train_one(role: str, spec: dict, cfg: dict, corpus, out_dir: Path, steps: int | None) -> dict:
    """Train, save and record one model; returns the facts its card is written from."""
    tc = TrainConfig.from_dict(spec["train"])
    if steps is not None:
        tc = replace(tc, steps=steps, warmup_steps=min(tc.warmup_steps, steps // 2))
    ids = special_token_ids(corpus.tokenizer)
    config = model_config(
        spec["arch"], corpus.tokenizer.get_vocab_size(), ids["<|im_end|>"], ids["<|endoftext|>"]
    )
    seed = cfg["seed"]
    model = build_model(config, seed)
    result = train(
        model, tc, corpus.train_tokens, corpus.val_tokens, cfg["seq_len"], seed, desc=role
    )
    path = save_model(result.model, config, corpus.tokenizer, out_dir / role)
    facts = {
        "role": role,
        "arch": spec["arch"],
        "parameters": result.parameters,
        "eos_token_id": ids["<|im_end|>"],
        "seed": seed,
        "seq_len": cfg["seq_len"],
        "train": asdict(tc),
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "train_seconds": round(result.train_seconds, 1),
        "final_train_loss": result.final_train_loss,
        "history": result.history,
        "corpus": corpus.stats,
        "machine": machine(),
    }
    (path / FACTS_FILE).write_text(json.dumps(facts, indent=2) + "\n")
    print(
        f"[{role}] {result.parameters:,} parameters, {result.steps} steps, "
        f"{result.tokens_seen:,} tokens, {result.train_seconds / 60:.1f} min -> {path}",
        flush=True,
    )
    return facts


def recorded_facts(out_dir: Path, cfg: dict) -> dict[str, dict]:
    """Each saved model's training facts, so one model can be retrained alone (`--only`)."""
    return {
        role: json.loads(p.read_text())
        for role in cfg["models"]
        if (p := out_dir / role / FACTS_FILE).exists()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--only", choices=["draft", "target"], default=None)
    parser.add_argument("--steps", type=int, default=None, help="override every model's steps")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument(
        "--cards-only", action="store_true", help="rewrite README.md cards from recorded facts"
    )
    args = parser.parse_args(argv)

    cfg = yaml.safe_load(args.config.read_text())
    out_dir = args.output_dir or Path(cfg["output_dir"])
    if args.cards_only:
        report_file = out_dir / REPORT_FILE
        report = json.loads(report_file.read_text()) if report_file.exists() else None
        write_cards(out_dir, recorded_facts(out_dir, cfg), report)
        return
    start = time.perf_counter()
    corpus = build_corpus(
        cfg["tokenizer"]["vocab_size"], cfg["corpus"]["val_fraction"], cfg["seed"]
    )
    print(f"corpus ready in {time.perf_counter() - start:.0f}s: {corpus.stats}", flush=True)

    for role, spec in cfg["models"].items():
        if args.only in (None, role):
            train_one(role, spec, cfg, corpus, out_dir, args.steps)

    facts = recorded_facts(out_dir, cfg)
    report = None
    if not args.skip_eval and {"target", "draft"} <= facts.keys():
        ev = cfg.get("evaluation", {})
        report = evaluate_pair(
            out_dir / "target",
            out_dir / "draft",
            val_fraction=cfg["corpus"]["val_fraction"],
            seq_len=cfg["seq_len"],
            k=ev.get("num_draft_tokens", 4),
            max_tokens=ev.get("max_tokens", 256),
        )
        print(format_report(report), flush=True)
        (out_dir / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    write_cards(out_dir, facts, report)
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
