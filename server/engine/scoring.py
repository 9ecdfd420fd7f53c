"""The target's log-probabilities of a prompt's own tokens (`/v1/completions` with `echo` and
`logprobs`: how lm-evaluation-harness scores a continuation).

A prompt is fed in chunks, one chunk per call between two scheduler steps, so a long prompt
delays the streams decoding by one chunk's forward at a time, as a prefill does. The cache it
fills then goes to the prefix cache: the generation that follows prefills one token, not the
prompt again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from server.engine.kv.batch import new_cache
from server.engine.scheduling.sampling import align_vocab, normalize


@dataclass
class PromptLogprobs:
    """`logprobs[i]`: the log-probability of token i + 1 given the tokens before it; `top[i]`:
    the `top` most likely tokens there, most likely first, as (token, logprob)."""

    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)


class PromptScorer:
    """Scores `tokens` with `model`, `chunk` tokens per `step()` (MLX thread only)."""

    def __init__(self, model, tokens: list[int], top: int, vocab_size: int, chunk: int):
        self.model, self.tokens, self.top = model, tokens, top
        self.vocab_size, self.chunk = vocab_size, chunk
        self.cache = None
        self.fed = 0
        self.result = PromptLogprobs()

    @property
    def done(self) -> bool:
        return self.fed == len(self.tokens)

    def step(self) -> bool:
        """Feed the next chunk; True once the whole prompt is scored."""
        if self.cache is None:
            self.cache = new_cache(self.model)
        start, end = self.fed, min(self.fed + self.chunk, len(self.tokens))
        logits = self.model(mx.array(self.tokens[start:end], mx.uint32)[None], cache=self.cache)
        targets = self.tokens[start + 1: end + 1]  # what each position predicts
        if not targets:  # the prompt's last token predicts nothing here
            mx.eval([c.state for c in self.cache])
        else:
            self._score(logits[0, :len(targets)], targets)
        self.fed = end
        return self.done

    def _score(self, logits: mx.array, targets: list[int]) -> None:
        logprobs = normalize(align_vocab(logits.astype(mx.float32), self.vocab_size))
        chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)[:, 0]
        outputs = [chosen]
        if self.top:
            part = mx.argpartition(-logprobs, kth=self.top - 1, axis=-1)[:, :self.top]
            values = mx.take_along_axis(logprobs, part, axis=-1)
            order = mx.argsort(-values, axis=-1)
            outputs += [mx.take_along_axis(part, order, axis=-1),
                        mx.take_along_axis(values, order, axis=-1)]
        mx.eval(outputs, [c.state for c in self.cache])
        self.result.logprobs += chosen.tolist()
        if self.top:
            self.result.top += [list(zip(t, v, strict=True)) for t, v in
                                zip(outputs[1].tolist(), outputs[2].tolist(), strict=True)]
        else:
            self.result.top += [[] for _ in targets]
