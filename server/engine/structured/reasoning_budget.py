"""A thinking model's reasoning, ended after a budget of tokens (Anthropic's `budget_tokens`).

A `ReasoningBudget` is a `TokenConstraint` (`server.engine.structured.constraints`): it allows any
token
until the reasoning holds `budget` tokens, then only the end marker (`</think>`), so the model
moves on to its answer. Being a constraint, it masks the drafts as the target's tokens, so the
text is the same with or without drafting. The reasoning is counted from where it opens: at the
start of the reply when the prompt opened it (a template's `<think>`), or at the model's own
start marker; once closed, nothing more is constrained until it opens again.
"""

from __future__ import annotations

import numpy as np


class ReasoningBudget:
    def __init__(self, budget: int, start_id: int, end_id: int, vocab_size: int, *,
                 in_reasoning: bool):
        self.budget = budget
        self._start, self._end = start_id, end_id
        self._vocab_size = vocab_size
        # (in the reasoning, its tokens so far) before the reply, then after each consumed token
        self._states: list[tuple[bool, int]] = [(in_reasoning, 0)]
        self._only_end: np.ndarray | None = None

    def allowed(self) -> np.ndarray | None:
        if not self._over_budget():
            return None
        if self._only_end is None:
            self._only_end = np.zeros(self._vocab_size, dtype=bool)
            self._only_end[self._end] = True
        return self._only_end

    def consume(self, tokens: list[int]) -> int:
        for count, token in enumerate(tokens):
            if self._over_budget() and token != self._end:
                return count
            inside, used = self._states[-1]
            if inside:
                self._states.append((False, used) if token == self._end else (True, used + 1))
            else:
                self._states.append((token == self._start, 0))
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            del self._states[-num_tokens:]

    def is_finished(self) -> bool:
        return False

    def forced(self) -> list[int]:
        """The end marker, once the budget is spent (it drafts itself)."""
        return [self._end] if self._over_budget() else []

    def _over_budget(self) -> bool:
        inside, used = self._states[-1]
        return inside and used >= self.budget


def reasoning_budget(tokenizer, budget: int, vocab_size: int, prompt: list[int]):
    """A builder of the budget's constraint for a reply after `prompt` (what
    `GenerationParams.constraint` takes), or None when the model does not think or its
    markers are not single tokens."""
    if not tokenizer.has_thinking:
        return None
    starts, ends = tokenizer.think_start_tokens, tokenizer.think_end_tokens
    if len(starts) != 1 or len(ends) != 1:
        return None
    in_reasoning = opens_reasoning(tokenizer, prompt)
    return lambda: ReasoningBudget(budget, starts[0], ends[0], vocab_size,
                                   in_reasoning=in_reasoning)


def opens_reasoning(tokenizer, prompt: list[int]) -> bool:
    """Whether a reply after `prompt` starts in the reasoning: the prompt's last marker opens
    one (`mlx_lm.server`'s rule)."""
    return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
