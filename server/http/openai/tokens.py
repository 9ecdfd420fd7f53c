"""POST /tokenize, POST /detokenize and GET /tokenizer_info, in vLLM's shape: count a prompt's
tokens before sending it, and let lm-evaluation-harness (`tokenizer_backend=remote`) and other
tools use the served model's own tokenizer."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from api_schemas.tokens import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from server.engine import text_tokens
from server.http.common.auth import require_api_key
from server.http.common.bodies import OffLoopJson
from server.http.common.request_mapping import chat_prompt, check_token_ids, serving

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["tokenizer"],
                   route_class=OffLoopJson)


@router.post("/tokenize", summary="Tokenize a prompt or a chat",
             description="The tokens `/v1/completions` (`prompt`) or `/v1/chat/completions`"
             " (`messages`, `tools`) would prefill.")
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    engine = request.app.state.engine

    def tokenized() -> TokenizeResponse:  # in a worker thread: a long prompt takes seconds
        tokenizer = engine.tokenizer
        if body.messages is not None:
            tokens = chat_prompt(engine, body)
        elif body.add_special_tokens:
            tokens = text_tokens(tokenizer, body.prompt)
        else:
            tokens = list(tokenizer.encode(body.prompt, add_special_tokens=False))
        strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=engine.context_length,
                                tokens=tokens, token_strs=strs)

    async with serving(engine, body.model):
        return await asyncio.to_thread(tokenized)


@router.post("/detokenize", summary="Decode token ids")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    engine = request.app.state.engine
    async with serving(engine, body.model):
        check_token_ids(engine.target.vocab_size, body.tokens, "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(engine.tokenizer.decode,
                                                                 body.tokens))


@router.get("/tokenizer_info", summary="The served tokenizer's special tokens and template")
async def tokenizer_info(request: Request) -> TokenizerInfo:
    engine = request.app.state.engine
    hf = engine.tokenizer._tokenizer
    return TokenizerInfo(
        tokenizer_class=type(hf).__name__, bos_token=hf.bos_token, eos_token=hf.eos_token,
        pad_token=hf.pad_token, model_max_length=engine.context_length,
        chat_template=hf.chat_template if isinstance(hf.chat_template, str) else None)

