"""Fill in the middle: a text completion's `suffix`, for code models trained to write the part
between a prefix and a suffix.

Such a model's vocabulary holds three marker tokens, and its prompt is the prefix and the
suffix between them, the middle to be written after the last:

    <|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>     (Qwen2.5-Coder, Qwen3-Coder)
    <fim_prefix>PREFIX<fim_suffix>SUFFIX<fim_middle>           (StarCoder, Granite Code)
    <｜fim▁begin｜>PREFIX<｜fim▁hole｜>SUFFIX<｜fim▁end｜>      (DeepSeek-Coder)
    [SUFFIX]SUFFIX[PREFIX]PREFIX                                (Codestral: suffix first)

The markers are found by their text in the vocabulary, as llama.cpp does for models whose
files do not name them. The model ends the middle with its end-of-text token. Prompt lookup
drafts well here: the middle often repeats names and lines of the suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

# (prefix, suffix, middle marker; middle None: the prefix is last), in the order tried.
MARKERS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    ("[PREFIX]", "[SUFFIX]", None),
)


@dataclass(frozen=True)
class FimFormat:
    prefix: int
    suffix: int
    middle: int | None  # None: suffix first, then the prefix (Codestral's order)
    bos: tuple[int, ...]  # the BOS the tokenizer puts first, if it adds one

    @classmethod
    def of(cls, tokenizer) -> FimFormat | None:
        """The tokenizer's fill-in-the-middle markers, or None when it has none."""
        vocab = tokenizer.get_vocab()
        for names in MARKERS:
            if all(name in vocab for name in names if name is not None):
                ids = [vocab[name] if name is not None else None for name in names]
                return cls(ids[0], ids[1], ids[2], _bos(tokenizer))
        return None

    def prompt(self, prefix: list[int], suffix: list[int]) -> list[int]:
        """The prompt whose continuation is the middle (`prefix`, `suffix`: tokens without
        special tokens)."""
        if self.middle is None:
            return [*self.bos, self.suffix, *suffix, self.prefix, *prefix]
        return [*self.bos, self.prefix, *prefix, self.suffix, *suffix, self.middle]


def _bos(tokenizer) -> tuple[int, ...]:
    """The BOS the tokenizer adds to a text (none for Qwen, StarCoder; DeepSeek's, Mistral's)."""
    bos = tokenizer.bos_token_id
    first = tokenizer.encode("a")[:1]
    return (bos,) if bos is not None and first == [bos] else ()


def supported_markers() -> str:
    """The marker sets looked for, for error messages."""
    return "; ".join(" ".join(n for n in names if n) for names in MARKERS)
