"""One request through the engine, for every generation API: the chat request's prompt, its
GenerationParams, the scheduler, then a `ResponseFormat` per choice that shapes the answer,
streamed or collected. The Responses and Messages routes translate their bodies into a chat
completion request and come through here too, so there is one generation path.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from api_schemas.openai import ChatCompletionRequest, CompletionRequest
from server.engine.params import GenerationParams
from server.http.common.choices import Choices
from server.http.common.reasoning import ReplyStart
from server.http.common.request_ids import request_id
from server.http.common.request_log import log_finished
from server.http.common.request_mapping import generation_params, serving
from server.http.common.streaming import ResponseFormat, collect, stream_response
from server.http.common.tools import ToolCallParser, parser_factory
from server.http.common.truncation import fit_to_context

# Builds the format of a chat request's answer from its tool-call parser factory (or None)
# and where its reply starts (`ReplyStart`: the prompt, whether a grammar holds the reply).
FormatFactory = Callable[[Callable[[], ToolCallParser] | None, ReplyStart], ResponseFormat]


def plan(request: Request, body: ChatCompletionRequest | CompletionRequest,
         prompts: list[list[int]], target: str, *,
         fill_context: bool = False) -> list[GenerationParams]:
    """Each prompt's GenerationParams; a 4xx for what the loaded model cannot do.

    `target`: the fingerprint of the target read before the prompts were tokenized (the
    scheduler refuses them if another one serves by then). `fill_context`: without a token
    limit, generate up to the end of the context (the Responses API's rule), not
    `defaults.max_tokens`."""
    state = request.app.state
    return [generation_params(body, prompt, state.engine, state.settings.defaults, target,
                              fill_context=fill_context) for prompt in prompts]


async def run(request: Request, body: ChatCompletionRequest | CompletionRequest,
              params: list[GenerationParams], formats: list[ResponseFormat], *,
              ndjson: bool = False):
    """Generate `body.n` choices per prompt; `formats`: one per choice, in index order;
    `ndjson`: stream JSON lines (Ollama's API), not SSE."""
    state = request.app.state
    choices = Choices(state.engine, params, body.n)
    formats = [fmt.sibling_of(formats[0], i) for i, fmt in enumerate(formats)]
    endpoint = request.url.path

    def observe(done):
        state.metrics.observe(endpoint, done.finish_reason, done.stats)
        log_finished(endpoint, done.finish_reason, done.stats, request_id(request))

    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream_response(choices, formats, usage, observe, ndjson=ndjson)
    return await collect(choices, formats, observe, request.is_disconnected)


async def complete_chat(request: Request, body: ChatCompletionRequest,
                        make_format: FormatFactory, *, fill_context: bool = False,
                        ndjson: bool = False, truncate: bool = False):
    """`truncate`: drop the earliest exchanges that do not fit in the context
    (`truncation.fit_to_context`)."""
    engine = request.app.state.engine
    async with serving(engine, body.model):
        target = engine.target.fingerprint  # before anything is tokenized
        tools = parser_factory(engine.tokenizer, body.active_tools(),
                               forced=body.forced_functions() is not None)
        body, prompt = fit_to_context(engine, body, truncate=truncate)
        params = plan(request, body, [prompt], target, fill_context=fill_context)
        start = ReplyStart(prompt, constrained=body.constrains_output())
        formats = [make_format(tools, start) for _ in range(body.n)]
        return await run(request, body, params, formats, ndjson=ndjson)
