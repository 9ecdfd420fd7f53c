"""Calls a model writes by itself (`tool_choice` auto) held to the offered functions' schemas
from its `<tool_call>` token on (`server.engine.structured.lazy_grammar`): the constraint alone,
then the
server against `mlx_lm` driven by the same rule, with and without drafts."""

from __future__ import annotations

import json

import anyio
import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.tool_parsers import qwen3_coder
from support.servers import served
from support.tool_call_model import (
    OPENS_AT,
    PROMPT,
    QWEN3_CODER_TEMPLATE,
    TOOLS,
    build_tool_call_pair,
)

from server.engine.structured.grammar import grammars_for
from server.engine.structured.lazy_grammar import LazyConstraint, lazy_tool_calls
from server.http.common.tools import own_call_syntax, render_chat

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


def constraint_of(tokenizer, syntax: str = "json") -> LazyConstraint:
    vocab = tokenizer.get_vocab()
    build = lazy_tool_calls(grammars_for(tokenizer), vocab, [TOOLS[0]["function"]],
                            "<tool_call>", "</tool_call>", syntax)
    return build()


DRAFTING = ({"use_draft": False}, {"num_draft_tokens": 3}, {"draft": "prompt_lookup"})


def replies(pair, body: dict, extras=DRAFTING) -> list[dict]:
    """The server's answers to `body` under each drafting setting of `extras`."""
    async def run():
        async with served(*pair) as (client, _):
            return [(await client.post("/v1/chat/completions", json={**body, **extra})).json()
                    for extra in extras]

    return anyio.run(run)


def driven(model, tokenizer, constraint, max_tokens: int = MAX) -> tuple[str, list[int]]:
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
    out = list(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
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
    call = json.loads(expected.split("<tool_call>")[1].split("</tool_call>")[0])
    jsonschema.validate(call["arguments"], TOOLS[0]["function"]["parameters"])
    for reply in replies(call_pair, body):
        calls = reply["choices"][0]["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls][:1] == [(call["name"], call["arguments"])], reply
        assert reply["usage"]["completion_tokens"] == len(tokens)
        before, rest = expected.split("<tool_call>")
        assert reply["choices"][0]["message"]["content"] == before + rest.split("</tool_call>")[1]
    # The call's frame and the lone function's name are forced: they draft themselves.
    assert reply["stats"]["draft_tokens_accepted"] > 0


def test_a_forced_call_writes_the_call_tags_as_their_tokens(call_pair, model_and_tokenizer):
    """A model whose `<tool_call>` is a token of its own, forced to call: the grammar writes
    the tags as those tokens (llguidance matches no text to an added token), and the server's
    call is mlx_lm's under that grammar."""
    model, tokenizer = model_and_tokenizer
    forced = grammars_for(tokenizer).tool_calls([TOOLS[0]["function"]], parallel=False)
    expected, tokens = driven(model, tokenizer, forced())
    start, end = (tokenizer.get_vocab()[t] for t in ("<tool_call>", "</tool_call>"))
    assert tokens[0] == start and end in tokens
    call = json.loads(expected.split("<tool_call>")[1].split("</tool_call>")[0])
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": MAX, "temperature": 0,
            "tool_choice": "required", "parallel_tool_calls": False}
    (reply,) = replies(call_pair, body, DRAFTING[:1])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in reply["choices"][0]["message"]["tool_calls"]] == [
        (call["name"], call["arguments"])], reply


# --- Qwen3-Coder's XML calls ------------------------------------------------------------------
XML_MAX = 120  # the tiny vocabulary spells the XML frame out in many tokens


@pytest.fixture(scope="module")
def xml_pair(tiny_pair, tmp_path_factory):
    return build_tool_call_pair(tiny_pair, tmp_path_factory.mktemp("xml-calls"), prompt_tokens,
                                QWEN3_CODER_TEMPLATE)


def test_an_xml_call_is_held_to_its_function_and_its_parameters_types(xml_pair):
    _, tokenizer = load(str(xml_pair[0]))
    assert own_call_syntax(tokenizer) == "xml"  # mlx_lm reads its calls as Qwen3-Coder's
    start, end = (tokenizer.get_vocab()[t] for t in ("<tool_call>", "</tool_call>"))
    good = ("\n<function=get_weather>\n<parameter=city>\nNew <York>\n</parameter>\n"
            "<parameter=unit>\ncelsius\n</parameter>\n</function>\n")
    bad = [good.replace("get_weather", "get_time"),  # an unknown function
           good.replace("New <York>", "A city too long"),  # over maxLength
           good.replace("celsius", "kelvin"),  # not in the enum
           good.replace("<parameter=city>\nNew <York>\n</parameter>\n", "")]  # required
    for text, fits in [(good, True)] + [(b, False) for b in bad]:
        constraint = constraint_of(tokenizer, "xml")
        ids = [start, *tokenizer.encode(text, add_special_tokens=False), end]
        assert (constraint.consume(ids) == len(ids)) is fits, text
    call = qwen3_coder.parse_tool_call(good, TOOLS)
    assert call == {"name": "get_weather", "arguments": {"city": "New <York>",
                                                         "unit": "celsius"}}


def test_the_servers_xml_call_is_mlx_lms_under_the_rule_and_it_validates(xml_pair):
    model, tokenizer = load(str(xml_pair[0]))
    expected, tokens = driven(model, tokenizer, constraint_of(tokenizer, "xml"), XML_MAX)
    raw, _ = driven(model, tokenizer, None, XML_MAX)
    assert tokenizer.get_vocab()["<tool_call>"] in tokens[:OPENS_AT]  # it opens a call
    assert raw != expected
    before, rest = expected.split("<tool_call>", 1)  # (it opens a second call later)
    call = qwen3_coder.parse_tool_call(rest.split("</tool_call>")[0], TOOLS)
    jsonschema.validate(call["arguments"], TOOLS[0]["function"]["parameters"])
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": XML_MAX, "temperature": 0}
    for reply in replies(xml_pair, body):
        calls = reply["choices"][0]["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls][:1] == [(call["name"], call["arguments"])], reply
        assert reply["usage"]["completion_tokens"] == len(tokens)
        assert reply["choices"][0]["message"]["content"].startswith(before)
    assert reply["stats"]["draft_tokens_accepted"] > 0  # the call's frame drafts itself


def test_a_forced_call_is_written_in_the_models_own_xml(xml_pair):
    """tool_choice names the function: the grammar writes Qwen3-Coder's XML, not Hermes' JSON,
    and the server's call is mlx_lm's under that grammar."""
    model, tokenizer = load(str(xml_pair[0]))
    forced = grammars_for(tokenizer).tool_calls([TOOLS[0]["function"]], parallel=False,
                                                syntax="xml")
    expected, tokens = driven(model, tokenizer, forced(), XML_MAX)
    assert expected.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\n")
    call = qwen3_coder.parse_tool_call(expected.split("<tool_call>")[1].split("</tool_call>")[0],
                                       TOOLS)
    jsonschema.validate(call["arguments"], TOOLS[0]["function"]["parameters"])
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": XML_MAX, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    for reply in replies(xml_pair, body, DRAFTING[:2]):
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls", reply
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in choice["message"]["tool_calls"]] == [(call["name"], call["arguments"])]
        assert reply["usage"]["completion_tokens"] == len(tokens) - 1  # mlx_lm's has the EOS
