"""Responses API tools -> the chat tools the model is offered, and its calls -> output items.

Function tools are offered as they are. A custom tool (free-text input) is offered as a
function with one string parameter, `input`, and a call to it comes back as a
`custom_tool_call` with that text. The tools of a namespace tool are offered as
`<namespace>__<name>`, and calls to them carry `namespace`. Hosted tools (`web_search`, ...)
are not offered: this server cannot run them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from api_schemas.responses import (
    CustomTool,
    CustomToolCallInput,
    CustomToolCallItem,
    FunctionCallInput,
    FunctionCallItem,
    FunctionTool,
    NamespaceTool,
)
from server.http.common.chat_translation import tool_call
from server.http.common.errors import APIError

SEPARATOR = "__"
MAX_NAME = 64  # a chat function name's limit
INPUT_SCHEMA = {"type": "object", "properties": {"input": {"type": "string"}},
                "required": ["input"], "additionalProperties": False}


def offered_name(name: str, namespace: str | None) -> str:
    return name if namespace is None else f"{namespace}{SEPARATOR}{name}"


@dataclass(frozen=True)
class Offered:
    kind: str  # "function" or "custom"
    name: str
    namespace: str | None


class ToolTable:
    """A request's tools as the model sees them (`chat_tools`), and back (`output_item`)."""

    def __init__(self, tools: list | None):
        self.chat_tools: list[dict] = []
        self._offered: dict[str, Offered] = {}
        for index, tool in enumerate(tools or ()):
            if isinstance(tool, NamespaceTool):
                for inner in tool.tools:
                    self._offer(inner, tool, index)
            elif isinstance(tool, (FunctionTool, CustomTool)):
                self._offer(tool, None, index)

    def _offer(self, tool: FunctionTool | CustomTool, namespace: NamespaceTool | None,
               index: int) -> None:
        space = namespace.name if namespace is not None else None
        name = offered_name(tool.name, space)
        if len(name) > MAX_NAME or name in self._offered:
            why = "is longer than 64 characters" if len(name) > MAX_NAME else "is offered twice"
            raise APIError(400, f"tools.{index}: the tool name {name!r} {why}",
                           param=f"tools.{index}", code="invalid_value")
        self._offered[name] = Offered(tool.type, tool.name, space)
        description = " ".join(filter(None, [namespace and namespace.description,
                                             tool.description]))
        if isinstance(tool, CustomTool):
            function = {"name": name, "parameters": INPUT_SCHEMA,
                        "description": _with_format(description, tool)}
        else:
            function = {**tool.model_dump(exclude={"type"}, exclude_none=True), "name": name}
            if description:
                function["description"] = description
        self.chat_tools.append({"type": "function", "function": function})

    def output_item(self, call: dict) -> FunctionCallItem | CustomToolCallItem:
        """A parsed chat tool call -> the output item of the tool it calls."""
        function = call["function"]
        offered = self._offered.get(function["name"])
        if offered is None:  # not a tool of this request: reported as the model wrote it
            return FunctionCallItem(call_id=call["id"], name=function["name"],
                                    arguments=function["arguments"])
        if offered.kind == "custom":
            return CustomToolCallItem(call_id=call["id"], name=offered.name,
                                      input=_custom_input(function["arguments"]),
                                      namespace=offered.namespace)
        return FunctionCallItem(call_id=call["id"], name=offered.name,
                                arguments=function["arguments"], namespace=offered.namespace)


def history_call(item: FunctionCallInput | CustomToolCallInput) -> dict:
    """An earlier call (an input item) -> the chat tool call the model made."""
    name = offered_name(item.name, item.namespace)
    if isinstance(item, CustomToolCallInput):
        return tool_call(item.call_id, name, json.dumps({"input": item.input},
                                                        ensure_ascii=False))
    return tool_call(item.call_id, name, item.arguments)


def _with_format(description: str, tool: CustomTool) -> str:
    fmt = tool.format
    if fmt is None or fmt.type == "text":
        return description
    rule = f"The input must match this {fmt.syntax} grammar:\n{fmt.definition}"
    return f"{description}\n\n{rule}" if description else rule


def _custom_input(arguments: str) -> str:
    """A custom tool's `input` from the arguments the model wrote, else those as they are."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
        return parsed["input"]
    return arguments
