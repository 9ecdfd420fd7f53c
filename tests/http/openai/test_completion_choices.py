"""`/v1/completions` with `echo` and prompt logprobs (the way lm-evaluation-harness scores
continuations), several prompts per request, and `n` choices per prompt: against the target's
own forward pass, requests of one choice each, and the `openai` SDK."""

from __future__ import annotations

import math

import mlx.core as mx
import openai
import pytest
from support.http import read_sse

pytestmark = pytest.mark.anyio

TEXT = "/v1/completions"
CHAT = "/v1/chat/completions"


def reference_logprobs(loaded_pair, tokens: list[int]) -> mx.array:
    """(len(tokens) - 1, V): the target's log-probabilities at each position but the last,
    from one forward over the whole prompt."""
    target = loaded_pair[0]
    logits = target(mx.array(tokens)[None])[0, :-1].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def long_prompt(loaded_pair, length=300) -> list[int]:
    """A prompt of `length` token ids, longer than a prefill chunk (128)."""
    ids = loaded_pair[1].encode("def binary_search(items, target):\n    low, high = 0, len(")
    return (ids * (length // len(ids) + 1))[:length]


async def test_echo_scores_every_prompt_token_as_the_target_does(client, loaded_pair):
    tokens = long_prompt(loaded_pair)
    r = await client.post(TEXT, json={"prompt": tokens, "echo": True, "logprobs": 3,
                                      "max_tokens": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == loaded_pair[1].decode(tokens)
    assert choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(tokens)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    ref = reference_logprobs(loaded_pair, tokens)
    expected = mx.take_along_axis(ref, mx.array(tokens[1:])[:, None], axis=-1)[:, 0].tolist()
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=2e-3)
    top3 = mx.sort(ref, axis=-1)[:, ::-1][:, :3].tolist()
    for got, want in zip(logprobs["top_logprobs"][1:], top3, strict=True):
        assert 1 <= len(got) <= 3  # fewer when two ids decode to the same text
        assert max(got.values()) == pytest.approx(want[0], abs=2e-3)
        assert all(any(abs(v - w) < 2e-3 for w in want) for v in got.values())
    # A token that is the most likely one has exactly the top value (lm-eval's greedy test).
    greedy = mx.argmax(ref, axis=-1).tolist()
    for i, (tok, best) in enumerate(zip(tokens[1:], greedy, strict=True)):
        if tok == best:
            assert logprobs["token_logprobs"][i + 1] == max(logprobs["top_logprobs"][i + 1]
                                                            .values())
    assert r.json()["usage"] == {"prompt_tokens": len(tokens), "completion_tokens": 0,
                                 "total_tokens": len(tokens),
                                 "prompt_tokens_details": {"cached_tokens": 0}}


async def test_echo_then_generation_equals_the_plain_request(client, loaded_pair):
    prompt = "def binary_search("
    plain = (await client.post(TEXT, json={"prompt": prompt, "max_tokens": 6, "logprobs": 2,
                                           "temperature": 0})).json()["choices"][0]
    r = await client.post(TEXT, json={"prompt": prompt, "max_tokens": 6, "logprobs": 2,
                                      "temperature": 0, "echo": True})
    echoed = r.json()["choices"][0]
    assert echoed["text"] == prompt + plain["text"]
    n = len(loaded_pair[1].encode(prompt))
    lp = echoed["logprobs"]
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(plain["logprobs"]["token_logprobs"],
                                                     abs=1e-4)
    assert lp["text_offset"][n:] == [o + len(prompt) for o in plain["logprobs"]["text_offset"]]
    assert lp["text_offset"][:n] == sorted(lp["text_offset"][:n])
    # The generation reused the scoring's prefill: one prompt token left to prefill.
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1

    async with client.stream("POST", TEXT, json={"prompt": prompt, "max_tokens": 6,
                                                 "logprobs": 2, "temperature": 0,
                                                 "echo": True, "stream": True}) as s:
        chunks = [c for c in await read_sse(s) if isinstance(c, dict)]
    assert chunks[0]["choices"][0]["text"] == prompt
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == lp["tokens"][:n]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == echoed["text"]
    offsets = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]


def test_lm_eval_loglikelihood_request_through_the_sdk(live_server, loaded_pair):
    """lm-evaluation-harness's `local-completions` payload for loglikelihood (token ids, a
    batch of two, `echo`, `logprobs: 1`, `max_tokens: 1`), read as it reads it."""
    tokenizer = loaded_pair[1]
    context = tokenizer.encode("The capital of France is")
    continuations = [tokenizer.encode(" Paris"), tokenizer.encode(" a large city")]
    prompts = [context + c for c in continuations]
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="", prompt=prompts, temperature=0, max_tokens=1,
                                    logprobs=1, seed=1234, echo=True)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, tokens in zip(sorted(out.choices, key=lambda c: c.index), prompts, strict=True):
        got = sum(choice.logprobs.token_logprobs[len(context):-1])
        ref = reference_logprobs(loaded_pair, tokens)
        want = sum(ref[i - 1, tokens[i]].item() for i in range(len(context), len(tokens)))
        assert got == pytest.approx(want, abs=2e-3)
        assert len(choice.logprobs.token_logprobs) == len(tokens) + 1
        assert choice.text.startswith(tokenizer.decode(tokens))
    assert out.usage.prompt_tokens == sum(map(len, prompts))
    assert out.usage.completion_tokens == 2


async def test_several_prompts_each_equal_their_own_request(client):
    prompts = ["def binary_search(", "class Stack:", "import numpy as"]
    singles = [(await client.post(TEXT, json={"prompt": p, "max_tokens": 8,
                                              "temperature": 0})).json() for p in prompts]
    r = await client.post(TEXT, json={"prompt": prompts, "max_tokens": 8, "temperature": 0})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert body["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert body["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"]
                                                     for s in singles)
    assert body["stats"] is None
    assert all(c["stats"]["generation_tokens"] == 8 for c in body["choices"])


async def test_n_seeded_choices_equal_requests_seeded_one_up(client):
    base = {"prompt": "def binary_search(", "max_tokens": 10, "temperature": 1.0, "seed": 7}
    r = await client.post(TEXT, json={**base, "n": 3})
    texts = [c["text"] for c in r.json()["choices"]]
    singles = [(await client.post(TEXT, json={**base, "seed": 7 + j})).json()["choices"][0]
               ["text"] for j in range(3)]
    assert texts == singles
    assert len(set(texts)) > 1  # different seeds, different samples
    stats = [c["stats"] for c in r.json()["choices"]]
    prompt = stats[0]["prompt_tokens"]
    assert [s["cached_tokens"] for s in stats[1:]] == [prompt - 1, prompt - 1]
    assert r.json()["usage"]["prompt_tokens"] == prompt


async def test_n_streamed_chat_choices_interleave_and_close_each(client):
    body = {"messages": [{"role": "user", "content": "Write a function"}], "max_tokens": 12,
            "temperature": 0, "n": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", CHAT, json=body) as s:
        assert s.status_code == 200
        chunks = [c for c in await read_sse(s) if isinstance(c, dict)]
    whole = (await client.post(CHAT, json={**body, "stream": False})).json()
    texts, finished = {}, {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content")
                                                                   or "")
        if choice["finish_reason"]:
            finished[choice["index"]] = c["stats"]["generation_tokens"]
    assert sorted(texts) == [0, 1, 2] and finished == {0: 12, 1: 12, 2: 12}
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert len({c["id"] for c in chunks}) == 1
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 36
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_n_through_the_sdk(live_server):
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5,
        temperature=0.8, seed=3, logprobs=True, top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert len(c.logprobs.content) == 5
        assert all(math.isfinite(t.logprob) for t in c.logprobs.content)
    assert out.usage.completion_tokens == 10


async def test_cancelling_a_streamed_n_request_frees_every_row(client, engine):
    import asyncio

    body = {"prompt": "def binary_search(", "max_tokens": 400, "n": 3, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", TEXT, json=body) as s:
        async for _ in s.aiter_lines():
            break
    for _ in range(100):
        if engine.batch_size == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.batch_size == 0


async def test_n_forced_tool_calls_each_parse(client):
    """Each choice has its own grammar and tool-call parser."""
    tools = [{"type": "function", "function": {
        "name": "ping", "parameters": {"type": "object", "properties": {},
                                       "additionalProperties": False}}}]
    body = {"messages": [{"role": "user", "content": "Ping?"}], "tools": tools,
            "tool_choice": "required", "parallel_tool_calls": False, "n": 3,
            "temperature": 0.7, "seed": 11, "max_tokens": 100}
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for c in choices:
        assert c["finish_reason"] == "tool_calls"
        (call,) = c["message"]["tool_calls"]
        assert call["function"] == {"name": "ping", "arguments": "{}"}
    assert len({c["message"]["tool_calls"][0]["id"] for c in choices}) == 3
