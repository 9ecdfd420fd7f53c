"""The Responses and Messages APIs over HTTP (in process): the same engine path as chat
completions, so greedy output is the same tokens; their event streams, store, tools, errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
from support.paths import DATA
from support.servers import make_settings, served

from server.http.app import create_app

pytestmark = pytest.mark.anyio

PROMPT = "Write a function"
SYSTEM = "You are terse."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER,
                  "strict": True}
MESSAGES_TOOL = {"name": "get_weather", "input_schema": WEATHER}


async def chat(client, messages, **extra) -> dict:
    r = await client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0,
                                                        **extra})
    assert r.status_code == 200, r.text
    return r.json()


async def responses(client, **body) -> dict:
    r = await client.post("/v1/responses", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def messages(client, **body) -> dict:
    r = await client.post("/v1/messages", json={"model": "", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def output_text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


async def read_events(client, path: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, JSON data) of each SSE event."""
    out, name = [], None
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


# --- one engine: greedy output equals chat completions' -------------------------------------


@pytest.mark.parametrize("max_tokens", [12, 40])
async def test_greedy_output_equals_chat_completions(client, max_tokens):
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    want = await chat(client, turns, max_tokens=max_tokens)
    text = want["choices"][0]["message"]["content"]
    n = want["usage"]["completion_tokens"]
    r = await responses(client, instructions=SYSTEM, input=PROMPT, max_output_tokens=max_tokens)
    assert (output_text(r), r["usage"]["output_tokens"]) == (text, n)
    assert r["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]
    assert r["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    m = await messages(client, system=SYSTEM, max_tokens=max_tokens,
                       messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}])
    assert (m["content"][0]["text"], m["usage"]["output_tokens"]) == (text, n)
    u = m["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] == want["usage"]["prompt_tokens"]
    for stats in (r["stats"], m["stats"]):
        assert set(stats) == set(want["stats"]) and stats["generation_tokens"] == n
        assert stats["draft_tokens_proposed"] > 0  # speculation ran under both APIs


async def test_count_tokens_is_the_generation_prompt(client):
    body = {"model": "", "system": [{"type": "text", "text": SYSTEM}],
            "messages": [{"role": "user", "content": PROMPT}], "tools": [MESSAGES_TOOL]}
    r = await client.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200
    m = await messages(client, max_tokens=1, **{k: v for k, v in body.items() if k != "model"})
    assert r.json() == {"input_tokens": m["stats"]["prompt_tokens"]}
    want = await chat(client, [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": PROMPT}], tools=[CHAT_TOOL],
                      max_tokens=1)
    assert r.json()["input_tokens"] == want["usage"]["prompt_tokens"]


# --- the Responses API ---------------------------------------------------------------------


async def test_responses_stream_events_and_equality(client):
    body = {"input": PROMPT, "max_output_tokens": 20, "temperature": 0, "metadata": {"k": "v"}}
    whole = await responses(client, **body)
    events = await read_events(client, "/v1/responses", {**body, "stream": True})
    names = [name for name, _ in events]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = [data for name, data in events if name == "response.output_text.delta"]
    assert all(isinstance(d["from_draft"], bool) for d in deltas)
    assert any(d["from_draft"] for d in deltas)
    final = events[-1][1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "".join(d["delta"] for d in deltas) == output_text(final) == output_text(whole)
    assert final["stats"]["generation_tokens"] == whole["stats"]["generation_tokens"] == 20
    assert final["metadata"] == {"k": "v"} and final["usage"] == final["usage"] | {
        "output_tokens": 20}


def same_logprobs(got: list[dict], want: list[dict]) -> bool:
    """The same tokens; log-probabilities equal up to float32 noise (the forwards that scored
    them verified drafts of other lengths)."""
    def flat(entries):
        return [(e["token"], e["bytes"], e["logprob"]) for entry in entries
                for e in [entry, *entry["top_logprobs"]]]
    return [t[:2] for t in flat(got)] == [t[:2] for t in flat(want)] and \
        [t[2] for t in flat(got)] == pytest.approx([t[2] for t in flat(want)], abs=1e-4)


async def test_responses_logprobs_are_chat_completions_and_typed_by_the_sdk(client):
    from openai.types.responses import Response

    want = await chat(client, [{"role": "user", "content": PROMPT}], max_tokens=8,
                      logprobs=True, top_logprobs=2)
    expected = want["choices"][0]["logprobs"]["content"]
    body = {"input": PROMPT, "max_output_tokens": 8, "temperature": 0, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}
    whole = await responses(client, **body)
    part = Response.model_validate(whole).output[0].content[0]
    assert same_logprobs([lp.model_dump() for lp in part.logprobs], expected)
    events = await read_events(client, "/v1/responses", {**body, "stream": True})
    deltas = [d["logprobs"] for name, d in events if name == "response.output_text.delta"]
    assert same_logprobs([lp for delta in deltas for lp in delta], expected)
    done = next(d for name, d in events if name == "response.output_text.done")
    assert same_logprobs(done["logprobs"], expected)
    # Without `include`, none (as at OpenAI, top_logprobs alone asks for nothing).
    plain = await responses(client, **{k: v for k, v in body.items() if k != "include"})
    assert plain["output"][0]["content"][0]["logprobs"] == []


async def test_without_max_output_tokens_a_response_may_fill_the_context(client, tiny_pair):
    """OpenAI's rule for the Responses API (Codex sends no limit); chat completions keep
    `defaults.max_tokens` (512)."""
    context = json.loads((tiny_pair[0] / "config.json").read_text())["max_position_embeddings"]
    text = "one two three " * 420
    r = await responses(client, input=text, ignore_eos=True)
    usage = r["usage"]
    assert 512 < usage["output_tokens"] == context - usage["input_tokens"]
    assert r["status"] == "incomplete"
    want = await chat(client, [{"role": "user", "content": text}], ignore_eos=True)
    assert want["usage"]["completion_tokens"] == 512


async def test_responses_store_get_delete(client):
    r = await responses(client, input=PROMPT, max_output_tokens=4)
    got = await client.get(f"/v1/responses/{r['id']}")
    assert got.status_code == 200 and got.json() == r
    deleted = await client.delete(f"/v1/responses/{r['id']}")
    assert deleted.json() == {"id": r["id"], "object": "response", "deleted": True}
    gone = await client.get(f"/v1/responses/{r['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    unstored = await responses(client, input=PROMPT, max_output_tokens=2, store=False)
    assert (await client.get(f"/v1/responses/{unstored['id']}")).status_code == 404
    r = await client.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_no"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "previous_response_id"


async def test_store_is_bounded(tiny_pair):
    async with served(*tiny_pair, responses_store_size=2) as (c, _):
        ids = [(await responses(c, input=PROMPT, max_output_tokens=1))["id"] for _ in range(3)]
        found = [(await c.get(f"/v1/responses/{i}")).status_code for i in ids]
    assert found == [404, 200, 200]


async def test_previous_response_id_continues_the_conversation(client):
    first = await responses(client, instructions=SYSTEM, input=PROMPT, max_output_tokens=8)
    second = await responses(client, previous_response_id=first["id"], input="More",
                             max_output_tokens=8)
    # Instructions are not carried over (OpenAI's rule); the history is.
    want = await chat(client, [{"role": "user", "content": PROMPT},
                               {"role": "assistant", "content": output_text(first)},
                               {"role": "user", "content": "More"}], max_tokens=8)
    assert output_text(second) == want["choices"][0]["message"]["content"]
    assert second["previous_response_id"] == first["id"]


async def test_responses_forced_function_call_round_trip(client):
    r = await responses(client, input="Weather in Paris?", tools=[RESPONSES_TOOL],
                        tool_choice={"type": "function", "name": "get_weather"},
                        max_output_tokens=80)
    (call,) = [item for item in r["output"] if item["type"] == "function_call"]
    assert r["status"] == "completed" and call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER)
    follow = {"tools": [RESPONSES_TOOL], "max_output_tokens": 10,
              "input": [{"type": "function_call_output", "call_id": call["call_id"],
                         "output": "sunny"}]}
    by_id = await responses(client, previous_response_id=r["id"], **follow)
    full_input = [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "function_call", "call_id": call["call_id"],
                   "name": "get_weather", "arguments": call["arguments"]}, *follow["input"]]
    by_items = await responses(client, **{**follow, "input": full_input})
    want = await chat(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["call_id"], "type": "function",
             "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "sunny"}],
        tools=[CHAT_TOOL], max_tokens=10)
    assert output_text(by_id) == output_text(by_items) == \
        want["choices"][0]["message"]["content"]


async def test_responses_streamed_function_call(client):
    body = {"input": "Weather?", "tools": [RESPONSES_TOOL], "tool_choice": "required",
            "parallel_tool_calls": False, "max_output_tokens": 80, "temperature": 0}
    whole = await responses(client, **body)
    events = await read_events(client, "/v1/responses", {**body, "stream": True})
    names = [name for name, _ in events]
    assert "response.function_call_arguments.delta" in names
    (done,) = [d for n, d in events if n == "response.function_call_arguments.done"]
    final = events[-1][1]["response"]
    assert names[-1] == "response.completed"
    calls = [i for i in final["output"] if i["type"] == "function_call"]
    assert [c["arguments"] for c in calls] == [done["arguments"]] == \
        [i["arguments"] for i in whole["output"] if i["type"] == "function_call"]


async def test_responses_json_schema_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = await responses(client, input="A number", max_output_tokens=60, text={
        "format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(output_text(r)), schema)
    assert r["text"]["format"]["name"] == "num"


# A namespace tool (Codex's multi_agent_v1 is one), a custom tool with a grammar (Codex's
# apply_patch), and what the model is offered for them (`server.http.openai.responses.tools`).
NAMESPACE_TOOL = {"type": "namespace", "name": "weather", "description": "Weather tools.",
                  "tools": [RESPONSES_TOOL]}
PATCH_GRAMMAR = "start: /[a-z ]+/"
CUSTOM_TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
OFFERED = {
    "weather__get_weather": {"type": "function", "function": {
        "name": "weather__get_weather", "description": "Weather tools.", "parameters": WEATHER,
        "strict": True}},
    "apply_patch": {"type": "function", "function": {
        "name": "apply_patch", "parameters": {
            "type": "object", "properties": {"input": {"type": "string"}},
            "required": ["input"], "additionalProperties": False},
        "description": f"Edit files.\n\nThe input must match this lark grammar:\n{PATCH_GRAMMAR}"}},
}


async def test_namespace_and_custom_tools_are_offered_as_functions(client):
    """Forced calls equal chat completions' with the offered functions, turned into a
    namespaced function_call and a custom_tool_call (its `input` unwrapped)."""
    cases = [([NAMESPACE_TOOL], "required", ["weather__get_weather"]),
             ([NAMESPACE_TOOL, CUSTOM_TOOL], {"type": "custom", "name": "apply_patch"},
              ["weather__get_weather", "apply_patch"])]
    for tools, choice, offered in cases:
        r = await responses(client, input="Weather in Paris?", tools=tools, tool_choice=choice,
                            parallel_tool_calls=False, max_output_tokens=60)
        want = await chat(client, [{"role": "user", "content": "Weather in Paris?"}],
                          tools=[OFFERED[name] for name in offered], parallel_tool_calls=False,
                          tool_choice={"type": "function", "function": {"name": offered[-1]}},
                          max_tokens=60)
        (call,) = want["choices"][0]["message"]["tool_calls"]
        (item,) = r["output"]
        if offered[-1] == "apply_patch":
            assert (item["type"], item["name"], item["namespace"]) == (
                "custom_tool_call", "apply_patch", None)
            assert item["input"] == json.loads(call["function"]["arguments"])["input"]
        else:
            assert (item["type"], item["name"], item["namespace"]) == (
                "function_call", "get_weather", "weather")
            assert item["arguments"] == call["function"]["arguments"]


async def test_custom_tool_call_streams_its_input_and_round_trips(client):
    body = {"input": "Fix it", "tools": [CUSTOM_TOOL], "max_output_tokens": 60,
            "tool_choice": {"type": "custom", "name": "apply_patch"}, "temperature": 0}
    whole = await responses(client, **body)
    events = await read_events(client, "/v1/responses", {**body, "stream": True})
    names = [name for name, _ in events]
    (added,) = [d["item"] for n, d in events if n == "response.output_item.added"]
    (delta,) = [d["delta"] for n, d in events if n == "response.custom_tool_call_input.delta"]
    (done,) = [d["input"] for n, d in events if n == "response.custom_tool_call_input.done"]
    (item,) = whole["output"]
    assert (added["type"], added["input"], added["status"]) == (
        "custom_tool_call", "", "in_progress")
    assert delta == done == item["input"] and names[-1] == "response.completed"
    assert events[-1][1]["response"]["output"][0]["input"] == item["input"]
    # Stateless, as Codex sends it: the call and its output as input items.
    history = [{"role": "user", "content": "Fix it"},
               {"type": "custom_tool_call", "call_id": item["call_id"], "name": "apply_patch",
                "input": item["input"]},
               {"type": "custom_tool_call_output", "call_id": item["call_id"], "output": "ok"}]
    follow = await responses(client, input=history, tools=[CUSTOM_TOOL], max_output_tokens=10)
    want = await chat(client, [
        {"role": "user", "content": "Fix it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": item["call_id"], "type": "function", "function": {
                "name": "apply_patch", "arguments": json.dumps({"input": item["input"]})}}]},
        {"role": "tool", "tool_call_id": item["call_id"], "content": "ok"}],
        tools=[OFFERED["apply_patch"]], max_tokens=10)
    assert output_text(follow) == want["choices"][0]["message"]["content"]


async def test_earlier_reasoning_items_are_listed_and_left_out_of_the_prompt(client):
    reasoning = {"type": "reasoning", "id": "rs_1", "encrypted_content": "opaque",
                 "summary": [{"type": "summary_text", "text": "Thought."}]}
    turns = [{"role": "user", "content": PROMPT}, reasoning,
             {"role": "assistant", "content": "Which?"}, {"role": "user", "content": "Any."}]
    with_reasoning = await responses(client, input=turns, max_output_tokens=8)
    without = await responses(client, input=[t for t in turns if t is not reasoning],
                              max_output_tokens=8)
    assert output_text(with_reasoning) == output_text(without)
    listed = (await client.get(f"/v1/responses/{with_reasoning['id']}/input_items",
                               params={"order": "asc"})).json()["data"]
    assert listed[1] == reasoning


async def test_hosted_tools_are_accepted_and_not_offered(client):
    plain = await responses(client, input=PROMPT, max_output_tokens=8)
    hosted = await responses(client, input=PROMPT, max_output_tokens=8,
                             tools=[{"type": "web_search", "external_web_access": False}])
    assert output_text(hosted) == output_text(plain)
    assert hosted["tools"] == [{"type": "web_search"}]
    counts = [(await client.post("/v1/responses/input_tokens", json={
        "input": PROMPT, "tools": tools})).json()["input_tokens"]
        for tools in ([], [{"type": "file_search"}], [RESPONSES_TOOL])]
    assert counts[0] == counts[1] < counts[2]


CODEX_REQUEST = DATA / "codex_0.171_request.json"


async def test_a_codex_cli_turn_and_the_next_with_a_namespaced_call(client):
    """Codex CLI 0.171's request as it sent it (texts shortened and three of its seven function
    tools left out, to fit the test model's context; ids replaced): function tools,
    a namespace tool, web_search, developer messages, `reasoning`, `include`,
    `client_metadata`, `store: false`, streamed. Then its next turn, stateless: the history,
    the output, a call to a namespace's tool and its output."""
    body = {**json.loads(CODEX_REQUEST.read_text()), "model": "", "max_output_tokens": 8,
            "temperature": 0}
    events = await read_events(client, "/v1/responses", body)
    assert [n for n, _ in events][:2] == ["response.created", "response.in_progress"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)
    final = events[-1][1]["response"]
    assert events[-1][0] == f"response.{final['status']}" and final["store"] is False
    assert [t["type"] for t in final["tools"]] == [t["type"] for t in body["tools"]]
    call = {"type": "function_call", "call_id": "call_1", "name": "spawn_agent",
            "namespace": "multi_agent_v1", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "started"}
    turn = {**body, "stream": False, "input": [*body["input"], *final["output"], call, result]}
    namespaced = await responses(client, **turn)
    flat = {**call, "name": "multi_agent_v1__spawn_agent", "namespace": None}
    offered = await responses(client, **{**turn, "input": [*turn["input"][:-2], flat, result]})
    assert output_text(namespaced) == output_text(offered)
    assert namespaced["usage"]["input_tokens"] == offered["usage"]["input_tokens"] > \
        final["usage"]["input_tokens"]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": "x", "tools": [{"type": "local_shell"}]}, "tools"),
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": "required"}, None),
    ({"input": "x", "tools": [NAMESPACE_TOOL, {**RESPONSES_TOOL, "name": "weather__get_weather"}
                              ]}, "tools"),
    ({"input": "x", "tools": [{**CUSTOM_TOOL, "format": {"type": "grammar"}}]}, "tools"),
    ({"input": "x", "tools": [CUSTOM_TOOL], "tool_choice": {"type": "function",
                                                             "name": "apply_patch"}}, None),
    ({"input": "x", "tool_choice": "required"}, None),
    ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
])
async def test_responses_bad_input_is_400(client, body, param):
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"].split(".")[0] == param


# --- the Messages API ---------------------------------------------------------------------


async def test_messages_stream_events_and_equality(client):
    body = {"model": "", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}
    whole = await messages(client, **body)
    events = await read_events(client, "/v1/messages", {**body, "stream": True})
    names = [name for name, _ in events]
    assert [data["type"] for _, data in events] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert all(isinstance(d["from_draft"], bool) for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == whole["content"][0]["text"]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 16 == delta["stats"]["generation_tokens"]


CLAUDE_CODE_REQUEST = DATA / "claude_code_2.1.197_request.json"


async def test_a_claude_code_turn_and_the_next_with_a_tool_result(client):
    """Claude Code 2.1.197's request as it sent it (texts shortened, six of its 26 tools kept,
    ids replaced): system blocks with cache_control, a system turn after the user's,
    `thinking`, `context_management`, `output_config.effort`, `metadata`, streamed. Its
    `max_tokens: 32000` does not fit the test model's context (a 400 naming the numbers), so
    the turns here ask for 8. Then its next turn: a Bash tool_use and its tool_result."""
    sent = json.loads(CLAUDE_CODE_REQUEST.read_text())
    r = await client.post("/v1/messages", json={**sent, "model": ""})
    assert r.status_code == 400 and "32000" in r.json()["error"]["message"]
    body = {**sent, "model": "", "max_tokens": 8, "temperature": 0}
    events = await read_events(client, "/v1/messages", body)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    start = events[0][1]["message"]
    prompt = start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"]
    count = await client.post("/v1/messages/count_tokens", json=body)
    assert count.json()["input_tokens"] == prompt
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "README.md"}
    turn = {**body, "stream": False, "messages": [
        *body["messages"], {"role": "assistant", "content": [{"type": "text", "text": text},
                                                             use]},
        {"role": "user", "content": [result]}]}
    answer = await messages(client, **turn)
    usage = answer["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > prompt
    assert usage["cache_read_input_tokens"] >= prompt - 1  # the first turn's prompt, cached
    assert answer["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


async def test_fit_max_tokens_cuts_an_agents_max_tokens_to_the_context(engine, tiny_pair):
    settings = make_settings(*tiny_pair)
    settings.defaults.fit_max_tokens = True
    body = {"model": "", "max_tokens": 32000, "ignore_eos": True, "temperature": 0,
            "messages": [{"role": "user", "content": "one two three " * 480}]}
    context = json.loads((tiny_pair[0] / "config.json").read_text())["max_position_embeddings"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(settings, engine)),
                                 base_url="http://t", timeout=60) as c:
        r = (await c.post("/v1/messages", json=body)).json()
    usage = r["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert r["stop_reason"] == "max_tokens" and usage["output_tokens"] == context - prompt > 0


async def test_messages_earlier_thinking_is_left_out_of_the_prompt(client):
    """As at Anthropic, an assistant turn's thinking blocks are not part of what the model
    sees: the same answer as without them. In a user turn they are a 400."""
    thinking = [{"type": "thinking", "thinking": "Let me see.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"}]
    turns = [{"role": "user", "content": PROMPT},
             {"role": "assistant", "content": [*thinking, {"type": "text", "text": "Which?"}]},
             {"role": "user", "content": "Any."}]
    plain = [*turns[:1], {"role": "assistant", "content": "Which?"}, turns[2]]
    with_thinking = await messages(client, max_tokens=12, messages=turns)
    without = await messages(client, max_tokens=12, messages=plain)
    assert with_thinking["content"] == without["content"]
    assert with_thinking["usage"]["input_tokens"] + \
        with_thinking["usage"]["cache_read_input_tokens"] == \
        without["usage"]["input_tokens"] + without["usage"]["cache_read_input_tokens"]
    bad = {"model": "", "max_tokens": 1, "messages": [{"role": "user", "content": thinking}]}
    r = await client.post("/v1/messages", json=bad)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_messages_system_turn_inside_the_conversation(client):
    """A message of role system (Anthropic's SystemMessageParam; Claude Code 2.1 sends one
    after the first user turn) is a system turn where it stands."""
    turns = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Which?"},
             {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
             {"role": "user", "content": "Any."}]
    r = await messages(client, max_tokens=12, messages=turns)
    want = await chat(client, [{**t, "content": SYSTEM} if t["role"] == "system" else t
                               for t in turns], max_tokens=12)
    assert r["content"][0]["text"] == want["choices"][0]["message"]["content"]
    bad = {"model": "", "max_tokens": 1, "messages": [{"role": "system", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}
    r = await client.post("/v1/messages", json=bad)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_messages_stop_sequence(client):
    body = {"max_tokens": 16, "messages": [{"role": "user", "content": PROMPT}]}
    text = (await messages(client, **body))["content"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    m = await messages(client, stop_sequences=[stop], **body)
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", stop)
    assert m["content"][0]["text"] == text[:text.index(stop)]


async def test_messages_forced_tool_use_round_trip(client):
    body = {"max_tokens": 80, "tools": [MESSAGES_TOOL],
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    m = await messages(client, tool_choice={"type": "tool", "name": "get_weather"}, **body)
    (use,) = [b for b in m["content"] if b["type"] == "tool_use"]
    assert m["stop_reason"] == "tool_use" and use["name"] == "get_weather"
    jsonschema.validate(use["input"], WEATHER)
    history = [*body["messages"], {"role": "assistant", "content": m["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                             "content": "sunny"}]}]
    answer = await messages(client, **{**body, "messages": history, "max_tokens": 10})
    want = await chat(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use["id"], "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(use["input"])}}]},
        {"role": "tool", "tool_call_id": use["id"], "content": "sunny"}],
        tools=[CHAT_TOOL], max_tokens=10)
    assert answer["content"][0]["text"] == want["choices"][0]["message"]["content"]


async def test_messages_streamed_tool_use_equals_whole(client):
    body = {"model": "", "max_tokens": 80, "temperature": 0, "tools": [MESSAGES_TOOL],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [{"role": "user", "content": "Weather?"}]}
    whole = await messages(client, **body)
    events = await read_events(client, "/v1/messages", {**body, "stream": True})
    partial = [d["delta"]["partial_json"] for n, d in events
               if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    uses = [b for b in whole["content"] if b["type"] == "tool_use"]
    assert [json.loads(p) for p in partial] == [u["input"] for u in uses] and uses
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("body, status, kind", [
    ({"model": "", "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error"),  # no max_tokens
    ({"model": "nope", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error"),
    ({"model": "", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error"),
    ({"model": "", "max_tokens": 10**9, "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error"),
])
async def test_messages_errors_in_anthropics_shape(client, body, status, kind):
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
    assert set(r.json()["error"]) == {"type", "message"}


async def test_messages_auth_by_x_api_key_or_bearer(tiny_pair):
    body = {"model": "", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    async with served(*tiny_pair, api_key="k") as (c, _):
        r = await c.post("/v1/messages", json=body)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert (await c.post("/v1/messages", json=body, headers={"x-api-key": "k",
                                                                 "anthropic-version": "2023-06-01"})
                ).status_code == 200
        assert (await c.post("/v1/messages", json=body, headers={"authorization": "Bearer k"})
                ).status_code == 200
        r = await c.post("/v1/responses", json={"input": "x"}, headers={"x-api-key": "bad"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


async def test_full_queue_is_529_overloaded_for_messages(tiny_pair):
    long = {"model": "", "max_tokens": 3000, "use_draft": False,
            "messages": [{"role": "user", "content": "x"}]}
    short = {**long, "max_tokens": 2}
    async with served(*tiny_pair, max_queue_size=1, engine={"max_batch_size": 1}) as (c, e):
        running = asyncio.create_task(c.post("/v1/messages", json=long))
        while e.batch_size < 1:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(c.post("/v1/messages", json=short))
        while e.queue_depth < 1:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/messages", json=short)
        assert r.status_code == 529 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "overloaded_error"
        running.cancel()
        assert (await waiting).status_code == 200
