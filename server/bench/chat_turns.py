"""`python -m server.bench.chat_turns`: what the prefix cache saves a chat and a shared prompt.

    python -m server.bench.chat_turns --server [NAME=]URL [--compare [NAME=]URL]
        [--system-chars 4500] [--turns 3] [--max-tokens 32] [--clients 8]

1. A multi-turn chat whose system prompt is a long module's source (json/decoder.py, cut to
   `--system-chars`): each turn resends the whole history, as chat clients do. Servers take
   turns (ours turn 1, theirs turn 1, ours turn 2, ...). Prints each turn's time to first
   token per server, and the ratios ours/theirs and turn N / turn 1.
2. Our server only: `--clients` concurrent requests sharing that system prompt, first with
   `cache_prompt: false`, then with the cache (emptied first with DELETE /v1/cache).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import json.decoder
import statistics
import time

import httpx

QUESTIONS = ("What does this module do?", "Which function parses numbers?",
             "Summarise the error handling.", "How are strings scanned?")


def system_prompt(chars: int) -> str:
    source = inspect.getsource(json.decoder)
    return "You answer questions about this Python module.\n\n" + source[:chars]


async def stream_chat(client: httpx.AsyncClient, url: str, messages: list, max_tokens: int,
                      **extra) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    first, text, usage = None, [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = first or time.perf_counter()
                    text.append(content)
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft_s": (first or time.perf_counter()) - start, "text": "".join(text),
            "prompt_tokens": (usage or {}).get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens")}


async def chat(servers: dict[str, str], system: str, turns: int, max_tokens: int) -> list[dict]:
    histories = {name: [{"role": "system", "content": system}] for name in servers}
    rows = []
    async with httpx.AsyncClient(timeout=600) as client:
        for turn in range(turns):
            for name, url in servers.items():
                history = histories[name]
                history.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
                result = await stream_chat(client, url, history, max_tokens)
                history.append({"role": "assistant", "content": result["text"]})
                rows.append({"server": name, "turn": turn + 1,
                             **{k: v for k, v in result.items() if k != "text"}})
    return rows


async def shared_prompt(url: str, system: str, clients: int, max_tokens: int,
                        cache_prompt: bool) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        await client.delete(f"{url}/v1/cache")
        start = time.perf_counter()
        results = await asyncio.gather(*(
            stream_chat(client, url, [{"role": "system", "content": system},
                                      {"role": "user", "content": f"Question {i}: what is "
                                       f"line {10 * i} about?"}], max_tokens,
                        cache_prompt=cache_prompt)
            for i in range(clients)))
    ttfts = [r["ttft_s"] for r in results]
    return {"cache_prompt": cache_prompt, "clients": clients,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_max_s": max(ttfts),
            "total_s": time.perf_counter() - start,
            "cached_tokens": sum(r["cached_tokens"] or 0 for r in results)}


def parse_server(text: str) -> tuple[str, str]:
    name, _, url = text.rpartition("=")
    return (name or url), url.rstrip("/")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.bench.chat_turns", description=__doc__)
    p.add_argument("--server", required=True, help="[NAME=]URL of our server")
    p.add_argument("--compare", action="append", default=[], help="[NAME=]URL (repeatable)")
    p.add_argument("--system-chars", type=int, default=4500)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--output", help="write the rows as JSON here")
    args = p.parse_args(argv)
    ours, ours_url = parse_server(args.server)
    servers = dict([(ours, ours_url), *(parse_server(c) for c in args.compare)])
    system = system_prompt(args.system_chars)
    rows = asyncio.run(chat(servers, system, args.turns, args.max_tokens))
    print(f"{'turn':>4} {'server':>14} {'prompt tok':>10} {'cached':>7} {'TTFT s':>8} "
          f"{'vs turn 1':>9} {'ours/this':>9}")
    ttft = {(r["server"], r["turn"]): r["ttft_s"] for r in rows}
    for r in rows:
        print(f"{r['turn']:>4} {r['server']:>14} {r['prompt_tokens'] or '-':>10} "
              f"{r['cached_tokens'] if r['cached_tokens'] is not None else '-':>7} "
              f"{r['ttft_s']:8.3f} {r['ttft_s'] / ttft[(r['server'], 1)]:9.3f} "
              f"{ttft[(ours, r['turn'])] / r['ttft_s']:9.3f}")
    shared = [asyncio.run(shared_prompt(ours_url, system, args.clients, args.max_tokens, c))
              for c in (False, True)]
    print(f"\n{args.clients} concurrent clients sharing the system prompt (ours):")
    for s in shared:
        print(f"  cache_prompt={s['cache_prompt']!s:5}  TTFT mean {s['ttft_mean_s']:.3f} s, "
              f"max {s['ttft_max_s']:.3f} s, all done {s['total_s']:.2f} s, "
              f"cached tokens {s['cached_tokens']}")
    print(f"  ratio cached/uncached: TTFT mean "
          f"{shared[1]['ttft_mean_s'] / shared[0]['ttft_mean_s']:.3f}, "
          f"total {shared[1]['total_s'] / shared[0]['total_s']:.3f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"chat": rows, "shared_prompt": shared, "date": time.ctime(),
                       "system_chars": args.system_chars}, f, indent=1)


if __name__ == "__main__":
    main()
