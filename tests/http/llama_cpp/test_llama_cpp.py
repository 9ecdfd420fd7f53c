"""llama.cpp server's native `POST /completion` (its `/infill` is in test_fim.py): the text
mlx_lm writes for the same prompt, in llama.cpp's answer shape, streamed and not; the prompt as
text (the tokenizer's BOS added, as llama.cpp does) or as token ids."""

from __future__ import annotations

import json

import pytest
from mlx_lm import generate

pytestmark = pytest.mark.anyio
PROMPT = "def add(a, b):"
MAX = 16


async def test_completion_is_mlx_lms_text_in_llama_cpps_shape(client, loaded_pair):
    model, tokenizer, _ = loaded_pair
    tokens = tokenizer.encode(PROMPT)
    expected = generate(model, tokenizer, tokens, max_tokens=MAX)
    for prompt in (PROMPT, tokens):
        r = await client.post("/completion", json={"prompt": prompt, "n_predict": MAX,
                                                   "temperature": 0, "num_draft_tokens": 3,
                                                   "mirostat": 0, "repeat_last_n": 64})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["content"] == expected
        assert (answer["stop"], answer["stop_type"], answer["tokens_predicted"]) == (
            True, "limit", MAX)
        assert answer["tokens_evaluated"] == len(tokens)
        assert answer["stats"]["draft_tokens_proposed"] > 0
    async with client.stream("POST", "/completion", json={
            "prompt": PROMPT, "n_predict": MAX, "temperature": 0, "stream": True}) as s:
        chunks = [json.loads(line[len("data:"):]) async for line in s.aiter_lines()
                  if line.startswith("data:")]
    assert "".join(c["content"] for c in chunks) == expected
    assert chunks[-1]["stop"] is True and all(not c["stop"] for c in chunks[:-1])


async def test_completion_stops_at_a_stop_word_and_refuses_bad_input(client, loaded_pair):
    model, tokenizer, _ = loaded_pair
    text = generate(model, tokenizer, tokenizer.encode(PROMPT), max_tokens=MAX)
    word = text[len(text) // 2:len(text) // 2 + 2]
    r = await client.post("/completion", json={"prompt": PROMPT, "n_predict": MAX,
                                               "temperature": 0, "stop": [word]})
    answer = r.json()
    assert (answer["stop_type"], answer["stopping_word"]) == ("word", word)
    assert answer["content"] == text[:text.index(word)]
    for bad in ({"prompt": ""}, {"prompt": []},
                {"prompt": PROMPT, "stop": list("abcde")},
                {"prompt": [10**9]}, {"prompt": PROMPT, "temperature": "hot"}):
        r = await client.post("/completion", json=bad)
        assert r.status_code == 400, bad
