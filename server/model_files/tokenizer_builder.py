"""Train a byte-level BPE tokenizer on the Python standard library, saved in HF format.

The generated test models and the trained demo pair share this builder, so every model this
project makes offline speaks the same ChatML dialect and loads through `mlx_lm.load`.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END]

# ChatML, as Qwen2.5 ships it (without the tool-calling branches).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, sorted so every machine reads them in one order."""
    root = stdlib_dir()
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3")
    return sorted(
        p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts)
    )


def iter_texts(files: list[Path], max_bytes: int) -> Iterator[str]:
    """Yield file contents until `max_bytes` characters have been read."""
    total = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def train_tokenizer(vocab_size: int, *, max_bytes: int = 4_000_000, texts=None) -> Tokenizer:
    """A byte-level BPE whose first ids are the special tokens (deterministic for one corpus)."""
    if texts is None:
        return _train_on_stdlib(vocab_size, max_bytes)
    return _train(vocab_size, texts)


@functools.lru_cache(maxsize=4)
def _train_on_stdlib(vocab_size: int, max_bytes: int) -> Tokenizer:
    return _train(vocab_size, iter_texts(stdlib_files(), max_bytes))


def _train(vocab_size: int, texts) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """Write `tokenizer.json` and a `tokenizer_config.json` that transformers loads as fast."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
