"""Grammar constraints for structured output and tool calls, on llguidance.

`Grammars(tokenizer)` compiles what a request asks for (`json_object`, `json_schema`, forced tool
calls; vLLM's regex, choice and Lark grammars) into a `Grammar`: validated once, cached per
grammar, and callable with no arguments, so it is what `GenerationParams.constraint` takes.
Each call returns a fresh `GrammarConstraint`, this request's grammar state, which the decoder
drives through the `TokenConstraint` protocol (`server.engine.structured.constraints`).

Why llguidance (measured against the alternatives before it was chosen): no dependencies beyond
its abi3 wheel (Linux x86-64, macOS arm64); it compiles in about a millisecond; it computes a
mask in tens of microseconds for a 49k vocabulary; it refuses a schema keyword it cannot enforce
rather than ignoring it; and it rolls back consumed tokens natively, which is what speculative
verification needs.

JSON is written on one line with `", "` and `": "` separators: a small model given free
whitespace tends to loop on newlines.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from server.engine.errors import GrammarError, XmlCallError
from server.engine.structured.xml_calls import xml_call_lark, xml_calls_lark

JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# How a forced tool call is written: the Hermes / Qwen2.5 format that mlx_lm's `json_tools`
# parser reads, one call per block, blocks separated by a newline.
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
MAX_PARALLEL_TOOL_CALLS = 8
GRAMMAR_CACHE_SIZE = 128


@dataclass(frozen=True)
class SpecialTokens:
    """A tokenizer's EOS tokens, and its added tokens (`<tool_call>`, `<think>`, ...), which
    llguidance takes for special ones: a grammar matches them only where it names the token,
    though its mask may offer one where a text would match its text."""

    eos: frozenset[int]
    added: frozenset[int] = frozenset()


class GrammarConstraint:
    """One request's grammar state (a `TokenConstraint`).

    EOS is handled here, not by llguidance: once the grammar is complete llguidance reports EOS
    as allowed but refuses to consume it, while the decoder consumes (and may roll back) every
    token it emits, EOS included.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, special: SpecialTokens):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos = special.eos
        self._added = np.array(sorted(t for t in special.added if t < vocab_size), dtype=np.int64)
        self._ended = False  # EOS consumed
        self._mask: np.ndarray | None = None  # for the current state

    def allowed(self) -> np.ndarray:
        if self._mask is None:
            if self._ended or self._matcher.is_error() or self._must_end():
                mask = np.zeros(self._vocab_size, dtype=bool)
                mask[[t for t in self._eos if t < self._vocab_size]] = True
            else:
                bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
                mask = np.unpackbits(bits, bitorder="little")[: self._vocab_size].view(bool)
                if not self._matcher.is_accepting():
                    # EOS ends the output here, not only a lexeme: llguidance lets it end a
                    # lazy one (a `stop` rule's text) where the grammar still wants more.
                    mask[[t for t in self._eos if t < self._vocab_size]] = False
                self._drop_unmatched_added(mask)
            self._mask = mask
        return self._mask

    def _drop_unmatched_added(self, mask: np.ndarray) -> None:
        """Offer an added token only where the grammar would consume it (see SpecialTokens). A
        grammar whose text is an added token's text and nothing else (llguidance offers no other
        tokenization of it) then offers nothing: the output ends there."""
        refused = [t for t in self._added[mask[self._added]].tolist()
                   if self._matcher.validate_tokens([t]) != 1]
        if refused:
            mask[refused] = False
            if not mask.any():
                mask[[t for t in self._eos if t < self._vocab_size]] = True

    def consume(self, tokens: list[int]) -> int:
        if self._ended or not tokens:
            return 0
        tokens = [int(t) for t in tokens]
        cut = next((i for i, t in enumerate(tokens) if t in self._eos), len(tokens))
        count = self._matcher.try_consume_tokens(tokens[:cut]) if cut else 0
        if count == cut < len(tokens) and self._matcher.is_accepting():
            self._ended = True
            count += 1
        if count:
            self._mask = None
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self._mask = None
        if self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: "
                             f"{self._matcher.get_error() or 'more than were consumed'}")

    def is_finished(self) -> bool:
        return self._ended or self._matcher.is_stopped()

    def forced(self) -> list[int]:
        """The tokens the grammar allows no alternative to from here (llguidance's
        fast-forward tokens: a schema's next key, a call's fixed frame), which draft a round
        for free; EOS is never among them."""
        if self._ended or self._matcher.is_error() or self._must_end():
            return []
        return self._matcher.compute_ff_tokens()

    def _must_end(self) -> bool:
        """Only EOS from here, though the grammar allows more (a subclass's rule)."""
        return False


class ToolCallsConstraint(GrammarConstraint):
    """Forced parallel tool calls that end at the first call repeating an earlier one.

    A small model tends to loop: the same call again, up to the grammar's limit. Once the
    output's last complete call equals an earlier one (same name, same arguments), only EOS is
    allowed: a repeat costs one call's tokens, not seven. The HTTP side drops the repeat
    (`server.http.common.tools.ToolCallParser`), so a client never sees two identical calls.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, special: SpecialTokens,
                 decode):
        super().__init__(matcher, vocab_size, special)
        self._decode = decode  # token ids -> bytes
        self._tokens: list[int] = []  # consumed, for the text

    def consume(self, tokens: list[int]) -> int:
        count = 0
        for token in tokens:  # one at a time: after a repeat, anything but EOS is refused
            if int(token) not in self._eos and self._must_end():
                break
            if super().consume([token]) != 1:
                break
            self._tokens.append(int(token))
            count += 1
        return count

    def rollback(self, num_tokens: int) -> None:
        super().rollback(num_tokens)
        if num_tokens > 0:
            del self._tokens[-num_tokens:]

    def _must_end(self) -> bool:
        tail = self._decode(self._tokens[-len(TOOL_CALL_END):])  # a token holds >= 1 byte
        if not tail.endswith(TOOL_CALL_END.encode()):
            return False
        return repeats_a_call(self._decode(self._tokens).decode("utf-8", errors="replace"))


_CALL_BODY = re.compile(re.escape(TOOL_CALL_START) + r"\n(.*?)\n" + re.escape(TOOL_CALL_END),
                        re.DOTALL)


def call_key(name: str, arguments: Any) -> str:
    """What makes two calls the same call: the name and the arguments as JSON values."""
    return json.dumps([name, arguments], sort_keys=True, ensure_ascii=False)


def repeats_a_call(text: str) -> bool:
    """Whether the last complete Hermes call in `text` equals an earlier one."""
    keys = []
    for body in _CALL_BODY.findall(text):
        try:
            call = json.loads(body)
            keys.append(call_key(call["name"], call["arguments"]))
        except (ValueError, KeyError, TypeError):
            keys.append(body)
    return len(keys) > 1 and keys[-1] in keys[:-1]


class Grammar:
    """A compiled grammar; calling it starts a new `GrammarConstraint` (a constraint factory)."""

    def __init__(self, template: llguidance.LLMatcher, vocab_size: int, special: SpecialTokens,
                 description: str, decode=None):
        self._template = template
        self._vocab_size = vocab_size
        self._special = special
        self.description = description
        self._decode = decode  # set: forced parallel tool calls (`ToolCallsConstraint`)

    def __call__(self) -> GrammarConstraint:
        matcher = self._template.deep_copy()
        if self._decode is not None:
            return ToolCallsConstraint(matcher, self._vocab_size, self._special, self._decode)
        return GrammarConstraint(matcher, self._vocab_size, self._special)

    def ending_at_repeated_calls(self, decode) -> Grammar:
        """This grammar with `ToolCallsConstraint` states (`decode`: token ids -> bytes)."""
        return Grammar(self._template, self._vocab_size, self._special, self.description,
                       decode)

    def __repr__(self) -> str:
        return f"Grammar({self.description})"


class Grammars:
    """Compiles grammars for one tokenizer (an `mlx_lm` TokenizerWrapper or an HF fast one)."""

    def __init__(self, tokenizer: Any):
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        try:
            self._tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=sorted(eos) or None)
        except ValueError as e:  # not a fast (Rust) tokenizer
            raise GrammarError(f"structured output is not supported for this tokenizer: {e}") \
                from e
        self.vocab_size = self._tokenizer.vocab_size
        self.eos_token_ids = frozenset(eos)
        self._special = SpecialTokens(self.eos_token_ids,
                                      frozenset(hf.get_added_vocab().values()) - self.eos_token_ids)
        # A call tag that is a token of its own (Qwen's, Hermes') is written as that token:
        # llguidance takes an added token for a special one, which no text in a grammar matches.
        vocab = hf.get_vocab()
        self._tags = {tag: f"<[{vocab[tag]}]>" for tag in (TOOL_CALL_START, TOOL_CALL_END)
                      if tag in vocab}
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ what requests ask for
    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return self.json_schema({"type": "object"}, strict=True)

    def json_schema(self, schema: dict, *, strict: bool = False) -> Grammar:
        """Output that validates against `schema`.

        `strict`: a keyword that cannot be enforced is an error. Otherwise such keywords
        (`uniqueItems`, `if`/`then`, ...) are ignored, the rest is still enforced.
        """
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        return self._compile_schema(schema, strict, lambda s: _lark_json("start", s))

    def tool_calls(self, functions: list[dict], *, parallel: bool = True,
                   syntax: str = "json") -> Grammar:
        """One call (or up to MAX_PARALLEL_TOOL_CALLS) of one of `functions`, written as

            <tool_call>
            {"name": "NAME", "arguments": {...}}
            </tool_call>

        or, with `syntax` "xml", in Qwen3-Coder's XML between the same tags
        (`server.engine.structured.xml_calls`). `functions`: OpenAI function objects ({"name",
        "parameters"?, "strict"?}); the arguments are constrained to the function's
        `parameters` schema, whose top-level properties are the only ones allowed unless it
        sets `additionalProperties` itself. `parallel`: the calls end at the first one that
        repeats an earlier one (`ToolCallsConstraint`).
        """
        if syntax == "xml":
            return self._xml_tool_calls(functions, parallel)
        body, strict = _calls_schema(functions)
        start = "start: call"
        if parallel:
            start += f" ({_lark_literal(chr(10))} call){{0,{MAX_PARALLEL_TOOL_CALLS - 1}}}"
        call = (f"call: {self._tag(TOOL_CALL_START)} {_lark_literal(chr(10))} body "
                f"{_lark_literal(chr(10))} {self._tag(TOOL_CALL_END)}")

        def lark(schema: dict) -> str:
            return "\n".join([start, call, _lark_json("body", schema)])

        grammar = self._compile_schema(body, strict, lark)
        if not parallel:
            return grammar
        return grammar.ending_at_repeated_calls(self._tokenizer.decode_bytes)

    def tool_call_body(self, functions: list[dict], end_token: int) -> Grammar:
        """What follows a `<tool_call>` token, for a model that wrote it freely (`tool_choice`
        auto; `server.engine.structured.lazy_grammar`): a newline, one call of one of `functions` as
        `tool_calls` writes it, a newline and the `</tool_call>` token (`end_token`)."""
        body, strict = _calls_schema(functions)

        def lark(schema: dict) -> str:
            return "\n".join([f"start: {_lark_literal(chr(10))} body {_lark_literal(chr(10))}"
                              f" <[{int(end_token)}]>", _lark_json("body", schema)])

        return self._compile_schema(body, strict, lark)

    def _xml_tool_calls(self, functions: list[dict], parallel: bool) -> Grammar:
        try:
            text = xml_calls_lark(functions, self._tag(TOOL_CALL_START),
                                  self._tag(TOOL_CALL_END),
                                  MAX_PARALLEL_TOOL_CALLS if parallel else 1)
        except XmlCallError as e:
            raise GrammarError(str(e)) from e
        grammar = self.lark(text)
        return grammar.ending_at_repeated_calls(self._tokenizer.decode_bytes) if parallel \
            else grammar

    def xml_call_body(self, functions: list[dict], end_token: int) -> Grammar:
        """What follows a `<tool_call>` token for a model that writes Qwen3-Coder's XML calls
        by itself (`server.engine.structured.xml_calls`), up to the `</tool_call>` token
        (`end_token`)."""
        try:
            text = xml_call_lark(functions, end_token)
        except XmlCallError as e:
            raise GrammarError(str(e)) from e
        return self.lark(text)

    def regex(self, pattern: str) -> Grammar:
        """Output that the regular expression matches as a whole (vLLM's `regex`)."""
        return self._compile(f"regex {pattern}",
                             lambda: llguidance.LLMatcher.grammar_from_regex(pattern))

    def choice(self, options: list[str]) -> Grammar:
        """Output that is exactly one of `options` (vLLM's `choice`)."""
        return self.lark("start: " + " | ".join(_lark_literal(o) for o in options))

    def grammar(self, text: str) -> Grammar:
        """Output that follows a client's grammar: Lark in llguidance's dialect, or llama.cpp's
        GBNF (`root ::= ...`), which llguidance translates to Lark."""
        try:
            return self.lark(any_to_lark(text))
        except GbnfToLarkError as e:
            raise GrammarError(f"not a Lark or GBNF grammar: {e}") from e

    def lark(self, text: str) -> Grammar:
        """Output that follows a Lark grammar, in llguidance's dialect."""
        return self._compile(f"lark {text}",
                             lambda: llguidance.LLMatcher.grammar_from_lark(text))

    def _tag(self, text: str) -> str:
        """A call tag in Lark: its token where it is one, else the text."""
        return self._tags.get(text, _lark_literal(text))

    # ------------------------------------------------------------------ compiling
    def _compile_schema(self, schema: dict, strict: bool, to_lark) -> Grammar:
        try:
            try:
                return self.lark(to_lark(_with_options(schema, lenient=False)))
            except GrammarError as e:
                if strict or "nimplemented" not in str(e):
                    raise
            return self.lark(to_lark(_with_options(schema, lenient=True)))
        except (ValueError, TypeError, RuntimeError, RecursionError) as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(f"cannot compile this schema: {e}") from e

    def _compile(self, key: str, grammar_of) -> Grammar:
        """The grammar `grammar_of()` returns, validated and compiled once per `key`."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar_text = grammar_of()
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                grammar_text, self._tokenizer)
            if is_error:
                raise GrammarError(_first_line(messages[0]) if messages else "invalid grammar")
            matcher = llguidance.LLMatcher(self._tokenizer, grammar_text, log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:
            if isinstance(e, GrammarError):
                raise
            raise GrammarError(_first_line(str(e))) from e
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        grammar = Grammar(matcher, self.vocab_size, self._special, key[:80])
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


@lru_cache(maxsize=4)
def grammars_for(tokenizer: Any) -> Grammars:
    """The `Grammars` of a tokenizer, built once (the vocabulary bridge takes ~0.3 s at 49k)."""
    return Grammars(tokenizer)


def _calls_schema(functions: list[dict]) -> tuple[dict, bool]:
    """The JSON schema of one call of one of `functions` (`_call_schema`), and whether it is
    strict (every function is)."""
    if not functions:
        raise GrammarError("at least one function is needed for a tool call")
    variants = [_call_schema(f) for f in functions]
    body = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return body, all(f.get("strict") for f in functions)


def _call_schema(function: dict) -> dict:
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise GrammarError("every function needs a name")
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:  # a function that takes no arguments
        parameters = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, dict):
        raise GrammarError(f"function {name!r}: parameters must be a JSON schema object")
    if "properties" in parameters and "additionalProperties" not in parameters:
        # A function takes the parameters it declares: a small model left free to add keys
        # invents them, and the caller's `**arguments` fails.
        parameters = {**parameters, "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _with_options(schema: dict, *, lenient: bool) -> dict:
    """`schema` with our JSON layout, unless the schema sets its own (llguidance's x-guidance)."""
    options = {**JSON_OPTIONS, "lenient": lenient, **schema.get("x-guidance", {})}
    return {**schema, "x-guidance": options}


def _lark_json(rule: str, schema: dict) -> str:
    return f"{rule}: %json {json.dumps(schema, ensure_ascii=False)}"


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _first_line(message: str) -> str:
    """llguidance's message without its position in our generated lark text."""
    line = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    return re.sub(r"^at \d+\(\d+\):\s*", "", line)[:300]
