"""`mlx-spec-bench suffix`: what suffix drafting buys where requests repeat what was served.

Through an in-process app (the server's settings: suffix drafting on, the cost model on),
greedy, each drafter in turn within each rep, `--reps` reps; decode tok/s from the answers'
`stats`, medians:
- repeat: a request, then the same again (a retry, a regenerate, an eval rerun): the second
  time's tok/s over the first time's, and the text identical;
- near repeat: a request, then one with a small change (another class name);
- agent: a conversation of an agent editing a file: each edit rewrites the whole file, each
  test run is a forced call of the same tool, the history growing turn by turn; tok/s of all
  its answers together.
The drafters: plain decoding, the draft model alone, suffix drafting alone, hybrid (draft model,
prompt lookup and suffix drafting, by expected accepted tokens). `DELETE /v1/cache` empties the
prefix cache and the suffix index before each case and drafter, so no run drafts from another
drafter's answers. Also the suffix index's memory at its bound (tracemalloc).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import tracemalloc

import httpx

from server.bench import results
from server.bench.results import num
from server.bench.structured import model_options, pick_models
from server.config import Settings
from server.engine.speculation.suffix import BYTES_PER_TOKEN, SuffixIndex
from server.http.app import build_engine, create_app

P = results.PROMPTS["suffix"]
DRAFTERS = {"plain": {"use_draft": False}, "model": {"draft": "model"},
            "suffix": {"draft": "suffix"}, "hybrid": {"draft": "hybrid"},
            "prompt_lookup": {"draft": "prompt_lookup"}}
NEEDS_DRAFT_MODEL = ("model", "hybrid")
RUN_TESTS = {"type": "function", "function": {
    "name": "run_tests", "description": "Run the tests of a file.",
    "parameters": {"type": "object", "required": ["path", "verbose"], "properties": {
        "path": {"type": "string"}, "verbose": {"type": "boolean"}}}}}
TEST_CALL_TOKENS = 64  # a run_tests call is short


async def complete(client, messages: list[dict], drafter: str, max_tokens: int,
                   **extra) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            **DRAFTERS[drafter], **extra}
    return (await client.post("/v1/chat/completions", json=body)).raise_for_status().json()


def decode_seconds(response: dict) -> float:
    stats = response["stats"]
    return stats["generation_tokens"] / max(stats["generation_tps"], 1e-9)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def pair(client, drafter: str, first: str, second: str, max_tokens: int) -> dict:
    """A request, then the next one, from an empty prefix cache and suffix index."""
    await client.delete("/v1/cache")
    a = await complete(client, user(first), drafter, max_tokens)
    b = await complete(client, user(second), drafter, max_tokens)
    return {"first_tps": a["stats"]["generation_tps"], "tps": b["stats"]["generation_tps"],
            "tokens": b["stats"]["generation_tokens"],
            "from_draft": b["stats"]["from_draft_fraction"],
            "texts": [r["choices"][0]["message"]["content"] for r in (a, b)]}


async def conversation(client, drafter: str, max_tokens: int, turns: int) -> dict:
    """The agent's conversation from an empty prefix cache and suffix index: every answer's
    decode tok/s together, its share from drafts, and its texts."""
    await client.delete("/v1/cache")
    agent = P["agent"]
    messages = [{"role": "system", "content": agent["system"]}]
    answers = []
    for turn in agent["turns"][:turns]:
        if "user" in turn:
            messages += user(turn["user"].format(file=agent["file"]))
            r = await complete(client, messages, drafter, max_tokens,
                               tools=[RUN_TESTS], tool_choice="none")
            messages.append({"role": "assistant",
                             "content": r["choices"][0]["message"]["content"]})
        else:
            messages += user("Run the tests.")
            r = await complete(client, messages, drafter, TEST_CALL_TOKENS, tools=[RUN_TESTS],
                               tool_choice={"type": "function",
                                            "function": {"name": "run_tests"}})
            messages += _called(r["choices"][0]["message"], turn["test"])
        answers.append(r)
    tokens = sum(r["stats"]["generation_tokens"] for r in answers)
    accepted = sum(r["stats"]["draft_tokens_accepted"] for r in answers)
    return {"tokens": tokens, "tps": tokens / sum(map(decode_seconds, answers)),
            "from_draft": accepted / tokens,
            "texts": [_said(m) for m in messages]}


def _said(message: dict) -> str:
    """What a message says: its text, or its calls' names and arguments (not their ids)."""
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or []]
    return str(calls) if calls else message.get("content") or ""


def _called(message: dict, result: str) -> list[dict]:
    """The history after a test run: the call and its result; a call cut short by the token
    limit (a small random model's argument can run on) stays text, its result a user turn."""
    calls = message.get("tool_calls")
    if not calls:
        return [{"role": "assistant", "content": message.get("content") or ""},
                {"role": "user", "content": result}]
    return [{"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": result}]


async def measure(client, drafters: list[str], args) -> list[dict]:
    """Every case under every drafter, drafters interleaved within each rep; one row per case
    and drafter with medians, and ratios over plain decoding and the draft model alone."""
    runs: dict[tuple[str, str], list[dict]] = {}
    near = P["near_repeat"]
    for _ in range(args.reps):
        for drafter in drafters:
            runs.setdefault(("repeat", drafter), []).append(
                await pair(client, drafter, P["repeat"], P["repeat"], args.max_tokens))
            runs.setdefault(("near repeat", drafter), []).append(
                await pair(client, drafter, near[0], near[1], args.max_tokens))
            runs.setdefault(("agent", drafter), []).append(
                await conversation(client, drafter, args.max_tokens, args.turns))
    rows = [summary(case, drafter, got) for (case, drafter), got in runs.items()]
    for row in rows:
        by = {r["drafter"]: r for r in rows if r["case"] == row["case"]}
        row["vs_plain"] = results.ratio(row["tps"], by.get("plain", {}).get("tps"))
        row["vs_model"] = results.ratio(row["tps"], by.get("model", {}).get("tps"))
        plain = by.get("plain", {}).get("texts")
        row["same_text"] = None if plain is None else row["texts"] == plain
        if row["case"] == "repeat":
            row["same_as_first"] = row["texts"][0] == row["texts"][1]
    for row in rows:
        del row["texts"]
    return sorted(rows, key=lambda r: (list(dict.fromkeys(r["case"] for r in rows)).index(
        r["case"]), drafters.index(r["drafter"])))


def summary(case: str, drafter: str, got: list[dict]) -> dict:
    """Medians of one case and drafter's reps (the last rep's texts)."""
    row = {"case": case, "drafter": drafter, "tokens": got[-1]["tokens"],
           "tps": statistics.median(g["tps"] for g in got),
           "tps_runs": [g["tps"] for g in got],
           "from_draft": statistics.median(g["from_draft"] for g in got),
           "texts": got[-1]["texts"]}
    if "first_tps" in got[0]:
        row["first_tps"] = statistics.median(g["first_tps"] for g in got)
        row["vs_first"] = row["tps"] / row["first_tps"]
    return row


def index_memory(max_bytes: int, seed: int = 0) -> dict:
    """The suffix index filled three times over its bound with random answers (every anchor
    new: the most memory per token), as tracemalloc measures it."""
    rng = random.Random(seed)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index, added = SuffixIndex(max_bytes), 0
        while added < 3 * max_bytes:
            index.add("", [rng.randrange(150_000) for _ in range(300)])
            added += 300 * BYTES_PER_TOKEN
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return {"bound_mb": max_bytes / 1e6, "measured_mb": held / 1e6, "tokens": index.tokens,
            "answers": len(index)}


def index_line(memory: dict) -> str:
    return (f"suffix index at its bound: {memory['measured_mb']:.1f} MB measured for a "
            f"{memory['bound_mb']:.1f} MB bound ({memory['tokens']} tokens, "
            f"{memory['answers']} answers)")


def notes(doc: dict) -> str:
    """For the benchmark page: the index's memory at its bound (kept in the metadata)."""
    memory = doc.get("metadata", {}).get("suffix_index")
    return f"The {index_line(memory)}." if memory else ""


def goals(rows: list[dict]) -> list[dict]:
    """The issue's goals for suffix drafting, where the rows measure them."""
    by = {(r["case"], r["drafter"]): r for r in rows}
    checks = [
        ("G1", "a repeated request: >= 2.0x the first time's tok/s (hybrid), same text",
         by.get(("repeat", "hybrid")), "vs_first", 2.0),
        ("G2", "the agent's conversation: >= 1.3x the draft model alone (hybrid)",
         by.get(("agent", "hybrid")), "vs_model", 1.3),
    ]
    out = []
    for gid, claim, row, key, goal in checks:
        if row is None or row.get(key) is None:
            out.append({"id": gid, "verdict": "N-A", "claim": claim, "detail": "not measured"})
            continue
        same = row.get("same_text") is not False and row.get("same_as_first", True)
        verdict = "PASS" if row[key] >= goal and same else "FAIL"
        out.append({"id": gid, "verdict": verdict, "claim": claim,
                    "detail": f"{row[key]:.2f}x, same text {str(same).lower()}"})
    return out


def table(rows: list[dict]) -> list[list[str]]:
    lines = [["case", "drafter", "tokens", "first tok/s", "tok/s", "x first", "x plain",
              "x model", "from draft", "same text"]]
    for r in rows:
        same = r.get("same_text")
        lines.append([r["case"], r["drafter"], str(r["tokens"]), num(r.get("first_tps"), ".1f"),
                      num(r["tps"], ".1f"), num(r.get("vs_first"), ".2f", suffix="x"),
                      num(r.get("vs_plain"), ".2f", suffix="x"),
                      num(r.get("vs_model"), ".2f", suffix="x"), num(r["from_draft"], ".2f"),
                      "-" if same is None else str(same).lower()])
    return lines


async def measured(client, timeout_s: float = 600.0) -> None:
    """Wait while the server measures its forward times (in idle moments after it is ready):
    every drafter is then measured with the same cost model."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = (await client.get("/health")).json()
        if not (health.get("cost_model") or {}).get("measuring"):
            return
        await asyncio.sleep(0.2)


async def run(args, settings: Settings, drafters: list[str]) -> list[dict]:
    engine = build_engine(settings)
    engine.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(
                settings, engine)), base_url="http://bench", timeout=600) as client:
            await complete(client, user(P["repeat"]), "plain", 8)  # warm-up
            await measured(client)
            return await measure(client, drafters, args)
    finally:
        engine.stop()


def main(argv: list[str]) -> int:
    p = results.parser("suffix", __doc__)
    a = p.add_argument
    model_options(p)
    a("--drafters", default="plain,model,suffix,hybrid",
      help=f"Comma-separated, of {', '.join(DRAFTERS)} (model and hybrid need a draft model).")
    a("--max-tokens", type=int, default=256, help="Tokens per answer at most.")
    a("--turns", type=int, default=len(P["agent"]["turns"]),
      help="Turns of the agent's conversation (edits and test runs alternate).")
    a("--reps", type=int, default=3, help="Runs of each case and drafter; medians.")
    a("--index-mb", type=float, default=None,
      help="The suffix index's bound (engine.suffix_max_mb; default: the server's).")
    args = p.parse_args(argv)
    drafters = [d for d in args.drafters.split(",") if d]
    target, draft, _ = pick_models(args.target_model, args.draft_model)
    results.check(p, [
        (any(d not in DRAFTERS for d in drafters), f"--drafters: each of {', '.join(DRAFTERS)}"),
        (draft is None and any(d in NEEDS_DRAFT_MODEL for d in drafters),
         "--drafters model and hybrid need a draft model"),
        (args.reps < 1 or args.max_tokens < 2 or args.turns < 1,
         "--reps, --turns >= 1 and --max-tokens >= 2"),
        (args.index_mb is not None and args.index_mb <= 0, "--index-mb must be > 0")])
    engine = {} if args.index_mb is None else {"suffix_max_mb": args.index_mb}
    settings = Settings.load(None, models={"model": target, "draft_model": draft},
                             engine=engine)
    rows = asyncio.run(run(args, settings, drafters))
    memory = index_memory(int(settings.engine.suffix_max_mb * 1e6))
    verdicts = goals(rows)
    footer = (f"\n{index_line(memory)}\n"
              + "\n".join(f"{v['id']} {v['verdict']}: {v['claim']}: {v['detail']}"
                          for v in verdicts))
    results.save("suffix", argv, args, results.environment(
        target_model=target, draft_model=draft, suffix_index=memory), rows, table,
        footer=footer, verdicts=verdicts)
    return 0
