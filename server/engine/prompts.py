"""Prompt text -> token ids, one way for the server and the developer tools."""

from __future__ import annotations


def text_tokens(tokenizer, text: str) -> list[int]:
    """A raw prompt: BOS added by the tokenizer unless the text already starts with it."""
    bos = tokenizer.bos_token
    return list(tokenizer.encode(text, add_special_tokens=bos is None
                                 or not text.startswith(bos)))


def chat_tokens(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """The chat template with the generation prompt; `role: content` lines without one."""
    if not tokenizer.has_chat_template:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return list(tokenizer.encode(text))
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              **template_kwargs))
