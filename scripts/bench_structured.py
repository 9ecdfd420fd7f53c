"""What a grammar costs, and whether speculation still pays under one.

    python scripts/bench_structured.py [--target-model P] [--draft-model P|lookup]
        [--drafter model|prompt_lookup|hybrid] [--reps 3]

Through the real request path (an in-process app: request mapping, grammar, scheduler,
decoder), greedy, one request at a time:

1. constraint cost: tok/s with a JSON schema vs free text, same prompt, no draft, the free
   run forced to the same length (ignore_eos); plus the grammar's own time per token
   (`allowed()` + `consume()`, replayed over the constrained output) in microseconds;
2. speculation: speedup (tok/s with the draft / without) and acceptance rate, under the same
   schema and on free text.

Defaults: the default target (SmolLM2-135M-Instruct, once converted) with its distilled draft
when present; without that draft, prompt lookup drafts (`--draft-model lookup`); the demo pair
when the default target is missing. `--drafter` picks how a loaded draft model is used (the
request's `draft`: the model alone, or `hybrid`, lookup when it matches and the model when not).
Timings on a shared CPU are noisy: the medians of `--reps` runs are printed, with the machine's
load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import get_args

from server.engine.params import DraftSource

DEFAULT_TARGET = Path("models/generated/SmolLM2-135M-Instruct")
DEFAULT_DRAFT = Path("models/smollm2-draft")
DEMO = Path("models/demo")
PROMPT = ("List eight famous scientists with the year each was born, as a JSON array of "
          "objects with the keys name and born.")
SCHEMA = {"type": "array", "minItems": 8, "maxItems": 8, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "born": {"type": "integer", "minimum": 1000, "maximum": 2024}},
    "required": ["name", "born"], "additionalProperties": False}}


def pick_models(target: str | None, draft: str | None) -> tuple[str, str | None, str]:
    """(target, draft model or None, drafter) with the defaults described above."""
    if target is None:
        target = str(DEFAULT_TARGET if DEFAULT_TARGET.exists() else DEMO / "target")
        if draft is None:
            if Path(target) == DEFAULT_TARGET:
                draft = str(DEFAULT_DRAFT) if DEFAULT_DRAFT.exists() else "lookup"
            else:
                draft = str(DEMO / "draft")
    draft = draft or "lookup"
    if draft == "lookup":
        return target, None, "prompt_lookup"
    return target, draft, "model"


def body(max_tokens: int, *, schema: bool, drafter: str | None, k: int, **extra) -> dict:
    out = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
           "temperature": 0, **extra}
    if schema:
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "scientists", "schema": SCHEMA}}
    if drafter is None:
        out["use_draft"] = False
    else:
        out.update(draft=drafter, num_draft_tokens=k, use_draft=True)
    return out


async def measure(client, request: dict, reps: int) -> dict:
    """Median generation tok/s over `reps` runs, and the last run's text and stats."""
    runs = []
    for _ in range(reps):
        r = await client.post("/v1/chat/completions", json=request)
        r.raise_for_status()
        runs.append(r.json())
    tps = statistics.median(run["stats"]["generation_tps"] for run in runs)
    last = runs[-1]
    return {"tps": tps, "text": last["choices"][0]["message"]["content"],
            "tokens": last["usage"]["completion_tokens"], "stats": last["stats"]}


def grammar_us_per_token(engine, text: str) -> float:
    """The grammar's own time per token: allowed() + consume(), replayed over `text`."""
    from server.engine.grammar import grammars_for

    tokenizer = engine.tokenizer
    tokens = tokenizer.encode(text, add_special_tokens=False)
    grammar = grammars_for(tokenizer).json_schema(SCHEMA)
    best = float("inf")
    for _ in range(5):
        constraint = grammar()
        t0 = time.perf_counter()
        for token in tokens:
            constraint.allowed()
            constraint.consume([token])
        best = min(best, (time.perf_counter() - t0) / max(len(tokens), 1))
    return best * 1e6


async def run(args) -> None:
    import httpx

    from server.config import Settings
    from server.http.app import build_engine, create_app

    target, draft, drafter = pick_models(args.target_model, args.draft_model)
    if args.drafter is not None:
        if draft is None and args.drafter != "prompt_lookup":
            raise SystemExit(f"--drafter {args.drafter} needs a draft model")
        drafter = args.drafter
    settings = Settings.load(None, models={"model": target, "draft_model": draft})
    engine = build_engine(settings)
    engine.start()
    try:
        app = create_app(settings, engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://bench", timeout=600) as client:
            await measure(client, body(8, schema=True, drafter=None, k=0), 1)  # warm-up
            print(f"target {target}; drafts: {drafter}, {draft or 'no draft model'} "
                  f"(k={args.k}); reps {args.reps}; load average {os.getloadavg()[0]:.2f} "
                  f"on {os.cpu_count()} CPUs (shared machine: figures are noisy)")
            constrained = await measure(client, body(args.max_tokens, schema=True,
                                                     drafter=None, k=0), args.reps)
            n = constrained["tokens"]
            free = await measure(client, body(n, schema=False, drafter=None, k=0,
                                              ignore_eos=True), args.reps)
            overhead = 1 - constrained["tps"] / free["tps"]
            print(f"\n1. constraint cost, no draft, {n} tokens: free {free['tps']:.1f} tok/s, "
                  f"JSON schema {constrained['tps']:.1f} tok/s -> overhead {overhead:+.1%}; "
                  f"grammar alone {grammar_us_per_token(engine, constrained['text']):.0f} "
                  f"us/token")
            print("\n2. speculation (speedup = tok/s with drafts / without):")
            for label, schema, base in (("free text", False, free),
                                        ("JSON schema", True, constrained)):
                extra = {} if schema else {"ignore_eos": True}
                spec = await measure(client, body(n, schema=schema, drafter=drafter, k=args.k,
                                                  **extra), args.reps)
                same = spec["text"] == base["text"]
                print(f"   {label:11s}: {base['tps']:.1f} -> {spec['tps']:.1f} tok/s, speedup "
                      f"{spec['tps'] / base['tps']:.2f}x, acceptance "
                      f"{spec['stats']['acceptance_rate'] or 0:.2f}, mean accepted length "
                      f"{spec['stats'].get('mean_accepted_length') or 0:.2f}; "
                      f"same text as without drafts: {same}")
    finally:
        engine.stop()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-model")
    parser.add_argument("--draft-model", help="a draft model path, or 'lookup'")
    parser.add_argument("--drafter", choices=get_args(DraftSource),
                        help="the requests' draft (default: model with a draft model, else "
                             "prompt_lookup)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
