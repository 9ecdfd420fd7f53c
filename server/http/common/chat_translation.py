"""What the Responses and Messages translations share: a chat completion request built from
their fields (validated by the chat schema, its errors renamed to the caller's fields)."""

from __future__ import annotations

from contextlib import contextmanager

from pydantic import BaseModel, ValidationError

from api_schemas.openai import ChatCompletionRequest
from server.http.common.errors import APIError


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def with_tool_call(messages: list[dict], call: dict) -> None:
    """Append `call` to the assistant turn that ends `messages`, or start one."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def chat_request(fields: dict, renames: dict[str, str]) -> ChatCompletionRequest:
    """`fields` of a chat completion request (None values dropped) -> the validated request."""
    return validated(ChatCompletionRequest, fields, renames)


def validated(model: type[BaseModel], fields: dict, renames: dict[str, str]):
    """`fields` (None values dropped) validated as `model`; a 400 names the caller's field."""
    try:
        return model.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        param = renames.get(loc.split(".")[0], loc) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        raise APIError(400, f"{param}: {message}" if param else message, param=param,
                       code="invalid_value") from e


@contextmanager
def renamed_params(renames: dict[str, str]):
    """A 400 the chat path raises names chat fields (`max_completion_tokens`, `messages`): name
    the caller's instead."""
    try:
        yield
    except APIError as e:
        if e.param in renames:
            e.message = e.message.replace(e.param, renames[e.param])
            e.param = renames[e.param]
        raise
