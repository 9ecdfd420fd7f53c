"""The grammar of a tool call in Qwen3-Coder's XML (Qwen3-Coder, Qwen3.5: what their chat
templates write and `mlx_lm`'s `qwen3_coder` parser reads), from after its `<tool_call>`
token to its `</tool_call>` token:

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>

One of the offered functions; its parameters in their schema's order, the required ones
always, no others. A value is what the parser converts for the parameter's type: free text for
a string (any text up to the closing tag, which ends it; one line within `minLength` and
`maxLength` where the schema bounds it),
one of an enum's values, a number, true or false, or JSON that follows the schema for an object
or an array.
"""

from __future__ import annotations

import json

from server.engine.errors import XmlCallError

NL = "\n"
VALUE_END = NL + "</parameter>"
PATTERNS = {"integer": r"-?[0-9]+", "number": r"-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?",
            "boolean": r"true|false"}


def xml_call_lark(functions: list[dict], end_token: int) -> str:
    """Lark (llguidance's dialect) for what follows a `<tool_call>` token: one call of one of
    `functions` (OpenAI function objects), then the token `end_token`."""
    return "\n".join([f"start: xml_call <[{int(end_token)}]>", *_call_rules(functions)])


def xml_calls_lark(functions: list[dict], start: str, end: str, max_calls: int) -> str:
    """Lark for 1 to `max_calls` whole calls, each between the `start` and `end` tags (Lark:
    a literal or a token), one per line: the calls a request forces (`tool_choice` required or
    named)."""
    more = f" ({_literal(NL)} call){{0,{max_calls - 1}}}" if max_calls > 1 else ""
    return "\n".join([f"start: call{more}", f"call: {start} xml_call {end}",
                      *_call_rules(functions)])


def _call_rules(functions: list[dict]) -> list[str]:
    """`xml_call`: a newline, one call of one of `functions`, a newline."""
    if not functions:
        raise XmlCallError("at least one function is needed for a tool call")
    rules = [f"xml_call: {_literal(NL)} ({' | '.join(f'f{i}' for i in range(len(functions)))})"
             f" {_literal(NL)}"]
    for i, function in enumerate(functions):
        rules += _function_rules(f"f{i}", function)
    return rules


def _function_rules(rule: str, function: dict) -> list[str]:
    name = _word(function.get("name"), "function")
    schema = function.get("parameters") or {}
    if not isinstance(schema, dict):
        raise XmlCallError(f"function {name!r}: parameters must be a JSON schema object")
    required = set(schema.get("required") or ())
    rules, parts = [], []
    for j, (param, param_schema) in enumerate((schema.get("properties") or {}).items()):
        part = f"{rule}_{j}"
        parts.append(part if param in required else f"{part}?")
        rules += _parameter_rules(part, _word(param, "parameter"), param_schema or {})
    body = " ".join([_literal(f"<function={name}>{NL}"), *parts, _literal("</function>")])
    return [f"{rule}: {body}", *rules]


def _parameter_rules(rule: str, name: str, schema: dict) -> list[str]:
    """`<parameter=NAME>`, a newline, the value, a newline, `</parameter>` and a newline."""
    opening, kind = _literal(f"<parameter={name}>{NL}"), _kind(schema)
    closing = _literal(VALUE_END + NL)
    if kind == "text":
        bounds = _length(schema)
        if bounds is None:  # up to the closing tag, which the lazy lexeme's stop string takes
            return [f"{rule}: {opening} {rule}_v {_literal(NL)}",
                    f"{rule}_v[stop={_literal(VALUE_END)}]: /(?s:.*)/"]
        # One line: llguidance's mask is empty where a lazy lexeme reaches its bound.
        return [f"{rule}: {opening} /[^\\n]{bounds}/ {closing}"]
    if kind == "enum":
        values = " | ".join(_literal(str(v)) for v in schema["enum"])
        return [f"{rule}: {opening} ({values}) {closing}"]
    if kind == "json":
        return [f"{rule}: {opening} {rule}_v {closing}",
                f"{rule}_v: %json {json.dumps(schema, ensure_ascii=False)}"]
    return [f"{rule}: {opening} /{PATTERNS[kind]}/ {closing}"]


def _length(schema: dict) -> str | None:
    """A string's `minLength` and `maxLength` as a regex repetition, or None for neither."""
    low, high = schema.get("minLength"), schema.get("maxLength")
    ints = [v for v in (low, high) if v is not None]
    if not ints or not all(isinstance(v, int) and v >= 0 for v in ints):
        return None
    return f"{{{low or 0},{high if high is not None else ''}}}"


def _kind(schema: dict) -> str:
    """How the parser converts the value: text, enum, integer, number, boolean or json."""
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "enum"
    types = schema.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    types = [t for t in types if t != "null"]
    if len(types) != 1:  # no type, or several: the parser keeps what it cannot convert
        return "text"
    if types[0] in ("object", "array"):
        return "json"
    return types[0] if types[0] in PATTERNS else "text"


def _word(name, what: str) -> str:
    if not isinstance(name, str) or not name or any(c in name for c in "<>\n "):
        raise XmlCallError(f"a {what} name must be a word: {name!r}")
    return name


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
