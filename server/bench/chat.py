"""`mlx-spec-bench chat`: what the prefix cache saves a multi-turn chat and a shared prompt.

A chat under a long system prompt, the servers taking turns (TTFT, over turn 1, ours over this),
then `--clients` requests sharing the prompt on ours, uncached and cached. `mlx-spec-bench
restart` (`restart_main`): TTFT of a long prompt after a restart, from the disk prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json.decoder
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from server.bench import results, runners
from server.bench.results import num, ratio
from server.bench.runners import Stream, StreamFailed, engine_stats, request_body, stream_async
from server.engine.config import EngineConfig
from server.engine.events import GenerationStats
from server.engine.params import GenerationParams
from server.engine.service import InferenceEngine
from server.model_files.default_model import DEFAULT_TARGET_DIR
from server.model_files.synthetic import build_pair

QUESTIONS = results.PROMPTS["chat"]["questions"]


def _figures(stream: Stream) -> dict:
    if stream.error:
        raise StreamFailed(stream.error)
    usage, stats = stream.usage or {}, stream.stats or {}
    return {"prompt_tokens": stats.get("prompt_tokens", usage.get("prompt_tokens")),
            "cached_tokens": stats.get("cached_tokens", usage.get("cached_tokens")),
            "ttft_s": (stream.arrivals[0] if stream.arrivals else stream.end) - stream.start}


async def turns(client, servers: list[tuple[str, str]], system: str, args) -> list[dict]:
    histories = {name: [{"role": "system", "content": system}] for name, _ in servers}
    rows = []
    for turn in range(1, args.turns + 1):
        for name, url in servers:
            history = histories[name]
            history.append({"role": "user", "content": QUESTIONS[(turn - 1) % len(QUESTIONS)]})
            body = request_body(args.api, history, max_tokens=args.max_tokens, temperature=0.0,
                                model=args.models.get(name))
            stream = await stream_async(client, url, args.api, body)
            history.append({"role": "assistant", "content": "".join(stream.text)})
            rows.append({"part": "turns", "server": name, "turn": turn, **_figures(stream)})
    ttft = {(r["server"], r["turn"]): r["ttft_s"] for r in rows}
    for r in rows:
        r["vs_first"] = ratio(r["ttft_s"], ttft[r["server"], 1])
        r["ours_over_this"] = ratio(ttft[servers[0][0], r["turn"]], r["ttft_s"])
    return rows


async def shared_prompt(client, name: str, url: str, system: str, args) -> list[dict]:
    rows = []
    for cache_prompt in (False, True):
        await client.delete(f"{url}/v1/cache")
        streams = await asyncio.gather(*(stream_async(client, url, args.api, request_body(
            args.api, [{"role": "system", "content": system},
                       {"role": "user", "content": f"Question {i}: what is line {10 * i} about?"}],
            max_tokens=args.max_tokens, temperature=0.0, model=args.models.get(name),
            cache_prompt=cache_prompt)) for i in range(args.clients)))
        figures = [_figures(s) for s in streams]
        ttfts = [f["ttft_s"] for f in figures]
        rows.append({"part": "shared", "server": name, "clients": args.clients,
                     "cache_prompt": cache_prompt, "ttft_s": statistics.mean(ttfts),
                     "ttft_max_s": max(ttfts),
                     "total_s": max(s.end for s in streams) - min(s.start for s in streams),
                     "prompt_tokens": sum(f["prompt_tokens"] or 0 for f in figures),
                     "cached_tokens": sum(f["cached_tokens"] or 0 for f in figures)})
    rows[1]["vs_first"] = ratio(rows[1]["ttft_s"], rows[0]["ttft_s"])
    return rows


def table(rows: list[dict]) -> list[list[str]]:
    lines = [["what", "server", "prompt tokens", "cached", "TTFT s", "vs turn 1 / uncached",
              "ours / this", "all done s"]]
    for r in rows:
        what = f"turn {r['turn']}" if r["part"] == "turns" else \
            f"{r['clients']} clients, cache_prompt={str(r['cache_prompt']).lower()}"
        ttft = num(r["ttft_s"], ".3f") + (f" (max {r['ttft_max_s']:.3f})"
                                           if r["part"] == "shared" else "")
        lines.append([what, r["server"], num(r["prompt_tokens"], "d"),
                      num(r["cached_tokens"], "d"), ttft, num(r.get("vs_first"), ".3f", suffix="x"),
                      num(r.get("ours_over_this"), ".3f", suffix="x"),
                      num(r.get("total_s"), ".2f")])
    return lines


def main(argv: list[str]) -> int:
    p = results.parser("chat", __doc__, api=True, servers="required")
    a = p.add_argument
    a("--system-chars", type=int, default=4500, help="System prompt length in chars (4500).")
    a("--turns", type=int, default=3, help="Chat turns (3).")
    a("--max-tokens", type=int, default=32, help="Tokens per answer (32).")
    a("--clients", type=int, default=8,
      help="Concurrent clients sharing the prompt (8; 0: skip that part).")
    args = p.parse_args(argv)
    servers = [args.server, *args.compare]
    health = [runners.server_health(*s) for s in servers]
    args.models = {s["name"]: s["target"] for s in health}
    system = ("You answer questions about this Python module.\n\n"
              + inspect.getsource(json.decoder)[:args.system_chars])

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=600, headers=results.auth(args.api_key)) as client:
            rows = await turns(client, servers, system, args)
            if args.clients:
                rows += await shared_prompt(client, *servers[0], system, args)
            return rows

    try:
        rows = asyncio.run(run())
    except (httpx.HTTPError, StreamFailed) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    results.save("chat", argv, args, results.environment(servers=health), rows, table,
                 system_chars=args.system_chars)
    return 0


# -- restart: the disk prefix cache after a restart ----------------------------------------
WORDS = ("the model reads a long shared system prompt with tools and rules before every turn "
         "so a cache that survives restarts saves its prefill").split()


def serve_once(args, folder: Path) -> GenerationStats:
    """Start an engine on `folder`, warm it up, answer the long prompt, stop it."""
    engine = InferenceEngine(EngineConfig(model=args.model, draft_model=args.draft_model,
                                          prefix_cache_bytes=10**9, disk_cache_dir=str(folder),
                                          disk_cache_bytes=4 * 10**9))
    engine.start()
    try:
        n = args.prompt_tokens  # of varied English text, the same each time
        text = " ".join(f"{WORDS[i % len(WORDS)]} {i}" for i in range(n // 2 + 8))
        tokens = engine.tokenizer.encode(text)[:n]
        assert len(tokens) == n, "the text is too short for the tokenizer"
        engine_stats(engine, GenerationParams(tuple(tokens[63::-1]), 1, cache_prompt=False))
        return engine_stats(engine, GenerationParams(tuple(tokens), 1))
    finally:
        engine.stop(timeout=120)  # writes what is queued before it returns


def restart_main(argv: list[str]) -> list[dict]:
    """`mlx-spec-bench restart`: time to first token after a restart, from the disk cache."""
    p = argparse.ArgumentParser(prog="mlx-spec-bench restart",
                                description="TTFT after a restart, from the disk prefix cache.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default=str(DEFAULT_TARGET_DIR), help="Target model folder.")
    a("--draft-model", default=None, help="Draft model folder.")
    a("--tiny", action="store_true", help="A tiny generated pair instead (seconds).")
    a("--prompt-tokens", type=int, default=2048, help="The long prompt's length.")
    a("--reps", type=int, default=1, help="Restarts measured; the median.")
    args, rows = p.parse_args(argv), []
    with tempfile.TemporaryDirectory(prefix="restart-bench-") as folder:
        if args.tiny:
            args.model, args.draft_model = map(str, build_pair(Path(folder) / "pair", "tiny"))
        for rep in range(args.reps):
            cache = Path(folder) / f"cache-{rep}"
            cold, warm = serve_once(args, cache), serve_once(args, cache)
            rows.append({"rep": rep, "prompt_tokens": cold.prompt_tokens,
                         "cold_ttft_s": cold.ttft_s, "restart_ttft_s": warm.ttft_s,
                         "restart_cached_tokens": warm.cached_tokens,
                         "ratio": warm.ttft_s / cold.ttft_s})
            print(f"rep {rep}: {cold.prompt_tokens} tokens, cold TTFT {cold.ttft_s:.3f} s, "
                  f"after restart {warm.ttft_s:.3f} s ({warm.cached_tokens} cached tokens), "
                  f"ratio {rows[-1]['ratio']:.3f}", flush=True)
    ratios = [r["ratio"] for r in rows]
    print(f"TTFT after restart / cold: {statistics.median(ratios):.3f}"
          + (f" (median of {len(ratios)})" if len(ratios) > 1 else ""))
    return rows
