"""`mlx-spec-bench prediction`: what a guess of the answer (OpenAI's `prediction`) buys.

Through an in-process app (the server's default drafter: hybrid, as `make serve`), greedy, each
request run without and with its guess in turn, `--reps` times; medians of decode tok/s. The
cases: the exact answer as the guess (what a guess can buy at most: a regenerated answer), two
edits whose guess is the input with the change (a JSON record, code), and an unrelated guess
(what a wrong one costs).
"""

from __future__ import annotations

import asyncio
import json
import statistics

import httpx

from server.bench import results
from server.bench.results import num
from server.bench.structured import model_options, pick_models
from server.config import Settings
from server.engine.params import DraftSource
from server.http.app import build_engine, create_app

P = results.PROMPTS["prediction"]
RECORD = json.dumps(P["record"], indent=2)


def cases() -> list[tuple[str, str, str | None]]:
    """(name, request, guess); None: the guess is the answer without one."""
    edited = RECORD.replace('"age": 30', '"age": 31')
    return [("exact answer", P["code"], None),
            ("edit a JSON record", P["record_request"].format(record=RECORD), edited),
            ("edit code", P["functions_request"].format(code=P["functions"]), P["functions"]),
            ("unrelated guess", P["code"], P["unrelated"])]


async def complete(client, request: str, max_tokens: int, guess: str | None) -> dict:
    body = {"messages": [{"role": "user", "content": request}], "max_tokens": max_tokens,
            "temperature": 0}
    if guess is not None:
        body["prediction"] = {"type": "content", "content": guess}
    return (await client.post("/v1/chat/completions", json=body)).raise_for_status().json()


def decode_tps(response: dict) -> float:
    stats = response["stats"]
    return stats["generation_tokens"] / max(stats["total_s"] - stats["ttft_s"], 1e-9)


async def measure(client, name: str, request: str, guess: str | None, args) -> dict:
    """One case: plain and guessed runs interleaved; medians, and the last guessed run's
    counts."""
    if guess is None:
        guess = (await complete(client, request, args.max_tokens, None)
                 )["choices"][0]["message"]["content"]
    plain, guessed = [], []
    for _ in range(args.reps):
        plain.append(await complete(client, request, args.max_tokens, None))
        guessed.append(await complete(client, request, args.max_tokens, guess))
    details = guessed[-1]["usage"]["completion_tokens_details"]
    base, fast = (statistics.median(map(decode_tps, runs)) for runs in (plain, guessed))
    return {"case": name, "tokens": guessed[-1]["usage"]["completion_tokens"],
            "plain_tps": base, "guess_tps": fast, "speedup": fast / base,
            "accepted": details["accepted_prediction_tokens"],
            "rejected": details["rejected_prediction_tokens"],
            "from_draft": guessed[-1]["stats"]["from_draft_fraction"],
            "plain_from_draft": plain[-1]["stats"]["from_draft_fraction"],
            "same_text": guessed[-1]["choices"][0]["message"]["content"] ==
            plain[-1]["choices"][0]["message"]["content"]}


async def run(args, settings: Settings) -> list[dict]:
    engine = build_engine(settings)
    engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(
                settings, engine)), base_url="http://bench", timeout=600) as client:
            await complete(client, P["code"], 8, P["unrelated"])  # warm-up
            return [await measure(client, *case, args) for case in cases()]
    finally:
        engine.stop()


def table(rows: list[dict]) -> list[list[str]]:
    lines = [["case", "tokens", "tok/s", "with guess", "speedup", "guess accepted / rejected",
              "from draft (without)", "same text"]]
    for r in rows:
        lines.append([r["case"], str(r["tokens"]), num(r["plain_tps"], ".1f"),
                      num(r["guess_tps"], ".1f"), num(r["speedup"], ".2f", suffix="x"),
                      f"{r['accepted']} / {r['rejected']}",
                      f"{r['from_draft']:.2f} ({r['plain_from_draft']:.2f})",
                      str(r["same_text"]).lower()])
    return lines


def main(argv: list[str]) -> int:
    p = results.parser("prediction", __doc__)
    a = p.add_argument
    model_options(p)
    a("--drafter", choices=[d.value for d in DraftSource], default="hybrid",
      help="The server's default drafter, as in config.yaml (hybrid; prompt_lookup without a"
      " draft model).")
    a("--max-tokens", type=int, default=200, help="Tokens per request (200).")
    a("--reps", type=int, default=3, help="Runs of each side per case; medians (3).")
    args = p.parse_args(argv)
    target, draft, _ = pick_models(args.target_model, args.draft_model)
    drafter = args.drafter if draft is not None else "prompt_lookup"
    settings = Settings.load(None, models={"model": target, "draft_model": draft},
                             defaults={"draft": drafter})
    rows = asyncio.run(run(args, settings))
    results.save("prediction", argv, args, results.environment(
        target_model=target, draft_model=draft, drafter=settings.defaults.draft), rows, table)
    return 0
