"""The chat requests a draft's training data answers: code, questions and prose, all made here.

A draft is accepted as often as it predicts what the target writes, on what users ask. The first
pool is four families, interleaved in one seeded order so that any prefix of it mixes them:

- **function**: a documented function of the standard library's training files, asked for by
  its signature and docstring summary (`corpus.function_pairs`);
- **module**: two or three of those functions asked for at once, as one module with docstrings
  and type hints;
- **explain**: a documented function or class asked about (`corpus.explain_pairs`);
- **prose**: everyday topics under prose templates (reflections, advice, explanations,
  stories, letters), from the lists below.

A second pool follows the first in the order (so the first's order, and the held-out split
taken from it, never change), two more code families over the same functions:

- **utility module**: one function asked for by its signature and summary and two or three
  more by their signatures alone, as "small utility functions" of one module (the shape of the
  benchmark's `structured` prompt, `server.bench.cells`);
- **implement**: each function request worded another way, with a usage example asked for.

Only the requests are made here; the answers are the target's own (`target_answers`).
"""

from __future__ import annotations

import random
import re

from server.model_files.tokenizer_builder import stdlib_files
from server.model_files.training.corpus import (
    explain_pairs,
    function_pairs,
    read_source,
    split_files,
)

VAL_FRACTION = 0.05  # the stdlib files no training here sees (corpus.split_files)

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

# Topics for measuring only (`eval_prose_requests`), none of them in TOPICS.
EVAL_TOPICS = (
    "a first day at school", "learning to bake pies", "a lighthouse keeper's week",
    "choosing a second-hand car", "a year without travel", "writing a song", "a street parade",
    "a broken umbrella", "visiting a zoo", "moving to the countryside",
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
UTILITY_MODULE_REQUEST = ("Write a Python module with a function `{sig}` that {what}, and {n} "
                          "small utility functions: {utilities}. Give each function a docstring "
                          "and type hints.")
IMPLEMENT_REQUEST = ("Implement `{sig}` in Python: it {what}. Include a docstring, type hints "
                     "and a short example of calling it.")


def requests(seed: int) -> list[str]:
    """Every request in a seeded order: the first pool's four families interleaved, then the
    second pool's two."""
    rng = random.Random(seed)
    functions, explains = _stdlib_requests()
    first = _interleaved([functions, _module_requests(functions, rng), explains,
                          prose_requests()], rng)
    second = _interleaved([_utility_module_requests(functions, rng),
                           _implement_requests(functions)], rng)
    return list(dict.fromkeys(first + second))


def _interleaved(families: list[list[str]], rng: random.Random) -> list[str]:
    """Each family shuffled, then one of each in turn until all run out."""
    for family in families:
        rng.shuffle(family)
    out = []
    for i in range(max(map(len, families))):
        out += [family[i] for family in families if i < len(family)]
    return out


def _stdlib_requests() -> tuple[list[str], list[str]]:
    functions, explains = [], []
    for path in split_files(stdlib_files(), VAL_FRACTION).train:
        source = read_source(path)
        functions += [q for q, _ in function_pairs(source)]
        explains += [q for q, _ in explain_pairs(source)]
    return sorted(set(functions)), sorted(set(explains))


_FUNCTION_REQUEST = re.compile(r"^Write a Python function `(?P<sig>[^`]+)` that (?P<what>.+)$")


def _short_functions(function_requests: list[str]) -> list[tuple[str, str]]:
    """(signature, what it does) of the function requests with a short signature, no method."""
    return [(m["sig"], m["what"].rstrip(".")) for m in map(_FUNCTION_REQUEST.match,
                                                          function_requests)
            if m and len(m["sig"]) < 60 and "(self" not in m["sig"]]


def _module_requests(function_requests: list[str], rng: random.Random) -> list[str]:
    """Two or three function requests ("`f(x)` that returns ...") joined into one module."""
    parts = [f"`{sig}` that {what}" for sig, what in _short_functions(function_requests)]
    rng.shuffle(parts)
    out, i = [], 0
    while i + 3 <= len(parts):
        n = 2 + i % 2
        out.append(MODULE_REQUEST.format(n=("two", "three")[n - 2],
                                         items="; ".join(parts[i: i + n])))
        i += n
    return out


def _utility_module_requests(function_requests: list[str], rng: random.Random) -> list[str]:
    """One function by signature and summary, two or three more by signature alone."""
    functions = _short_functions(function_requests)
    rng.shuffle(functions)
    out, i = [], 0
    while i + 4 <= len(functions):
        n = 2 + i % 2
        (sig, what), utilities = functions[i], [f"`{s}`" for s, _ in functions[i + 1: i + 1 + n]]
        out.append(UTILITY_MODULE_REQUEST.format(
            sig=sig, what=what, n=("two", "three")[n - 2],
            utilities=", ".join(utilities[:-1]) + " and " + utilities[-1]))
        i += n + 1
    return out


def _implement_requests(function_requests: list[str]) -> list[str]:
    """Each function request ("Write a Python function `f(x)` that ...") worded another way."""
    return [IMPLEMENT_REQUEST.format(sig=m["sig"], what=m["what"].rstrip("."))
            for m in map(_FUNCTION_REQUEST.match, function_requests) if m]


def request_names(request: str) -> set[str]:
    """The functions and classes a request names: each backticked name, without its arguments
    (a function asked for in one request and explained in another is named by both)."""
    return {name.split("(")[0] for name in re.findall(r"`([^`]+)`", request)}


def prose_requests(topics: tuple[str, ...] = TOPICS) -> list[str]:
    """The prose family: every topic under every prose template."""
    return [t.format(topic=topic) for topic in topics for t in PROSE_TEMPLATES]


def eval_prose_requests() -> list[str]:
    """Prose requests on topics no training request uses (`EVAL_TOPICS`): the held-out answers
    are the last 5% of `requests`, where only code requests are left, so prose is measured on
    these."""
    return prose_requests(EVAL_TOPICS)
