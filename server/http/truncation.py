"""The Responses API's `truncation: "auto"`: a conversation longer than the context loses its
earliest exchanges instead of failing with a 400.

What is kept: the leading system messages (the instructions), and the conversation from a user
message on, the earliest such cut that leaves the context room for `max_output_tokens` (one
token without it). Cutting only before a user message keeps every tool call with its result
and the roles in the order chat templates expect. The request's last user message and what
follows it are never cut: if they alone do not fit, the usual 400 follows.
"""

from __future__ import annotations

from api_schemas.openai import ChatCompletionRequest
from server.engine.service import InferenceEngine
from server.http.request_mapping import chat_prompt

LEADING = ("system", "developer")


def fit_to_context(engine: InferenceEngine, body: ChatCompletionRequest
                   ) -> tuple[ChatCompletionRequest, list[int]]:
    """`body` with the fewest earliest exchanges dropped for its prompt to fit, and that
    prompt; `body` itself when it fits whole or nothing would."""
    prompt = chat_prompt(engine, body)
    context = engine.context_length
    needed = body.token_limit() or 1
    if context is None or len(prompt) + needed <= context:
        return body, prompt
    messages = body.messages
    lead = next((i for i, m in enumerate(messages) if m.role not in LEADING), len(messages))
    cuts = [i for i in range(lead + 1, len(messages)) if messages[i].role == "user"]
    best = None
    low, high = 0, len(cuts) - 1
    while low <= high:  # the prompt shrinks as the cut moves on: the first cut that fits
        middle = (low + high) // 2
        candidate = body.model_copy(update={"messages": messages[:lead] +
                                            messages[cuts[middle]:]})
        tokens = chat_prompt(engine, candidate)
        if len(tokens) + needed <= context:
            best, high = (candidate, tokens), middle - 1
        else:
            low = middle + 1
    return best or (body, prompt)
