"""A thinking model's reasoning, apart from its answer, in all three APIs: chat completions
(`reasoning` / `reasoning_content`), Responses (a reasoning item) and Messages (a thinking
block); against the raw text `mlx_lm` generates, split at `</think>`, and through the
official SDKs."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from mlx_lm import generate, load
from support.http import read_sse
from support.servers import make_settings, served, started_engine, uvicorn_thread
from support.thinking_model import CLOSES_AT, PROMPT

pytestmark = pytest.mark.anyio

MAX = 24
USER = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def reference(thinking_pair):
    """(tokenizer, prompt tokens, reasoning, answer): what mlx_lm writes for PROMPT, split
    where it closes its reasoning."""
    model, tokenizer = load(str(thinking_pair[0]))
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    raw = generate(model, tokenizer, prompt, max_tokens=MAX)
    reasoning, answer = raw.split("</think>", 1)
    assert reasoning and answer and "<think>" not in raw
    return tokenizer, prompt, reasoning, answer


@pytest.fixture(scope="module")
def thinking_engine(thinking_pair):
    with started_engine(*thinking_pair) as engine:
        yield engine


@pytest.fixture()
async def client(thinking_engine, thinking_pair):
    import httpx

    from server.http.app import create_app

    app = create_app(make_settings(*thinking_pair), thinking_engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def live(thinking_engine, thinking_pair):
    """The thinking pair's app served by uvicorn (for the anthropic SDK): its URL."""
    from server.http.app import create_app

    with uvicorn_thread(create_app(make_settings(*thinking_pair), thinking_engine)) as url:
        yield url


def chat(**extra) -> dict:
    return {"messages": USER, "max_tokens": MAX, "temperature": 0, **extra}


@pytest.mark.parametrize("k", [0, 4])
async def test_chat_splits_reasoning_from_the_answer(client, reference, k):
    _, _, reasoning, answer = reference
    r = await client.post("/v1/chat/completions", json=chat(num_draft_tokens=k))
    message = r.json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == reasoning
    assert message["content"] == answer
    async with client.stream("POST", "/v1/chat/completions",
                             json=chat(num_draft_tokens=k, stream=True)) as s:
        chunks = [c for c in await read_sse(s) if isinstance(c, dict)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == answer
    assert deltas[0]["role"] == "assistant"


async def test_a_reply_cut_inside_its_reasoning_has_no_answer(client, reference):
    r = await client.post("/v1/chat/completions", json=chat(max_tokens=2))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None
    assert reference[2].startswith(choice["message"]["reasoning"])


@pytest.mark.parametrize("extra", [{"reasoning_effort": "none"},
                                   {"chat_template_kwargs": {"enable_thinking": False}}])
async def test_thinking_turned_off_through_the_template(client, thinking_pair, extra):
    model, tokenizer = load(str(thinking_pair[0]))
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True,
                                           enable_thinking=False)
    expected = generate(model, tokenizer, prompt, max_tokens=MAX)
    r = await client.post("/v1/chat/completions", json=chat(**extra))
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
    tokens = await client.post("/tokenize", json={"messages": USER, **extra}) \
        if "chat_template_kwargs" in extra else None
    if tokens is not None:
        assert tokens.json()["tokens"] == prompt


async def test_an_earlier_turn_reasoning_reaches_the_template(client, reference):
    tokenizer = reference[0]
    history = USER + [{"role": "assistant", "content": "Sunny.", "reasoning": "It is June."},
                      {"role": "user", "content": "And tomorrow?"}]
    rendered = tokenizer.apply_chat_template(
        [{**m, "reasoning_content": m.pop("reasoning")} if "reasoning" in m else m
         for m in [dict(m) for m in history]], add_generation_prompt=True)
    r = await client.post("/tokenize", json={"messages": history})
    assert r.json()["tokens"] == rendered
    assert "It is June." in tokenizer.decode(rendered)


@pytest.mark.parametrize("bad", [{"tokenize": False}, {"add_generation_prompt": False},
                                 {"tools": []}])
async def test_reserved_template_kwargs_are_400(client, bad):
    r = await client.post("/v1/chat/completions", json=chat(chat_template_kwargs=bad))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "chat_template_kwargs"


async def test_responses_reasoning_item_through_the_sdk(client, reference):
    _, _, reasoning, answer = reference
    sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=client)
    response = await sdk.responses.create(model="", input=PROMPT, max_output_tokens=MAX,
                                          temperature=0)
    item, message = response.output
    assert item.type == "reasoning" and item.content[0].text == reasoning
    assert message.type == "message" and response.output_text == answer
    assert response.usage.output_tokens_details.reasoning_tokens == CLOSES_AT
    events = [e async for e in await sdk.responses.create(
        model="", input=PROMPT, max_output_tokens=MAX, temperature=0, stream=True)]
    kinds = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") \
        == reasoning
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == reasoning
    off = await sdk.responses.create(model="", input=PROMPT, max_output_tokens=MAX,
                                     temperature=0, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"]


async def test_responses_reasoning_goes_back_with_the_next_turn(client, reference):
    """A stateless client sends the reasoning item back: the template renders it on the
    assistant turn after it (the test template keeps every turn's reasoning)."""
    sdk = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=client)
    first = await sdk.responses.create(model="", input=PROMPT, max_output_tokens=MAX,
                                       temperature=0, store=False)
    items = [{"role": "user", "content": PROMPT}] + \
        [o.model_dump(exclude_none=True) for o in first.output] + \
        [{"role": "user", "content": "And tomorrow?"}]
    counted = await client.post("/v1/responses/input_tokens", json={"input": items})
    history = USER + [{"role": "assistant", "content": reference[3],
                       "reasoning_content": reference[2]},
                      {"role": "user", "content": "And tomorrow?"}]
    rendered = reference[0].apply_chat_template(history, add_generation_prompt=True)
    assert counted.json()["input_tokens"] == len(rendered)


async def test_messages_thinking_block_through_the_sdk(live, reference, thinking_engine):
    _, _, reasoning, answer = reference
    name = thinking_engine.model_name
    sdk = anthropic.AsyncAnthropic(base_url=live, api_key="x", max_retries=0)
    message = await sdk.messages.create(model=name, max_tokens=MAX,
                                        messages=USER)
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == reasoning
    assert text.type == "text" and text.text == answer
    async with sdk.messages.stream(model=name, max_tokens=MAX,
                                   messages=USER) as stream:
        deltas = [e.thinking for e in [ev async for ev in stream]
                  if e.type == "thinking"]
        final = await stream.get_final_message()
    assert "".join(deltas) == reasoning
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == answer
    off = await sdk.messages.create(model=name, max_tokens=MAX, messages=USER,
                                    thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    # The thinking block goes back in the next turn and reaches the template.
    turn = USER + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": reasoning, "signature": ""},
        {"type": "text", "text": answer}]}, {"role": "user", "content": "And tomorrow?"}]
    counted = await sdk.messages.count_tokens(model=name, messages=turn)
    history = USER + [{"role": "assistant", "content": answer, "reasoning_content": reasoning},
                      {"role": "user", "content": "And tomorrow?"}]
    assert counted.input_tokens == len(reference[0].apply_chat_template(
        history, add_generation_prompt=True))


async def test_a_model_that_does_not_think_has_no_reasoning_fields(tiny_pair):
    async with served(*tiny_pair) as (client, _):
        r = await client.post("/v1/chat/completions", json=chat())
        assert set(r.json()["choices"][0]["message"]) == {"role", "content"}


@pytest.mark.parametrize("extra", [{}, {"chat_template_kwargs": {"enable_thinking": True}}])
async def test_structured_output_is_the_answer(client, reference, extra):
    """A grammar holds the whole reply: the template is asked not to think (unless the
    request insists), and the JSON is the answer either way, never reasoning."""
    tokenizer = reference[0]
    body = chat(response_format={"type": "json_object"}, max_tokens=60, **extra)
    r = await client.post("/v1/chat/completions", json=body)
    message = r.json()["choices"][0]["message"]
    assert "reasoning" not in message
    json.loads(message["content"])
    thinking = extra.get("chat_template_kwargs", {}).get("enable_thinking", False)
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True,
                                           enable_thinking=thinking)
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)


# --- a reasoning budget: the end marker forced after `budget` reasoning tokens ------------------

def budgeted_reference(thinking_pair, reference, budget: int) -> tuple[str, str]:
    """(reasoning, answer) of mlx_lm made to close its reasoning after `budget` tokens: its
    greedy first `budget` tokens, `</think>`, then its greedy continuation."""
    from mlx_lm import stream_generate

    tokenizer, prompt, _, _ = reference
    model, _ = load(str(thinking_pair[0]))
    first = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=budget)
             ] if budget else []
    forced = [*first, tokenizer.think_end_id]
    rest = [r.token for r in stream_generate(model, tokenizer, prompt + forced,
                                             max_tokens=MAX - len(forced))]
    reasoning, answer = tokenizer.decode(forced + rest).split("</think>", 1)
    return reasoning, answer


@pytest.mark.parametrize("budget", [0, 2])
async def test_a_reasoning_budget_closes_the_reasoning(client, thinking_pair, reference, budget):
    assert budget < CLOSES_AT - 1  # else the model closes it by itself
    reasoning, answer = budgeted_reference(thinking_pair, reference, budget)
    assert (reasoning, answer) != reference[2:]
    for k in (0, 4):
        r = await client.post("/v1/chat/completions",
                              json=chat(num_draft_tokens=k, reasoning_budget=budget))
        message = r.json()["choices"][0]["message"]
        assert (message.get("reasoning", ""), message["content"]) == (reasoning, answer), k


async def test_a_budget_the_reasoning_fits_changes_nothing(client, reference):
    r = await client.post("/v1/chat/completions", json=chat(reasoning_budget=CLOSES_AT))
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == reference[2:]


async def test_anthropics_budget_tokens_is_the_budget(live, thinking_pair, reference,
                                                      thinking_engine):
    reasoning, answer = budgeted_reference(thinking_pair, reference, 2)
    sdk = anthropic.AsyncAnthropic(base_url=live, api_key="x", max_retries=0)
    message = await sdk.messages.create(
        model=thinking_engine.model_name, max_tokens=MAX, messages=USER,
        thinking={"type": "enabled", "budget_tokens": 2})
    thinking, text = message.content
    assert (thinking.thinking, text.text) == (reasoning, answer)
