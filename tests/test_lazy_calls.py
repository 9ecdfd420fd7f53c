"""Calls a model writes by itself (`tool_choice` auto) held to the offered functions' schemas
from its `<tool_call>` token on (`server.engine.lazy_grammar`): the constraint alone, then the
server against `mlx_lm` driven by the same rule, with and without drafts."""

from __future__ import annotations

import json

import anyio
import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from conftest import served
from mlx_lm import load, stream_generate
from tool_call_model import OPENS_AT, PROMPT, TOOLS, build_tool_call_pair

from server.engine.grammar import grammars_for
from server.engine.lazy_grammar import LazyConstraint, lazy_tool_calls
from server.http.tools import render_chat

pytestmark = pytest.mark.anyio
MAX = 60
MESSAGES = [{"role": "user", "content": PROMPT}]


def prompt_tokens(tokenizer) -> list[int]:
    return render_chat(tokenizer, MESSAGES, TOOLS)


@pytest.fixture(scope="module")
def call_pair(tiny_pair, tmp_path_factory):
    return build_tool_call_pair(tiny_pair, tmp_path_factory.mktemp("calls"), prompt_tokens)


@pytest.fixture(scope="module")
def model_and_tokenizer(call_pair):
    return load(str(call_pair[0]))


def constraint_of(tokenizer) -> LazyConstraint:
    vocab = tokenizer.get_vocab()
    build = lazy_tool_calls(grammars_for(tokenizer), vocab, [TOOLS[0]["function"]],
                            "<tool_call>", "</tool_call>")
    return build()


def driven(model, tokenizer, constraint) -> tuple[str, list[int]]:
    """mlx_lm's greedy reply with `constraint` masking its logits (None: unconstrained)."""
    prompt = prompt_tokens(tokenizer)
    consumed = 0

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal consumed
        new = tokens[len(prompt) + consumed:].tolist()
        if new:
            assert constraint.consume(new) == len(new)
            consumed += len(new)
        mask = constraint.allowed()
        if mask is None:
            return logits
        full = np.zeros(logits.shape[-1], dtype=bool)
        full[: len(mask)] = mask[: logits.shape[-1]]
        return mx.where(mx.array(full), logits, -mx.inf)

    processors = [process] if constraint is not None else []
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=MAX,
                               logits_processors=processors))
    return "".join(r.text for r in out), [r.token for r in out]


def test_free_until_the_marker_then_one_valid_call_then_free(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    start, end = (tokenizer.get_vocab()[t] for t in ("<tool_call>", "</tool_call>"))
    constraint = constraint_of(tokenizer)
    assert constraint.allowed() is None and constraint.forced() == []
    body = tokenizer.encode('\n{"name": "get_weather", "arguments": {"city": "Paris", '
                            '"unit": "celsius"}}\n', add_special_tokens=False)
    assert constraint.consume([5, start]) == 2
    assert constraint.allowed() is not None  # inside the call
    assert tokenizer.decode(constraint.forced()).startswith('\n{"name": "get_weather"')
    assert constraint.consume(body + [end, 7]) == len(body) + 2
    assert constraint.allowed() is None  # closed: free text again
    constraint.rollback(2)  # back inside, before `</tool_call>`
    assert constraint.forced() == [end]
    constraint.rollback(len(body) + 1)  # before the marker
    assert constraint.allowed() is None
    bad = tokenizer.encode('\n{"name": "get_time"', add_special_tokens=False)
    assert constraint.consume([start] + bad) < len(bad) + 1  # an unknown function: refused


def test_the_servers_call_is_mlx_lms_under_the_rule_and_it_validates(call_pair,
                                                                       model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    expected, tokens = driven(model, tokenizer, constraint_of(tokenizer))
    raw, _ = driven(model, tokenizer, None)
    assert tokenizer.get_vocab()["<tool_call>"] in tokens[:OPENS_AT]  # it opens a call
    assert raw != expected  # without the rule the random model's call is something else
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX, "temperature": 0}
    async def run():
        async with served(*call_pair) as (client, _):
            return [(await client.post("/v1/chat/completions", json={**body, **extra})).json()
                    for extra in ({"use_draft": False}, {"num_draft_tokens": 3},
                                  {"draft": "prompt_lookup"})]

    call = json.loads(expected.split("<tool_call>")[1].split("</tool_call>")[0])
    jsonschema.validate(call["arguments"], TOOLS[0]["function"]["parameters"])
    for reply in anyio.run(run):
        calls = reply["choices"][0]["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls][:1] == [(call["name"], call["arguments"])], reply
        assert reply["usage"]["completion_tokens"] == len(tokens)
        before, rest = expected.split("<tool_call>")
        assert reply["choices"][0]["message"]["content"] == before + rest.split("</tool_call>")[1]
    # The call's frame and the lone function's name are forced: they draft themselves.
    assert reply["stats"]["draft_tokens_accepted"] > 0
