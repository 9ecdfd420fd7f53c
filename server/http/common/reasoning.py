"""A thinking model's reasoning, told apart from its answer.

Models that think (Qwen3, SmolLM3, DeepSeek-R1's distills, ...) write their reasoning between
markers, `<think>` and `</think>`, and chat templates often open it in the generation prompt.
`mlx_lm` knows the markers of the tokenizer (`has_thinking`, `think_start`, `think_end`) and
matches them in the decoded text with its `TextStateMachine`; a reply then starts in the
reasoning when the prompt's last marker opens one, as `mlx_lm.server` decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.generate import TextStateMachine

from server.engine import opens_reasoning

REASONING, ANSWER = "reasoning", "normal"


@dataclass(frozen=True)
class ReplyStart:
    """Where a reply starts: after `prompt`; `constrained`: a grammar (structured output, a
    forced call) holds the reply, so all of it is the answer, even after a prompt that opens
    a reasoning (the grammar would not let the model close it)."""

    prompt: list[int]
    constrained: bool = False

    def in_reasoning(self, tokenizer) -> bool:
        return not self.constrained and opens_reasoning(tokenizer, self.prompt)


class ReasoningSplit:
    """Feed a reply's text; get back (reasoning, answer) text, the markers dropped. Text that
    may be the start of a marker is held back until the next feed shows it is not."""

    def __init__(self, tokenizer, start: ReplyStart):
        machine = TextStateMachine({ANSWER: [(tokenizer.think_start, REASONING)],
                                    REASONING: [(tokenizer.think_end, ANSWER)]})
        self._state = machine.make_state(REASONING if start.in_reasoning(tokenizer) else ANSWER)

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


def reasoning_split(tokenizer, start: ReplyStart) -> ReasoningSplit | None:
    """A split for a reply that starts at `start`, or None when the model does not think."""
    return ReasoningSplit(tokenizer, start) if tokenizer.has_thinking else None
