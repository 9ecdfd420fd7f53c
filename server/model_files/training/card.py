"""Model cards (README.md) for the demo pair, written from recorded training and evaluation facts.

Cards are generated, not hand-edited, so a rebuild updates every number in them.
"""

from __future__ import annotations

from pathlib import Path

CONFIG = "server/model_files/training/tiny_pair.yaml"
REBUILD = f"python -m server.model_files.training --config {CONFIG}"
EVALUATE = f"python -m server.model_files.training.evaluate --config {CONFIG}"


def _arch_line(arch: dict) -> str:
    return (
        f"{arch['model_type']}: hidden {arch['hidden_size']}, {arch['num_hidden_layers']} layers, "
        f"{arch['num_attention_heads']} heads ({arch['num_key_value_heads']} KV), "
        f"MLP {arch['intermediate_size']}, tied embeddings: {arch.get('tie_word_embeddings')}"
    )


def render_card(role: str, facts: dict, other: dict | None, report: dict | None) -> str:
    """Markdown for one model; `other` is the partner model's facts, `report` the pair's eval."""
    c, t = facts["corpus"], facts["train"]
    epochs = facts["tokens_seen"] / c["train_tokens"]
    lines = [
        f"# Demo {role} model",
        "",
        f"The {role} of this project's bundled demo pair (`models/demo/target` + "
        "`models/demo/draft`), the default models of the server. A tiny model for demos, tests "
        "and speculative-decoding experiments on a laptop CPU: it writes Python-looking text, "
        "not reliable code or facts.",
        "",
        "| | |",
        "| --- | --- |",
        f"| architecture | {_arch_line(facts['arch'])} |",
        f"| parameters | {facts['parameters']:,} |",
        "| weights | `model.safetensors`, float16, `mlx_lm` format |",
        f"| vocabulary | {c['vocab_size']} (byte-level BPE, shared by target and draft) |",
        # GFM splits table cells at every unescaped pipe, even inside code spans.
        f"| eos | `<\\|im_end\\|>` (id {facts['eos_token_id']}): generation stops at the end "
        "of an assistant turn |",
        f"| steps | {facts['steps']:,} x {t['batch_size']} sequences x {facts['seq_len']} tokens |",
        f"| tokens seen | {facts['tokens_seen']:,} ({epochs:.2f} epochs) |",
        f"| optimiser | AdamW, peak lr {t['learning_rate']:g}, {t['warmup_steps']} warmup steps, "
        f"cosine to {t['min_learning_rate']:g}, weight decay {t['weight_decay']:g}, "
        f"grad clip {t['grad_clip']:g}, seed {facts['seed']} |",
        f"| final train loss | {facts['final_train_loss']:.3f} nats/token (smoothed) |",
    ]
    if report:
        lines.append(
            f"| validation loss | {report['val_loss'][role]:.3f} nats/token "
            f"({c['val_tokens']:,} held-out tokens; float16 weights evaluated in float32) |"
        )
    lines += [
        f"| train time | {facts['train_seconds'] / 60:.1f} min on {facts['machine']} |",
        "",
        "## Corpus",
        "",
        f"The Python {c['python']} standard library's own source ({c['files']} `.py` files, "
        "without tests, idlelib, lib2to3 or site-packages), plus one ChatML exchange per "
        'documented function (mined with `ast`): the user asks *"Write a Python function '
        "`name(args)` that <docstring summary>\"* and the assistant answers with the function's "
        f"source ({c['chat_pairs']:,} pairs). {c['val_files']} files (2%, chosen by a hash of "
        "their path) and their pairs are held out for validation; the tokenizer is trained on "
        f"the other {c['train_files']} only. Training stream: {c['train_tokens']:,} tokens.",
        "",
    ]
    if report and other:
        k = report["num_draft_tokens"]
        lines += [
            "## Speculative decoding",
            "",
            f"Target {_size(facts if role == 'target' else other)} parameters, draft "
            f"{_size(other if role == 'target' else facts)}. Greedy acceptance (accepted / "
            f"proposed draft tokens) at k={k} through `mlx_lm.stream_generate(..., "
            "draft_model=...)`:",
            "",
            "| prompt | accepted / proposed | rate |",
            "| --- | --- | --- |",
        ]
        for r in report["prompts"].values():
            lines.append(
                f"| {r['prompt']} | {r['accepted']} / {r['proposed']} | "
                f"{r['acceptance_rate']:.2f} |"
            )
        lines += ["", *_example(report["prompts"].get("structured"))]
    lines += [
        "## Rebuild",
        "",
        "```bash",
        f"{REBUILD}   # tokenizer, draft, target, evaluation, these cards",
        f"{EVALUATE}  # validation loss and acceptance only",
        "```",
        "",
        "Seeded and deterministic for one Python version and machine (another Python's "
        "standard library is another corpus); on Linux preload OpenBLAS "
        "(`LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0`) for fast fp32 matmuls. "
        "Train times vary with the machine's load.",
        "",
    ]
    return "\n".join(lines)


def _example(r: dict | None) -> list[str]:
    """The pair's greedy answer to the structured prompt (chat template applied)."""
    if not r:
        return []
    return [
        "Greedy completion (identical with and without the draft: "
        f"{r['matches_plain_greedy']}) of the chat prompt *{r['prompt']}*:",
        "",
        "```python",
        r["text"].rstrip(),
        "```",
        "",
        "Greedy decoding from a model this small soon falls into repetition loops, which the "
        "draft predicts well: that inflates the acceptance rate of long greedy runs. Sampling "
        "(temperature ~0.7, repetition penalty ~1.3) reads better.",
        "",
    ]


def _size(facts: dict) -> str:
    return f"{facts['parameters'] / 1e6:.2f}M"


def write_cards(out_dir: Path, facts: dict[str, dict], report: dict | None) -> None:
    for role, f in facts.items():
        other = next((v for k, v in facts.items() if k != role), None)
        (out_dir / role / "README.md").write_text(render_card(role, f, other, report))
