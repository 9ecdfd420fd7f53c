"""The draft's training requests: mined from the standard library's source, four families
interleaved in one seeded order."""

import ast
import random

from server.model_files.training import chat_requests as cr

SOURCE = '''
def add(x, y=1):
    """Return the sum of x and y.  Longer text follows."""
    return x + y


def __repr__(self):
    """Return a representation."""


def helper():
    """Internal helper for the parser."""


class Parser:
    """A parser that reads tokens one at a time from a stream and builds a tree of nodes,
    reporting the first error it meets with its line and column."""

    def _hidden(self):
        """Return nothing."""

    def long(self):
        """Compute a table."""
''' + "        x = 1\n" * 400


def test_function_and_explain_requests_follow_the_docstrings():
    tree = ast.parse(SOURCE)
    assert cr.function_requests(tree, SOURCE.splitlines(keepends=True)) == [
        "Write a Python function `add(x, y=1)` that returns the sum of x and y.",
        "Write a Python function `helper()`. Its docstring begins: Internal helper for the "
        "parser.",
        "Write a Python function `_hidden(self)` that returns nothing."]  # no dunder, too long
    assert cr.explain_requests(tree) == ["What does the Python class `Parser` do?"]
    assert [cr._as_clause(s) for s in ("Do it.", "Copy a file.", "Push x.", "Parsed text.")] == [
        "does it.", "copies a file.", "pushes x.", None]


def test_the_families_interleave_in_a_seeded_order():
    every = cr.requests(0)
    assert len(every) == len(set(every)) and every == cr.requests(0) != cr.requests(1)
    functions, explains = cr._stdlib_requests()
    modules = cr._module_requests(functions, random.Random(0))
    families = [set(functions), set(modules), set(explains), set(cr.prose_requests())]
    assert [next(i for i, f in enumerate(families) if r in f) for r in every[:8]] == [
        0, 1, 2, 3, 0, 1, 2, 3]
    assert len(cr.prose_requests()) == len(cr.TOPICS) * len(cr.PROSE_TEMPLATES)
    assert modules[0].startswith("Write a Python module with t")


def test_the_held_out_files_are_chosen_by_a_hash_of_their_path(tmp_path):
    files = [tmp_path / f"m{i}.py" for i in range(40)]
    kept = cr.training_files(files, root=tmp_path)
    assert len(kept) == 38 and cr.training_files(files[::-1], root=tmp_path) == kept[::-1]
