"""Dropping a conversation's earliest exchanges when it is longer than the context, instead of
failing with a 400: the Responses API's `truncation: "auto"` and Ollama's `/api/chat` (its
`truncate`, default true).

What is kept: every system (or developer) message, and the conversation from a user message on,
the earliest such cut that leaves the context room for the request's token limit (one token
without one). Cutting only before a user message keeps every tool call with its result and the
roles in the order chat templates expect. The last user message and what follows it are never
cut: if they alone do not fit, the usual 400 follows.
"""

from __future__ import annotations

from api_schemas.openai import ChatCompletionRequest
from server.engine import InferenceEngine
from server.http.common.request_mapping import chat_prompt

SYSTEM = ("system", "developer")


def fit_to_context(engine: InferenceEngine, body: ChatCompletionRequest, *, truncate: bool
                   ) -> tuple[ChatCompletionRequest, list[int]]:
    """`body` and its prompt; with `truncate`, `body` with the fewest earliest exchanges dropped
    for its prompt to fit (`body` itself when it fits whole or nothing would)."""
    prompt = chat_prompt(engine, body)
    context = engine.context_length
    needed = body.token_limit() or 1
    if not truncate or context is None or len(prompt) + needed <= context:
        return body, prompt
    messages = body.messages
    first = next((i for i, m in enumerate(messages) if m.role not in SYSTEM), len(messages))
    cuts = [i for i in range(first + 1, len(messages)) if messages[i].role == "user"]
    best = None
    low, high = 0, len(cuts) - 1
    while low <= high:  # the prompt shrinks as the cut moves on: the first cut that fits
        middle = (low + high) // 2
        kept = [m for m in messages[:cuts[middle]] if m.role in SYSTEM]
        candidate = body.model_copy(update={"messages": kept + messages[cuts[middle]:]})
        tokens = chat_prompt(engine, candidate)
        if len(tokens) + needed <= context:
            best, high = (candidate, tokens), middle - 1
        else:
            low = middle + 1
    return best or (body, prompt)
