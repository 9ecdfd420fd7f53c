"""The Responses API's `truncation: "auto"` through the official `openai` SDK, and Ollama's
`/api/chat` through the `ollama` client: a conversation longer than the context (the tiny
target's 4,096 tokens) loses its earliest exchanges, whole, and the answer is the one the same
request gets with the kept exchanges sent alone; the cut is computed here with mlx_lm's
tokenizer (the fewest exchanges dropped for the chat template's prompt to leave room for the
token limit; system messages kept). Without it, the same request is a 400."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

CONTEXT = 4096  # the tiny target's max_position_embeddings
INSTRUCTIONS = "Be brief."
LIMIT = 8


@pytest.fixture(scope="module")
def oai(live_server):
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)


def history(exchanges: int, words: int = 60) -> list[dict]:
    """Alternating user and assistant messages, each about `words` words long."""
    turns = []
    for i in range(exchanges):
        turns.append({"role": "user", "content": f"Question {i}: " + "why is it so? " * words})
        turns.append({"role": "assistant", "content": f"Answer {i}: " + "because. " * words})
    return turns


def expected_cut(tokenizer, conversation: list[dict], system=({"role": "system",
                                                                "content": INSTRUCTIONS},)
                 ) -> tuple[int, list[dict], list[int]]:
    """The first user message from which the conversation fits, what is kept (the system
    messages before it too), and its prompt."""
    for cut in range(1, len(conversation)):
        if conversation[cut]["role"] != "user":
            continue
        kept = [m for m in conversation[:cut] if m["role"] == "system"] + conversation[cut:]
        prompt = tokenizer.apply_chat_template([*system, *kept], add_generation_prompt=True)
        if len(prompt) + LIMIT <= CONTEXT:
            return cut, kept, prompt
    raise AssertionError("nothing fits")


def test_auto_drops_the_earliest_exchanges(oai, loaded_pair, tiny_pair):
    from openai.types.responses import Response

    _, tokenizer, _ = loaded_pair
    conversation = history(40) + [{"role": "user", "content": "Write a function"}]
    whole = tokenizer.apply_chat_template(
        [{"role": "system", "content": INSTRUCTIONS}] + conversation, add_generation_prompt=True)
    assert len(whole) > CONTEXT
    cut, _, prompt = expected_cut(tokenizer, conversation)
    assert 2 <= cut < len(conversation) - 1
    kwargs = dict(model=str(tiny_pair[0]), instructions=INSTRUCTIONS, temperature=0,
                  max_output_tokens=LIMIT)

    truncated = oai.responses.create(input=conversation, truncation="auto", **kwargs)
    Response.model_validate(truncated.model_dump(mode="json", exclude_unset=True))
    alone = oai.responses.create(input=conversation[cut:], **kwargs)
    assert truncated.truncation == "auto" and alone.truncation == "disabled"
    assert truncated.output_text == alone.output_text
    assert truncated.usage.input_tokens == alone.usage.input_tokens == len(prompt)
    assert oai.responses.input_tokens.count(input=conversation, truncation="auto",
                                            **{k: kwargs[k] for k in ("model", "instructions")}
                                            ).input_tokens == len(prompt)
    for refused in ({}, {"truncation": "disabled"}):
        with pytest.raises(openai.BadRequestError, match="maximum context length") as e:
            oai.responses.create(input=conversation, **refused, **kwargs)
        assert e.value.code == "context_length_exceeded"

    # the stored response keeps its whole input; a follow-up is cut again
    assert len(list(oai.responses.input_items.list(truncated.id, limit=100))) == len(
        conversation)
    follow = oai.responses.create(previous_response_id=truncated.id, input="More",
                                  truncation="auto", **kwargs)
    assert follow.status == "incomplete" and follow.usage.input_tokens + LIMIT <= CONTEXT


def test_auto_keeps_what_fits_and_refuses_what_cannot(oai, tiny_pair):
    kwargs = dict(model=str(tiny_pair[0]), temperature=0, max_output_tokens=LIMIT,
                  truncation="auto")
    short = oai.responses.create(input=history(2) + [{"role": "user", "content": "Hi"}],
                                 **kwargs)
    same = oai.responses.create(input=history(2) + [{"role": "user", "content": "Hi"}],
                                **{**kwargs, "truncation": "disabled"})
    assert short.usage.input_tokens == same.usage.input_tokens  # nothing dropped
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        oai.responses.create(input="why? " * 3000, **kwargs)  # the last message alone
    with pytest.raises(openai.BadRequestError, match="truncation"):
        oai.responses.create(input="x", **{**kwargs, "truncation": "middle"})


def test_ollama_chat_drops_the_earliest_exchanges_by_default(live_server, loaded_pair,
                                                             tiny_pair):
    ollama = pytest.importorskip("ollama")
    _, tokenizer, _ = loaded_pair
    conversation = history(20) + [{"role": "system", "content": "Answer in Python."}] + history(
        20) + [{"role": "user", "content": "Write a function"}]
    cut, kept, prompt = expected_cut(tokenizer, conversation, system=())
    assert conversation.index({"role": "system", "content": "Answer in Python."}) < cut
    client = ollama.Client(host=live_server)
    options = {"num_predict": LIMIT, "temperature": 0}
    model = str(tiny_pair[0])
    truncated = client.chat(model=model, messages=conversation, options=options)
    alone = client.chat(model=model, messages=kept, options=options)
    assert truncated.message.content == alone.message.content
    assert truncated.prompt_eval_count == alone.prompt_eval_count == len(prompt)
    refused = httpx.post(f"{live_server}/api/chat", timeout=60, json={
        "model": model, "messages": conversation, "options": options, "stream": False,
        "truncate": False})  # the client has no truncate argument
    assert refused.status_code == 400 and "maximum context length" in refused.json()["error"]
