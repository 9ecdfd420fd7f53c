"""From an OpenAI request body to the engine's GenerationParams (HTTP side, no MLX)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from api_schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    StructuredOutputs,
)
from server.config import GenerationDefaults
from server.engine import (
    RESERVED_TEMPLATE_KWARGS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    GenerationParams,
    GrammarError,
    InferenceEngine,
    SamplingParams,
    SpeculationParams,
    grammars_for,
    lazy_tool_calls,
    reasoning_budget,
    supported_markers,
    text_tokens,
)
from server.http.common.chat_translation import caller_field
from server.http.common.errors import APIError
from server.http.common.tools import own_call_syntax, render_chat


@asynccontextmanager
async def serving(engine: InferenceEngine, requested: str | None) -> AsyncIterator[None]:
    """Run the block on the target `requested` (a request's `model`) selects: when it names
    another of `models.more_targets`, once the server switched to it; no switch happens
    before the block exits. A 404 for a name that no target answers to."""
    switcher = engine.switcher
    if switcher.entry_named(requested) is None and not engine.serves(requested):
        names = [engine.model_name] + [e.name for e in switcher.standby()]
        raise APIError(404, f"model {requested!r} does not exist; this server serves "
                       + " or ".join(map(repr, names)), param="model", code="model_not_found")
    async with switcher.hold(requested):
        yield


def chat_prompt(engine: InferenceEngine, body: ChatCompletionRequest) -> list[int]:
    """`body`: anything with `messages` and `active_tools()` (a chat or a /tokenize body)."""
    messages = [m.template_dict() for m in body.messages]
    kwargs = {**engine.chat_template_kwargs, **template_kwargs(body)}
    try:
        return render_chat(engine.tokenizer, messages, body.active_tools(), kwargs,
                           continue_final=body.continue_final_message,
                           generation_prompt=body.generation_prompt())
    except Exception as e:  # a template that rejects this conversation (roles, order)
        raise APIError(400, f"chat template failed: {e}",
                       param=caller_field("messages")) from e



def template_kwargs(body) -> dict:
    """A chat body's template variables (`chat_template_kwargs`, `reasoning_effort`)."""
    kwargs = body.template_kwargs()
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                       param="chat_template_kwargs", code="invalid_value")
    return kwargs


def completion_prompt(engine: InferenceEngine, prompt: str | list[int],
                      suffix: str | None = None) -> list[int]:
    """One prompt of a /v1/completions body (a string or token ids) as token ids; with a
    `suffix`, the fill-in-the-middle prompt of the text between them."""
    if suffix:
        return fim_prompt(engine, prompt, suffix)
    if len(prompt) == 0:
        raise APIError(400, "a prompt must not be empty (with a suffix, it may be)",
                       param="prompt")
    if isinstance(prompt, str):
        tokens = text_tokens(engine.tokenizer, prompt)
        if not tokens:
            raise APIError(400, "prompt encodes to no tokens", param="prompt")
        return tokens
    check_token_ids(engine.target.vocab_size, prompt, "prompt")
    return list(prompt)


def fim_prompt(engine: InferenceEngine, prefix: str | list[int], suffix: str) -> list[int]:
    fim = engine.target.fim
    if fim is None:
        raise APIError(400, "suffix needs a model trained to fill in the middle, whose"
                       " vocabulary has the markers of one of these formats: "
                       f"{supported_markers()}; this one has none", param="suffix")
    encode = engine.tokenizer.encode
    if isinstance(prefix, str):
        prefix = encode(prefix, add_special_tokens=False)
    check_token_ids(engine.target.vocab_size, prefix, "prompt")
    return fim.prompt(list(prefix), encode(suffix, add_special_tokens=False))


def check_token_ids(vocab: int, ids: list[int], param: str, code: str | None = None) -> None:
    """400 unless every id is in a vocabulary of `vocab` tokens."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{param} token ids out of range [0, {vocab}): {bad[:5]}",
                       param=param, code=code)


def sampling_params(body: SamplingRequest, defaults: GenerationDefaults, tokenizer, vocab: int):
    bias = tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items())
    if any(not 0 <= k < vocab for k, _ in bias):
        raise APIError(400, f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
    sizes = {name: getattr(body, name) for name in ("repetition_context_size",
             "presence_context_size", "frequency_context_size") if getattr(body, name)}
    xtc = {}
    if body.xtc_probability:  # mlx_lm.server's special tokens: a newline and the EOS tokens
        special = list(tokenizer.encode("\n", add_special_tokens=False))
        xtc = {"xtc_probability": body.xtc_probability,
               "xtc_special_tokens": tuple(special + sorted(tokenizer.eos_token_ids))}
        if body.xtc_threshold is not None:
            xtc["xtc_threshold"] = body.xtc_threshold
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=min(defaults.top_k if body.top_k is None else body.top_k, vocab),
        min_p=defaults.min_p if body.min_p is None else body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=bias,
        seed=body.seed,
        **sizes, **xtc,
    )


def generation_params(
    body: ChatCompletionRequest | CompletionRequest,
    prompt: list[int],
    engine: InferenceEngine,
    defaults: GenerationDefaults,
    target: str = "",
    *,
    fill_context: bool = False,
    tenant: str = "",
) -> GenerationParams:
    """`target`: the fingerprint of the target `prompt` was tokenized for; `tenant`: whose
    served texts it may draft from (`auth.tenant_of`)."""
    max_tokens = enforce_model_limits(body, prompt, engine, defaults, fill_context=fill_context)
    speculation_defaults = SpeculationParams(
        source=defaults.draft,
        acceptance=body.acceptance or defaults.acceptance,
        adaptive=defaults.adaptive if body.adaptive is None else body.adaptive,
        draft_p_min=defaults.draft_p_min if body.draft_p_min is None else body.draft_p_min,
        hybrid_min_match=(defaults.hybrid_min_match if body.hybrid_min_match is None
                          else body.hybrid_min_match),
    )
    speculation = resolve_speculation(body, engine, speculation_defaults)
    if isinstance(body, ChatCompletionRequest):
        logprobs, top = body.logprobs, body.top_logprobs or 0
    else:
        logprobs, top = body.logprobs is not None, body.logprobs or 0
    return GenerationParams(
        prompt_tokens=tuple(prompt),
        max_tokens=max_tokens,
        sampling=sampling_params(body, defaults, engine.tokenizer, engine.target.vocab_size),
        speculation=speculation,
        stop=tuple(body.stop_list()),
        logprobs=logprobs,
        top_logprobs=top,
        **eos_controls(body, engine),
        cache_prompt=body.cache_prompt is not False,
        constraint=reply_constraint(body, engine, prompt),
        prediction=prediction_tokens(body, engine),
        priority=body.priority or 0,
        target=target,
        tenant=tenant,
    )


def resolve_speculation(body: SamplingRequest, engine: InferenceEngine,
                        defaults: SpeculationParams) -> SpeculationParams:
    """How the request drafts (`SpeculationPolicy.for_request`). A prediction drafts with no
    draft model (its rounds are lookup rounds): when the server's default drafter is the draft
    model and none is loaded, it drafts by prompt lookup rather than not at all."""
    def resolve(draft):
        return engine.resolve_speculation(use_draft=body.use_draft, defaults=defaults,
                                          num_draft_tokens=body.num_draft_tokens, draft=draft)

    speculation = resolve(body.draft)
    if not speculation.num_draft_tokens and body.draft is None and \
            getattr(body, "prediction", None) is not None:
        speculation = resolve("prompt_lookup")  # still none when drafting is turned off
    return speculation


def prediction_tokens(body: SamplingRequest, engine: InferenceEngine) -> tuple[int, ...]:
    """A chat request's `prediction` as tokens (as they would appear in the answer)."""
    prediction = getattr(body, "prediction", None)
    if prediction is None:
        return ()
    if body.use_draft is False or body.num_draft_tokens == 0:
        raise APIError(400, "a prediction drafts the answer: it needs drafting on (use_draft "
                       "and num_draft_tokens)", param="prediction", code="invalid_value")
    return tuple(engine.tokenizer.encode(prediction.text(), add_special_tokens=False))


# ---------------------------------------------------------------- structured output and EOS
def eos_controls(body: SamplingRequest, engine: InferenceEngine) -> dict:
    """vLLM's `ignore_eos`, `min_tokens` (at most max_tokens, as vLLM checks) and
    `stop_token_ids` (in the vocabulary)."""
    check_token_ids(engine.target.vocab_size, body.stop_token_ids or [], "stop_token_ids")
    min_tokens, max_tokens = body.min_tokens or 0, body.token_limit()
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({min_tokens}) must be at most "
                       f"{caller_field('max_tokens')} ({max_tokens})", param="min_tokens",
                       code="invalid_value")
    return {"ignore_eos": bool(body.ignore_eos), "min_tokens": min_tokens,
            "stop_token_ids": tuple(body.stop_token_ids or ())}


def reply_constraint(body: SamplingRequest, engine: InferenceEngine, prompt: list[int]):
    """What constrains the reply: a grammar (`output_constraint`), else a thinking model's
    `reasoning_budget` (a grammar leaves no room to think), else the calls the model may
    write by itself (`lazy_calls`), else nothing."""
    grammar = output_constraint(body, engine)
    if grammar is not None:
        return grammar
    budget = getattr(body, "reasoning_budget", None)
    if budget is not None:
        return reasoning_budget(engine.tokenizer, budget, engine.target.vocab_size, prompt)
    return lazy_calls(body, engine)


def lazy_calls(body: SamplingRequest, engine: InferenceEngine):
    """With tools offered and not forced, the calls a model writes by itself held to the
    functions' schemas from its `<tool_call>` token on, in its own syntax (Hermes' JSON or
    Qwen3-Coder's XML; `server.engine.structured.lazy_grammar`); None for models that write calls
    another way, or without those tokens."""
    tools = body.active_tools() if isinstance(body, ChatCompletionRequest) else None
    syntax = own_call_syntax(engine.tokenizer) if tools else None
    if syntax is None:
        return None
    functions = [t["function"] for t in tools if t.get("type") == "function"]
    return lazy_tool_calls(grammars_for(engine.tokenizer), engine.target.vocab, functions,
                           TOOL_CALL_START, TOOL_CALL_END, syntax) if functions else None


def output_constraint(body: SamplingRequest, engine: InferenceEngine):
    """The grammar the output must follow, or None: vLLM's `structured_outputs` (any route),
    else a forced tool call (tool_choice required or named), which wins over `response_format`.
    The schema refuses `structured_outputs` beside either of the others."""
    wanted = _wanted_grammar(body, own_call_syntax(engine.tokenizer) or "json")
    if wanted is None:
        return None
    param, compile_grammar = wanted
    param = caller_field(param)
    try:
        return compile_grammar(grammars_for(engine.tokenizer))
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_schema") from e


def _wanted_grammar(body: SamplingRequest, syntax: str):
    """(the field that asks, a function compiling its grammar from a `Grammars`), or None;
    `syntax`: how forced calls are written ("json" or "xml")."""
    if body.structured_outputs is not None:
        return "structured_outputs", _structured_grammar(body.structured_outputs)
    if not isinstance(body, ChatCompletionRequest):
        return None
    functions = body.forced_functions()
    if functions is not None:
        parallel = body.parallel_tool_calls is not False and body.named_tool() is None
        return "tools", lambda g: g.tool_calls(functions, parallel=parallel, syntax=syntax)
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "response_format", lambda g: g.json_object()
    spec = fmt.json_schema
    return "response_format", lambda g: g.json_schema(spec.schema_ or {},
                                                      strict=bool(spec.strict))


def _structured_grammar(spec: StructuredOutputs):
    if spec.json_ is not None:
        return lambda g: g.json_schema(spec.json_)
    if spec.json_object:
        return lambda g: g.json_object()
    if spec.regex is not None:
        return lambda g: g.regex(spec.regex)
    if spec.choice is not None:
        return lambda g: g.choice(spec.choice)
    return lambda g: g.grammar(spec.grammar)


# ---------------------------------------------------------------- bounds of the loaded model
# The schema checks what it can alone; these bounds depend on the model that is loaded.
def enforce_model_limits(
    body: ChatCompletionRequest | CompletionRequest,
    prompt: list[int],
    engine: InferenceEngine,
    defaults: GenerationDefaults,
    *,
    fill_context: bool = False,
) -> int:
    """400 for what the loaded model cannot do; return the number of tokens to generate.

    A prompt must leave room for one token; an explicit max_tokens must fit the context left
    after the prompt (OpenAI's 400, naming the numbers), unless `defaults.fit_max_tokens` cuts
    it to that room; the default is cut to that room, or is that room with `fill_context`.
    `top_k` may be at most the vocabulary size (equal to it keeps every token, like 0).
    """
    vocab = engine.target.vocab_size
    if body.top_k is not None and body.top_k > vocab:
        raise APIError(400, f"top_k must be in [0, {vocab}] (the vocabulary size), "
                       f"got {body.top_k}", param="top_k", code="invalid_value")
    prompt_param = caller_field("messages" if isinstance(body, ChatCompletionRequest)
                                else "prompt")
    tokens = _fit_context(body, prompt, engine, defaults, fill_context, prompt_param)
    return _fit_memory(body, prompt, engine, defaults, tokens, prompt_param)


def _max_tokens_name(body: ChatCompletionRequest | CompletionRequest) -> str:
    return caller_field("max_completion_tokens" if getattr(body, "max_completion_tokens", None)
                        else "max_tokens")


def _fit_context(body, prompt: list[int], engine: InferenceEngine,
                 defaults: GenerationDefaults, fill_context: bool, prompt_param: str) -> int:
    requested = body.token_limit()
    context = engine.context_length  # the target config's max_position_embeddings
    if context is None:
        return requested or defaults.max_tokens
    if len(prompt) >= context:
        raise APIError(400, f"this model's maximum context length is {context} tokens, but the "
                       f"prompt has {len(prompt)} tokens; shorten the {prompt_param}",
                       param=prompt_param, code="context_length_exceeded")
    room = context - len(prompt)
    if requested is None:
        return room if fill_context else min(defaults.max_tokens, room)
    if requested > room and defaults.fit_max_tokens:
        return room
    if requested > room:
        name = _max_tokens_name(body)
        raise APIError(400, f"this model's maximum context length is {context} tokens; the "
                       f"prompt has {len(prompt)}, so {name} may be at most {room} "
                       f"(got {requested})", param=name, code="context_length_exceeded")
    return requested


def _fit_memory(body, prompt: list[int], engine: InferenceEngine,
                defaults: GenerationDefaults, tokens: int, prompt_param: str) -> int:
    """`tokens` to generate, within what one request may hold in the memory budget: a
    default is cut to the room the prompt leaves there (an explicit one too with
    `fit_max_tokens`); else a 400 that names the limit (`memory_budget_exceeded`)."""
    room = engine.memory_room()
    if room is None or len(prompt) + tokens <= room:
        return tokens
    if len(prompt) < room and (body.token_limit() is None or defaults.fit_max_tokens):
        return room - len(prompt)
    engine.check_memory(len(prompt), tokens, prompt_name=prompt_param,
                        max_tokens_name=_max_tokens_name(body))
    return tokens
