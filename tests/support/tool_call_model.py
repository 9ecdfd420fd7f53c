"""A tiny pair that writes tool calls by itself (as Qwen2.5, in Hermes' JSON, or Qwen3-Coder, in
its XML, do with `tool_choice` auto): the tiny test pair with `<tool_call>` and `</tool_call>`
appended to its vocabulary as tokens of their own. The random target never writes a new token
by itself, so `<tool_call>`'s output row is made a copy, scaled up, of the row of a token it
writes early in its reply to `PROMPT` with `TOOLS` offered: it then opens a call there. What
follows is up to the grammar (`server.engine.structured.lazy_grammar`), or, without one, to the
random
model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from support.thinking_model import add_tokens

CALL_TOKENS = ("<tool_call>", "</tool_call>")
PROMPT = "What is the weather in Paris?"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}]
OPENS_AT = 3  # its reply opens the call with its third token


# A chat template that renders tools and calls as Qwen3-Coder's does (mlx_lm then reads the
# model's calls with its `qwen3_coder` parser), on the tiny pair's ChatML.
QWEN3_CODER_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
To call one, reply with:
<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
<function={{ call.function.name }}>
{% for key, value in call.function.arguments | items %}<parameter={{ key }}>
{{ value }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def build_tool_call_pair(pair: tuple[Path, Path], out: Path, prompt_tokens,
                         template: str | None = None) -> tuple[Path, Path]:
    """`prompt_tokens(tokenizer)`: the prompt the server renders for PROMPT with TOOLS;
    `template`: the pair's chat template (default: the tiny pair's, which knows no tools)."""
    from mlx_lm import load, stream_generate

    target, draft = out / "target", out / "draft"
    start, _ = add_tokens(pair[0], target, CALL_TOKENS, template=template)
    add_tokens(pair[1], draft, CALL_TOKENS, template=template)
    model, tokenizer = load(str(target))
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt_tokens(tokenizer),
                                               max_tokens=OPENS_AT)]
    for path in (target, draft):
        weights = mx.load(str(path / "model.safetensors"))
        head = weights["lm_head.weight"]
        weights["lm_head.weight"] = mx.concatenate(
            [head[:start], 1.05 * head[tokens[OPENS_AT - 1]][None], head[start + 1:]])
        mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    return target, draft
