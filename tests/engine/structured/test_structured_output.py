"""Grammar constraints (server.engine.structured.grammar): alone, under mlx_lm, the decoder and
HTTP.

The unit tests drive a `GrammarConstraint` with `mlx_lm.stream_generate` and a logits processor
that applies `allowed()`, so they need no engine; every finished output must validate with the
`jsonschema` package. The engine tests check what the decoder promises: greedy constrained
output is the same with a draft, prompt lookup or none, and equals the mlx_lm reference.
"""

from __future__ import annotations

import json
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
from support.http import chat_body
from support.servers import served

from server.engine.errors import GrammarError
from server.engine.structured.constraints import TokenConstraint
from server.engine.structured.grammar import MAX_PARALLEL_TOOL_CALLS, Grammars, grammars_for

PROMPTS = ("Give me a JSON record", "def parse(data):\n    return")
MAX_TOKENS = 120

# Bounded schemas: a random model must finish each within MAX_TOKENS, so every run validates.
SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "enum_array": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "tags": {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
        "required": ["ok", "tags"], "additionalProperties": False},
    "nested_refs": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"path": {
            "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3}},
        "required": ["path"], "additionalProperties": False},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                         {"type": "object", "properties": {"err": {"type": "string",
                                                                   "maxLength": 6}},
                          "required": ["err"], "additionalProperties": False}]},
    "nullable_enum": {"type": "object", "properties": {
        "unit": {"anyOf": [{"enum": ["kg", "lb"]}, {"type": "null"}]},
        "n": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["unit", "n"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"}},
        "required": ["zip", "code"], "additionalProperties": False},
    "const_bool": {"type": "object", "properties": {"v": {"const": 3}, "b": {"type": "boolean"}},
                   "required": ["v", "b"], "additionalProperties": False},
    "tuple": {"type": "array", "prefixItems": [{"type": "boolean"},
                                               {"type": "integer", "minimum": 0, "maximum": 5}],
              "items": False, "minItems": 2},
    "optional_props": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "boolean"}}, "additionalProperties": False},
    "string_length": {"type": "string", "minLength": 2, "maxLength": 6},
    "date": {"type": "object", "properties": {"when": {"type": "string", "format": "date"}},
             "required": ["when"], "additionalProperties": False},
}
# (temperature, seed): greedy and sampled.
MODES = ((0.0, 0), (1.0, 1), (1.0, 2))


@pytest.fixture(scope="module")
def grammars(loaded_pair) -> Grammars:
    return grammars_for(loaded_pair[1])


def grammar_processor(constraint: TokenConstraint, prompt_len: int):
    """An mlx_lm logits processor: consume what was sampled, then mask to `allowed()`."""
    consumed = 0

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        nonlocal consumed
        new = tokens[prompt_len + consumed:].tolist()
        if new:
            assert constraint.consume(new) == len(new), f"sampled a refused token: {new}"
            consumed += len(new)
        mask = constraint.allowed()
        full = np.zeros(logits.shape[-1], dtype=bool)
        full[: len(mask)] = mask[: logits.shape[-1]]
        return mx.where(mx.array(full), logits, -mx.inf)

    return process


def constrained_generate(model, tokenizer, grammar, prompt: str, *, temperature=0.0, seed=0,
                         max_tokens=MAX_TOKENS) -> tuple[str, list[int], str]:
    """(text, tokens, finish_reason) of mlx_lm under `grammar`: the reference for the engine."""
    prompt_tokens = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True)
    mx.random.seed(seed)
    text, tokens, last = "", [], None
    for last in stream_generate(model, tokenizer, prompt_tokens, max_tokens=max_tokens,
                                sampler=make_sampler(temperature),
                                logits_processors=[grammar_processor(grammar(),
                                                                     len(prompt_tokens))]):
        text += last.text
        tokens.append(last.token)
    return text, tokens, last.finish_reason


# --- under mlx_lm: every output validates -----------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_constrained_output_validates(loaded_pair, grammars, name):
    model, tokenizer, _ = loaded_pair
    schema = SCHEMAS[name]
    grammar = grammars.json_schema(schema)
    for prompt in PROMPTS:
        for temperature, seed in MODES:
            text, _, finish = constrained_generate(model, tokenizer, grammar, prompt,
                                                   temperature=temperature, seed=seed)
            assert finish == "stop", (name, temperature, text)
            jsonschema.validate(json.loads(text), schema)


def test_json_object_is_an_object_whenever_it_finishes(loaded_pair, grammars):
    model, tokenizer, _ = loaded_pair
    finished = 0
    for prompt in PROMPTS:
        for temperature, seed in MODES:
            text, _, finish = constrained_generate(model, tokenizer, grammars.json_object(),
                                                   prompt, temperature=temperature, seed=seed)
            assert text.startswith("{")
            if finish == "stop":
                assert isinstance(json.loads(text), dict)
                finished += 1
    assert finished >= 3


def test_forced_tool_call_arguments_validate(loaded_pair, grammars):
    model, tokenizer, _ = loaded_pair
    params = SCHEMAS["person"]
    grammar = grammars.tool_calls([{"name": "add_person", "parameters": params},
                                   {"name": "ping"}], parallel=False)
    for temperature, seed in MODES:
        text, _, finish = constrained_generate(model, tokenizer, grammar, PROMPTS[0],
                                               temperature=temperature, seed=seed)
        assert finish == "stop"
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert call["name"] in ("add_person", "ping")
        if call["name"] == "add_person":
            jsonschema.validate(call["arguments"], params)
        else:
            assert call["arguments"] == {}


# --- the TokenConstraint contract ----------------------------------------------------------------


def tokens_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def eos_of(grammars: Grammars) -> int:
    return min(grammars.eos_token_ids)


def test_is_a_token_constraint_with_a_mask_over_the_vocabulary(loaded_pair, grammars):
    tokenizer = loaded_pair[1]
    constraint = grammars.json_object()()
    assert isinstance(constraint, TokenConstraint)
    mask = constraint.allowed()
    assert mask.dtype == bool and mask.shape == (len(tokenizer),)
    allowed = {tokenizer.decode([t]) for t in np.flatnonzero(mask)}
    assert allowed and all(s.startswith("{") for s in allowed)
    assert not mask[eos_of(grammars)]


def test_consume_stops_at_the_first_refused_token(loaded_pair, grammars):
    tokenizer = loaded_pair[1]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    good, bad = tokens_of(tokenizer, '{"a": 12}'), tokens_of(tokenizer, '{"b": 12}')
    prefix = next(i for i, (g, b) in enumerate(zip(good, bad, strict=False)) if g != b)
    constraint = grammars.json_schema(schema)()
    assert constraint.consume(bad) == prefix
    assert constraint.consume(good[prefix:]) == len(good) - prefix
    assert constraint.is_finished()


def test_eos_is_consumed_and_rolled_back_like_any_token(loaded_pair, grammars):
    tokenizer = loaded_pair[1]
    eos = eos_of(grammars)
    schema = {"type": "integer"}
    constraint = grammars.json_schema(schema)()
    assert constraint.consume([eos]) == 0  # not before the grammar accepts
    digits = tokens_of(tokenizer, "42")
    assert constraint.consume(digits) == len(digits)
    assert not constraint.is_finished() and constraint.allowed()[eos]
    assert constraint.consume([eos, *digits]) == 1  # nothing after EOS
    assert constraint.is_finished()
    assert np.flatnonzero(constraint.allowed()).tolist() == [eos]
    constraint.rollback(2)  # EOS and the last digit token
    assert not constraint.is_finished()
    assert constraint.consume(digits[-1:] + [eos]) == 2


def test_rollback_restores_every_mask(loaded_pair, grammars):
    tokenizer = loaded_pair[1]
    tokens = tokens_of(tokenizer, '{"name": "Ada", "age": 36}')
    constraint = grammars.json_schema(SCHEMAS["person"])()
    masks = []
    for token in tokens:
        masks.append(constraint.allowed().copy())
        assert constraint.consume([token]) == 1
    assert constraint.is_finished()
    for back in range(1, len(tokens) + 1):
        constraint.rollback(1)
        assert np.array_equal(constraint.allowed(), masks[-back])
    with pytest.raises(ValueError):
        constraint.rollback(1)


def test_speculative_rounds_leave_the_same_state_as_plain_decoding(loaded_pair, grammars):
    """Draft k (consume), roll back, consume accepted + one: the decoder's use, at random."""
    tokenizer = loaded_pair[1]
    text = '{"path": [{"x": 1, "y": -2}, {"x": 3, "y": 4}]}'
    tokens = tokens_of(tokenizer, text) + [eos_of(grammars)]
    grammar = grammars.json_schema(SCHEMAS["nested_refs"])
    rng = np.random.default_rng(0)
    for _ in range(20):
        constraint, plain, done = grammar(), grammar(), 0
        while done < len(tokens):
            k = int(rng.integers(0, 5))
            draft = tokens[done: done + k]
            masks = []
            for token in draft:  # drafting: mask, then consume each token
                masks.append(constraint.allowed())
                assert masks[-1][token] and constraint.consume([token]) == 1
            masks.append(constraint.allowed())
            constraint.rollback(len(draft))
            accepted = int(rng.integers(0, len(draft) + 1))
            emit = tokens[done: done + accepted + 1]
            for j, token in enumerate(emit):  # the verification rows' masks, seen along the draft
                assert masks[j][token]
            assert constraint.consume(emit) == len(emit)
            for token in emit:
                plain.consume([token])
            done += len(emit)
            assert np.array_equal(constraint.allowed(), plain.allowed())
        assert constraint.is_finished() and plain.is_finished()


def test_strict_refuses_what_it_cannot_enforce_and_lenient_ignores_it(loaded_pair, grammars):
    tokenizer = loaded_pair[1]
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(GrammarError, match="uniqueItems"):
        grammars.json_schema(schema, strict=True)
    constraint = grammars.json_schema(schema)()
    tokens = tokens_of(tokenizer, "[1, 1]")
    assert constraint.consume(tokens) == len(tokens)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
    {"type": "objekt"},
    ["not", "an", "object"],
])
def test_bad_schemas_are_grammar_errors(grammars, schema):
    with pytest.raises(GrammarError):
        grammars.json_schema(schema)


def test_grammars_are_cached_per_schema_and_tokenizer(loaded_pair, grammars):
    assert grammars_for(loaded_pair[1]) is grammars
    schema = dict(SCHEMAS["person"])
    assert grammars.json_schema(schema) is grammars.json_schema(dict(schema))
    first, second = grammars.json_schema(schema)(), grammars.json_schema(schema)()
    assert first is not second  # one state per request
    first.consume(tokens_of(loaded_pair[1], '{"name"'))
    assert not np.array_equal(first.allowed(), second.allowed())


def test_tool_call_grammar(loaded_pair, grammars):
    tokenizer = loaded_pair[1]
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}, {"name": "ping"}]
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'

    def accepts(grammar, text):
        constraint = grammar()
        tokens = tokens_of(tokenizer, text) + [eos_of(grammars)]
        return constraint.consume(tokens) == len(tokens)

    parallel = grammars.tool_calls(functions)
    single = grammars.tool_calls(functions, parallel=False)
    assert accepts(parallel, one) and accepts(single, one) and accepts(single, ping)
    assert accepts(parallel, "\n".join([one, ping]))
    assert not accepts(single, "\n".join([one, ping]))
    cities = [one.replace("Paris", f"C{i}") for i in range(MAX_PARALLEL_TOOL_CALLS + 1)]
    assert accepts(parallel, "\n".join(cities[:MAX_PARALLEL_TOOL_CALLS]))
    assert not accepts(parallel, "\n".join(cities))
    assert accepts(parallel, "\n".join([ping, one, ping]))  # a repeat ends the calls
    assert not accepts(parallel, "\n".join([ping, one, ping, one]))
    assert not accepts(parallel, one.replace("get_weather", "get_time"))
    assert not accepts(parallel, one.replace('"city"', '"town"'))
    with pytest.raises(GrammarError):
        grammars.tool_calls([])
    with pytest.raises(GrammarError):
        grammars.tool_calls([{"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"$ref": "#/nowhere"}}}}])


def test_parallel_calls_allow_only_eos_after_a_repeated_call(loaded_pair, grammars):
    tokenizer, eos = loaded_pair[1], eos_of(grammars)
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}}]

    def call(arguments: str) -> str:
        return f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'

    first, other = call('{"city": "Paris", "unit": "C"}'), call('{"city": "Oslo", "unit": "C"}')
    newline = tokens_of(tokenizer, "\n")
    for second, repeats in ((other, False), (first, True)):
        constraint = grammars.tool_calls(functions)()
        tokens = tokens_of(tokenizer, first + "\n" + second)
        assert constraint.consume(tokens) == len(tokens)
        allowed = constraint.allowed()
        assert allowed[eos]
        assert allowed[newline[0]] != repeats
        assert constraint.consume(newline) == (0 if repeats else len(newline))
        constraint.rollback(0 if repeats else len(newline))
        constraint.rollback(1)  # back inside the second call's end marker
        assert constraint.allowed()[tokens[-1]] and not constraint.allowed()[eos]
        assert constraint.consume(tokens[-1:] + [eos]) == 2 and constraint.is_finished()
    single = grammars.tool_calls(functions, parallel=False)()
    assert single.consume(tokens_of(tokenizer, first)) > 0  # one call: nothing to repeat


# --- the engine: speculation stays on under a grammar ----------------------------------------


def schema_body(schema: dict, **extra) -> dict:
    extra = {"max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return chat_body(PROMPTS[0], **extra,
                     response_format={"type": "json_schema",
                                      "json_schema": {"name": "out", "schema": schema}})


@pytest.mark.anyio
async def test_greedy_constrained_output_is_the_same_with_and_without_drafts(tiny_pair,
                                                                            loaded_pair):
    model, tokenizer, _ = loaded_pair
    grammars = grammars_for(tokenizer)
    async with served(*tiny_pair) as (client, _):
        for name in ("person", "tags", "nested_refs", "pattern"):
            schema = SCHEMAS[name]
            expected, tokens, _ = constrained_generate(model, tokenizer,
                                                       grammars.json_schema(schema), PROMPTS[0])
            runs = {}
            for label, extra in {"none": {"use_draft": False},
                                 "draft": {"num_draft_tokens": 4, "adaptive": False},
                                 "lookup": {"draft": "prompt_lookup", "num_draft_tokens": 3}
                                 }.items():
                r = await client.post("/v1/chat/completions", json=schema_body(schema, **extra))
                assert r.status_code == 200, r.text
                runs[label] = r.json()
                assert runs[label]["choices"][0]["message"]["content"] == expected, (name, label)
                assert runs[label]["choices"][0]["finish_reason"] == "stop"
                assert runs[label]["usage"]["completion_tokens"] == len(tokens) - 1  # no EOS
            assert runs["draft"]["stats"]["draft_tokens_proposed"] > 0
            assert runs["draft"]["stats"]["draft_tokens_accepted"] > 0


@pytest.mark.anyio
async def test_sampled_constrained_output_validates_with_a_draft(tiny_pair):
    async with served(*tiny_pair) as (client, _):
        for name in ("person", "any_of", "tuple", "date"):
            schema = SCHEMAS[name]
            for seed in range(3):
                body = schema_body(schema, temperature=1.0, seed=seed, num_draft_tokens=3)
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "stop", choice
                jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.anyio
async def test_json_object_and_errors_over_http(client):
    body = chat_body(max_tokens=40, temperature=0, response_format={"type": "json_object"})
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("{")
    unsupported = {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": {"type": "array", "uniqueItems": True}}}
    r = await client.post("/v1/chat/completions", json=chat_body(response_format=unsupported))
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format"
    broken = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}
    r = await client.post("/v1/chat/completions", json=chat_body(response_format=broken))
    assert r.status_code == 400
    r = await client.post("/v1/chat/completions",
                          json=chat_body(response_format={"type": "json_schema"}))
    assert r.status_code == 400


@pytest.mark.anyio
async def test_ignore_eos_and_min_tokens(client, loaded_pair):
    eos = min(grammars_for(loaded_pair[1]).eos_token_ids)
    # A grammar that is complete after one token would stop at once; min_tokens is about EOS.
    body = chat_body(max_tokens=12, temperature=0, logit_bias={str(eos): 100},
                     use_draft=False)
    r = await client.post("/v1/chat/completions", json=body)
    assert r.json()["usage"]["completion_tokens"] == 0 or r.json()["choices"][0][
        "finish_reason"] == "stop"
    for extra in ({"ignore_eos": True}, {"min_tokens": 12}, {"ignore_eos": True,
                                                              "num_draft_tokens": 3}):
        r = await client.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12, extra
        assert r.json()["choices"][0]["finish_reason"] == "length"
    r = await client.post("/v1/chat/completions", json={**body, "min_tokens": 13})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


@pytest.mark.anyio
async def test_rejection_sampling_under_a_grammar_follows_the_masked_target(tiny_pair,
                                                                            loaded_pair):
    """A token verified by rejection sampling under a grammar, sampled many times, against the
    target's masked law. The first token comes from the prefill; among the samples whose first
    token is the likeliest one, d0, the second token was drafted (k = 1) and verified, so it
    must follow the target's distribution after prompt + d0, masked by the grammar after d0."""
    import asyncio

    from scipy.stats import chisquare

    model, tokenizer, _ = loaded_pair
    schema = {"type": "integer"}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[1]}],
                                           add_generation_prompt=True)
    grammar = grammars_for(tokenizer).json_schema(schema)()
    first_mask = grammar.allowed()
    logits = model(mx.array(prompt)[None])[0, -1].astype(mx.float32)
    first_probs = np.array(mx.softmax(logits), dtype=np.float64)[: len(first_mask)] * first_mask
    d0 = int(np.argmax(first_probs))
    assert grammar.consume([d0]) == 1
    mask = grammar.allowed()
    logits = model(mx.array([*prompt, d0])[None])[0, -1].astype(mx.float32)
    probs = np.array(mx.softmax(logits), dtype=np.float64)[: len(mask)] * mask
    probs /= probs.sum()
    ids = {tokenizer.decode([t]): int(t) for t in np.flatnonzero(mask)}
    assert len(ids) == mask.sum() > 5
    samples, proposed, requests = 0, 0, 0
    counts = np.zeros(len(mask))
    # Concurrent requests: let every one of them speculate (batched verification).
    async with served(*tiny_pair, engine={"spec_max_batch": 64}) as (client, _):
        body = schema_body(schema, temperature=1.0, max_tokens=2, num_draft_tokens=1,
                           adaptive=False, acceptance="rejection", logprobs=True)
        body["messages"][0]["content"] = PROMPTS[1]
        while samples < 600 and requests < 6000:
            replies = await asyncio.gather(*[
                client.post("/v1/chat/completions", json={**body, "seed": seed})
                for seed in range(requests, requests + 50)])
            requests += 50
            for r in replies:
                assert r.status_code == 200, r.text
                content = r.json()["choices"][0]["logprobs"]["content"]
                if len(content) < 2 or content[0]["token"] != tokenizer.decode([d0]):
                    continue
                counts[ids[content[1]["token"]]] += 1
                samples += 1
                proposed += r.json()["stats"]["draft_tokens_proposed"]
    assert samples >= 600
    assert counts[~mask].sum() == 0
    assert proposed >= samples  # every second token came out of a speculative round
    keep = probs * samples >= 5
    expected = probs[keep] * samples
    observed = counts[keep]
    expected *= observed.sum() / expected.sum()
    assert chisquare(observed, expected).pvalue > 1e-3


# --- vLLM's structured_outputs: regex, choice, Lark grammar -------------------------------------

# Bounded, so a random model finishes each within MAX_TOKENS.
STRUCTURED = {
    "regex": {"regex": r"(yes|no), [0-9]{1,3} [a-z]{2,6}\."},
    "choice": {"choice": ["red apple", "green pear", "blue"]},
    "grammar": {"grammar": 'start: "SELECT " col (", " col){0,2} " FROM t"\n'
                           "col: /[a-z]{1,6}/"},
}
STRUCTURED_MATCH = {
    "regex": re.compile(r"(yes|no), [0-9]{1,3} [a-z]{2,6}\."),
    "choice": re.compile("red apple|green pear|blue"),
    "grammar": re.compile(r"SELECT [a-z]{1,6}(, [a-z]{1,6}){0,2} FROM t"),
}


def structured_grammar(grammars: Grammars, spec: dict):
    kind, value = next(iter(spec.items()))
    return {"regex": grammars.regex, "choice": grammars.choice, "grammar": grammars.lark}[kind](
        value)


@pytest.mark.parametrize("kind", sorted(STRUCTURED))
def test_structured_outputs_match_under_mlx_lm(loaded_pair, grammars, kind):
    model, tokenizer, _ = loaded_pair
    grammar = structured_grammar(grammars, STRUCTURED[kind])
    for prompt in PROMPTS:
        for temperature, seed in MODES:
            text, _, finish = constrained_generate(model, tokenizer, grammar, prompt,
                                                   temperature=temperature, seed=seed)
            assert finish == "stop" and STRUCTURED_MATCH[kind].fullmatch(text), (kind, text)


@pytest.mark.anyio
async def test_structured_outputs_greedy_equal_mlx_lm_with_and_without_drafts(tiny_pair,
                                                                              loaded_pair):
    model, tokenizer, _ = loaded_pair
    grammars = grammars_for(tokenizer)
    async with served(*tiny_pair) as (client, _):
        for kind, spec in STRUCTURED.items():
            expected, _, _ = constrained_generate(model, tokenizer,
                                                  structured_grammar(grammars, spec), PROMPTS[0])
            for extra in ({"use_draft": False}, {"num_draft_tokens": 4, "adaptive": False},
                          {"draft": "prompt_lookup", "num_draft_tokens": 3}):
                body = chat_body(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                 structured_outputs=spec, **extra)
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert (choice["message"]["content"], choice["finish_reason"]) == \
                    (expected, "stop"), (kind, extra)
            # Text completions take it too; the text is the same with the draft as without.
            texts = set()
            for extra in ({"use_draft": False}, {"num_draft_tokens": 4}):
                body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0,
                        "structured_outputs": spec, **extra}
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                texts.add(r.json()["choices"][0]["text"])
            assert len(texts) == 1 and STRUCTURED_MATCH[kind].fullmatch(texts.pop()), kind


# The "grammar" of STRUCTURED in llama.cpp's GBNF.
GBNF = 'root ::= "SELECT " col (", " col){0,2} " FROM t"\ncol ::= [a-z]{1,6}'


@pytest.mark.anyio
async def test_gbnf_and_llama_cpp_fields_give_the_lark_grammars_text(tiny_pair, loaded_pair):
    """A GBNF grammar (in structured_outputs or as llama.cpp's top-level `grammar`) gives the
    greedy text mlx_lm gives under the same grammar written in Lark; llama.cpp's `json_schema`
    that of structured_outputs' `json`."""
    model, tokenizer, _ = loaded_pair
    grammars = grammars_for(tokenizer)
    expected, _, _ = constrained_generate(model, tokenizer, grammars.lark(
        STRUCTURED["grammar"]["grammar"]), PROMPTS[0])
    assert STRUCTURED_MATCH["grammar"].fullmatch(expected)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    async with served(*tiny_pair) as (client, _):
        async def text(**extra) -> str:
            r = await client.post("/v1/chat/completions", json=chat_body(
                PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, **extra))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        assert await text(structured_outputs={"grammar": GBNF}) == expected
        assert await text(grammar=GBNF, num_draft_tokens=3) == expected
        assert await text(json_schema=schema) == await text(structured_outputs={"json": schema})
        r = await client.post("/v1/completions", json={
            "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "grammar": GBNF})
        assert STRUCTURED_MATCH["grammar"].fullmatch(r.json()["choices"][0]["text"]), r.text


@pytest.mark.anyio
@pytest.mark.parametrize("extra, message", [
    ({"grammar": "root ::= ((("}, "not a Lark or GBNF grammar"),
    ({"grammar": GBNF, "json_schema": {"type": "object"}}, "send one of them"),
    ({"grammar": GBNF, "structured_outputs": {"regex": "a"}}, "send one of them"),
])
async def test_bad_llama_cpp_grammars_are_400s(client, extra, message):
    r = await client.post("/v1/chat/completions", json=chat_body(**extra))
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


@pytest.mark.anyio
async def test_structured_outputs_reach_the_other_apis_and_sampling_stays_inside(client):
    spec = STRUCTURED["choice"]
    body = {"input": "Pick a fruit", "max_output_tokens": 20, "structured_outputs": spec}
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert STRUCTURED_MATCH["choice"].fullmatch(r.json()["output"][0]["content"][0]["text"])
    body = {"model": "", "max_tokens": 20, "structured_outputs": spec,
            "messages": [{"role": "user", "content": "Pick a fruit"}]}
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert STRUCTURED_MATCH["choice"].fullmatch(r.json()["content"][0]["text"])
    for seed in range(4):
        body = chat_body(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, num_draft_tokens=3,
                         structured_outputs=STRUCTURED["regex"])
        r = await client.post("/v1/chat/completions", json=body)
        assert STRUCTURED_MATCH["regex"].fullmatch(r.json()["choices"][0]["message"]["content"])


@pytest.mark.anyio
@pytest.mark.parametrize("spec, message", [
    ({"regex": "("}, "regex parse error"),
    ({"grammar": "start: foo"}, 'unknown name: "foo"'),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"choice": []}, "at least 1"),
    ({"choice": [""]}, "at least 1"),
    ({"json_object": False}, "exactly one of"),
])
async def test_bad_structured_outputs_are_400s(client, spec, message):
    for path, body in (("/v1/chat/completions", chat_body(structured_outputs=spec)),
                       ("/v1/completions", {"prompt": "x", "structured_outputs": spec})):
        r = await client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["param"].startswith("structured_outputs")


@pytest.mark.anyio
async def test_structured_outputs_beside_another_grammar_is_a_400(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for extra in ({"response_format": {"type": "json_object"}},
                  {"tools": tools, "tool_choice": "required"}):
        body = chat_body(structured_outputs={"regex": "a"}, **extra)
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "one grammar" in r.json()["error"]["message"], r.text


# --- forced tokens: what the grammar allows no alternative to drafts a round for free ---------

LONG_KEY = {"type": "object", "properties": {
    "a_rather_long_key_name": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a_rather_long_key_name"], "additionalProperties": False}


def test_the_grammar_names_the_tokens_it_forces(loaded_pair, grammars):
    tokenizer = loaded_pair[1]
    constraint = grammars.json_schema(LONG_KEY)()
    forced = constraint.forced()
    key = '{"a_rather_long_key_name":'
    # The space before the value is forced too, unless a token of this (trained) vocabulary
    # could start with it: llguidance then leaves it to the model.
    assert tokenizer.decode(forced) in (key, key + " ")
    assert constraint.consume(forced) == len(forced)
    rest = constraint.forced()
    assert tokenizer.decode(forced + rest) in (key, key + " ")  # never the digit
    constraint.consume(rest)
    constraint.rollback(len(forced) + len(rest))
    assert constraint.forced() == forced


@pytest.mark.anyio
async def test_forced_tokens_draft_and_change_nothing(tiny_pair, loaded_pair):
    model, tokenizer, _ = loaded_pair
    expected, _, _ = constrained_generate(model, tokenizer,
                                          grammars_for(tokenizer).json_schema(LONG_KEY),
                                          PROMPTS[0])
    forced = len(grammars_for(tokenizer).json_schema(LONG_KEY)().forced())
    async with served(*tiny_pair) as (client, _):
        runs = {}
        for label, extra in {"none": {"use_draft": False},
                             "lookup": {"draft": "prompt_lookup"}}.items():
            r = await client.post("/v1/chat/completions", json=schema_body(LONG_KEY, **extra))
            runs[label] = r.json()
            assert runs[label]["choices"][0]["message"]["content"] == expected, label
    # Prompt lookup finds nothing in this prompt; the forced key drafts itself.
    assert runs["lookup"]["stats"]["draft_tokens_accepted"] >= forced - 1
    assert runs["none"]["stats"]["draft_tokens_proposed"] == 0


def test_an_added_token_is_offered_only_where_the_grammar_names_it(model_dir, tiny_pair):
    """llguidance takes an added token for a special one: a grammar's text never matches it,
    though its mask offered the token (and only it) where the text is the token's text."""
    from support.thinking_model import add_tokens

    from server.engine.structured.grammar import Grammars

    folder = model_dir / "added-tag"
    if not folder.exists():
        add_tokens(tiny_pair[0], folder, ("<tag>",))
    tokenizer = load(str(folder))[1]
    tag = tokenizer.get_vocab()["<tag>"]
    grammars = Grammars(tokenizer)
    as_text = grammars.lark('start: "<tag>" "x"')()
    offered = np.flatnonzero(as_text.allowed()).tolist()
    assert offered == sorted(tokenizer.eos_token_ids)  # not the tag: the output can only end
    as_token = grammars.lark(f'start: <[{tag}]> "x"')()
    assert as_token.allowed()[tag] and as_token.consume([tag]) == 1
