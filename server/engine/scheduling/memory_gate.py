"""Admission and preemption by memory: what the batch's KV caches will take, against the budget.

Each model's batch cache is one rectangle (`ModelBatch`): every row is as wide as the widest,
so a batch of R rows W positions wide takes R x bytes(W), for the target and, over the rows
that draft with it, for the draft. The scheduler hands the gate each row's width at a horizon
(now plus what it may grow by), and the gate prices them with each model's `KVLayout`:

- a request joins the batch only when every row, itself included, fits once each grew by
  `ADMISSION_GROWTH_TOKENS` (or what it has left): room to grow before anything is paused;
- before each step, while the rows would not fit their next round, the newest is paused
  (preempted): its KV is released and it resumes later from its tokens;
- a request whose prompt and `max_tokens` could never fit the budget, even alone, is refused.

The budget already leaves a margin for what a forward allocates for a moment; the gate
watches what the steps really allocate (`memory.step_transient`) and takes the largest beyond
that margin from the budget: a wave prefilled 1,024 tokens at a time over 2,000-token prompts
took 0.24 GB for a moment (generated pair), twice the margin of a 1.2 GB cgroup, and without
this the flood in it was OOM-killed.

The prefix cache is not priced here: it holds at most what the rows leave of the budget and
gives way first (`PrefixCache.give_way`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from server.engine.errors import MemoryBudgetExceeded
from server.engine.kv.kv_size import KVLayout, kv_layout
from server.engine.memory import MemoryBudget, step_transient
from server.engine.models.model_kit import ModelKit

# Admission leaves every row room to grow this many tokens (or what it has left) before the
# budget pauses one: mlx_lm's KV caches grow 256 positions at a time.
ADMISSION_GROWTH_TOKENS = 256
GB = 1e9
UNKNOWN_HEADS = 32  # a model whose config names its attention heads otherwise: a large one's


@dataclass
class MemoryGate:
    budget: MemoryBudget
    target: KVLayout
    draft: KVLayout | None = None
    transient_bytes: int = 0  # the most a step has allocated for a moment

    @property
    def budget_bytes(self) -> int:
        """The budget less what steps allocated for a moment beyond its margin (a budget
        derived from the memory limit; a configured one is the KV caches' alone)."""
        if self.budget.limit is None:
            return self.budget.kv_bytes
        beyond = max(0, self.transient_bytes - self.budget.margin_bytes)
        return max(0, self.budget.kv_bytes - beyond)

    def observe(self, transient: int) -> None:
        """A step allocated `transient` bytes for a moment (`memory.step_transient`)."""
        self.transient_bytes = max(self.transient_bytes, transient)

    def need(self, target_widths: list[int], draft_widths: list[int] = ()) -> int:
        """The bytes of the target's batch with rows of `target_widths` positions and the
        draft's with rows of `draft_widths`: each batch as wide as its widest row."""
        need = self.target.bytes(max(target_widths, default=0), len(target_widths))
        if self.draft is not None:
            need += self.draft.bytes(max(draft_widths, default=0), len(draft_widths))
        return need

    def fits(self, target_widths: list[int], draft_widths: list[int] = ()) -> bool:
        return self.need(target_widths, draft_widths) <= self.budget_bytes

    def room(self) -> int:
        """The most tokens (prompt and output) one request may hold: its target cache alone
        within the whole budget (its draft drafts only where memory allows)."""
        return self.target.max_tokens(self.budget_bytes)

    def check(self, prompt_tokens: int, max_tokens: int, *, prompt_name: str = "prompt",
              max_tokens_name: str = "max_tokens") -> None:
        """MemoryBudgetExceeded for a request that could never run: its prompt and
        `max_tokens` need more KV than the whole budget (the fields by the caller's names)."""
        room = self.room()
        if prompt_tokens + max_tokens <= room:
            return
        need = self.target.bytes(prompt_tokens + max_tokens)
        limit = f"the server's memory budget for KV caches is {self.budget_bytes / GB:.3g} GB" \
                f" ({self._source()}), room for {room} tokens"
        if prompt_tokens >= room:
            raise MemoryBudgetExceeded(
                f"the prompt has {prompt_tokens} tokens, whose KV cache alone does not fit: "
                f"{limit}; shorten the {prompt_name}", prompt_name)
        raise MemoryBudgetExceeded(
            f"the prompt ({prompt_tokens} tokens) and {max_tokens_name} ({max_tokens}) need "
            f"{need / GB:.3g} GB of KV cache: {limit}, so {max_tokens_name} may be at most "
            f"{room - prompt_tokens}", max_tokens_name)

    def _source(self) -> str:
        limit = self.budget.limit
        if limit is None:
            return "engine.memory_budget_gb"
        held = self.budget.reserved_bytes / GB
        margin = max(self.budget.margin_bytes, self.transient_bytes) / GB
        return f"{limit.source}: {limit.bytes / GB:.3g} GB, less {held:.3g} GB held by the" \
               f" models and {margin:.3g} GB of margin"


def gate_for(kit: ModelKit, budget: MemoryBudget, prefill_tokens: int) -> MemoryGate:
    """The gate of `kit`'s models within `budget` (their layouts probed now: the MLX
    thread's work), expecting from the start the transient of a prefill forward of
    `prefill_tokens` (the scheduler's `idle_prefill_chunk`; `prefill_transient`): the steps'
    own are seen only once they ran."""
    draft = kv_layout(kit.draft.model) if kit.draft is not None else None
    step_transient()  # what loading the models allocated for a moment is not a step's
    expected = prefill_transient(kit.target.model, prefill_tokens) \
        if mx.default_device() == mx.cpu else 0
    return MemoryGate(budget, kv_layout(kit.target.model), draft, transient_bytes=expected)


def prefill_transient(model, tokens: int) -> int:
    """What a prefill forward of `tokens` over a context twice as long allocates for a moment
    on a CPU, where attention materializes its scores: a layer's float32 scores and their
    softmax (tokens x context x heads, twice) and its MLP's three activations. (Metal's and
    CUDA's fused attention keep no scores: there the steps' own figures serve.) The flood's
    wave on the generated pair: 0.23 GB estimated for 1,024 tokens, 0.21-0.24 GB seen."""
    args = getattr(model, "args", None)
    heads = next((v for name in ("num_attention_heads", "n_head", "n_heads", "num_heads")
                  if isinstance(v := getattr(args, name, None), int) and v > 0), UNKNOWN_HEADS)
    mlp = next((v for name in ("intermediate_size", "n_inner", "ffn_dim")
                if isinstance(v := getattr(args, name, None), int) and v > 0), 0)
    return 4 * (2 * tokens * 2 * tokens * heads + 3 * tokens * mlp)
