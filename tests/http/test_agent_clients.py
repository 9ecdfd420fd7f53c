"""The official SDKs and agent frameworks against our Responses, Messages and Models APIs
(uvicorn in a thread, the tiny pair with its draft; greedy, so every run is the same): openai's
`responses.create/stream/parse`, a function-tool round trip, custom and namespace tools,
`responses.input_items.list` and `responses.input_tokens.count`, an openai-agents Agent with
one function tool, anthropic's `messages.create/stream/count_tokens`, a tool round trip and its
exception classes, both SDKs' `models.list/retrieve`, langchain-anthropic's `invoke` and
`bind_tools`."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")  # dev extras; `make test` installs them
anthropic = pytest.importorskip("anthropic")
agents = pytest.importorskip("agents")
langchain_anthropic = pytest.importorskip("langchain_anthropic")


class Pet(BaseModel):
    """A pet."""

    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}


@pytest.fixture(scope="module")
def oai(live_server):
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(live_server):
    return anthropic.Anthropic(base_url=live_server, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_pair):
    return str(tiny_pair[0])


# --- openai: the Responses API --------------------------------------------------------------


def test_openai_responses_create_and_stream(oai, model):
    kwargs = dict(model=model, input="Write a function", temperature=0, max_output_tokens=16)
    whole = oai.responses.create(**kwargs)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 16 and whole.output_text
    assert whole.model_extra["stats"]["generation_tokens"] == 16
    # The SDK's stream helper gives a final response only after response.completed (not
    # response.incomplete, as at OpenAI): read this one's events.
    with oai.responses.stream(**kwargs) as stream:
        events = list(stream)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    assert events[-1].type == "response.incomplete"
    # Our extensions, as the raw event stream carries them (the helper rebuilds its events).
    raw = list(oai.responses.create(stream=True, **kwargs))
    flags = [e.model_extra["from_draft"] for e in raw if e.type == "response.output_text.delta"]
    assert len(flags) == len(deltas) and all(isinstance(f, bool) for f in flags) and any(flags)
    assert raw[-1].response.model_extra["stats"]["draft_tokens_proposed"] > 0
    assert oai.responses.retrieve(whole.id).output_text == whole.output_text
    oai.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(whole.id)


def test_openai_responses_stream_to_a_final_response(oai, model):
    kwargs = dict(model=model, input="Make up a pet.", temperature=0, max_output_tokens=200)
    with oai.responses.stream(text_format=Pet, **kwargs) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Pet)
    assert final.output_text == oai.responses.create(**kwargs, text={"format": {
        "type": "json_schema", "name": "Pet", "strict": True,
        "schema": openai.lib._pydantic.to_strict_json_schema(Pet)}}).output_text


def test_openai_responses_parse_with_a_pydantic_model(oai, model):
    r = oai.responses.parse(model=model, input="Make up a pet.", text_format=Pet,
                            temperature=0, max_output_tokens=200)
    assert r.status == "completed" and isinstance(r.output_parsed, Pet)


def test_openai_function_tool_round_trip(oai, model):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
    first = oai.responses.create(model=model, input="Weather in Paris?", tools=[tool],
                                 tool_choice="required", parallel_tool_calls=False,
                                 temperature=0, max_output_tokens=80)
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    by_id = oai.responses.create(model=model, previous_response_id=first.id, input=[output],
                                 tools=[tool], temperature=0, max_output_tokens=8)
    by_items = oai.responses.create(
        model=model, tools=[tool], temperature=0, max_output_tokens=8,
        input=[{"role": "user", "content": "Weather in Paris?"}, call, output])
    assert by_id.output_text == by_items.output_text
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=model, previous_response_id="resp_unknown", input="x")


def test_openai_custom_and_namespace_tools(oai, model):
    """The SDK's own types for a custom tool call (and its streamed input events) and a
    namespaced function call."""
    patch = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
    kwargs = dict(model=model, input="Fix it", tools=[patch], temperature=0,
                  tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=200)
    (call,) = oai.responses.create(**kwargs).output
    assert type(call).__name__ == "ResponseCustomToolCall" and call.name == "apply_patch"
    with oai.responses.stream(**kwargs) as stream:
        kinds = [type(event).__name__ for event in stream]
        final = stream.get_final_response()
    assert "ResponseCustomToolCallInputDeltaEvent" in kinds
    assert final.output[0].input == call.input
    space = {"type": "namespace", "name": "weather", "description": "Weather tools.",
             "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]}
    (fn,) = oai.responses.create(model=model, input="Weather?", tools=[space], temperature=0,
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=80).output
    assert (fn.type, fn.name, fn.namespace) == ("function_call", "get_weather", "weather")


def test_openai_input_items_list_the_chain_that_made_a_response(oai, model):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}
    first = oai.responses.create(model=model, input="Weather in Paris?", tools=[tool],
                                 tool_choice="required", parallel_tool_calls=False,
                                 temperature=0, max_output_tokens=80)
    output = {"type": "function_call_output", "call_id": first.output[0].call_id,
              "output": "sunny", "id": "fco_mine"}
    second = oai.responses.create(model=model, previous_response_id=first.id, tools=[tool],
                                  input=[output, {"role": "user", "content": "And Rome?"}],
                                  temperature=0, max_output_tokens=4)
    listed = list(oai.responses.input_items.list(second.id, order="asc"))
    assert [item.type for item in listed] == [
        "message", "function_call", "function_call_output", "message"]
    question, call, result, follow_up = listed
    assert (question.role, question.content[0].type, question.content[0].text) == (
        "user", "input_text", "Weather in Paris?")
    fields = ("id", "call_id", "name", "arguments")
    assert [getattr(call, f) for f in fields] == [getattr(first.output[0], f) for f in fields]
    assert (result.id, result.call_id, result.output) == ("fco_mine", call.call_id, "sunny")
    assert (follow_up.role, follow_up.content[0].text) == ("user", "And Rome?")
    assert len({item.id for item in listed}) == 4
    newest_first = oai.responses.input_items.list(second.id)  # order=desc by default
    assert [item.id for item in newest_first.data] == [item.id for item in reversed(listed)]
    page = oai.responses.input_items.list(second.id, order="asc", limit=1)
    assert (page.data[0].id, page.has_more) == (question.id, True)
    assert [item.id for item in page] == [item.id for item in listed]  # the SDK pages on
    assert [item.id for item in oai.responses.input_items.list(first.id)] == [question.id]
    with pytest.raises(openai.BadRequestError) as bad:
        oai.responses.input_items.list(second.id, after="msg_unknown")
    assert bad.value.body["param"] == "after"
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_items.list("resp_unknown")


def finished(oai, response_id: str):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        response = oai.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        time.sleep(0.05)
    raise AssertionError(f"response still {response.status}")


def test_openai_background_response_is_the_foreground_one(oai, model):
    from openai.types.responses import Response

    kwargs = dict(model=model, input="Write a function", temperature=0, max_output_tokens=16,
                  instructions="Be brief.")
    queued = oai.responses.create(**kwargs, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    assert queued.instructions == "Be brief."
    done = finished(oai, queued.id)
    Response.model_validate(done.model_dump(mode="json", exclude_unset=True))
    alone = oai.responses.create(**kwargs)
    assert (done.id, done.status, done.background) == (queued.id, alone.status, True)
    assert done.output_text == alone.output_text and done.usage.output_tokens == 16
    [item] = oai.responses.input_items.list(done.id)
    assert item.content[0].text == "Write a function"
    follow = oai.responses.create(model=model, previous_response_id=done.id, input="More",
                                  max_output_tokens=2)
    assert follow.status == "incomplete"
    assert oai.responses.cancel(done.id).status == "incomplete"  # ended: as it is


def test_openai_background_response_cancelled_failed_refused(oai, model):
    long = oai.responses.create(model=model, input="Write a long story", background=True,
                                max_output_tokens=400, extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError, match="still"):
        oai.responses.create(model=model, previous_response_id=long.id, input="x")
    cancelled = oai.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.background
    time.sleep(0.3)
    assert oai.responses.retrieve(long.id).status == "cancelled"  # not overwritten
    failed = finished(oai, oai.responses.create(model="no-such-model", input="x",
                                                background=True).id)
    assert failed.status == "failed" and "no-such-model" in failed.error.message
    foreground = oai.responses.create(model=model, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only background"):
        oai.responses.cancel(foreground.id)
    with pytest.raises(openai.BadRequestError, match="background needs store"):
        oai.responses.create(model=model, input="x", background=True, store=False)
    with pytest.raises(openai.BadRequestError, match="has no events to stream"):
        oai.responses.retrieve(failed.id, stream=True)  # not created with stream
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("resp_unknown", stream=True)


def test_openai_background_stream_resumes_after_a_dropped_connection(oai, model):
    """A background stream that the client drops after 10 events goes on; resuming after the
    10th gives the rest, numbered on; the events add up to the foreground response."""
    from openai.types.responses import Response

    kwargs = dict(model=model, input="Write a function", temperature=0, max_output_tokens=40)
    seen = []
    with oai.responses.stream(**kwargs, background=True) as stream:
        for event in stream:
            seen.append(event)
            if event.sequence_number == 10:
                break  # the connection drops
    assert seen[0].type == "response.created" and seen[0].response.status == "queued"
    assert seen[1].type == "response.in_progress" and seen[0].response.background
    response_id = seen[0].response.id
    rest = list(oai.responses.retrieve(response_id, stream=True, starting_after=10))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.id == response_id
    Response.model_validate(final.response.model_dump(mode="json", exclude_unset=True))
    alone = oai.responses.create(**kwargs)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.response.output_text == alone.output_text
    assert finished(oai, response_id).output_text == alone.output_text
    again = list(oai.responses.retrieve(response_id, stream=True))  # from the start
    assert again[11:] == rest

    def brief(e):
        return e.sequence_number, e.type, getattr(e, "delta", None)
    assert [brief(e) for e in again] == [brief(e) for e in events]

    # the SDK's stream helper resumes one too (it wants a completed response: a short JSON)
    pick = {"format": {"type": "json_schema", "name": "pick", "strict": True, "schema": {
        "type": "object", "properties": {"pick": {"enum": ["yes", "no"]}},
        "required": ["pick"], "additionalProperties": False}}}
    queued = oai.responses.create(model=model, input="Pick", temperature=0, text=pick,
                                  background=True, stream=True)
    response_id = next(iter(queued)).response.id
    queued.close()
    with oai.responses.stream(response_id=response_id, starting_after=2) as resumed:
        final = resumed.get_final_response()
    assert final.status == "completed" and final.id == response_id
    assert final.output_text == oai.responses.create(model=model, input="Pick", temperature=0,
                                                     text=pick).output_text


def test_openai_background_stream_of_a_failed_or_cancelled_response(oai, model):
    failed = list(oai.responses.create(model=model, input="x " * 5000, background=True,
                                       stream=True))
    assert [e.type for e in failed] == ["response.created", "response.failed"]
    assert "maximum context length" in failed[-1].response.error.message
    stream = oai.responses.create(model=model, input="Write a long story", background=True,
                                  stream=True, max_output_tokens=400,
                                  extra_body={"ignore_eos": True})
    first = next(iter(stream))
    oai.responses.cancel(first.response.id)
    rest = list(stream)  # ends once the run has stopped
    assert all(e.type != "response.completed" for e in rest)
    assert oai.responses.retrieve(first.response.id).status == "cancelled"


def test_openai_conversation_gives_the_chains_answers(oai, model):
    """A conversation's responses see its items: the same greedy texts as the same history
    through previous_response_id; its items are the inputs and outputs, in order."""
    from openai.types.conversations import Conversation, ConversationItemList

    first = {"type": "message", "role": "user", "content": "You write Python."}
    conv = oai.conversations.create(items=[first], metadata={"topic": "code"})
    Conversation.model_validate(conv.model_dump(mode="json"))
    kwargs = dict(model=model, temperature=0, max_output_tokens=8)
    one = oai.responses.create(conversation=conv.id, input="Write a function", **kwargs)
    two = oai.responses.create(conversation={"id": conv.id}, input="Shorter", **kwargs)
    assert one.conversation.id == conv.id == two.conversation.id
    chain_one = oai.responses.create(input=[first, {"role": "user",
                                                    "content": "Write a function"}], **kwargs)
    chain_two = oai.responses.create(previous_response_id=chain_one.id, input="Shorter",
                                     **kwargs)
    assert (one.output_text, two.output_text) == (chain_one.output_text, chain_two.output_text)
    assert two.usage.input_tokens == chain_two.usage.input_tokens
    listed = oai.conversations.items.list(conv.id, order="asc")
    ConversationItemList.model_validate(listed.model_dump(mode="json"))
    texts = [(item.role, item.content[0].text) for item in listed.data]
    assert texts == [("user", "You write Python."), ("user", "Write a function"),
                     ("assistant", one.output_text), ("user", "Shorter"),
                     ("assistant", two.output_text)]
    assert oai.responses.input_tokens.count(conversation=conv.id, input="More",
                                            model=model).input_tokens > two.usage.input_tokens


def test_openai_conversation_items_and_errors(oai, model):
    conv = oai.conversations.create()
    added = oai.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": "a"},
        {"type": "message", "role": "user", "content": "b"}])
    first, second = added.data
    assert oai.conversations.items.retrieve(second.id, conversation_id=conv.id).id == second.id
    oai.conversations.items.delete(first.id, conversation_id=conv.id)
    assert [i.id for i in oai.conversations.items.list(conv.id)] == [second.id]
    assert oai.conversations.update(conv.id, metadata={"k": "v"}).metadata == {"k": "v"}
    with pytest.raises(openai.BadRequestError, match="cannot both"):
        oai.responses.create(model=model, conversation=conv.id, previous_response_id="resp_x",
                             input="x")
    deleted = oai.conversations.delete(conv.id)
    assert (deleted.id, deleted.deleted) == (conv.id, True)
    with pytest.raises(openai.NotFoundError, match="No conversation"):
        oai.responses.create(model=model, conversation=conv.id, input="x")
    with pytest.raises(openai.NotFoundError, match="No conversation"):
        oai.conversations.items.list(conv.id)


def test_openai_input_tokens_count_what_create_reports(oai, model):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    request = dict(model=model, input="Write a function", instructions="Be brief.",
                   tools=[tool])
    first = oai.responses.create(**request, temperature=0, max_output_tokens=4)
    count = oai.responses.input_tokens.count(**request)
    assert (count.object, count.input_tokens) == ("response.input_tokens",
                                                  first.usage.input_tokens)
    follow = dict(model=model, previous_response_id=first.id, input="And in Rust?")
    second = oai.responses.create(**follow, temperature=0, max_output_tokens=4)
    assert oai.responses.input_tokens.count(**follow).input_tokens == second.usage.input_tokens
    assert oai.responses.input_tokens.count(model=model, previous_response_id=first.id
                                            ).input_tokens < second.usage.input_tokens
    with pytest.raises(openai.BadRequestError):
        oai.responses.input_tokens.count(model=model)  # nothing to count
    with pytest.raises(openai.NotFoundError):
        oai.responses.input_tokens.count(model=model, previous_response_id="resp_unknown")


def test_openai_models_list_and_retrieve(oai, model, tiny_pair):
    listed = oai.models.list().data
    assert [(m.id, m.model_extra["role"]) for m in listed] == [
        (model, "target"), (str(tiny_pair[1]), "draft")]
    for entry in listed:
        assert oai.models.retrieve(entry.id) == entry  # `created` is the load time: stable
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("gpt-nope")
    assert missing.value.body["code"] == "model_not_found"


def test_openai_agents_agent_with_a_function_tool(live_server, model):
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool
    from agents.models.openai_responses import OpenAIResponsesModel

    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    class Sky(BaseModel):
        sky: Literal["sunny", "rainy"]

    client = openai.AsyncOpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)
    # A structured final answer: the random test model then ends its last turn (a free-text one
    # would run to max_tokens, and the Agents SDK treats an incomplete response as a failure).
    agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                  output_type=Sky,
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=120, parallel_tool_calls=False))

    async def run():
        async with client:  # its connections close on this loop, not when collected later
            return await Runner.run(agent, "Weather in Paris?", max_turns=3,
                                    run_config=RunConfig(tracing_disabled=True))

    result = asyncio.run(run())
    assert calls and calls[0] in ("Paris", "Rome")
    assert isinstance(result.final_output, Sky)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"


def test_openai_agents_session_and_conversation_id(live_server, model):
    """The Agents SDK keeps a session in a conversation (`OpenAIConversationsSession`, through
    the items API) and runs on one server-side (`conversation_id`, through `conversation`)."""
    from agents import Agent, ModelSettings, OpenAIConversationsSession, RunConfig, Runner
    from agents.models.openai_responses import OpenAIResponsesModel

    class Sky(BaseModel):
        sky: Literal["sunny", "rainy"]

    client = openai.AsyncOpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="sky", instructions="Answer briefly.", output_type=Sky,
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=60))
    config = RunConfig(tracing_disabled=True)

    async def runs():
        session = OpenAIConversationsSession(openai_client=client)
        for question in ("Sky in Paris?", "And in Rome?"):
            await Runner.run(agent, question, session=session, run_config=config)
        conversation = await client.conversations.create()
        for question in ("Sky in Paris?", "And in Rome?"):
            await Runner.run(agent, question, conversation_id=conversation.id,
                             run_config=config)
        listed = await client.conversations.items.list(conversation.id, order="asc")
        items = await session.get_items()
        await client.close()  # its connections close on this loop, not when collected later
        return items, listed.data

    session_items, conversation_items = asyncio.run(runs())
    assert [item["role"] for item in session_items] == ["user", "assistant"] * 2
    assert [(item.role, item.content[0].text) for item in conversation_items] == [
        (item["role"], item["content"] if isinstance(item["content"], str)
         else item["content"][0]["text"]) for item in session_items]


# --- anthropic: the Messages API ------------------------------------------------------------


def test_anthropic_messages_create_stream_and_count(claude, model):
    kwargs = dict(model=model, max_tokens=16, extra_body={"temperature": 0},
                  messages=[{"role": "user", "content": "Write a function"}])
    whole = claude.messages.create(**kwargs)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 16
    assert whole.model_extra["stats"]["generation_tokens"] == 16
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16
    count = claude.messages.count_tokens(model=model, messages=kwargs["messages"])
    assert count.input_tokens == whole.model_extra["stats"]["prompt_tokens"]


class Animal(BaseModel):
    """Anthropic's structured outputs take no numeric or length bounds (its SDK moves them into
    descriptions, then validates the answer against the model): none here."""

    kind: Literal["cat", "dog", "fish"]
    legs: Literal[0, 2, 4]


def test_anthropic_parse_with_a_pydantic_model(claude, model):
    r = claude.messages.parse(model=model, max_tokens=200, output_format=Animal,
                              messages=[{"role": "user", "content": "Make up a pet."}])
    assert r.stop_reason == "end_turn" and isinstance(r.parsed_output, Animal)


def test_anthropic_tool_round_trip(claude, model):
    tools = [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER}]
    question = {"role": "user", "content": "Weather in Paris?"}
    first = claude.messages.create(model=model, max_tokens=80, tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   messages=[question])
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER)
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    answer = claude.messages.create(model=model, max_tokens=8, tools=tools,
                                    messages=[question, {"role": "assistant",
                                                         "content": first.content},
                                              {"role": "user", "content": [result]}])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens")


def test_anthropic_error_classes(claude, live_server, model):
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=model, max_tokens=20_000,  # > the test model's context
                               messages=[{"role": "user", "content": "x"}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=1,
                               messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=model, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AA=="}}]}])


def test_anthropic_models_list_and_retrieve(claude, model, tiny_pair):
    listed = claude.models.list()
    assert [(m.id, m.type, m.display_name) for m in listed.data] == [
        (model, "model", model), (str(tiny_pair[1]), "model", str(tiny_pair[1]))]
    assert (listed.first_id, listed.last_id, listed.has_more) == (
        model, str(tiny_pair[1]), False)
    target = listed.data[0]
    assert target.created_at.tzinfo is not None and target.max_input_tokens > 0
    assert claude.models.retrieve(model) == target
    first = claude.models.list(limit=1)
    assert first.has_more and [m.id for m in first] == [model, str(tiny_pair[1])]  # pages on
    assert [m.id for m in claude.models.list(before_id=str(tiny_pair[1])).data] == [model]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.models.retrieve("claude-nope")
    error = missing.value.body["error"]
    assert missing.value.body["type"] == "error" and error["type"] == "not_found_error"
    assert error["message"].startswith("model 'claude-nope' does not exist; this server serves")


# --- langchain-anthropic ------------------------------------------------------------------------


def test_langchain_anthropic_invoke_and_bind_tools(live_server, model):
    llm = langchain_anthropic.ChatAnthropic(base_url=live_server, api_key="unused", model=model,
                                            temperature=0, max_tokens=16, max_retries=0)
    message = llm.invoke("Write a function")
    assert isinstance(message.content, str) and message.content
    assert message.response_metadata["stop_reason"] == "max_tokens"

    class GetWeather(BaseModel):
        """Current weather in a city."""

        city: str = Field(max_length=10)
        unit: Literal["C", "F"]

    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather").bind(max_tokens=80)
    (call,) = bound.invoke("Weather in Paris?").tool_calls
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
