"""The contract between the decoder and a grammar: what a constrained request brings.

A `TokenConstraint` is one request's grammar state (JSON schema, tool call, ...). The decoder
(`server.engine.scheduling.decoder`) drives it on the MLX thread, identically in plain and
speculative
rounds:

- plain step: `allowed()` masks the target's logits, the sampled token is `consume`d;
- drafting: before each draft token `allowed()` masks the draft's logits and the drafted token is
  `consume`d, so the draft proposes only grammar-valid tokens; prompt-lookup drafts are
  `consume`d and cut at the first invalid one;
- verification: the masks seen along the draft (plus the one after its last token) mask the
  target's k + 1 rows the same way; then the drafts are `rollback`ed and the accepted tokens
  plus the target's own token are `consume`d;
- `forced` tokens (a JSON schema's next key, ...) are a drafting row's round, proposed as prompt
  lookup proposes, so a run of them costs one verification and no draft forward.

Masks are numpy bool arrays over at least the tokenizer's vocabulary (longer is cut, shorter
means "not allowed"); None means "any token".
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class TokenConstraint(Protocol):
    def allowed(self) -> np.ndarray | None:
        """Which tokens may come next, given everything consumed so far (EOS included)."""

    def consume(self, tokens: list[int]) -> int:
        """Advance through `tokens`; stop at the first one the grammar refuses.

        Returns how many were consumed (all of them when every token was valid).
        """

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed tokens."""

    def is_finished(self) -> bool:
        """The grammar is complete and accepts nothing more (generation should stop)."""

    def forced(self) -> list[int]:
        """The tokens that must come next, whatever the model prefers (possibly none): a
        drafting row proposes them as its round's draft, at no draft cost."""
