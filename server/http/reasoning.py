"""A thinking model's reasoning, told apart from its answer.

Models that think (Qwen3, SmolLM3, DeepSeek-R1's distills, ...) write their reasoning between
markers, `<think>` and `</think>`, and chat templates often open it in the generation prompt.
`mlx_lm` knows the markers of the tokenizer (`has_thinking`, `think_start`, `think_end`) and
matches them in the decoded text with its `TextStateMachine`; a reply then starts in the
reasoning when the prompt's last marker opens one, as `mlx_lm.server` decides.
"""

from __future__ import annotations

from mlx_lm.generate import TextStateMachine

REASONING, ANSWER = "reasoning", "normal"


def starts_in_reasoning(tokenizer, prompt: list[int]) -> bool:
    return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)


class ReasoningSplit:
    """Feed a reply's text; get back (reasoning, answer) text, the markers dropped. Text that
    may be the start of a marker is held back until the next feed shows it is not."""

    def __init__(self, tokenizer, prompt: list[int]):
        machine = TextStateMachine({ANSWER: [(tokenizer.think_start, REASONING)],
                                    REASONING: [(tokenizer.think_end, ANSWER)]})
        initial = REASONING if starts_in_reasoning(tokenizer, prompt) else ANSWER
        self._state = machine.make_state(initial)

    def feed(self, text: str) -> tuple[str, str]:
        self._state, segments = TextStateMachine.split(self._state, text)
        return _join(segments, REASONING), _join(segments, ANSWER)

    @property
    def in_reasoning(self) -> bool:
        return self._state[0] == REASONING

    def finish(self) -> tuple[str, str]:
        self._state, rest, state = TextStateMachine.flush(self._state)
        return (rest, "") if state == REASONING else ("", rest)


def _join(segments: list[tuple[str, str]], state: str) -> str:
    return "".join(text for s, text in segments if s == state)


def reasoning_split(tokenizer, prompt: list[int]) -> ReasoningSplit | None:
    """A split for a reply to `prompt`, or None when the model does not think."""
    return ReasoningSplit(tokenizer, prompt) if tokenizer.has_thinking else None
