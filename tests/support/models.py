"""The tiny-model kits' helpers: a damaged copy of a model, `mlx_lm`'s own greedy text."""

from __future__ import annotations

import shutil
from pathlib import Path


def corrupt_copy(model: Path, folder: Path) -> Path:
    """`model` copied to `folder` (once) with its weights file overwritten: a failed load."""
    if not folder.exists():
        shutil.copytree(model, folder)
        (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    return folder


def quantized_pair(pair: tuple[Path, Path], folder: Path, bits: int) -> tuple[Path, Path]:
    """`pair` (target, draft) as `mlx_lm.convert -q --q-bits BITS` writes it (mlx-community's
    conversions: group size 64, affine), into `folder` once."""
    from mlx_lm import convert

    out = []
    for name, source in zip(("target", "draft"), pair, strict=True):
        if not (folder / name).exists():
            convert(str(source), str(folder / name), quantize=True, q_bits=bits)
        out.append(folder / name)
    return out[0], out[1]


def mlx_lm_chat(target, chat: str | list[dict], max_tokens: int, *, adapter_path=None,
                draft=None, num_draft_tokens: int = 2) -> str:
    """`mlx_lm.generate`'s greedy reply to `chat` (messages, or one user turn's text), with
    the target's adapters or a draft model when given."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(target), adapter_path=str(adapter_path) if adapter_path else None)
    messages = [{"role": "user", "content": chat}] if isinstance(chat, str) else chat
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    spec = ({"draft_model": load(str(draft))[0], "num_draft_tokens": num_draft_tokens}
            if draft else {})
    return generate(model, tokenizer, prompt, max_tokens=max_tokens, **spec)


def mlx_lm_greedy(target, prompt: str, max_tokens: int) -> dict[str, str]:
    """mlx_lm's greedy texts for `prompt`: as a chat's one user turn ("chat"), and bare
    ("text")."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(target))
    return {"chat": mlx_lm_chat(target, prompt, max_tokens),
            "text": generate(model, tokenizer, prompt, max_tokens=max_tokens)}


# The architectures the model-family tests build (`zoo` in conftest): llama as the control,
# then hybrid (Gated DeltaNet, Mamba-2, short convolutions + attention) and sliding-window ones,
# and two whose forward `server.engine.models.batch_compat` readies for a batch.
ZOO = ["llama", "qwen3_5", "qwen3_next", "gemma3_text", "gpt_oss", "lfm2", "nemotron_h",
       "granitemoehybrid", "gemma2", "gpt_bigcode"]
