"""LiteLLM against the server, through each provider a user would pick for it: `openai/`
(chat, streaming, text completions, the Responses API), `hosted_vllm/` and `anthropic/` (the
Messages API). Greedy texts are compared with mlx_lm's on the tiny pair; our extensions
(`from_draft`, `stats`) come through LiteLLM's objects.
"""

from __future__ import annotations

import asyncio
import json
import os

import jsonschema
import pytest
from support.models import mlx_lm_greedy
from support.servers import served_url

pytestmark = [pytest.mark.slow,  # LiteLLM's own types warn as pydantic builds them
              pytest.mark.filterwarnings("ignore:Items? .* `ReadOnly` qualifier:UserWarning")]
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
litellm = pytest.importorskip("litellm")  # dev extras; `make test` installs them

PROMPT = "Write a function"
MESSAGES = [{"role": "user", "content": PROMPT}]
MAX = 16  # LiteLLM raises a Responses request's max_output_tokens to OpenAI's minimum, 16
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def url(tiny_pair):
    with served_url(*tiny_pair, models={"model_name": "tiny"}) as base:
        yield base


@pytest.fixture(scope="module")
def expected(tiny_pair):
    """mlx_lm's greedy texts: of the chat, and of the bare prompt."""
    return mlx_lm_greedy(tiny_pair[0], PROMPT, MAX)


def openai_args(url):
    return {"model": "openai/tiny", "api_base": f"{url}/v1", "api_key": "unused",
            "max_tokens": MAX, "temperature": 0}


def test_openai_provider_chat_and_stream(url, expected):
    r = litellm.completion(messages=MESSAGES, **openai_args(url))
    assert r.choices[0].message.content == expected["chat"]
    assert r.usage.completion_tokens == MAX and r.stats["draft_tokens_proposed"] > 0
    chunks = list(litellm.completion(messages=MESSAGES, stream=True, **openai_args(url)))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected["chat"]
    assert any(getattr(c.choices[0], "from_draft", False) for c in chunks)


def test_async_and_hosted_vllm_provider(url, expected):
    args = {**openai_args(url), "model": "hosted_vllm/tiny"}
    r = asyncio.run(litellm.acompletion(messages=MESSAGES, **args))
    assert r.choices[0].message.content == expected["chat"]


def test_anthropic_provider(url, expected):
    r = litellm.completion(model="anthropic/tiny", api_base=url, api_key="unused",
                           messages=MESSAGES, max_tokens=MAX, temperature=0)
    assert r.choices[0].message.content == expected["chat"]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX


def test_forced_tool_call_is_the_same_through_both_providers(url):
    calls = []
    for args in (openai_args(url), {"model": "anthropic/tiny", "api_base": url,
                                    "api_key": "unused", "temperature": 0}):
        r = litellm.completion(messages=MESSAGES, tools=TOOLS, tool_choice=FORCED,
                               **{**args, "max_tokens": 128})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        calls.append(call.function.arguments)
    assert calls[0] == calls[1]


def test_text_completion_and_responses(url, expected):
    r = litellm.text_completion(prompt=PROMPT, **openai_args(url))
    assert r.choices[0].text == expected["text"]
    args = {k: v for k, v in openai_args(url).items() if k != "max_tokens"}
    r = litellm.responses(input=PROMPT, max_output_tokens=MAX, **args)
    assert r.output[0].content[0].text == expected["chat"]
    assert r.usage.output_tokens == MAX
