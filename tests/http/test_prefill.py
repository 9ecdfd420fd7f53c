"""Continuing a final assistant message (an assistant prefill): vLLM's `continue_final_message`
on chat completions and `/tokenize`, and Anthropic's final assistant message, against the
template rendered by `mlx_lm` with `continue_final_message` and `mlx_lm.generate`."""

from __future__ import annotations

import anthropic
import pytest
from mlx_lm import generate

pytestmark = pytest.mark.anyio
MAX = 16
PREFILL = "def binary_search(items"
MESSAGES = [{"role": "user", "content": "Write a function"},
            {"role": "assistant", "content": PREFILL}]


def continued(tokenizer) -> list[int]:
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False,
                                         continue_final_message=True)


def expected_text(loaded_pair) -> str:
    target, tokenizer, _ = loaded_pair
    return generate(target, tokenizer, continued(tokenizer), max_tokens=MAX)


async def test_the_prompt_ends_with_the_prefill_and_the_reply_continues_it(client, loaded_pair):
    tokenizer = loaded_pair[1]
    r = await client.post("/tokenize", json={"messages": MESSAGES,
                                             "continue_final_message": True})
    assert r.json()["tokens"] == continued(tokenizer)
    assert tokenizer.decode(r.json()["tokens"]).endswith(PREFILL)
    new_turn = (await client.post("/tokenize", json={"messages": MESSAGES})).json()["tokens"]
    assert new_turn != continued(tokenizer)  # by default the assistant starts a new turn
    expected = expected_text(loaded_pair)
    for extra in ({"num_draft_tokens": 3}, {"use_draft": False}, {"stream": True}):
        body = {"messages": MESSAGES, "max_tokens": MAX, "temperature": 0,
                "continue_final_message": True, **extra}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if extra.get("stream"):
            assert "".join(line for line in _deltas(r.text)) == expected
        else:
            assert r.json()["choices"][0]["message"]["content"] == expected
            assert r.json()["usage"]["prompt_tokens"] == len(continued(tokenizer))


def _deltas(sse: str):
    import json

    for line in sse.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    yield choice["delta"]["content"]


@pytest.mark.parametrize("body, message", [
    ({"messages": MESSAGES[:1], "continue_final_message": True}, "final assistant message"),
    ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
     "cannot both be true"),
])
async def test_what_cannot_be_continued_is_a_400(client, body, message):
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_anthropics_prefill_through_its_sdk(live_server, loaded_pair):
    client = anthropic.Anthropic(base_url=live_server, api_key="unused", max_retries=0)
    message = client.messages.create(model="", max_tokens=MAX, messages=MESSAGES,
                                     extra_body={"temperature": 0})
    assert message.content[0].text == expected_text(loaded_pair)
    count = client.messages.count_tokens(model="", messages=MESSAGES)
    assert count.input_tokens == len(continued(loaded_pair[1]))
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        client.messages.create(model="", max_tokens=MAX, messages=[
            MESSAGES[0], {"role": "assistant", "content": PREFILL + " "}])
