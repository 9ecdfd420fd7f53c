"""Ollama's API through the official `ollama` client (uvicorn in a thread, the tiny pair with its
draft; greedy): chat and generate give mlx_lm's texts, streamed or not, with the counts Ollama
reports; the model list, details and loaded models; JSON output; tool calls (the tiny pair
made to call, as Qwen does), a thinking model's reasoning and embeddings, each equal to what
the OpenAI routes of the same server answer; errors in Ollama's shape, as the client raises
them. Our extensions (`from_draft`, `stats`), which the client drops, are read raw."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from support.models import mlx_lm_greedy
from support.servers import served_url
from support.thinking_model import PROMPT as THINKING_PROMPT
from support.tool_call_model import PROMPT as CALL_PROMPT
from support.tool_call_model import TOOLS, build_tool_call_pair

from server.http.common.tools import render_chat

pytestmark = pytest.mark.slow
ollama = pytest.importorskip("ollama")  # dev extras; `make test` installs them

PROMPT = "Write a function"
MESSAGES = [{"role": "user", "content": PROMPT}]
MAX = 12
GREEDY = {"num_predict": MAX, "temperature": 0}


@pytest.fixture(scope="module")
def url(tiny_pair):
    with served_url(*tiny_pair, models={"model_name": "tiny",
                                           "embedding_model": str(tiny_pair[0])}) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    return ollama.Client(host=url)


@pytest.fixture(scope="module")
def expected(tiny_pair):
    """mlx_lm's greedy texts: of the chat, and of the bare prompt."""
    return mlx_lm_greedy(tiny_pair[0], PROMPT, MAX)


def ndjson(url: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson", r.text
    return [json.loads(line) for line in r.text.splitlines()]


def test_chat_gives_mlx_lms_text_streamed_or_not(client, url, expected):
    whole = client.chat(model="tiny", messages=MESSAGES, options=GREEDY)
    assert whole.message.role == "assistant" and whole.message.content == expected["chat"]
    assert whole.done and whole.done_reason == "length" and whole.eval_count == MAX
    assert whole.prompt_eval_count > 0 and whole.total_duration >= whole.eval_duration > 0
    parts = list(client.chat(model="tiny", messages=MESSAGES, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == expected["chat"]
    assert [p.done for p in parts] == [False] * MAX + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == MAX
    # Our extensions, raw: each token says whether it was drafted; the last line has stats.
    lines = ndjson(url, "/api/chat", {"model": "tiny", "messages": MESSAGES, "options": GREEDY,
                                      "num_draft_tokens": 3})
    assert all(isinstance(line["from_draft"], bool) for line in lines[:-1])
    assert any(line["from_draft"] for line in lines[:-1])
    assert lines[-1]["stats"]["draft_tokens_proposed"] > 0
    assert lines[-1]["stats"]["generation_tokens"] == MAX
    # Ollama's name for the latest tag of a model is the model.
    assert client.chat(model="tiny:latest", messages=MESSAGES,
                       options=GREEDY).message.content == expected["chat"]


def test_generate_is_a_chat_turn_or_the_raw_prompt(client, url, expected):
    turn = client.generate(model="tiny", prompt=PROMPT, options=GREEDY)
    assert turn.response == expected["chat"] and turn.done_reason == "length"
    raw = client.generate(model="tiny", prompt=PROMPT, raw=True, options=GREEDY)
    assert raw.response == expected["text"] and raw.eval_count == MAX
    parts = list(client.generate(model="tiny", prompt=PROMPT, raw=True, options=GREEDY,
                                 stream=True))
    assert "".join(p.response for p in parts) == expected["text"] and parts[-1].done
    with_system = client.generate(model="tiny", prompt=PROMPT, system="Be brief.",
                                  options=GREEDY)
    chat = client.chat(model="tiny", options=GREEDY, messages=[
        {"role": "system", "content": "Be brief."}, *MESSAGES])
    assert with_system.response == chat.message.content
    # No prompt: Ollama loads the model and writes nothing.
    loaded = client.generate(model="tiny", prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_options_reach_the_sampler(client, url):
    """A seed fixes a sampled text; stop strings end it; repeat_penalty changes the greedy
    text as the chat route's repetition_penalty does."""
    sampled = {"num_predict": MAX, "temperature": 1.0, "seed": 7}
    a = client.chat(model="tiny", messages=MESSAGES, options=sampled).message.content
    b = client.chat(model="tiny", messages=MESSAGES, options=sampled).message.content
    assert a == b
    openai_text = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": MAX, "temperature": 0,
        "repetition_penalty": 1.5, "repetition_context_size": 8}).json()
    penalized = client.chat(model="tiny", messages=MESSAGES, options={
        **GREEDY, "repeat_penalty": 1.5, "repeat_last_n": 8})
    assert penalized.message.content == openai_text["choices"][0]["message"]["content"]
    whole = client.chat(model="tiny", messages=MESSAGES, options=GREEDY).message.content
    stop = whole[3:6]
    cut = client.chat(model="tiny", messages=MESSAGES, options={**GREEDY, "stop": [stop]})
    assert cut.message.content == whole[:whole.index(stop)] and cut.done_reason == "stop"


def test_json_output_follows_the_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat(model="tiny", messages=MESSAGES, format=schema,
                    options={"num_predict": 60, "temperature": 0})
    jsonschema.validate(json.loads(r.message.content), schema)
    r = client.generate(model="tiny", prompt=PROMPT, format="json",
                        options={"num_predict": 60, "temperature": 0})
    assert isinstance(json.loads(r.response), dict)


def test_models_details_and_loaded_models(client, tiny_pair):
    listed = client.list().models
    assert [m.model for m in listed] == ["tiny", str(tiny_pair[0])]  # target, embedding model
    config = json.loads((tiny_pair[0] / "config.json").read_text())
    assert listed[0].details.family == config["model_type"] and listed[0].size > 0
    shown = client.show("tiny")
    assert shown.modelinfo[f"{config['model_type']}.context_length"] == \
        config["max_position_embeddings"]
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.template and shown.details.quantization_level == "F32"
    running = client.ps().models
    assert [m.model for m in running] == ["tiny", str(tiny_pair[1]), str(tiny_pair[0])]
    assert running[0].context_length == config["max_position_embeddings"]
    assert httpx.get(f"{client._client.base_url}/api/version").json()["version"]


def test_embed_equals_the_openai_route(client, url):
    texts = ["a cat", "the weather in Paris"]
    ours = client.embed(model=client.list().models[1].model, input=texts).embeddings
    theirs = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=60).json()
    assert ours == [d["embedding"] for d in theirs["data"]]


def test_errors_come_in_ollamas_shape(client, url):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=MESSAGES)
    assert e.value.status_code == 404 and "nope" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=MESSAGES, options={"temperature": -1})
    assert e.value.status_code == 400 and e.value.error.startswith("options.temperature")
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=[{"role": "user", "content": "x",
                                             "images": ["aGk="]}])
    assert e.value.status_code == 400 and "text models only" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nope")
    assert e.value.status_code == 404
    for body in ({"model": "tiny", "prompt": "x", "template": "{{ .Prompt }}"},
                 {"model": "tiny", "prompt": "x", "raw": True, "format": "json"},
                 {"model": "tiny", "messages": []}, {"model": "tiny", "prompt": 3}):
        path = "/api/chat" if "messages" in body else "/api/generate"
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and list(r.json()) == ["error"], r.text
    r = httpx.get(f"{url}/api/pull")
    assert r.status_code == 404 and "error" in r.json()


@pytest.fixture(scope="module")
def call_pair(tiny_pair, tmp_path_factory):
    return build_tool_call_pair(tiny_pair, tmp_path_factory.mktemp("calls"),
                                lambda tokenizer: render_chat(tokenizer, CALL_MESSAGES, TOOLS))


CALL_MESSAGES = [{"role": "user", "content": CALL_PROMPT}]


def test_tool_calls_and_their_results(call_pair):
    # The client sends tools in its own model of them (which keeps no maxLength): the OpenAI
    # requests get the same.
    sent = [ollama.Tool.model_validate(t).model_dump(exclude_none=True) for t in TOOLS]
    with served_url(*call_pair) as base:
        client = ollama.Client(host=base)
        r = client.chat(model=str(call_pair[0]), messages=CALL_MESSAGES, tools=TOOLS,
                        options={"num_predict": 60, "temperature": 0})
        openai_r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": CALL_MESSAGES, "tools": sent, "max_tokens": 60,
            "temperature": 0}).json()["choices"][0]["message"]
        calls = [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls]
        assert calls == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                         for c in openai_r["tool_calls"]]
        jsonschema.validate(calls[0][1], TOOLS[0]["function"]["parameters"])
        assert r.message.content == (openai_r["content"] or "")
        # The call and its result go back (arguments as an object, the tool by its name):
        # the same prompt as the OpenAI shape of that history.
        history = [*CALL_MESSAGES, r.message, {"role": "tool", "content": "18 C",
                                               "tool_name": calls[0][0]}]
        after = client.chat(model=str(call_pair[0]), messages=history, tools=TOOLS,
                            options=GREEDY)
        openai_after = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "tools": sent, "max_tokens": MAX, "temperature": 0, "messages": [
                *CALL_MESSAGES, {"role": "assistant", "content": r.message.content,
                                 "tool_calls": openai_r["tool_calls"]},
                {"role": "tool", "content": "18 C", "name": calls[0][0],
                 "tool_call_id": openai_r["tool_calls"][0]["id"]}]}).json()
        assert after.prompt_eval_count == openai_after["usage"]["prompt_tokens"]
        assert after.message.content == openai_after["choices"][0]["message"]["content"]


def test_a_thinking_models_reasoning_goes_in_thinking(thinking_pair):
    messages = [{"role": "user", "content": THINKING_PROMPT}]
    with served_url(*thinking_pair) as base:
        client = ollama.Client(host=base)
        model = str(thinking_pair[0])
        openai_r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 24, "temperature": 0}).json()
        reply = openai_r["choices"][0]["message"]
        r = client.chat(model=model, messages=messages, think=True,
                        options={"num_predict": 24, "temperature": 0})
        assert (r.message.thinking, r.message.content) == (reply["reasoning_content"],
                                                           reply["content"])
        parts = list(client.chat(model=model, messages=messages, think=True, stream=True,
                                 options={"num_predict": 24, "temperature": 0}))
        assert "".join(p.message.thinking or "" for p in parts) == reply["reasoning_content"]
        assert "".join(p.message.content for p in parts) == reply["content"]
        assert "thinking" in client.show(model).capabilities
        off = client.chat(model=model, messages=messages, think=False,
                          options={"num_predict": 24, "temperature": 0})
        off_openai = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 24, "temperature": 0,
            "reasoning_effort": "none"}).json()["choices"][0]["message"]
        assert off.message.content == off_openai["content"] and not off.message.thinking


def test_log_probabilities_of_each_token(client, url, expected):
    """`logprobs` with `top_logprobs`: each token's entry, the same as the chat route's for
    the same request, on chat and on a raw generate. The chat route answers first, so both
    requests find the prompt in the prefix cache (a prompt prefilled whole and one read from
    the cache differ in the last digits)."""
    httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": MAX, "temperature": 0})
    r = client.chat(model="tiny", messages=MESSAGES, options=GREEDY, logprobs=True,
                    top_logprobs=2)
    openai_r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": MAX, "temperature": 0,
        "logprobs": True, "top_logprobs": 2}).json()["choices"][0]["logprobs"]["content"]
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in r.logprobs] == \
        [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]]) for e in openai_r]
    assert "".join(e.token for e in r.logprobs) == expected["chat"]
    parts = list(client.generate(model="tiny", prompt=PROMPT, raw=True, options=GREEDY,
                                 logprobs=True, stream=True))
    tokens = [e.token for p in parts for e in (p.logprobs or ())]
    assert len(tokens) == MAX and "".join(tokens) == expected["text"]
