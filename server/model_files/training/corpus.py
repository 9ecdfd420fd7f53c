"""The demo pair's corpus: the Python standard library's source plus chat pairs mined from it.

The standard library ships with every Python, so the corpus needs no download and every machine
with the same Python rebuilds the same models. Besides raw source, each documented function
becomes one ChatML exchange: the user asks for the function by its signature and docstring
summary, the assistant answers with its source. That teaches the models the chat template and to
end an assistant turn with `<|im_end|>`, which is what the server's chat endpoint feeds them.
"""

from __future__ import annotations

import ast
import hashlib
import math
import platform
import textwrap
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np

from server.model_files.tokenizer_builder import (
    CHATML_TEMPLATE,
    END_OF_TEXT,
    stdlib_dir,
    stdlib_files,
    train_tokenizer,
)

# Function sources longer than this are mostly long tables or state machines: poor answers.
MAX_ANSWER_CHARS = 3000

# First words of docstring summaries that are not verbs ("The ...", "Internal helper ...").
_NOT_VERBS = frozenset(
    "a an the this these that it its if in on for of to as with when while used internal "
    "helper private deprecated convenience abstract same like alias note see default "
    "called given new base simple compatibility backward backwards".split()
)
_IRREGULAR = {"do": "does", "go": "goes", "be": "is", "have": "has", "undo": "undoes"}


@dataclass(frozen=True)
class Split:
    train: list[Path]
    val: list[Path]


def split_files(files: list[Path], val_fraction: float, root: Path | None = None) -> Split:
    """Hold out the files whose path hashes lowest, so the split is the same on every machine.

    Hashing the path relative to the stdlib root (not a file's position) keeps a file's side of
    the split stable even when another Python version adds or drops modules.
    """
    root = root or stdlib_dir()
    n_val = max(1, math.ceil(len(files) * val_fraction))
    ranked = sorted(files, key=lambda p: hashlib.sha1(_rel(p, root).encode()).hexdigest())
    val = set(ranked[:n_val])
    return Split(train=[p for p in files if p not in val], val=[p for p in files if p in val])


def _rel(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _parse(source: str) -> ast.Module | None:
    """The module's syntax tree, or None for a file this Python cannot parse."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old modules
        try:
            return ast.parse(source)
        except (SyntaxError, ValueError):
            return None


def function_pairs(source: str) -> list[tuple[str, str]]:
    """(user request, function source) for every documented function or method in `source`."""
    tree = _parse(source)
    if tree is None:
        return []
    lines = source.splitlines(keepends=True)
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        pair = _pair(lines, node)
        if pair is not None:
            pairs.append(pair)
    return pairs


def explain_pairs(source: str) -> list[tuple[str, str]]:
    """(question, docstring) for documented functions and classes: prose answers."""
    tree = _parse(source)
    if tree is None:
        return []
    pairs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and 80 <= len(doc) <= 2000 and not node.name.startswith("_"):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                pairs.append((f"What does the Python {kind} `{node.name}` do?", doc.strip()))
    return pairs


def _pair(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str] | None:
    if node.name.startswith("__") and node.name.endswith("__"):
        return None  # "write `__repr__(self)`" is not a request anyone makes
    summary = _summary(ast.get_docstring(node) or "")
    if not summary or node.end_lineno is None:
        return None
    # Whole lines (not ast.get_source_segment, which re-splits the file on every call: minutes
    # for the stdlib), dedented so methods and nested functions start at column 0.
    code = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])).rstrip()
    if len(code) > MAX_ANSWER_CHARS:
        return None
    return request(f"{node.name}({ast.unparse(node.args)})", summary), code


def _summary(docstring: str) -> str:
    """The docstring's first sentence (summaries often wrap onto a second line)."""
    paragraph = " ".join(docstring.strip().split("\n\n", 1)[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def request(signature: str, summary: str) -> str:
    """The user turn: "Write a Python function `f(x)` that returns ..." from "Return ..."."""
    clause = _as_clause(summary)
    if clause is None:
        return f"Write a Python function `{signature}`. Its docstring begins: {summary}"
    return f"Write a Python function `{signature}` that {clause}"


def _as_clause(summary: str) -> str | None:
    """'Return the x.' -> 'returns the x.'; None when the summary does not start with a verb."""
    first, _, rest = summary.partition(" ")
    word = first.lower()
    if not first.isalpha() or not first[0].isupper() or not first[1:].islower():
        return None
    if word in _NOT_VERBS or word.endswith(("ed", "ing", "ly", "ion", "er", "or")):
        return None
    verb = word if word.endswith("s") and not word.endswith("ss") else _third_person(word)
    return f"{verb} {rest}".strip()


def _third_person(verb: str) -> str:
    if verb in _IRREGULAR:
        return _IRREGULAR[verb]
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        return verb + "es"
    if verb.endswith("y") and len(verb) > 1 and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


_TEMPLATE = jinja2.Environment().from_string(CHATML_TEMPLATE)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render with the very template the tokenizer ships, so training and serving agree."""
    return _TEMPLATE.render(messages=messages, add_generation_prompt=add_generation_prompt)


def chat_documents(source: str) -> Iterator[str]:
    for prompt, code in function_pairs(source):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": code}]
        yield render_chat(messages)


def documents(files: Iterable[Path]) -> Iterator[str]:
    """Each file's source, then its chat pairs: the training text, one document at a time."""
    for path in files:
        source = read_source(path)
        yield source
        yield from chat_documents(source)


def tokenize(tokenizer, docs: Iterable[str], batch: int = 256) -> np.ndarray:
    """One uint16 stream of all documents, each followed by <|endoftext|>."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    docs = list(docs)
    chunks = []
    for i in range(0, len(docs), batch):
        for enc in tokenizer.encode_batch(docs[i : i + batch]):
            chunks.append(np.asarray(enc.ids + [eot], dtype=np.uint16))
    return np.concatenate(chunks)


def shuffled(docs: Iterable[str], seed: int) -> list[str]:
    """Documents in a seeded random order, so neighbouring windows mix modules and chat pairs."""
    docs = list(docs)
    order = np.random.default_rng(seed).permutation(len(docs))
    return [docs[i] for i in order]


@dataclass
class Corpus:
    """The shared tokenizer and the train/validation token streams it produced."""

    tokenizer: object  # tokenizers.Tokenizer
    train_tokens: np.ndarray
    val_tokens: np.ndarray
    stats: dict


def build_corpus(vocab_size: int, val_fraction: float, seed: int) -> Corpus:
    """Split the stdlib, train the BPE on the training side only, tokenize both sides.

    The tokenizer never sees validation files, so validation loss measures held-out text.
    """
    files = stdlib_files()
    split = split_files(files, val_fraction)
    train_docs = shuffled(documents(split.train), seed)
    val_docs = list(documents(split.val))
    tokenizer = train_tokenizer(vocab_size, texts=iter(train_docs))
    train_tokens = tokenize(tokenizer, train_docs)
    val_tokens = tokenize(tokenizer, val_docs)
    n_pairs = sum(doc.startswith("<|im_start|>") for doc in train_docs + val_docs)
    stats = {
        "python": platform.python_version(),
        "files": len(files),
        "train_files": len(split.train),
        "val_files": len(split.val),
        "chat_pairs": n_pairs,
        "train_chars": sum(map(len, train_docs)),
        "train_tokens": int(len(train_tokens)),
        "val_tokens": int(len(val_tokens)),
        "vocab_size": tokenizer.get_vocab_size(),
    }
    return Corpus(tokenizer, train_tokens, val_tokens, stats)


def val_tokens_for(tokenizer, val_fraction: float) -> np.ndarray:
    """The validation stream again, for evaluating saved models with their own tokenizer."""
    split = split_files(stdlib_files(), val_fraction)
    return tokenize(tokenizer, documents(split.val))
