"""An Ollama request -> the chat or text completion request that the engine path takes.

`options` become the sampling fields (`num_predict` -> max tokens, `repeat_penalty` ->
repetition_penalty, `repeat_last_n` -> its context size, ...); what an option leaves unset is
the server's default, as for every API. `format` "json" -> a JSON object, a schema -> that
schema; `think` -> reasoning on or off. A message's tool calls carry their arguments as an
object (Ollama's way), and a tool result names its tool (`tool_name`). `/api/generate` is a
chat turn (`system`, then `prompt`) unless `raw`, which sends the prompt as it is; `suffix`
fills in the middle, as `/v1/completions` does.
"""

from __future__ import annotations

import json

from api_schemas.ollama import OllamaChatRequest, OllamaGenerateRequest, OllamaOptions
from api_schemas.openai import ChatCompletionRequest, CompletionRequest
from server.http.common.chat_translation import chat_request, tool_call, validated, with_tool_call
from server.http.common.errors import APIError

RENAMES = {"max_completion_tokens": "options.num_predict", "max_tokens": "options.num_predict",
           "repetition_penalty": "options.repeat_penalty",
           "repetition_context_size": "options.repeat_last_n", "stop": "options.stop",
           "response_format": "format", "reasoning_effort": "think"}
WHOLE_CONTEXT = 1_000_000  # repeat_last_n -1: the whole context


def fills_context(body: OllamaChatRequest | OllamaGenerateRequest) -> bool:
    """Ollama's default: no `num_predict` (or a negative one) generates up to the context's end."""
    limit = body.options.num_predict if body.options else None
    return limit is None or limit < 0


def sampling_fields(body: OllamaChatRequest | OllamaGenerateRequest) -> dict:
    options = body.options or OllamaOptions()
    fields = {
        "model": body.model, "stream": body.stream,
        "max_tokens": options.num_predict if options.num_predict not in (None, -1, -2)
        else None,
        "temperature": options.temperature, "top_p": options.top_p, "seed": options.seed,
        "stop": options.stop, "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty, **body.extensions(),
    }
    for name, value in (("top_k", options.top_k), ("min_p", options.min_p),
                        ("repetition_penalty", options.repeat_penalty)):
        if value is not None:
            fields[name] = value
    if options.repeat_last_n == 0:  # Ollama's "off"
        fields.pop("repetition_penalty", None)
    elif options.repeat_last_n is not None:
        fields["repetition_context_size"] = (WHOLE_CONTEXT if options.repeat_last_n == -1
                                             else options.repeat_last_n)
    return fields


def chat_fields(body: OllamaChatRequest | OllamaGenerateRequest) -> dict:
    """The fields a chat turn adds: output format, thinking, log-probabilities."""
    fields = sampling_fields(body)
    fields["max_completion_tokens"] = fields.pop("max_tokens")
    fields["response_format"] = _response_format(body.format)
    if body.think is not None:
        fields["reasoning_effort"] = ("medium" if body.think is True else
                                      "none" if body.think is False else body.think)
    if body.logprobs:
        fields |= {"logprobs": True, "top_logprobs": body.top_logprobs}
    return fields


def _response_format(fmt) -> dict | None:
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt,
                                                       "strict": True}}
    return None


def chat_from_ollama(body: OllamaChatRequest) -> ChatCompletionRequest:
    if not body.messages:
        raise APIError(400, "messages: at least one message is needed", param="messages",
                       code="invalid_value")
    fields = chat_fields(body) | {
        "messages": chat_messages(body),
        "tools": body.tools or None,
        # A final assistant message is continued, as Ollama does.
        "continue_final_message": body.messages[-1].role == "assistant" or None,
    }
    return chat_request(fields, RENAMES)


def chat_messages(body: OllamaChatRequest) -> list[dict]:
    """The chat messages of `body`. Ollama's tool results carry no call id: each answers the
    first call of the turn before that it has not answered yet, of its `tool_name` if named."""
    messages: list[dict] = []
    unanswered: list[tuple[str, str]] = []  # (id, name) of the last assistant turn's calls
    for i, message in enumerate(body.messages):
        if message.images:
            raise APIError(400, f"messages.{i}.images: this server serves text models only",
                           param=f"messages.{i}.images", code="unsupported_content")
        if message.role == "tool":
            messages.append(_tool_result(i, message, unanswered))
            continue
        turn = {"role": message.role, "content": message.content}
        if message.role == "assistant" and message.thinking:
            turn["reasoning_content"] = message.thinking
        messages.append(turn)
        if message.role == "assistant":
            unanswered = [(f"call_{i}_{j}", c.function.name)
                          for j, c in enumerate(message.tool_calls or ())]
        for (call_id, name), call in zip(unanswered, message.tool_calls or (), strict=False):
            with_tool_call(messages, tool_call(call_id, name,
                                               json.dumps(call.function.arguments)))
    return messages


def _tool_result(i: int, message, unanswered: list[tuple[str, str]]) -> dict:
    match = next((c for c in unanswered if message.tool_name in (None, c[1])), None)
    if match is None:
        raise APIError(400, f"messages.{i}: a tool result answers no tool call of the assistant"
                       " turn before it", param=f"messages.{i}", code="invalid_value")
    unanswered.remove(match)
    return {"role": "tool", "content": message.content, "tool_call_id": match[0],
            "name": match[1]}


def generate_from_ollama(body: OllamaGenerateRequest) -> ChatCompletionRequest | CompletionRequest:
    """A chat turn of `system` and `prompt`, or with `raw` or a `suffix`, a text completion."""
    for name in ("images", "template", "context"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported by this server", param=name,
                           code="unsupported_parameter")
    if body.raw or body.suffix is not None:
        if body.format or body.think:
            name = "format" if body.format else "think"
            raise APIError(400, f"{name} needs a chat turn: not with raw or suffix", param=name,
                           code="unsupported_parameter")
        fields = sampling_fields(body) | {"prompt": body.prompt, "suffix": body.suffix}
        if body.logprobs:
            fields["logprobs"] = min(body.top_logprobs or 0, 5)
        return validated(CompletionRequest, fields, RENAMES)
    system = [{"role": "system", "content": body.system}] if body.system else []
    fields = chat_fields(body) | {"messages": [*system, {"role": "user",
                                                         "content": body.prompt}]}
    return chat_request(fields, RENAMES)

