"""The chat requests the draft's training answers answer: code, questions and prose, made here.

A draft is accepted as often as it predicts what the target writes, on what users ask. The
requests are four families, interleaved in one seeded order so that any prefix of it mixes them:

- **function**: a documented function of the Python standard library's training files, asked
  for by its signature and docstring summary;
- **module**: two or three of those functions asked for at once, as one module with docstrings
  and type hints;
- **explain**: a documented function or class asked about;
- **prose**: everyday topics under prose templates (reflections, advice, stories, letters).

The standard library ships with every Python, so the requests need no download. Only the
requests are made here; the answers are the target's own (`target_answers`).
"""

from __future__ import annotations

import ast
import hashlib
import math
import random
import re
import textwrap
import warnings
from functools import cache
from pathlib import Path

from server.model_files.tokenizer_builder import stdlib_dir, stdlib_files

VAL_FRACTION = 0.05  # the stdlib files whose functions no request asks about
MAX_CODE_CHARS = 3000  # functions longer than this are mostly tables or state machines

TOPICS = (
    "learning a new language", "cooking for friends", "moving to a new city", "keeping a "
    "garden", "reading before bed", "walking in the rain", "saving money", "starting a new job",
    "teaching a child to ride a bicycle", "living with a roommate", "running a first marathon",
    "writing letters by hand", "visiting grandparents", "learning to play the piano",
    "a long train journey", "working from home", "volunteering at a food bank",
    "keeping a journal", "camping in the mountains", "baking bread", "adopting a dog",
    "quitting social media for a month", "fixing an old bicycle", "a morning routine",
    "making new friends as an adult", "public speaking", "getting enough sleep",
    "a rainy weekend at home", "painting with watercolors", "planning a small wedding",
    "traveling alone", "living near the sea", "growing tomatoes on a balcony",
    "learning from mistakes", "a conversation with a stranger", "moving back home",
    "taking up photography", "the first snow of winter", "a family dinner",
    "retiring after forty years", "studying for an exam", "a power outage", "riding the bus",
    "a small bookshop", "being a beginner again", "a neighbourhood market",
    "keeping houseplants alive", "the end of summer", "helping a friend move",
    "knitting a scarf", "waiting at an airport", "a job interview", "learning to swim",
    "forgiving someone", "keeping a promise", "a school reunion", "sharing a meal",
    "slowing down", "being bored", "finishing a hard project", "asking for help",
    "a walk in the forest", "losing a game", "building a bookshelf", "a quiet library",
    "raising chickens", "repairing clothes", "learning to cook rice", "a summer job",
    "living without a car", "watching the sunrise", "an old photograph", "a lost wallet",
    "working night shifts", "coaching a children's football team", "a snow day",
    "learning to drive", "living in a small apartment", "a favourite teacher",
    "music while working", "cleaning out a closet", "making coffee", "a day at the museum",
    "being a good listener", "trying a new recipe", "writing a first program",
    "a broken phone", "an unexpected detour", "a bakery at dawn", "saying no politely",
    "the value of routine", "a birthday party", "a village festival", "sorting old letters",
    "caring for an elderly parent", "staying curious", "a hiking trail", "patience",
    "kindness at work", "a thunderstorm", "learning chess", "living abroad",
)

PROSE_TEMPLATES = (
    "Write a short reflection on {topic}. Use a few paragraphs of plain prose.",
    "What have people learned from {topic}? Answer in plain prose.",
    "Give some practical advice about {topic}.",
    "Explain to a friend why {topic} can matter more than it seems.",
    "Write a short story about {topic}.",
    "Describe {topic} for someone who has never experienced it.",
    "Write a letter to a younger sibling about {topic}.",
    "What are the pleasures and difficulties of {topic}? Write a few paragraphs.",
    "Write a blog post about {topic}, in a warm and personal tone.",
    "Summarize what someone should know about {topic}.",
)

MODULE_REQUEST = ("Write a Python module with {n} functions: {items}. Give each function a "
                  "docstring and type hints.")

# First words of docstring summaries that are not verbs ("The ...", "Internal helper ...").
_NOT_VERBS = frozenset(
    "a an the this these that it its if in on for of to as with when while used internal "
    "helper private deprecated convenience abstract same like alias note see default "
    "called given new base simple compatibility backward backwards".split())
_IRREGULAR = {"do": "does", "go": "goes", "be": "is", "have": "has", "undo": "undoes"}


def requests(seed: int = 0) -> list[str]:
    """Every request, the four families interleaved in a seeded order."""
    rng = random.Random(seed)
    functions, explains = _stdlib_requests()
    families = [list(functions), _module_requests(functions, rng), list(explains),
                prose_requests()]
    for family in families:
        rng.shuffle(family)
    out = []
    for i in range(max(map(len, families))):
        out += [family[i] for family in families if i < len(family)]
    return list(dict.fromkeys(out))


def prose_requests() -> list[str]:
    """The prose family: every topic under every prose template."""
    return [t.format(topic=topic) for topic in TOPICS for t in PROSE_TEMPLATES]


@cache
def _stdlib_requests() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(function requests, explain requests) of the stdlib's training files, sorted."""
    functions, explains = set(), set()
    for path in training_files(stdlib_files()):
        source = path.read_text(encoding="utf-8", errors="replace")
        tree = _parse(source)
        if tree is not None:
            functions |= set(function_requests(tree, source.splitlines(keepends=True)))
            explains |= set(explain_requests(tree))
    return tuple(sorted(functions)), tuple(sorted(explains))


def training_files(files: list[Path], root: Path | None = None) -> list[Path]:
    """All but the VAL_FRACTION of files whose path (relative to the stdlib) hashes lowest: the
    same split on every machine, whatever modules another Python adds or drops."""
    root = root or stdlib_dir()

    def key(path: Path) -> str:
        rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
        return hashlib.sha1(rel.encode()).hexdigest()

    held_out = set(sorted(files, key=key)[: max(1, math.ceil(len(files) * VAL_FRACTION))])
    return [p for p in files if p not in held_out]


def _parse(source: str) -> ast.Module | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old modules
        try:
            return ast.parse(source)
        except (SyntaxError, ValueError):
            return None


def function_requests(tree: ast.Module, lines: list[str]) -> list[str]:
    """"Write a Python function `f(x)` that returns ..." for each documented function or
    method (not dunder) whose docstring has a summary and whose source is not too long."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                node.name.startswith("__") and node.name.endswith("__")):
            continue
        summary = _summary(ast.get_docstring(node) or "")
        if not summary or node.end_lineno is None or _code_chars(node, lines) > MAX_CODE_CHARS:
            continue
        signature, clause = f"{node.name}({ast.unparse(node.args)})", _as_clause(summary)
        out.append(f"Write a Python function `{signature}`. Its docstring begins: {summary}"
                   if clause is None else f"Write a Python function `{signature}` that {clause}")
    return out


def _code_chars(node: ast.AST, lines: list[str]) -> int:
    """The length of the function's whole lines, dedented (trailing space stripped)."""
    return len(textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno])).rstrip())


def explain_requests(tree: ast.Module) -> list[str]:
    """"What does the Python function `f` do?" for documented public functions and classes."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and 80 <= len(doc) <= 2000 and not node.name.startswith("_"):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append(f"What does the Python {kind} `{node.name}` do?")
    return out


def _summary(docstring: str) -> str:
    """The docstring's first sentence (summaries often wrap onto a second line)."""
    paragraph = " ".join(docstring.strip().split("\n\n", 1)[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]


def _as_clause(summary: str) -> str | None:
    """'Return the x.' -> 'returns the x.'; None when the summary does not start with a verb."""
    first, _, rest = summary.partition(" ")
    word = first.lower()
    if not first.isalpha() or not first[0].isupper() or not first[1:].islower():
        return None
    if word in _NOT_VERBS or word.endswith(("ed", "ing", "ly", "ion", "er", "or")):
        return None
    if word.endswith("s") and not word.endswith("ss"):
        verb = word
    elif word in _IRREGULAR:
        verb = _IRREGULAR[word]
    elif word.endswith(("s", "sh", "ch", "x", "z")):
        verb = word + "es"
    elif word.endswith("y") and len(word) > 1 and word[-2] not in "aeiou":
        verb = word[:-1] + "ies"
    else:
        verb = word + "s"
    return f"{verb} {rest}".strip()


_FUNCTION_REQUEST = re.compile(r"^Write a Python function `(?P<sig>[^`]+)` that (?P<what>.+)$")


def _module_requests(function_requests: tuple[str, ...], rng: random.Random) -> list[str]:
    """Two or three function requests with a short signature (no method) joined into one."""
    parts = [f"`{m['sig']}` that {m['what'].rstrip('.')}"
             for m in map(_FUNCTION_REQUEST.match, function_requests)
             if m and len(m["sig"]) < 60 and "(self" not in m["sig"]]
    rng.shuffle(parts)
    out, i = [], 0
    while i + 3 <= len(parts):
        n = 2 + i % 2
        out.append(MODULE_REQUEST.format(n=("two", "three")[n - 2],
                                         items="; ".join(parts[i: i + n])))
        i += n
    return out
