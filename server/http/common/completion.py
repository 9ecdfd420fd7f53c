"""One request through the engine, for every generation API: the chat request's prompt, its
GenerationParams, the scheduler, then a `ResponseFormat` per choice that shapes the answer,
streamed or collected. The Responses and Messages routes translate their bodies into a chat
completion request and come through here too, so there is one generation path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import Request

from api_schemas.openai import ChatCompletionRequest, CompletionRequest
from server.engine import GenerationParams, InferenceEngine
from server.http.common.auth import tenant_of
from server.http.common.choices import Choices
from server.http.common.reasoning import ReplyStart
from server.http.common.request_ids import request_id
from server.http.common.request_log import log_finished
from server.http.common.request_mapping import generation_params, serving
from server.http.common.streaming import ResponseFormat, collect, stream_response
from server.http.common.tools import ToolCallParser, parser_factory
from server.http.common.truncation import fit_to_context

Body = ChatCompletionRequest | CompletionRequest
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
    tenant = tenant_of(request)
    return [generation_params(body, prompt, state.engine, state.settings.defaults, target,
                              fill_context=fill_context, tenant=tenant) for prompt in prompts]


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


# The prompts of a request (`tokenize(engine) -> (body, prompts)`: the body as it will run,
# which a truncation may have shortened) and the answer's formats, one per choice in index
# order (`formats(engine, body, prompts, target)`).
Tokenize = Callable[[InferenceEngine], tuple[Body, list[list[int]]]]
Formats = Callable[[InferenceEngine, Body, list[list[int]], str], Awaitable[list[ResponseFormat]]]


async def complete(request: Request, body, tokenize: Tokenize, formats: Formats, *,
                   fill_context: bool = False, ndjson: bool = False):
    """The steps every generation route shares: select the target `body.model` names (after
    a switch it waits for), read its fingerprint before anything is tokenized, tokenize
    (into the chat or text completion request that runs) and plan each prompt's
    GenerationParams (grammars compiled) in a worker thread, build the formats, run.
    Neither step touches MLX, and the event loop runs meanwhile (a tokenizer releases the
    GIL while it encodes; a template's Python yields it every few ms), so `/health` and
    running streams are not held up by a multi-MB prompt."""
    engine = request.app.state.engine

    def prepare(target: str):  # a multi-MB prompt takes seconds: off the event loop
        body_, prompts = tokenize(engine)
        return body_, prompts, plan(request, body_, prompts, target, fill_context=fill_context)

    async with serving(engine, body.model):
        target = engine.target.fingerprint  # before anything is tokenized
        body, prompts, params = await asyncio.to_thread(prepare, target)
        return await run(request, body, params, await formats(engine, body, prompts, target),
                         ndjson=ndjson)


def each_choice(make: Callable[[], ResponseFormat]) -> Formats:
    """`formats` for a request whose choices all look alike: `make()` for each of its `n`."""
    async def formats(engine, body: Body, prompts: list[list[int]], target: str):
        return [make() for _ in range(body.n * len(prompts))]

    return formats


async def complete_chat(request: Request, body: ChatCompletionRequest,
                        make_format: FormatFactory, *, fill_context: bool = False,
                        ndjson: bool = False, truncate: bool = False):
    """`truncate`: drop the earliest exchanges that do not fit in the context
    (`truncation.fit_to_context`)."""
    def tokenize(engine):
        body_, prompt = fit_to_context(engine, body, truncate=truncate)
        return body_, [prompt]

    async def formats(engine, body_: ChatCompletionRequest, prompts, target):
        tools = parser_factory(engine.tokenizer, body_.active_tools(),
                               forced=body_.forced_functions() is not None)
        start = ReplyStart(prompts[0], constrained=body_.constrains_output())
        return [make_format(tools, start) for _ in range(body_.n)]

    return await complete(request, body, tokenize, formats, fill_context=fill_context,
                          ndjson=ndjson)
