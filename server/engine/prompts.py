"""Prompt text -> token ids, one way for the server and the developer tools."""

from __future__ import annotations

from pathlib import Path


def text_tokens(tokenizer, text: str) -> list[int]:
    """A raw prompt: BOS added by the tokenizer unless the text already starts with it."""
    bos = tokenizer.bos_token
    return list(tokenizer.encode(text, add_special_tokens=bos is None
                                 or not text.startswith(bos)))


def chat_tokens(tokenizer, messages: list[dict], *, continue_final: bool = False,
                generation_prompt: bool = True, **template_kwargs) -> list[int]:
    """The chat template, opening the assistant's turn (`generation_prompt`) or continuing the
    final message (`continue_final`: an assistant prefill); `role: content` lines without a
    template."""
    if continue_final:
        generation_prompt = False
    if not tokenizer.has_chat_template:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        text = "\n".join(lines) + ("" if continue_final else "\n")
        return list(tokenizer.encode(text + ("assistant: " if generation_prompt else "")))
    if continue_final:
        template_kwargs["continue_final_message"] = True
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                              **template_kwargs))


# Arguments the renderer sets itself, or that would change what it returns: never template
# variables (a request's or the server's `chat_template_kwargs`).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs"})


def chat_template_text(value: str) -> str:
    """`models.chat_template`: a Jinja template, or the path of a file that holds one."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat template file not found: {value} (a template itself must"
                         " contain {{ or {%)")
    return path.read_text(encoding="utf-8")


def check_chat_template(tokenizer) -> None:
    """Render a one-message chat, so a template that cannot render fails at start-up."""
    try:
        chat_tokens(tokenizer, [{"role": "user", "content": "hi"}])
    except Exception as e:  # noqa: BLE001 - jinja raises many kinds
        raise ValueError(f"the chat template cannot render a user message: "
                         f"{type(e).__name__}: {e}") from e
