"""The draft's training requests: the second pool comes after the first, which stays as it was."""

import random

from server.model_files.training import chat_requests as cr


def _first_pool(seed: int) -> list[str]:
    """The first pool as `requests` made it before the second pool was added."""
    rng = random.Random(seed)
    functions, explains = cr._stdlib_requests()
    families = [functions, cr._module_requests(functions, rng), explains, cr.prose_requests()]
    for family in families:
        rng.shuffle(family)
    out = []
    for i in range(max(map(len, families))):
        out += [family[i] for family in families if i < len(family)]
    return list(dict.fromkeys(out))


def test_the_second_pool_follows_the_first_which_keeps_its_order():
    first, every = _first_pool(0), cr.requests(0)
    assert every[: len(first)] == first  # the answers files and held-out split stay valid
    second = every[len(first):]
    assert second and not set(second) & set(first)
    utility = [r for r in second if r.startswith("Write a Python module with a function `")]
    implement = [r for r in second if r.startswith("Implement `")]
    assert len(utility) + len(implement) == len(second)
    assert second[:2] in ([utility[0], implement[0]], [implement[0], utility[0]])  # interleaved
    functions, _ = cr._stdlib_requests()
    assert implement and set(implement) == set(cr._implement_requests(functions))


def test_second_pool_requests_read_as_the_bench_prompt_does():
    functions = ["Write a Python function `a(x)` that returns x.",
                 "Write a Python function `b(y, z=1)` that adds y and z.",
                 "Write a Python function `c()` that does nothing.",
                 "Write a Python function `d(s)` that splits s.",
                 "Write a Python function `m(self)` that is a method.",  # no method in a module
                 "Write a Python function `e(t)` that trims t."]
    utility = cr._utility_module_requests(functions, random.Random(0))
    assert len(utility) == 1  # a(…) and two utilities take 3; then 2 left, fewer than 4
    assert utility[0].startswith("Write a Python module with a function `")
    assert " and two small utility functions: `" in utility[0]
    assert utility[0].endswith("`. Give each function a docstring and type hints.")
    assert "m(self)" not in utility[0]
    assert cr._implement_requests(functions[:2]) == [
        "Implement `a(x)` in Python: it returns x. Include a docstring, type hints and a short "
        "example of calling it.",
        "Implement `b(y, z=1)` in Python: it adds y and z. Include a docstring, type hints and "
        "a short example of calling it."]
    assert cr.request_names(utility[0]) <= {"a", "b", "c", "d", "e"}
