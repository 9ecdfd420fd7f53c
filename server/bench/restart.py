"""`mlx-spec-bench restart`: time to first token after a restart, from the disk prefix cache.

Time to first token of a long prompt after a restart, served from the disk prefix cache,
against a cold prefill of it.

In process (no HTTP): an engine with `cache.disk_dir` in a fresh folder answers the prompt
cold (its KV is written to disk), stops; a new engine on the same folder (empty memory)
answers the same prompt. Both engines first answer a short warm-up request that neither
reads nor stores the cache. Prints both TTFTs and their ratio (the goal: <= 0.25 at 2,048
tokens). `--reps N` repeats the pair N times, each in a fresh folder (cold, restart, cold,
restart, ...), and prints each ratio and their median.

`--decoding` measures instead what writing entries costs the streams that decode meanwhile:
one request decodes `--decode-tokens` tokens while a new prompt of `--side-tokens` tokens
arrives every `--every` of its tokens (each is prefilled and stored, so each is a disk write);
the same run with and without a disk cache, alternated `--reps` times. Prints the decoding
stream's tok/s with the disk cache over without (1.0: no cost).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from server.engine.disk_cache import DiskPromptCache
from server.engine.events import Finished, GenerationStats
from server.engine.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams
from server.engine.prefix_cache import PrefixCache
from server.engine.scheduler import Scheduler
from server.engine.sequence import Phase
from server.engine.service import InferenceEngine
from server.model_files.default_model import DEFAULT_TARGET_DIR

WORDS = ("the model reads a long shared system prompt with tools and rules before every turn "
         "so a cache that survives restarts saves its prefill").split()


def prompt_tokens(tokenizer, n: int) -> list[int]:
    """`n` token ids of varied English text (deterministic)."""
    text = " ".join(f"{WORDS[i % len(WORDS)]} {i}" for i in range(n // 2 + 8))
    tokens = tokenizer.encode(text)
    assert len(tokens) >= n, "the text is too short for the tokenizer"
    return tokens[:n]


async def answer(engine: InferenceEngine, tokens: list[int], *, cache: bool) -> GenerationStats:
    handle = engine.submit(GenerationParams(tuple(tokens), 1, cache_prompt=cache))
    async for event in handle:
        if isinstance(event, Finished):
            return event.stats
    raise RuntimeError("no Finished event")


def serve_once(args, folder: Path, n: int) -> GenerationStats:
    """Start an engine on `folder`, warm it up, answer the long prompt, stop it."""
    engine = InferenceEngine(model=args.model, draft_model=args.draft_model,
                             prefix_cache_bytes=int(args.memory_gb * 1e9),
                             disk_cache_dir=str(folder),
                             disk_cache_bytes=int(args.disk_max_gb * 1e9))
    engine.start()
    try:
        tokens = prompt_tokens(engine.tokenizer, n)
        warm_up = prompt_tokens(engine.tokenizer, 64)[::-1]

        async def both():
            await answer(engine, warm_up, cache=False)
            return await answer(engine, tokens, cache=True)

        return asyncio.run(both())
    finally:
        engine.stop(timeout=120)  # writes what is queued before it returns


def measure(args) -> list[dict]:
    rows = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="restart-bench-") as folder:
            cold = serve_once(args, Path(folder), args.prompt_tokens)
            warm = serve_once(args, Path(folder), args.prompt_tokens)
        row = {"rep": rep, "prompt_tokens": cold.prompt_tokens, "cold_ttft_s": cold.ttft_s,
               "restart_ttft_s": warm.ttft_s, "restart_cached_tokens": warm.cached_tokens,
               "ratio": warm.ttft_s / cold.ttft_s}
        rows.append(row)
        print(f"rep {rep}: {row['prompt_tokens']} tokens, cold TTFT {cold.ttft_s:.3f} s, "
              f"after restart {warm.ttft_s:.3f} s ({warm.cached_tokens} cached tokens), "
              f"ratio {row['ratio']:.3f}", flush=True)
    return rows


def decoding_run(kit: ModelKit, args, folder: Path | None) -> float:
    """The decoding stream's tok/s while side prompts are prefilled and stored."""
    scheduler = Scheduler(kit)
    disk = DiskPromptCache(folder, int(args.disk_max_gb * 1e9)) if folder else None
    scheduler.prefix_cache = PrefixCache(int(args.memory_gb * 1e9), disk)
    tokenizer = kit.target.tokenizer
    stamps: list = []
    stream = scheduler.submit(GenerationParams(tuple(prompt_tokens(tokenizer, 16)),
                                               args.decode_tokens, ignore_eos=True),
                              lambda event: stamps.append(time.perf_counter()))
    side = 0
    while stream.phase is not Phase.DONE:
        if len(stream.output) >= (side + 1) * args.every:
            tokens = prompt_tokens(tokenizer, args.side_tokens + side)[side:]
            scheduler.submit(GenerationParams(tuple(tokens), 1), lambda event: None)
            side += 1
        scheduler.step()
    while scheduler.has_work():
        scheduler.step()
    if disk is not None:
        disk.close()
    return (len(stamps) - 2) / (stamps[-2] - stamps[0])  # the last event is Finished


def measure_decoding(args) -> list[dict]:
    kit = ModelKit(load_model(args.model))
    decoding_run(kit, args, None)  # warm-up
    rows = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="restart-bench-") as folder:
            order = [None, Path(folder)] if rep % 2 == 0 else [Path(folder), None]
            tps = {bool(f): decoding_run(kit, args, f) for f in order}
        row = {"rep": rep, "tps_without": tps[False], "tps_with": tps[True],
               "ratio": tps[True] / tps[False]}
        rows.append(row)
        print(f"rep {rep}: decoding {row['tps_without']:.1f} tok/s without a disk cache,"
              f" {row['tps_with']:.1f} with; ratio {row['ratio']:.3f}", flush=True)
    return rows


def tiny_models(folder: Path) -> tuple[str, str]:
    from server.model_files.synthetic import build_pair

    target, draft = build_pair(folder / "pair", "tiny")
    return str(target), str(draft)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="mlx-spec-bench restart", description=__doc__)
    p.add_argument("--model", default=str(DEFAULT_TARGET_DIR), help="target model folder")
    p.add_argument("--draft-model", default=None, help="draft model folder (default: none)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny generated pair instead (target and draft; seconds)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--memory-gb", type=float, default=1.0, help="the in-memory prefix cache")
    p.add_argument("--disk-max-gb", type=float, default=4.0)
    p.add_argument("--decoding", action="store_true",
                   help="measure the disk writes' cost to decoding instead")
    p.add_argument("--decode-tokens", type=int, default=400)
    p.add_argument("--side-tokens", type=int, default=512)
    p.add_argument("--every", type=int, default=40)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="restart-models-") as models:
        if args.tiny:
            args.model, args.draft_model = tiny_models(Path(models))
        rows = measure_decoding(args) if args.decoding else measure(args)
    ratios = [r["ratio"] for r in rows]
    what = "decoding tok/s with / without a disk cache" if args.decoding else \
        "TTFT after restart / cold"
    print(f"{what}: {statistics.median(ratios):.3f}"
          + (f" (median of {len(ratios)})" if len(ratios) > 1 else ""))
    return rows


if __name__ == "__main__":
    main()
