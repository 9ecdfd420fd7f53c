"""Evaluate a target/draft pair: validation loss of each, and greedy draft acceptance.

    python -m server.model_files.training.evaluate [--target models/demo/target]
        [--draft models/demo/draft] [--config server/model_files/training/tiny_pair.yaml]
        [--num-draft-tokens 4] [--max-tokens 256] [--json]

Models are loaded as float32: on CPU, MLX's float16 matmuls are far slower than OpenBLAS fp32.
Acceptance is measured through `mlx_lm.stream_generate(..., draft_model=...)`, the code path a
server uses, so the numbers are the ones a user of the pair will see.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import yaml
from mlx_lm import load, stream_generate
from tokenizers import Tokenizer

from server.model_files.training.corpus import val_tokens_for
from server.model_files.training.train import validation_loss

DEFAULT_CONFIG = Path(__file__).with_name("tiny_pair.yaml")

# A structured (code) request in the training distribution, and an open-ended one outside it.
PROMPTS = {
    "structured": "Write a Python function `is_palindrome(s)` that returns True if s reads the "
    "same backwards.",
    "open_ended": "Tell me about the history of computing.",
}


def load_float32(path: str | Path):
    """(model, tokenizer) via `mlx_lm.load`, cast to float32 for fast CPU inference."""
    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)
    return model, tokenizer


def model_val_loss(path: str | Path, model, val_fraction: float, seq_len: int) -> float:
    """Validation nats/token of a saved model, with the tokenizer saved beside it."""
    tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return validation_loss(model, val_tokens_for(tokenizer, val_fraction), seq_len)


def chat_prompt(tokenizer, user: str) -> list[int]:
    """The user turn in the model's own chat template, ready for the assistant's reply."""
    messages = [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def acceptance_counts(from_draft: list[bool], k: int, max_tokens: int) -> tuple[int, int]:
    """(proposed, accepted) rebuilt from the per-token `from_draft` flags.

    Each verification round proposes min(k, tokens still allowed) draft tokens and ends with
    one target token (from_draft False); a round cut short by the end of generation still
    proposed its full share.
    """
    proposed = accepted = 0
    round_start = True
    for i, flag in enumerate(from_draft):
        if round_start:
            proposed += min(k, max_tokens - i)
            round_start = False
        if flag:
            accepted += 1
        else:
            round_start = True
    return proposed, accepted


def generate(model, tokenizer, prompt: list[int], max_tokens: int, draft=None, k: int = 0):
    """Greedy generation: (tokens, from_draft flags, text, finish reason)."""
    kwargs = {"draft_model": draft, "num_draft_tokens": k} if draft is not None else {}
    tokens, flags, text, finish = [], [], "", None
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs):
        tokens.append(r.token)
        flags.append(r.from_draft)
        text += r.text
        finish = r.finish_reason
    return tokens, flags, text, finish


def speculative_report(target, draft, tokenizer, user: str, k: int, max_tokens: int) -> dict:
    """Acceptance for one chat prompt, and whether the output matches plain greedy decoding."""
    prompt = chat_prompt(tokenizer, user)
    tokens, flags, text, finish = generate(target, tokenizer, prompt, max_tokens, draft, k)
    plain, _, _, _ = generate(target, tokenizer, prompt, max_tokens)
    proposed, accepted = acceptance_counts(flags, k, max_tokens)
    return {
        "prompt": user,
        "generated_tokens": len(tokens),
        "finish_reason": finish,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "matches_plain_greedy": tokens == plain,
        "text": text,
    }


def evaluate_pair(
    target_path: str | Path,
    draft_path: str | Path,
    *,
    val_fraction: float,
    seq_len: int,
    k: int = 4,
    max_tokens: int = 256,
) -> dict:
    target, tokenizer = load_float32(target_path)
    draft, _ = load_float32(draft_path)
    return {
        "val_loss": {
            "target": model_val_loss(target_path, target, val_fraction, seq_len),
            "draft": model_val_loss(draft_path, draft, val_fraction, seq_len),
        },
        "num_draft_tokens": k,
        "prompts": {
            name: speculative_report(target, draft, tokenizer, text, k, max_tokens)
            for name, text in PROMPTS.items()
        },
    }


def format_report(report: dict) -> str:
    lines = [
        f"validation loss (nats/token): target {report['val_loss']['target']:.4f}, "
        f"draft {report['val_loss']['draft']:.4f}"
    ]
    for name, r in report["prompts"].items():
        lines += [
            f"\n[{name}] {r['prompt']}",
            f"  k={report['num_draft_tokens']}: accepted {r['accepted']}/{r['proposed']} = "
            f"{r['acceptance_rate']:.3f}; {r['generated_tokens']} tokens ({r['finish_reason']}); "
            f"identical to plain greedy: {r['matches_plain_greedy']}",
            "  completion:",
            *("    " + line for line in r["text"].splitlines()),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--target", default=None, help="default: <output_dir>/target")
    parser.add_argument("--draft", default=None, help="default: <output_dir>/draft")
    parser.add_argument("--num-draft-tokens", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    cfg = yaml.safe_load(args.config.read_text())
    out, ev = Path(cfg["output_dir"]), cfg.get("evaluation", {})
    report = evaluate_pair(
        args.target or out / "target",
        args.draft or out / "draft",
        val_fraction=cfg["corpus"]["val_fraction"],
        seq_len=cfg["seq_len"],
        k=args.num_draft_tokens or ev.get("num_draft_tokens", 4),
        max_tokens=args.max_tokens or ev.get("max_tokens", 256),
    )
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    sys.stdout.flush()
    return report


if __name__ == "__main__":
    main()
