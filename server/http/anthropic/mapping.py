"""An Anthropic Messages request -> the chat completion request that the engine path takes.

`system`, and a message of role `system`, become system turns; a user turn's `tool_result`
blocks become `tool` turns (before its text, as Anthropic orders them); an assistant's
`tool_use` blocks become its tool calls; `tool_choice` any -> required, tool -> the named
function, disable_parallel_tool_use -> parallel_tool_calls false. A final assistant message
is continued (Anthropic's prefill): its text starts the reply, which returns what follows.
"""

from __future__ import annotations

import json

from api_schemas.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from api_schemas.openai import ChatCompletionRequest
from server.http.common.chat_translation import chat_request, tool_call, with_tool_call

RENAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
           "response_format": "output_config.format"}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_messages(body: CountTokensRequest) -> list[dict]:
    system = body.system_text()
    messages = [{"role": "system", "content": system}] if system else []
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        text = message.text()
        if message.role == "system":
            messages.append({"role": "system", "content": text})
            continue
        if message.role == "assistant":
            thinking = "".join(b.thinking or "" for b in message.content
                               if isinstance(b, ThinkingBlock) and b.type == "thinking")
            messages.append({"role": "assistant", "content": text,
                             **({"reasoning_content": thinking} if thinking else {})})
            for block in message.content:
                if isinstance(block, ToolUseBlock):
                    with_tool_call(messages, tool_call(block.id, block.name,
                                                       json.dumps(block.input)))
            continue
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                result = block.text()
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": f"Error: {result}" if block.is_error else result})
        if text or not any(isinstance(b, ToolResultBlock) for b in message.content):
            messages.append({"role": "user", "content": text})
    return messages


def chat_from_messages(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request of `body`; a CountTokensRequest gives its prompt only."""
    choice = body.tool_choice
    fields = {
        "model": body.model,
        "messages": chat_messages(body),
        "tools": [{"type": "function",
                   "function": {"name": t.name, "description": t.description,
                                "parameters": t.input_schema}}
                  for t in body.tools or ()] or None,
        "tool_choice": None if choice is None else _CHOICES.get(choice.type) or
        {"type": "function", "function": {"name": choice.name}},
        "parallel_tool_calls": False if choice and choice.disable_parallel_tool_use else None,
        "reasoning_effort": _effort(body.thinking),
        "reasoning_budget": body.thinking.budget_tokens
        if body.thinking is not None and body.thinking.type == "enabled" else None,
        # A final assistant message is a prefill: the reply continues it.
        "continue_final_message": body.messages[-1].role == "assistant",
    }
    if isinstance(body, MessagesRequest):
        fields |= {"max_completion_tokens": body.max_tokens, "stop": body.stop_sequences,
                   "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
                   "response_format": _response_format(body), **body.extensions(),
                   "top_k": body.top_k}
    return chat_request(fields, RENAMES)


def _effort(thinking) -> str | None:
    if thinking is None:
        return None
    return "none" if thinking.type == "disabled" else "medium"


def _response_format(body: MessagesRequest) -> dict | None:
    fmt = body.output_config.format if body.output_config else None
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_,
                                                   "strict": True}}
