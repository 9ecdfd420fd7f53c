"""`mlx-spec-bench startup`: how long `python -m server` takes to load its models, to be ready
(`/health` 200) and to finish measuring forward times (`/health`'s `cost_model.measuring`),
for each pair: as it is, and quantized by `mlx_lm.convert -q` (served dequantized or not);
then the target's tok/s alone and with the draft, and the server's memory.

Each server starts as a first start does: with a forward-time cache of its own, empty (`--warm`
keeps one cache for every server, as a restart finds it). Times are from the moment the process
is spawned; `load_s` is when the server logged that its models were loaded.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

from server.bench.load import peak_rss_gb
from server.bench.results import environment, num, parser, save
from server.bench.runners import wait_for

PROMPT = "Write a short story about a robot who learns to paint."
POLL_S = 0.05


def pair_arg(text: str) -> tuple[str, str, str | None]:
    """`NAME=TARGET[,DRAFT]` -> (name, target, draft)."""
    name, _, paths = text.partition("=")
    target, _, draft = paths.partition(",")
    if not name or not target:
        raise ValueError(f"expected NAME=TARGET[,DRAFT]: {text!r}")
    return name, target, draft or None


def default_pairs() -> list[tuple[str, str, str | None]]:
    """config.yaml's pair (fetched by `make serve`) and the generated pair (built if missing)."""
    from server.config import Settings
    from server.model_files.bundled import generated_pair

    models = Settings.load(Path("config.yaml")).models
    return [("default", models.model, models.draft_model), ("generated", *generated_pair())]


def quantized(pair: tuple[str, str, str | None], bits: int, folder: Path
              ) -> tuple[str, str, str | None]:
    """`pair` converted by `mlx_lm.convert -q --q-bits BITS` into `folder` (once)."""
    from mlx_lm import convert

    name, *paths = pair
    out = []
    for role, path in zip(("target", "draft"), paths, strict=True):
        if path is None:
            out.append(None)
            continue
        dest = folder / f"{name}-q{bits}" / role
        if not dest.exists():
            convert(path, str(dest), quantize=True, q_bits=bits)
        out.append(str(dest))
    return f"{name}-q{bits}", out[0], out[1]


def log_time(log: Path, message: str) -> float | None:
    """The Unix time of the first JSON log line whose message starts with `message`."""
    for line in log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if str(record.get("message", "")).startswith(message):
            return datetime.fromisoformat(record["time"]).timestamp()
    return None


def generation_tps(client: httpx.Client, url: str, *, use_draft: bool, args) -> float:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
            "temperature": 0, "use_draft": use_draft, "ignore_eos": True}
    runs = [client.post(f"{url}/v1/chat/completions", json=body).json()["stats"]
            ["generation_tps"] for _ in range(args.reps)]
    return statistics.median(runs)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(target: str, draft: str | None, dequantize: str, cache: Path, log: Path
          ) -> tuple[subprocess.Popen, str, float]:
    """`python -m server` on a free port with its forward-time cache in `cache`: (process,
    URL, Unix time it was spawned)."""
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--model", target, "--draft-model", draft or "none",
           "--port", str(port), "--log-format", "json"]
    if dequantize != "auto":  # left out otherwise, so the command also times a server without it
        cmd += ["--dequantize", dequantize]
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    with open(log, "w") as out:
        spawned = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}", spawned


def measuring(health: dict) -> bool:
    """Whether forward times are still to be measured (a server without `cost_model` in its
    /health measured them before it was ready)."""
    return bool((health.get("cost_model") or {}).get("measuring"))


def measure(name: str, target: str, draft: str | None, dequantize: str, args,
            cache: Path, log: Path) -> dict:
    """One server's row: its start-up times, tok/s and memory."""
    proc, url, spawned = serve(target, draft, dequantize, cache, log)
    try:
        with httpx.Client(timeout=600) as client:
            def health():
                r = client.get(f"{url}/health", timeout=5)
                return r.json() if r.status_code == 200 else None

            ready = wait_for(health, proc, args.timeout_s, log, POLL_S)
            ready_s = time.time() - spawned if ready is not None else None
            done = wait_for(lambda: (h := health()) and not measuring(h) and h or None, proc,
                            args.timeout_s, log, POLL_S)
            measured_s = time.time() - spawned if done is not None else None
            loaded = log_time(log, "models loaded")
            models = {m["role"]: m for m in client.get(f"{url}/v1/models").json()["data"]}
            row = {"pair": name, "target": target, "draft": draft, "dequantize": dequantize,
                   "quantization": models["target"].get("quantization"),
                   "dequantized": models["target"].get("dequantized"),
                   "load_s": loaded - spawned if loaded is not None else None,
                   "ready_s": ready_s, "measured_s": measured_s,
                   "cost_model": (done or ready or {}).get("cost_model"),
                   "target_tps": generation_tps(client, url, use_draft=False, args=args),
                   "draft_tps": generation_tps(client, url, use_draft=True, args=args)
                   if draft else None}
        row["ready_after_load_s"] = (row["ready_s"] - row["load_s"]
                                     if None not in (row["ready_s"], row["load_s"]) else None)
        row["peak_rss_gb"] = peak_rss_gb(proc.pid)
        return row
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def table(rows: list[dict]) -> list[list[str]]:
    head = ["pair", "dequantize", "load s", "ready s", "ready-load s", "measured s",
            "measuring s", "target tok/s", "draft tok/s", "peak GB"]
    return [head] + [[r["pair"], f"{r['dequantize']}" + (" (done)" if r["dequantized"] else ""),
                      num(r["load_s"], ".1f"), num(r["ready_s"], ".1f"),
                      num(r["ready_after_load_s"], ".1f"), num(r["measured_s"], ".1f"),
                      num((r["cost_model"] or {}).get("measured_s"), ".1f"),
                      num(r["target_tps"], ".1f"), num(r["draft_tps"], ".1f"),
                      num(r["peak_rss_gb"], ".2f")] for r in rows]


def main(argv: list[str]) -> int:
    p = parser("startup", __doc__)
    a = p.add_argument
    a("--pair", action="append", type=pair_arg, default=None, metavar="NAME=TARGET[,DRAFT]",
      help="A pair to start (repeatable; default: config.yaml's and the generated pair).")
    a("--quantize", action="append", type=int, default=[], metavar="BITS",
      help="Also each pair converted by mlx_lm.convert -q --q-bits BITS (repeatable).")
    a("--dequantize", default="auto,false",
      help="models.dequantize values a quantized pair is served with (a float pair: auto).")
    a("--models-dir", type=Path, default=Path("models/generated/quantized"),
      help="Where quantized conversions are written (once).")
    a("--max-tokens", type=int, default=128, help="Tokens per tok/s request (EOS ignored).")
    a("--reps", type=int, default=3, help="tok/s requests per setting; the median.")
    a("--timeout-s", type=float, default=900, help="Wait at most this for ready, and again"
      " for the measurement's end.")
    a("--warm", action="store_true", help="One forward-time cache for every server: each"
      " starts with what the ones before it stored (a restart), not as a first start.")
    a("--smoke", action="store_true", help="The tiny generated pair, 4-bit too, 8 tokens, 1 rep.")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    if args.smoke:
        from server.model_files.synthetic import build_pair

        tiny = build_pair(work / "tiny", "tiny")
        args.pair = [("tiny", str(tiny[0]), str(tiny[1]))]
        args.quantize, args.max_tokens, args.reps = args.quantize or [4], 8, 1
        args.models_dir = work / "quantized"
    pairs = args.pair or default_pairs()
    settings = [(pair, "auto") for pair in pairs] + [
        (quantized(pair, bits, args.models_dir), d) for bits in args.quantize for pair in pairs
        for d in args.dequantize.split(",")]
    rows = []
    for i, ((name, target, draft), dequantize) in enumerate(settings):
        cache = work / ("cache" if args.warm else f"cache-{i}")
        row = measure(name, target, draft, dequantize, args, cache, work / f"server-{i}.log")
        print(f"{name} (dequantize: {dequantize}): ready {num(row['ready_s'], '.1f')} s,"
              f" measured {num(row['measured_s'], '.1f')} s,"
              f" {num(row['target_tps'], '.1f')} tok/s", flush=True)
        rows.append(row)
    metadata = environment(pairs=[list(pair) for pair in pairs], warm=args.warm,
                           max_tokens=args.max_tokens, reps=args.reps)
    save("startup", argv, args, metadata, rows, table)
    return 0
