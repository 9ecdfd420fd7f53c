"""A Responses API request -> the chat completion request that the engine path takes, and the
response object it echoes. Input items become chat messages: a message item a turn, a
function_call or custom_tool_call an assistant tool call (`server.http.openai.responses.tools` names
it as the model was offered it), a function_call_output or custom_tool_call_output a `tool`
turn."""

from __future__ import annotations

from pydantic import TypeAdapter

from api_schemas.openai import ChatCompletionRequest
from api_schemas.responses import (
    CustomToolCallInput,
    CustomToolCallItem,
    FunctionCallInput,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    InputItem,
    InputMessageItem,
    InputText,
    ReasoningInput,
    ReasoningItem,
    ResponseItem,
    ResponseObject,
    ResponsesRequest,
    item_id,
)
from server.http.common.chat_translation import chat_request, with_tool_call
from server.http.openai.responses.tools import ToolTable, history_call

# Chat fields a chat-side 400 names -> the Responses fields they came from.
RENAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "max_tokens": "max_output_tokens"}
_ITEMS = TypeAdapter(list[InputItem])


def input_messages(items: str | list | None) -> list[dict]:
    """Input (text, or input items; None: none) -> chat messages."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning = ""  # goes to the assistant turn after it
    for item in items:
        if isinstance(item, ReasoningInput):
            reasoning += item.text()
            continue
        if isinstance(item, (FunctionCallInput, CustomToolCallInput)):
            with_tool_call(messages, history_call(item))
        elif isinstance(item, FunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
        else:
            messages.append({"role": item.role, "content": item.text()})
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
            reasoning = ""
    return messages


def request_items(items: str | list) -> list[ResponseItem]:
    """Input (text, or input items) -> the items `input_items` lists, each with an id (the
    client's, else a new one)."""
    if isinstance(items, str):
        return [InputMessageItem(id=item_id("msg"), role="user",
                                 content=[InputText(type="input_text", text=items)])]
    listed: list[ResponseItem] = []
    for item in items:
        if isinstance(item, FunctionCallInput):
            listed.append(FunctionCallItem(id=item.id or item_id("fc"), call_id=item.call_id,
                                           name=item.name, arguments=item.arguments,
                                           namespace=item.namespace))
        elif isinstance(item, CustomToolCallInput):
            listed.append(CustomToolCallItem(id=item.id or item_id("ctc"), call_id=item.call_id,
                                             name=item.name, input=item.input,
                                             namespace=item.namespace))
        elif isinstance(item, FunctionCallOutput):
            listed.append(FunctionCallOutputItem(id=item.id or item_id("fco"), type=item.type,
                                                 call_id=item.call_id, output=item.text()))
        elif isinstance(item, ReasoningInput):
            listed.append(ReasoningItem(id=item.id or item_id("rs"), summary=item.summary,
                                        content=item.content,
                                        encrypted_content=item.encrypted_content))
        else:
            kind = "output_text" if item.role == "assistant" else "input_text"
            content = [InputText(type=kind, text=item.content)] \
                if isinstance(item.content, str) else item.content
            listed.append(InputMessageItem(id=item.id or item_id("msg"), role=item.role,
                                           content=content))
    return listed


def item_messages(items: list[ResponseItem]) -> list[dict]:
    """Stored items (an input history, a response's output) as chat messages: what
    previous_response_id brings back."""
    return input_messages(_ITEMS.validate_python([item.model_dump() for item in items]))


def chat_from_responses(body: ResponsesRequest, conversation: list[dict],
                        tools: ToolTable) -> ChatCompletionRequest:
    """`conversation`: the chat messages before the instructions are put in front; `tools`:
    the request's, as the model is offered them."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fmt = body.text.format if body.text else None
    return chat_request({
        "model": body.model,
        "messages": system + conversation,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "tools": tools.chat_tools or None,
        "tool_choice": _tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(fmt),
        "reasoning_effort": body.reasoning.effort if body.reasoning else None,
        "logprobs": body.wants_logprobs(),
        "top_logprobs": body.top_logprobs if body.wants_logprobs() else None,
        **body.extensions(),
    }, RENAMES)


def _tool_choice(body: ResponsesRequest):
    named = body.named_tool()
    if named is not None:  # a top-level tool, offered under its own name
        return {"type": "function", "function": {"name": named}}
    if body.tool_choice == "auto" and not body.offers_tools():
        return None  # hosted tools only: nothing to call
    return body.tool_choice


def _response_format(fmt) -> dict | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description,
            "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items()
                                                   if v is not None}}


def response_skeleton(body: ResponsesRequest, model: str) -> ResponseObject:
    """The response object before generation: what the request set, echoed."""
    return ResponseObject(
        status="in_progress", model=model, instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, metadata=body.metadata or {},
        parallel_tool_calls=body.parallel_tool_calls is not False,
        previous_response_id=body.previous_response_id, store=body.store,
        conversation=None if body.conversation is None else {"id": body.conversation_id()},
        temperature=body.temperature, top_p=body.top_p,
        truncation=body.truncation or "disabled",
        text={"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        if body.text and body.text.format else {"format": {"type": "text"}},
        tool_choice=body.tool_choice.model_dump() if body.named_tool() else
        (body.tool_choice or "auto"),
        tools=[t.model_dump(exclude_none=True) for t in body.tools or ()],
    )
