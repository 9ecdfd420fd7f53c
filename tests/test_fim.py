"""Fill in the middle (`suffix` on /v1/completions, `server.engine.fim`): the markers of each
format, and a tiny pair given Qwen2.5-Coder's markers, against `mlx_lm.generate` on the prompt
built by hand."""

from __future__ import annotations

import pytest
from conftest import served
from mlx_lm import generate, load
from thinking_model import add_tokens

from server.engine.fim import FimFormat

pytestmark = pytest.mark.anyio
QWEN = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
PREFIX = "def binary_search(items, x):\n    lo, hi = 0, len(items)\n"
SUFFIX = "\n    return lo\n\nprint(binary_search([1, 2, 3], 2))\n"
MAX = 24


@pytest.fixture(scope="module")
def fim_pair(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("fim")
    add_tokens(tiny_pair[0], out / "target", QWEN)
    add_tokens(tiny_pair[1], out / "draft", QWEN)
    return out / "target", out / "draft"


class Vocab:
    """A tokenizer's face as FimFormat sees it."""

    def __init__(self, names, bos=None):
        self.vocab = {name: 100 + i for i, name in enumerate(names)}
        self.bos_token_id = bos

    def get_vocab(self):
        return self.vocab

    def encode(self, text):
        return [self.bos_token_id, 5] if self.bos_token_id is not None else [5]


@pytest.mark.parametrize("names, bos, expected", [
    (QWEN, None, [100, 1, 2, 101, 3, 102]),
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), None, [100, 1, 2, 101, 3, 102]),
    (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), 0, [0, 100, 1, 2, 101, 3, 102]),
    (("[PREFIX]", "[SUFFIX]"), 1, [1, 101, 3, 100, 1, 2]),  # Codestral: suffix first
])
def test_each_format_orders_the_prompt_its_way(names, bos, expected):
    fim = FimFormat.of(Vocab(names, bos))
    assert fim.prompt([1, 2], [3]) == expected


def test_a_model_without_markers_has_no_format(loaded_pair):
    assert FimFormat.of(loaded_pair[1]) is None
    assert FimFormat.of(Vocab(QWEN[:2])) is None  # all of a format's markers, or none


async def test_the_middle_is_mlx_lms_continuation_of_the_fim_prompt(fim_pair):
    model, tokenizer = load(str(fim_pair[0]))
    ids = tokenizer.get_vocab()
    prompt = [ids[QWEN[0]], *tokenizer.encode(PREFIX, add_special_tokens=False),
              ids[QWEN[1]], *tokenizer.encode(SUFFIX, add_special_tokens=False), ids[QWEN[2]]]
    expected = generate(model, tokenizer, prompt, max_tokens=MAX)
    async with served(*fim_pair) as (client, _):
        for extra in ({"num_draft_tokens": 3}, {"draft": "prompt_lookup"}, {"use_draft": False}):
            body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": MAX, "temperature": 0,
                    **extra}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == expected, extra
            assert r.json()["usage"]["prompt_tokens"] == len(prompt)
        as_ids = {"prompt": tokenizer.encode(PREFIX, add_special_tokens=False),
                  "suffix": SUFFIX, "max_tokens": MAX, "temperature": 0}
        r = await client.post("/v1/completions", json=as_ids)
        assert r.json()["choices"][0]["text"] == expected
        r = await client.post("/v1/completions", json={"prompt": "", "suffix": SUFFIX,
                                                       "max_tokens": 4})
        assert r.status_code == 200, r.text  # the cursor at the top of the file


async def test_what_cannot_fill_a_middle_is_a_400(client):
    r = await client.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "<|fim_prefix|>" in r.json()["error"]["message"]
    r = await client.post("/v1/completions",
                          json={"prompt": PREFIX, "suffix": SUFFIX, "echo": True})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]
    for empty in ("", [], [""]):
        r = await client.post("/v1/completions", json={"prompt": empty})
        assert r.status_code == 400, empty
