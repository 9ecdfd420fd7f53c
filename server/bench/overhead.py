"""What the server costs: tok/s through the streaming HTTP API vs direct `mlx_lm.stream_generate`.

    python -m server.bench.overhead [--target-model P] [--draft-model P] [--num-draft-tokens 4]
        [--max-tokens 256] [--reps 3]

Same models, same prompt, greedy, run one after the other (never at once): direct in this
process, then through a `python -m server` subprocess. Both rates are measured the same way,
from the arrival of the first token to the arrival of the last: (n - 1) / (t_last - t_first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import httpx
import mlx.core as mx
from mlx_lm import load, stream_generate

PROMPT = "Write a Python function `binary_search(items, target)` and explain how it works."


def rate(arrivals: list[float]) -> float:
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def run_direct(target, draft, tokenizer, prompt, k: int, max_tokens: int) -> dict:
    mx.reset_peak_memory()
    extra = {"draft_model": draft, "num_draft_tokens": k} if k else {}
    arrivals, tokens = [], []
    for r in stream_generate(target, tokenizer, prompt, max_tokens=max_tokens, **extra):
        arrivals.append(time.perf_counter())
        tokens.append(r.token)
    return {"tps": rate(arrivals), "peak_gb": mx.get_peak_memory() / 1e9, "tokens": tokens}


def run_http(url: str, prompt, k: int, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "num_draft_tokens": k, "adaptive": False}
    arrivals, stats = [], None
    with httpx.Client(timeout=600) as client:
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line.endswith("[DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("stats"):
                    stats = chunk["stats"]
                elif chunk["choices"]:
                    arrivals.append(time.perf_counter())
    return {"tps": rate(arrivals), "peak_gb": stats["peak_memory_gb"], "n": len(arrivals),
            "server_tps": stats["generation_tps"]}


def start_server(target: str, draft: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "--model", target, "--draft-model", draft,
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target-model")
    p.add_argument("--draft-model")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args(argv)
    target_path, draft_path = args.target_model, args.draft_model
    if not target_path:
        from server.model_files.bundled import demo_or_generated_pair

        target_path, draft_path = demo_or_generated_pair()
    target, tokenizer = load(target_path)
    draft, _ = load(draft_path)
    for m in (target, draft):
        m.set_dtype(mx.float32)
    prompt = tokenizer.encode(PROMPT)
    url = f"http://127.0.0.1:{args.port}"
    server = start_server(target_path, draft_path, args.port)
    results: dict[str, list] = {}
    try:
        for k in (0, args.num_draft_tokens):
            run_direct(target, draft, tokenizer, prompt, k, 16)  # warm-up
            run_http(url, prompt, k, 16)
            for _ in range(args.reps):
                results.setdefault(f"direct_k{k}", []).append(
                    run_direct(target, draft, tokenizer, prompt, k, args.max_tokens))
                results.setdefault(f"http_k{k}", []).append(
                    run_http(url, prompt, k, args.max_tokens))
    finally:
        server.terminate()
        server.wait(timeout=30)
    report(results, args.num_draft_tokens, target_path, draft_path)


def report(results: dict, k: int, target: str, draft: str) -> None:
    med = {key: statistics.median(r["tps"] for r in runs) for key, runs in results.items()}
    peak = {key: max(r["peak_gb"] for r in runs) for key, runs in results.items()}
    print(f"target={target} draft={draft} k={k} tokens={results['http_k0'][0]['n'] + 1}")
    print(f"{'mode':<12}{'direct tok/s':>14}{'HTTP tok/s':>12}{'HTTP/direct':>13}"
          f"{'direct GB':>11}{'HTTP GB':>9}")
    for kk, label in ((0, "no draft"), (k, f"draft k={k}")):
        d, h = med[f"direct_k{kk}"], med[f"http_k{kk}"]
        print(f"{label:<12}{d:>14.1f}{h:>12.1f}{h / d:>13.3f}"
              f"{peak[f'direct_k{kk}']:>11.3f}{peak[f'http_k{kk}']:>9.3f}")
    print(f"speculative speedup through the server: {med[f'http_k{k}'] / med['http_k0']:.2f}x"
          f" (direct: {med[f'direct_k{k}'] / med['direct_k0']:.2f}x)")


if __name__ == "__main__":
    main()
