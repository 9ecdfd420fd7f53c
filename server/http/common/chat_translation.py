"""What the Responses, Messages and Ollama translations share: a chat completion request built
from their fields (validated by the chat schema), and its errors naming the caller's fields:
the mapping's renames are carried to where each message is written (`caller_field`)."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

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


# The chat fields' names in the API being translated ({} for OpenAI's chat): set by
# `renamed_params` around the chat path, read where an error names a field.
_CALLER_FIELDS: ContextVar[dict[str, str] | None] = ContextVar("caller_fields", default=None)


def caller_field(name: str) -> str:
    """The name the caller's API gives the chat field `name` (`max_completion_tokens` is the
    Messages API's `max_tokens`), for the errors the chat path writes."""
    return (_CALLER_FIELDS.get() or {}).get(name, name)


@contextmanager
def renamed_params(renames: dict[str, str]):
    """Run the chat path for an API whose fields have other names (`renames`: chat field ->
    the API's): its errors name the API's fields (`caller_field`), their `param` too."""
    token = _CALLER_FIELDS.set(renames)
    try:
        yield
    except APIError as e:
        e.param = renames.get(e.param, e.param)
        raise
    finally:
        _CALLER_FIELDS.reset(token)
