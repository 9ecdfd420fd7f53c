"""Measure the grammar engines we could use for constrained decoding, side by side.

For llguidance, xgrammar and outlines-core (each skipped when not importable): JSON-schema
coverage (does the schema compile, is a valid instance accepted token by token and a violating
one refused) and the cost of the work a decoder does per token (mask + advance), plus compile
time. One walk per schema: the instance's own tokens, masks computed at every step.

    python scripts/grammar_engines.py [--tokenizer DIR] [--reps 3]

The tokenizer is any folder with an HF `tokenizer.json` (default: the demo target's, 4k vocab);
the mask cost grows with the vocabulary, so pass a 32k-150k tokenizer for realistic figures.
xgrammar needs torch (a multi-GB dependency on Linux); run it with torch on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

ITEM_SEP, KEY_SEP = ", ", ": "

# (name, schema, valid instance, violating instance or None)
CASES: list[tuple[str, dict, object, object | None]] = [
    ("flat", {"type": "object", "properties": {"name": {"type": "string"},
              "age": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"]}, {"name": "Ada", "age": 36, "ok": True},
     {"name": "Ada", "age": "x", "ok": True}),
    ("nested", {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["id", "tags"]}}, "required": ["user"]},
     {"user": {"id": 7, "tags": ["a", "b"]}}, {"user": {"id": 7}}),
    ("array_bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                      "maxItems": 3}, [1, 2, 3], [1, 2, 3, 4]),
    ("enum", {"type": "object", "properties": {"color": {"enum": ["red", "green"]}},
              "required": ["color"]}, {"color": "green"}, {"color": "blue"}),
    ("const", {"type": "object", "properties": {"v": {"const": 3}}, "required": ["v"]},
     {"v": 3}, {"v": 4}),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {
        "x": {"type": "string"}}, "required": ["x"]}]}, {"x": "s"}, {"y": "s"}),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "number"}]}, 1.5, True),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                          "required": ["a"]},
                         {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     {"a": 1, "b": "x"}, {"a": 1}),
    ("ref_defs", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"},
                  "y": {"type": "number"}}, "required": ["x", "y"]}}, "type": "array",
                  "items": {"$ref": "#/$defs/pt"}}, [{"x": 1, "y": 2.5}], [{"x": 1}]),
    ("recursive", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"]}}, "$ref": "#/$defs/node"},
     {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"v": 2}]}),
    ("pattern", {"type": "object", "properties": {"zip": {"type": "string",
                 "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}, {"zip": "12345"},
     {"zip": "1234a"}),
    ("format_datetime", {"type": "string", "format": "date-time"}, "2024-01-02T03:04:05Z",
     "yesterday"),
    ("format_email", {"type": "string", "format": "email"}, "a@b.co", "not an email"),
    ("format_uuid", {"type": "string", "format": "uuid"},
     "123e4567-e89b-12d3-a456-426614174000", "123"),
    ("int_bounds", {"type": "integer", "minimum": 10, "exclusiveMaximum": 20}, 19, 20),
    ("num_bounds", {"type": "number", "minimum": -1.5, "maximum": 1.5}, 0.25, 2.5),
    ("str_length", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "abcde"),
    ("map", {"type": "object", "additionalProperties": {"type": "integer"}}, {"a": 1, "b": 2},
     {"a": "x"}),
    ("closed_optional", {"type": "object", "properties": {"a": {"type": "integer"},
                         "b": {"type": "string"}}, "additionalProperties": False},
     {"b": "x"}, {"c": 1}),
    ("nullable", {"type": "object", "properties": {"n": {"type": ["string", "null"]}},
                  "required": ["n"]}, {"n": None}, {"n": 1}),
    ("tuple", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
               "items": False}, ["a", 1], [1, "a"]),
    ("pattern_properties", {"type": "object", "patternProperties": {
        "^x_": {"type": "integer"}}, "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
    ("min_properties", {"type": "object", "additionalProperties": {"type": "integer"},
                        "minProperties": 1}, {"a": 1}, {}),
    ("pydantic_model", {"$defs": {"Kind": {"enum": ["cat", "dog"], "title": "Kind",
        "type": "string"}}, "properties": {"name": {"title": "Name", "type": "string"},
        "kind": {"$ref": "#/$defs/Kind"}, "age": {"anyOf": [{"type": "integer"},
        {"type": "null"}], "default": None, "title": "Age"}}, "required": ["name", "kind", "age"],
        "title": "Pet", "type": "object", "additionalProperties": False},
     {"name": "Rex", "kind": "dog", "age": None}, {"name": "Rex", "kind": "cow", "age": None}),
    ("unique_items", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     [1, 2], None),
    ("if_then", {"type": "object", "properties": {"a": {"type": "integer"}},
                 "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
     {"a": 2}, None),
]


def dumps(value) -> str:
    return json.dumps(value, separators=(ITEM_SEP, KEY_SEP))


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer)
        self.mask = np.zeros((1, (self.tok.vocab_size + 31) // 32), dtype=np.int32)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"item_separator": ITEM_SEP, "key_separator": KEY_SEP,
                              "whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill_mask(self, matcher):
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, self.mask)

    def advance(self, matcher, token) -> bool:
        return matcher.consume_token(token)

    def accepting(self, matcher) -> bool:
        return matcher.is_accepting()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer):
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer,
                                                            vocab_size=len(hf_tokenizer))
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, self.info.vocab_size)

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(ITEM_SEP, KEY_SEP))
        return self.xgr.GrammarMatcher(compiled)

    def fill_mask(self, matcher):
        matcher.fill_next_token_bitmask(self.mask)

    def advance(self, matcher, token) -> bool:
        return matcher.accept_token(token)

    def accepting(self, matcher) -> bool:
        return matcher.accept_token(self.info.stop_token_ids[0])


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf_tokenizer):
        import outlines_core

        self.oc = outlines_core
        eos = hf_tokenizer.eos_token_id
        by_bytes: dict[bytes, list[int]] = {}
        for token_id in range(len(hf_tokenizer)):
            if token_id == eos or token_id in hf_tokenizer.all_special_ids:
                continue
            raw = _token_bytes(hf_tokenizer, token_id)
            if raw:
                by_bytes.setdefault(raw, []).append(token_id)
        self.vocab = outlines_core.Vocabulary(eos, by_bytes)
        self.eos = eos
        self.mask = np.zeros((len(hf_tokenizer) + 31) // 32, dtype=np.int32)

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern=r" ?")
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def fill_mask(self, guide):
        guide.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)

    def advance(self, guide, token) -> bool:
        try:
            guide.advance(token, return_tokens=False)
        except Exception:
            return False
        return True

    def accepting(self, guide) -> bool:
        return guide.is_finished() or self.eos in guide.get_tokens()


_BYTE_DECODER = None


def _token_bytes(hf_tokenizer, token_id: int) -> bytes:
    """A byte-level BPE token's bytes (the GPT-2 alphabet mapped back)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        others = [b for b in range(256) if b not in printable]
        _BYTE_DECODER = {chr(b): b for b in printable}
        _BYTE_DECODER.update({chr(256 + i): b for i, b in enumerate(others)})
    piece = hf_tokenizer.convert_ids_to_tokens(token_id)
    try:
        return bytes(_BYTE_DECODER[c] for c in piece)
    except KeyError:
        return piece.encode()


def walk(engine, matcher, tokens) -> tuple[bool, list[float]]:
    """Mask + advance through `tokens`; (all accepted and accepting at the end, step seconds)."""
    times = []
    for token in tokens:
        t0 = time.perf_counter()
        engine.fill_mask(matcher)
        ok = engine.advance(matcher, token)
        times.append(time.perf_counter() - t0)
        if not ok:
            return False, times
    t0 = time.perf_counter()
    engine.fill_mask(matcher)
    times.append(time.perf_counter() - t0)
    return engine.accepting(matcher), times


def measure(engine, hf_tokenizer, reps: int) -> dict:
    row = {"engine": engine.name, "covered": 0, "enforced": 0, "failures": [], "step_us": [],
           "compile_ms": []}
    for name, schema, good, bad in CASES:
        try:
            t0 = time.perf_counter()
            matcher = engine.compile(schema)
            row["compile_ms"].append((time.perf_counter() - t0) * 1e3)
        except Exception as e:  # an unsupported keyword or a compile error
            row["failures"].append(f"{name}: compile: {str(e).splitlines()[0][:80]}")
            continue
        tokens = hf_tokenizer.encode(dumps(good), add_special_tokens=False)
        accepted, times = walk(engine, matcher, tokens)
        for _ in range(reps - 1):
            _, more = walk(engine, engine.compile(schema), tokens)
            times = [min(a, b) for a, b in zip(times, more, strict=False)]
        if not accepted:
            row["failures"].append(f"{name}: valid instance refused")
            continue
        row["covered"] += 1
        row["step_us"].extend(t * 1e6 for t in times)
        if bad is None:
            row["enforced"] += 1
            continue
        bad_tokens = hf_tokenizer.encode(dumps(bad), add_special_tokens=False)
        refused, _ = walk(engine, engine.compile(schema), bad_tokens)
        if refused:
            row["failures"].append(f"{name}: violating instance accepted")
        else:
            row["enforced"] += 1
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="models/demo/target")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    args = parser.parse_args(argv)

    from transformers import PreTrainedTokenizerFast  # not AutoTokenizer: no model config

    hf = PreTrainedTokenizerFast.from_pretrained(args.tokenizer)
    print(f"tokenizer {args.tokenizer}: {len(hf)} tokens; {len(CASES)} schemas")
    kinds = {"llguidance": Llguidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}
    for name in args.engines.split(","):
        try:
            t0 = time.perf_counter()
            engine = kinds[name](hf)
            setup = time.perf_counter() - t0
        except ImportError as e:
            print(f"{name}: not importable ({e})")
            continue
        row = measure(engine, hf, args.reps)
        steps = row["step_us"]
        print(f"{name}: tokenizer setup {setup * 1e3:.0f} ms; covered {row['covered']}/"
              f"{len(CASES)}, enforced {row['enforced']}/{len(CASES)}; mask+advance per token "
              f"median {statistics.median(steps):.1f} us, p95 "
              f"{np.percentile(steps, 95):.1f} us, max {max(steps):.1f} us; compile median "
              f"{statistics.median(row['compile_ms']):.1f} ms, max {max(row['compile_ms']):.1f} ms")
        for failure in row["failures"]:
            print(f"    {failure}")


if __name__ == "__main__":
    main()
