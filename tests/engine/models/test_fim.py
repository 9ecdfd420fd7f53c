"""Fill in the middle (`suffix` on /v1/completions, `server.engine.fim`; llama.cpp's `/infill`):
the markers of each format, and a tiny pair given Qwen2.5-Coder's markers (and its repository
markers), against `mlx_lm.generate` on the prompt built by hand."""

from __future__ import annotations

import json

import pytest
from mlx_lm import generate, load
from support.servers import served
from support.thinking_model import add_tokens

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


# --- llama.cpp's /infill ---------------------------------------------------------------------
REPO = ("<|repo_name|>", "<|file_sep|>")
EXTRA = [{"filename": "util.py", "text": "def helper():\n    return 1\n"},
         {"text": "x = 2\n"}]


@pytest.fixture(scope="module")
def repo_pair(tiny_pair, tmp_path_factory):
    """Qwen2.5-Coder's markers and its repository-level ones."""
    out = tmp_path_factory.mktemp("repo")
    add_tokens(tiny_pair[0], out / "target", QWEN + REPO)
    add_tokens(tiny_pair[1], out / "draft", QWEN + REPO)
    return out / "target", out / "draft"


def llama_cpp_prompt(tokenizer, prompt="", repo=True) -> list[int]:
    """llama.cpp's format_infill, written out for these inputs (all of them fit)."""
    ids = tokenizer.get_vocab()

    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)
    if repo:
        extra = [ids[REPO[0]], *enc("myproject\n")]
        for chunk in EXTRA:
            extra += [ids[REPO[1]], *enc(chunk.get("filename", "tmp") + "\n"), *enc(chunk["text"])]
        extra += [ids[REPO[1]], *enc("filename\n")]
    else:
        extra = [t for chunk in EXTRA for t in [*enc("\n\n--- snippet ---\n\n"),
                                                *enc(chunk["text"])]]
    return [*extra, ids[QWEN[0]], *enc(PREFIX), *enc(prompt), ids[QWEN[1]], *enc(SUFFIX),
            ids[QWEN[2]]]


@pytest.mark.parametrize("pair", ["repo_pair", "fim_pair"])
async def test_infill_is_mlx_lms_continuation_of_llama_cpps_prompt(pair, request):
    target, draft = request.getfixturevalue(pair)
    model, tokenizer = load(str(target))
    prompt = llama_cpp_prompt(tokenizer, "    lo", repo=pair == "repo_pair")
    expected = generate(model, tokenizer, prompt, max_tokens=MAX)
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA,
            "prompt": "    lo", "n_predict": MAX, "temperature": 0, "n_indent": 4,
            "t_max_predict_ms": 1000}
    async with served(target, draft) as (client, _):
        r = await client.post("/infill", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["content"] == expected and answer["stop"] is True
        assert (answer["tokens_evaluated"], answer["tokens_predicted"]) == (len(prompt), MAX)
        assert answer["stop_type"] == "limit" and answer["timings"]["predicted_n"] == MAX
        async with client.stream("POST", "/infill", json={**body, "stream": True}) as s:
            chunks = [json.loads(line[len("data:"):]) async for line in s.aiter_lines()
                      if line.startswith("data:")]
        assert "".join(c["content"] for c in chunks) == expected
        assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
        assert chunks[-1]["tokens_predicted"] == MAX


async def test_infill_warm_up_fills_the_cache_and_writes_nothing(repo_pair):
    """llama.vim sends its extra context with `n_predict: 0` ahead of the completions that will
    need it: nothing is written, and the next request finds the context in the prefix cache."""
    warm = {"input_prefix": "", "input_suffix": "", "input_extra": EXTRA, "prompt": "",
            "n_predict": 0, "temperature": 0, "cache_prompt": True, "t_max_prompt_ms": 1}
    async with served(*repo_pair) as (client, _):
        r = await client.post("/infill", json=warm)
        assert r.status_code == 200, r.text
        assert (r.json()["content"], r.json()["tokens_predicted"]) == ("", 0)
        async with client.stream("POST", "/infill", json={**warm, "stream": True}) as s:
            chunks = [line for line in [ln async for ln in s.aiter_lines()]
                      if line.startswith("data:")]
        assert len(chunks) == 1 and json.loads(chunks[0][5:])["content"] == ""
        r = await client.post("/infill", json={**warm, "input_prefix": PREFIX, "n_predict": 4})
    tokenizer = load(str(repo_pair[0]))[1]
    shared = llama_cpp_prompt(tokenizer).index(tokenizer.get_vocab()[QWEN[0]]) + 1
    assert r.json()["tokens_cached"] == shared  # the extra context and the prefix marker


async def test_infill_refuses_what_it_cannot_fill(client):
    r = await client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX})
    assert r.status_code == 400 and "<|fim_prefix|>" in r.json()["error"]["message"]
    r = await client.post("/infill", json={"input_extra": [{"text": 3}]})
    assert r.status_code == 400
