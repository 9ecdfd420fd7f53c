"""A tiny pair that thinks (`<think>` ... `</think>`, as Qwen3 and SmolLM3 write), built from
the tiny test pair: two tokens appended to the vocabulary and a Qwen3-style chat template
that opens the reasoning in the generation prompt unless `enable_thinking` is false.

The random target never writes a particular token by itself, so `</think>`'s output row is
made a copy, scaled up, of the row of a token it writes early in its answer to `PROMPT`: it
then writes `</think>` wherever it would have written that token, and both the reasoning and
the answer are non-empty.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx

PROMPT = "Think about the weather"
THINK_TOKENS = ("<think>", "</think>")
CLOSES_AT = 5  # its reply to PROMPT closes the reasoning with its fifth token
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


def add_tokens(src: Path, dst: Path, texts: tuple[str, ...], *,
               template: str | None = None) -> list[int]:
    """Copy a model folder with `texts` appended to its vocabulary as tokens of their own
    (their embeddings and output rows are zero), and `template` as its chat template; their
    ids."""
    shutil.copytree(src, dst)
    tokenizer = json.loads((dst / "tokenizer.json").read_text())
    config = json.loads((dst / "config.json").read_text())
    vocab = config["vocab_size"]
    for i, text in enumerate(texts):
        tokenizer["added_tokens"].append({
            "id": vocab + i, "content": text, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": False})
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    if template is not None:
        tok_config = json.loads((dst / "tokenizer_config.json").read_text())
        tok_config["chat_template"] = template
        (dst / "tokenizer_config.json").write_text(json.dumps(tok_config))
    config["vocab_size"] = vocab + len(texts)
    (dst / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(dst / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        weights[name] = mx.concatenate([w, mx.zeros((len(texts), w.shape[1]), w.dtype)])
    mx.save_safetensors(str(dst / "model.safetensors"), weights, {"format": "mlx"})
    return list(range(vocab, vocab + len(texts)))


def _think_end_replaces(paths: list[Path], token: int, end: int) -> None:
    """`</think>`'s output row: the row of `token`, scaled by 1.05, in each model."""
    for path in paths:
        weights = mx.load(str(path / "model.safetensors"))
        head = weights["lm_head.weight"]
        weights["lm_head.weight"] = mx.concatenate(
            [head[:end], 1.05 * head[token][None], head[end + 1:]])
        mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})


def build_thinking_pair(pair: tuple[Path, Path], out: Path) -> tuple[Path, Path]:
    from mlx_lm import load, stream_generate

    target, draft = out / "target", out / "draft"
    _, end = add_tokens(pair[0], target, THINK_TOKENS, template=THINK_TEMPLATE)
    add_tokens(pair[1], draft, THINK_TOKENS, template=THINK_TEMPLATE)
    model, tokenizer = load(str(target))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                           add_generation_prompt=True)
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=8)]
    _think_end_replaces([target, draft], tokens[CLOSES_AT - 1], end)
    return target, draft
