"""Who runs a cell: the engine in this process, or synthetic numbers for `--dry-run`.

A runner turns one (cell, max_tokens, seed) into a `RunResult`; the sweep, statistics, writer
and plot never know which runner made it. `server.bench.http_runner` adds one for servers.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Protocol

from server.bench.cells import PROMPT_KINDS, Cell
from server.bench.stats import theoretical_speedup
from server.engine.params import SpeculationParams

COST_RATIO_STEPS = 32
COST_RATIO_CONTEXT = 64


@dataclass(frozen=True)
class RunResult:
    """One generation, as measured. None: this runner cannot know it."""

    tokens: int
    tps: float | None
    ttft_s: float | None
    peak_gb: float | None
    prompt_tokens: int | None
    from_draft: int | None
    proposed: int | None
    accepted: int | None
    rounds: int | None
    finish_reason: str | None

    @classmethod
    def from_stats(cls, stats: dict, **overrides) -> RunResult:
        """From the engine's (or our server's) `stats` dict."""
        histogram = stats.get("k_histogram")
        fields = dict(
            tokens=stats["generation_tokens"],
            tps=stats["generation_tps"],
            ttft_s=stats["ttft_s"],
            peak_gb=stats["peak_memory_gb"],
            prompt_tokens=stats["prompt_tokens"],
            from_draft=stats["draft_tokens_accepted"],
            proposed=stats["draft_tokens_proposed"],
            accepted=stats["draft_tokens_accepted"],
            rounds=sum(histogram.values()) if histogram else None,
            finish_reason=None,
        )
        return cls(**{**fields, **overrides})


class Runner(Protocol):
    label: str

    def describe(self) -> dict: ...

    def run(self, cell: Cell, *, max_tokens: int, seed: int) -> RunResult: ...

    def close(self) -> None: ...


class EngineRunner:
    """The server's engine in this process: `ModelKit` + `generate_events`, no HTTP."""

    label = "local"

    def __init__(self, target: str, draft: str | None, *, speculation: SpeculationParams,
                 temperature: float):
        from server.engine.model_kit import ModelKit, load_model

        self.kit = ModelKit(load_model(target))
        if draft is not None and speculation.source == "model":
            self.kit.load_draft(draft)
        self.speculation = speculation
        self.temperature = temperature
        self._prompts: dict[str, tuple[int, ...]] = {}

    def prompt_tokens(self, kind: str) -> tuple[int, ...]:
        """The chat-templated prompt, tokenized once per kind so every cell sees the same ids."""
        from server.demo import encode_prompt

        if kind not in self._prompts:
            tokenizer = self.kit.target.tokenizer
            self._prompts[kind] = tuple(encode_prompt(tokenizer, PROMPT_KINDS[kind], chat=True))
        return self._prompts[kind]

    def describe(self) -> dict:
        models = {"target": _model_card(self.kit.target)}
        if self.kit.draft is not None:
            models["draft"] = _model_card(self.kit.draft)
        return {"label": self.label, "kind": "engine", "models": models}

    def run(self, cell: Cell, *, max_tokens: int, seed: int) -> RunResult:
        from server.engine.events import Finished
        from server.engine.generation import generate_events
        from server.engine.params import GenerationParams, SamplingParams

        params = GenerationParams(
            prompt_tokens=self.prompt_tokens(cell.kind),
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=self.temperature, seed=seed),
            speculation=replace(self.speculation, num_draft_tokens=cell.k),
        )
        done = None
        for event in generate_events(self.kit, params):
            if isinstance(event, Finished):
                done = event
        return RunResult.from_stats(done.stats.to_dict(), finish_reason=done.finish_reason)

    def cost_ratio(self) -> float | None:
        if self.speculation.source == "prompt_lookup":
            return 0.0
        if self.kit.draft is None:
            return None
        return measure_cost_ratio(self.kit.target.model, self.kit.draft.model)

    def close(self) -> None:
        self.kit.unload_draft()


def _model_card(model) -> dict:
    return {"path": model.path, "parameters": model.parameter_count(),
            "memory_gb": model.nbytes() / 1e9,
            "model_type": model.config.get("model_type")}


def _timed_step(model, cache, y) -> float:
    import mlx.core as mx

    start = time.perf_counter()
    mx.eval(model(y, cache=cache))
    return time.perf_counter() - start


def measure_cost_ratio(target, draft, *, steps: int = COST_RATIO_STEPS,
                       context: int = COST_RATIO_CONTEXT) -> float:
    """c: the time of one draft-model forward token over one target forward token.

    Single-token decode steps after a short prefill, the two models alternating so that both
    see the same machine load; the ratio of the medians. The first steps warm up and are dropped.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.arange(1, context + 1)[None]
    caches = [make_prompt_cache(m) for m in (target, draft)]
    for model, cache in zip((target, draft), caches, strict=True):
        mx.eval(model(prompt, cache=cache))
    y = mx.array([[1]])
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps + 2):
        for model, cache, out in zip((target, draft), caches, times, strict=True):
            t = _timed_step(model, cache, y)
            if i >= 2:
                out.append(t)
    return statistics.median(times[1]) / statistics.median(times[0])


# Dry run: plausible numbers from the speedup model itself, so the files look like a real run.
SYNTHETIC_COST_RATIO = 0.1
SYNTHETIC_BASE_TPS = 50.0
SYNTHETIC_ACCEPTANCE = {"structured": 0.8, "open_ended": 0.55, "repeat_edit": 0.9}


class SyntheticRunner:
    """`--dry-run`: no models; numbers from the speedup model with 2% noise, seeded."""

    def __init__(self, label: str = "dry-run", *, speculation: SpeculationParams):
        self.label = label
        self.speculation = speculation

    def describe(self) -> dict:
        return {"label": self.label, "kind": "synthetic",
                "acceptance": SYNTHETIC_ACCEPTANCE, "cost_ratio": SYNTHETIC_COST_RATIO}

    def cost_ratio(self) -> float:
        return SYNTHETIC_COST_RATIO

    def run(self, cell: Cell, *, max_tokens: int, seed: int) -> RunResult:
        rng = random.Random(f"{self.label}/{cell.kind}/{cell.k}/{seed}")
        a = SYNTHETIC_ACCEPTANCE.get(cell.kind, 0.6)
        speedup = theoretical_speedup(a, cell.k, SYNTHETIC_COST_RATIO)
        tps = SYNTHETIC_BASE_TPS * speedup * (1 + rng.gauss(0, 0.02))
        per_round = theoretical_speedup(a, cell.k, 0.0)  # tokens per target forward
        rounds = round(max_tokens / per_round) if cell.k else 0
        accepted = max_tokens - rounds if cell.k else 0
        return RunResult(
            tokens=max_tokens, tps=tps, ttft_s=0.05 + rng.random() * 0.01,
            peak_gb=0.40 + 0.002 * cell.k, prompt_tokens=64, from_draft=accepted,
            proposed=rounds * cell.k, accepted=accepted, rounds=rounds or None,
            finish_reason="length",
        )

    def close(self) -> None:
        pass
