"""Tool calls, HTTP side: tools into the chat prompt, generated text into OpenAI `tool_calls`.

A chat template that knows tools renders them (`apply_chat_template(tools=...)`), and the
model's own tool parser from `mlx_lm` reads its calls. A template that does not (the ChatML
ones of the demo pair and SmolLM2) gets the tools described in the system message in the Hermes
format, the one `server.engine.structured.grammar` forces under `tool_choice` `required` or a named
function and `mlx_lm`'s `json_tools` parser reads:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

History is never dropped: assistant `tool_calls` and `tool` results are passed to a template
that renders them, and written into the message text (Hermes style) for one that does not.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlx_lm.tool_parsers import json_tools, qwen3_coder

from server.engine import TOOL_CALL_END, TOOL_CALL_START, call_key, chat_tokens


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model writes a tool call: between `start` and `end` ("" = to the end of output)."""

    start: str
    end: str
    parse: Callable[[str, Any], Any]  # an mlx_lm parser: text -> {"name", "arguments"} or list


HERMES = ToolCallFormat(TOOL_CALL_START, TOOL_CALL_END, json_tools.parse_tool_call)


def own_call_syntax(tokenizer) -> str | None:
    """How the model's own calls (`tool_choice` auto) are written between `<tool_call>` and
    `</tool_call>`: "json" (Hermes, `Grammars.tool_call_body`), "xml" (Qwen3-Coder,
    `Grammars.xml_call_body`), or None for another format."""
    return _syntax(call_format(tokenizer, forced=False))


def _syntax(fmt: ToolCallFormat) -> str | None:
    if (fmt.start, fmt.end) != (HERMES.start, HERMES.end):
        return None
    return {HERMES.parse: "json", qwen3_coder.parse_tool_call: "xml"}.get(fmt.parse)

TOOLS_SYSTEM_PROMPT = """\
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_renders_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return bool(getattr(tokenizer, "has_chat_template", False)) and isinstance(template, str) \
        and "tools" in template


def template_renders_tool_calls(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tool_calls" in template


def call_format(tokenizer, *, forced: bool) -> ToolCallFormat:
    """The format this request's calls come in: the model's own where its template renders
    tools; Hermes for prompts we wrote, and for forced calls in a syntax no grammar of ours
    writes (forced calls in Hermes' JSON or Qwen3-Coder's XML keep it)."""
    if not template_renders_tools(tokenizer) or not tokenizer.has_tool_calling:
        return HERMES
    own = ToolCallFormat(tokenizer.tool_call_start, tokenizer.tool_call_end or "",
                         tokenizer.tool_parser)
    return HERMES if forced and _syntax(own) is None else own


# ----------------------------------------------------------------------------- the prompt
def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None,
                template_kwargs: dict | None = None, **rendering) -> list[int]:
    """Prompt tokens for `messages` (OpenAI dicts) and `tools` (OpenAI tool objects or None);
    `template_kwargs`: more variables for the template (`enable_thinking`, ...); `rendering`:
    `chat_tokens`' `continue_final` and `generation_prompt`."""
    native_tools = bool(tools) and template_renders_tools(tokenizer)
    messages = [template_message(m, native_calls=template_renders_tool_calls(tokenizer))
                for m in messages]
    if tools and not native_tools:
        messages = with_tools_system_prompt(messages, tools)
    kwargs = dict(template_kwargs or {})
    if native_tools:
        kwargs["tools"] = tools
    try:
        return chat_tokens(tokenizer, messages, **rendering, **kwargs)
    except Exception:
        if not any(m["role"] == "tool" for m in messages):
            raise
    # A template that refuses the `tool` role: results go back as user turns (Hermes style).
    messages = [tool_result_as_user(m) if m["role"] == "tool" else m for m in messages]
    return chat_tokens(tokenizer, messages, **rendering, **kwargs)


def template_message(message: dict, *, native_calls: bool) -> dict:
    """One OpenAI message as chat templates expect it (HF: call arguments as a dict)."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key) is not None:
            out[key] = message[key]
    calls = message.get("tool_calls")
    if not calls:
        return out
    if native_calls:
        out["tool_calls"] = [
            {"id": c.get("id"), "type": "function",
             "function": {"name": c["function"]["name"],
                          "arguments": _arguments_dict(c["function"].get("arguments"))}}
            for c in calls]
        return out
    blocks = [hermes_call(c["function"]["name"], _arguments_dict(c["function"].get("arguments")))
              for c in calls]
    out["content"] = "\n".join(filter(None, [out["content"], *blocks]))
    return out


def hermes_call(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def tool_result_as_user(message: dict) -> dict:
    return {"role": "user",
            "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}


def with_tools_system_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    text = TOOLS_SYSTEM_PROMPT.format(tools=described)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _arguments_dict(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments  # a template still renders it; never drop it
    return arguments if arguments is not None else {}


# ----------------------------------------------------------------------------- the output
def openai_tool_call(parsed: dict) -> dict:
    """mlx_lm's {"name", "arguments"} -> OpenAI's {"id", "type", "function"}."""
    name = parsed.get("name") if isinstance(parsed, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"not a tool call: {parsed!r}")
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = parsed.get("id") if isinstance(parsed.get("id"), str) else None
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallParser:
    """Splits generated text, as it streams, into content and completed tool calls.

    `feed` returns the content that is safe to show now and the calls that the text completed;
    `finish` flushes what is left. A call identical to an earlier one of the turn (same name,
    same arguments as JSON values) is dropped. Text that may be the start of a call marker is
    held back;
    so is trailing whitespace, dropped at the end when the output made calls. The split does
    not depend on how the text was chunked, so a stream and a whole response agree. An
    unterminated call at the end (its end marker missing or cut) is parsed if it can be; else,
    when the model ended the output there, it is shown as text (nothing the model wrote is
    lost), and when the token limit cut it (`finish(cut=True)`), it is dropped, as is a call
    marker cut part way: a cut call is never content.
    """

    def __init__(self, fmt: ToolCallFormat, tools: list[dict] | None):
        self.fmt, self.tools = fmt, tools
        self.calls: list[dict] = []
        self._seen: set[str] = set()  # call_key of each call in self.calls
        self._buffer = ""
        self._held = ""  # whitespace between pieces of content
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buffer += text
        content, calls = [], []
        start, end = self.fmt.start, self.fmt.end
        while True:
            if not self._in_call:
                at = self._buffer.find(start)
                if at < 0:
                    safe = len(self._buffer) - _prefix_overlap(self._buffer, start)
                    content.append(self._content(self._buffer[:safe]))
                    self._buffer = self._buffer[safe:]
                    break
                content.append(self._content(self._buffer[:at]))
                self._buffer = self._buffer[at + len(start):]
                self._in_call = True
            else:
                at = self._buffer.find(end) if end else -1
                if at < 0:
                    break
                body, self._buffer = self._buffer[:at], self._buffer[at + len(end):]
                self._in_call = False
                parsed = self._parse(body)
                if parsed is None:
                    content.append(self._content(start + body + end))
                else:
                    calls.extend(parsed)
        return "".join(content), calls

    def finish(self, *, cut: bool = False) -> tuple[str, list[dict]]:
        """The rest; `cut`: the output ended at its token limit, not where the model ended it."""
        rest, calls = self._buffer, []
        self._buffer = ""
        if self._in_call:
            self._in_call = False
            end = self.fmt.end
            parsed = self._parse(rest[:len(rest) - _prefix_overlap(rest, end)] if end else rest)
            if parsed is not None:
                calls, rest = parsed, ""
            else:
                rest = "" if cut else self.fmt.start + rest
        elif cut:  # held back as the start of a call marker: a call the limit cut
            rest = rest[:len(rest) - _prefix_overlap(rest, self.fmt.start)]
        content = self._content(rest)
        if not self.calls:
            content, self._held = content + self._held, ""
        return content, calls

    def _content(self, text: str) -> str:
        """Content to show now; trailing whitespace waits until we know what follows it."""
        shown = text.rstrip()
        if not shown:
            self._held += text
            return ""
        shown, self._held = self._held + shown, text[len(shown):]
        return shown

    def _parse(self, body: str) -> list[dict] | None:
        """The new calls in one call block ([] when all repeat earlier ones); None when it
        does not parse."""
        try:
            parsed = self.fmt.parse(body, self.tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            calls = [openai_tool_call(p) for p in parsed]
        except Exception:  # any parser failure: the text stays content
            return None
        if not calls:
            return None
        calls = [c for c in calls if self._first_time(c)]
        self.calls.extend(calls)
        return calls

    def _first_time(self, call: dict) -> bool:
        """False for a call identical (name and arguments) to an earlier one of this turn: a
        degenerate repeat that an agent would run twice; it is dropped."""
        key = call_key(call["function"]["name"], _arguments_dict(call["function"]["arguments"]))
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


def _prefix_overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parser_factory(tokenizer, tools: list[dict] | None,
                   *, forced: bool) -> Callable[[], ToolCallParser] | None:
    """A new `ToolCallParser` per use for a request that offers tools; None when it does not."""
    if not tools:
        return None
    fmt = call_format(tokenizer, forced=forced)
    return lambda: ToolCallParser(fmt, tools)


def tool_input(arguments: str) -> dict:
    """A call's JSON arguments as the object Anthropic's `input` is."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}
