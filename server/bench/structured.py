"""`mlx-spec-bench structured`: what a grammar costs, and whether speculation pays under one.

Through an in-process app, greedy, medians of `--reps` runs: tok/s under a JSON schema against
free text as long, then with drafts over without, acceptance and whether the text is the same.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import httpx

from server.bench import results
from server.bench.results import num
from server.config import Settings
from server.engine.params import DraftSource
from server.http.app import build_engine, create_app
from server.model_files.default_model import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR

DEMO = Path("models/demo")
PROMPT, SCHEMA = results.PROMPTS["structured"]["prompt"], results.PROMPTS["structured"]["schema"]


def model_options(p) -> None:
    """--target-model and --draft-model, which `pick_models` reads."""
    p.add_argument("--target-model", help="Target (default: SmolLM2, else the demo target).")
    p.add_argument("--draft-model", help="A draft model folder, or 'lookup'.")


def pick_models(target: str | None, draft: str | None) -> tuple[str, str | None, str]:
    """(target, draft or None, drafter): SmolLM2 with `models/smollm2-draft` (else lookup), or
    the demo pair when SmolLM2 is missing."""
    if target is None:
        target = str(DEFAULT_TARGET_DIR if DEFAULT_TARGET_DIR.exists() else DEMO / "target")
        if draft is None and Path(target) == DEFAULT_TARGET_DIR:
            draft = str(DEFAULT_DRAFT_DIR) if DEFAULT_DRAFT_DIR.exists() else "lookup"
        draft = draft or str(DEMO / "draft")
    if (draft or "lookup") == "lookup":
        return target, None, "prompt_lookup"
    return target, draft, "model"


async def measure(client, max_tokens: int, reps: int, *, schema: bool, drafter: str | None = None,
                  k: int = 0) -> dict:
    """Median generation tok/s over `reps` runs, and the last run's text and stats."""
    request = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
               "temperature": 0, "use_draft": drafter is not None}
    if schema:
        request["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "scientists", "schema": SCHEMA}}
    else:  # free text as long as the schema's answer
        request["ignore_eos"] = True
    if drafter is not None:
        request.update(draft=drafter, num_draft_tokens=k)
    runs = [(await client.post("/v1/chat/completions", json=request)).raise_for_status().json()
            for _ in range(reps)]
    return {"tps": statistics.median(run["stats"]["generation_tps"] for run in runs),
            "text": runs[-1]["choices"][0]["message"]["content"],
            "tokens": runs[-1]["usage"]["completion_tokens"], "stats": runs[-1]["stats"]}


async def run(args, settings: Settings, drafter: str) -> list[dict]:
    """Every measurement through an in-process app: plain with and without the schema, then
    drafted, each against plain."""
    engine = build_engine(settings)
    engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(
                settings, engine)), base_url="http://bench", timeout=600) as client:
            await measure(client, 8, 1, schema=True)  # warm-up
            plain = {True: await measure(client, args.max_tokens, args.reps, schema=True)}
            n = plain[True]["tokens"]
            plain[False] = await measure(client, n, args.reps, schema=False)
            rows = []
            for schema in (False, True):
                spec = await measure(client, n, args.reps, schema=schema, drafter=drafter, k=args.k)
                output, base = "JSON schema" if schema else "free text", plain[schema]
                rows.append({"output": output, "drafts": "none", "tokens": base["tokens"],
                             "tps": base["tps"], "vs_free_text": base["tps"] / plain[False]["tps"]})
                rows.append({"output": output, "drafts": f"{drafter} k={args.k}",
                             "tokens": spec["tokens"], "tps": spec["tps"],
                             "speedup": spec["tps"] / base["tps"],
                             "acceptance": spec["stats"]["acceptance_rate"],
                             "mean_accepted_length": spec["stats"].get("mean_accepted_length"),
                             "same_text": spec["text"] == base["text"]})
            return rows
    finally:
        engine.stop()


def table(rows: list[dict]) -> list[list[str]]:
    lines = [["output", "drafts", "tokens", "tok/s", "vs free text", "speedup", "acceptance",
              "mean accepted", "same text"]]
    for r in rows:
        same = r.get("same_text")
        lines.append([r["output"], r["drafts"], str(r["tokens"]), num(r["tps"], ".1f"),
                      num(r.get("vs_free_text"), ".2f", suffix="x"),
                      num(r.get("speedup"), ".2f", suffix="x"), num(r.get("acceptance"), ".2f"),
                      num(r.get("mean_accepted_length"), ".2f"),
                      "-" if same is None else str(same).lower()])
    return lines


def main(argv: list[str]) -> int:
    p = results.parser("structured", __doc__)
    a = p.add_argument
    model_options(p)
    a("--drafter", choices=[d.value for d in DraftSource],
      help="The requests' draft (default: model with a draft model, else prompt_lookup).")
    a("--k", type=int, default=4, help="Draft tokens per round (4).")
    a("--max-tokens", type=int, default=200, help="Tokens per request (200).")
    a("--reps", type=int, default=3, help="Runs per measurement; medians (3).")
    args = p.parse_args(argv)
    target, draft, drafter = pick_models(args.target_model, args.draft_model)
    if args.drafter is not None:
        if draft is None and args.drafter != "prompt_lookup":
            p.error(f"--drafter {args.drafter} needs a draft model")
        drafter = args.drafter
    settings = Settings.load(None, models={"model": target, "draft_model": draft})
    rows = asyncio.run(run(args, settings, drafter))
    results.save("structured", argv, args, results.environment(
        target_model=target, draft_model=draft, drafter=drafter), rows, table)
    return 0
