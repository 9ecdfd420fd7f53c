"""`python -m server.bench.load`: many streaming clients at once, our server against others.

    python -m server.bench.load --server [NAME=]URL [--compare [NAME=]URL2 ...]
        [--concurrency 1,2,4,8,16] [--max-tokens 96] [--requests-per-client 1]
        [--timeout 300] [--warmup 1] [--results-dir RESULTS] [--tag T]

At each concurrency level C, C clients each stream `--requests-per-client` greedy chat
completions one after the other, all C at the same time, against one server; then the same
prompts against the next server (the servers take turns, and the first server of each level
rotates, so a drift of the machine does not favour one of them). Prompts are distinct (no
prefix-cache hit between requests beyond the chat template) and of varied length.

Measured on the client, the same way for every OpenAI-compatible server:
- tokens: our `stats.generation_tokens`, else the usage chunk, else the token chunks (ours mark
  each token with `from_draft`; others send a chunk per token that has text): both counts kept;
- aggregate tok/s: the tokens of the completed streams over the level's span (the first request
  sent to the last stream ended);
- per-stream tok/s: (n - 1) / (t_last - t_first) of each completed stream, as `server.bench`;
- TTFT: the first token chunk's arrival - the request's start; ITL: the gaps between token
  chunks (from a server that sends no chunk for a token without text, a gap can span two);
- errors: non-200 answers, error objects in the stream, streams that break or end without
  `[DONE]`, and requests past `--timeout`.
Our chunks carry `from_draft` and a final `stats`: acceptance is recorded where present.
Writes RESULTS/load-<stamp>[-tag].{jsonl,csv,json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from server.bench.http_runner import CellFailed, SseStreamReader
from server.bench.report import aligned, num

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
DEFAULT_MAX_TOKENS = 96
DEFAULT_REQUESTS_PER_CLIENT = 1
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_WARMUP = 1
WARMUP_MAX_TOKENS = 8
CONNECT_TIMEOUT_S = 10.0


# ------------------------------------------------------------------------------ prompts
_TASKS = (
    "Write a Python function that {}.",
    "Explain, step by step, how to write code that {}.",
    "Give a short example program that {}, with comments.",
    "Describe the edge cases of a function that {}.",
)
_SUBJECTS = (
    "reverses a linked list", "parses an ISO 8601 date", "merges two sorted lists",
    "counts the words in a text file", "checks whether a string is a palindrome",
    "finds the shortest path in a grid", "computes a moving average",
    "validates an email address", "flattens a nested dictionary",
    "converts Roman numerals to integers", "deduplicates a list while keeping order",
    "implements binary search", "retries an HTTP request with backoff",
    "serialises a dataclass to JSON", "groups records by a key",
    "rotates a matrix by 90 degrees",
)
_CONTEXT = (
    "The code will run on a small server with little memory.",
    "Prefer the standard library and keep the function pure.",
    "The inputs come from users, so expect malformed values.",
    "Type hints and a docstring are required by our style guide.",
    "Performance matters more than brevity for this one.",
    "A junior developer will maintain it next year.",
)


def prompt(i: int) -> str:
    """The i-th prompt: distinct for every i, 0 to 5 context sentences long."""
    subject = _SUBJECTS[i % len(_SUBJECTS)]
    task = _TASKS[(i // len(_SUBJECTS)) % len(_TASKS)]
    extra = [_CONTEXT[(i + j) % len(_CONTEXT)] for j in range(i % (len(_CONTEXT)))]
    return " ".join([task.format(subject), *extra, f"(Request {i}.)"])


# ------------------------------------------------------------------------------ one stream
@dataclass
class StreamRecord:
    """One streamed request as the client saw it; times are the clock's, in seconds."""

    server: str
    concurrency: int
    client: int
    start: float
    end: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # token chunks
    tokens: int = 0
    from_draft: int | None = None
    proposed: int | None = None
    accepted: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Server:
    label: str
    url: str
    transport: httpx.AsyncBaseTransport | None = None  # tests: an in-process server


def request_body(text: str, max_tokens: int) -> dict:
    """Greedy streamed chat; no extension fields, so every server gets the same request."""
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


async def stream_once(client: httpx.AsyncClient, server: Server, body: dict, record: StreamRecord,
                      *, clock: Callable[[], float]) -> None:
    """Fill `record` from one streamed request; anything that goes wrong becomes its `error`."""
    reader = SseStreamReader()
    try:
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                record.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return
            async for line in r.aiter_lines():
                if line.startswith("data:") and not reader.feed(line, clock()):
                    break
        if not reader.done:
            record.error = "stream ended without [DONE]"
    except (httpx.HTTPError, CellFailed, ValueError, KeyError) as e:
        record.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        record.end = clock()
        record.arrivals = reader.arrivals
        record.from_draft = reader.from_draft
        record.finish_reason = reader.finish_reason
        try:
            record.tokens = reader.tokens
        except (KeyError, TypeError):  # a malformed stats/usage object
            record.tokens = len(reader.arrivals)
        if reader.stats is not None:
            record.proposed = reader.stats.get("draft_tokens_proposed")
            record.accepted = reader.stats.get("draft_tokens_accepted")


async def timed_stream(client, server: Server, body: dict, record: StreamRecord, *,
                       timeout: float, clock: Callable[[], float]) -> StreamRecord:
    try:
        await asyncio.wait_for(stream_once(client, server, body, record, clock=clock), timeout)
    except asyncio.TimeoutError:
        record.error = f"timeout after {timeout:g}s"
        record.end = clock()
    return record


@dataclass(frozen=True)
class LoadSettings:
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    max_tokens: int = DEFAULT_MAX_TOKENS
    requests_per_client: int = DEFAULT_REQUESTS_PER_CLIENT
    timeout: float = DEFAULT_TIMEOUT_S
    warmup: int = DEFAULT_WARMUP
    api_key: str | None = None


def _client(server: Server, settings: LoadSettings, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    return httpx.AsyncClient(
        timeout=httpx.Timeout(settings.timeout, connect=CONNECT_TIMEOUT_S), headers=headers,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        transport=server.transport)


async def run_level(server: Server, concurrency: int, first_prompt: int, settings: LoadSettings,
                    *, clock: Callable[[], float] = time.perf_counter) -> list[StreamRecord]:
    """C clients at once, each sending its requests one after the other."""
    records: list[StreamRecord] = []

    async def one_client(c: int) -> None:
        for r in range(settings.requests_per_client):
            body = request_body(prompt(first_prompt + c + concurrency * r), settings.max_tokens)
            record = StreamRecord(server.label, concurrency, c, start=clock())
            records.append(record)
            await timed_stream(client, server, body, record, timeout=settings.timeout,
                               clock=clock)

    async with _client(server, settings, concurrency) as client:
        await asyncio.gather(*(one_client(c) for c in range(concurrency)))
    return records


# ------------------------------------------------------------------------------ figures
def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    vals = sorted(values)
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def _ratio(num, den) -> float | None:
    return num / den if num is not None and den else None


def _total(values: list[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def level_figures(records: list[StreamRecord]) -> dict:
    """The row of one (server, concurrency) level, from what its clients recorded."""
    ok = [r for r in records if r.ok]
    span = max(r.end for r in records) - min(r.start for r in records) if records else 0.0
    tokens = sum(r.tokens for r in ok)
    ttft = [r.arrivals[0] - r.start for r in ok if r.arrivals]
    gaps = [b - a for r in ok for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    stream_tps = [(r.tokens - 1) / (r.arrivals[-1] - r.arrivals[0])
                  for r in ok if len(r.arrivals) > 1 and r.arrivals[-1] > r.arrivals[0]]
    proposed, accepted = _total([r.proposed for r in ok]), _total([r.accepted for r in ok])
    from_draft = _total([r.from_draft for r in ok])
    errors = [r.error for r in records if not r.ok]
    return {
        "requests": len(records), "completed": len(ok), "errors": len(errors),
        "error_messages": list(dict.fromkeys(errors))[:3],
        "span_s": span, "tokens": tokens, "token_chunks": sum(len(r.arrivals) for r in ok),
        "tokens_per_stream": _ratio(tokens, len(ok)),
        "aggregate_tps": tokens / span if span > 0 and ok else None,
        "stream_tps_p50": percentile(stream_tps, 50),
        "stream_tps_min": min(stream_tps, default=None),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
        "proposed": proposed, "accepted": accepted,
        "acceptance_rate": _ratio(accepted, proposed),
        "from_draft_fraction": _ratio(from_draft, tokens) if from_draft is not None else None,
    }


RATIOS = {"aggregate_tps": "ratio_aggregate", "stream_tps_p50": "ratio_stream",
          "ttft_p50_s": "ratio_ttft"}


def add_ratios(rows: list[dict]) -> None:
    """On each compared server's row of a level: the first server's figure over this one's."""
    first = next(r for r in rows if r["role"] == "server")
    for row in rows:
        for key, name in RATIOS.items():
            row[name] = None if row is first else _ratio(first[key], row[key])


# ------------------------------------------------------------------------------ the run
def server_order(servers: list[Server], level_index: int) -> list[Server]:
    """Rotate who goes first at each level: A B C, B C A, C A B, ..."""
    shift = level_index % len(servers)
    return servers[shift:] + servers[:shift]


async def warm_up(servers: list[Server], settings: LoadSettings, first_prompt: int,
                  clock: Callable[[], float]) -> list[str]:
    """`settings.warmup` short requests per server, not measured; returns any errors."""
    problems = []
    for server in servers:
        async with _client(server, settings, 1) as client:
            for i in range(settings.warmup):
                body = request_body(prompt(first_prompt + i), WARMUP_MAX_TOKENS)
                record = await timed_stream(client, server, body,
                                            StreamRecord(server.label, 1, 0, start=clock()),
                                            timeout=settings.timeout, clock=clock)
                if not record.ok:
                    problems.append(f"{server.label}: {record.error}")
    return problems


async def run_load(servers: list[Server], settings: LoadSettings, *,
                   clock: Callable[[], float] = time.perf_counter,
                   on_row: Callable[[dict], None] = lambda row: None,
                   log=None) -> tuple[list[dict], list[str]]:
    """Every level on every server; rows (one per server and level) and warm-up problems."""
    problems = await warm_up(servers, settings, 0, clock)
    next_prompt = settings.warmup
    rows: list[dict] = []
    roles = {s.label: ("server" if i == 0 else "compare") for i, s in enumerate(servers)}
    for index, concurrency in enumerate(settings.concurrency):
        level_rows = []
        for position, server in enumerate(server_order(servers, index)):
            if log is not None:
                print(f"  {concurrency} stream(s) on {server.label}", file=log, flush=True)
            records = await run_level(server, concurrency, next_prompt, settings, clock=clock)
            level_rows.append({
                "server": server.label, "url": server.url, "role": roles[server.label],
                "concurrency": concurrency, "order": position,
                "requests_per_client": settings.requests_per_client,
                "max_tokens": settings.max_tokens, **level_figures(records)})
        level_rows.sort(key=lambda r: [s.label for s in servers].index(r["server"]))
        add_ratios(level_rows)
        for row in level_rows:
            on_row(row)
        rows += level_rows
        next_prompt += concurrency * settings.requests_per_client
    return rows, problems


# ------------------------------------------------------------------------------ report
def _pair(a, b, fmt: str) -> str:
    return f"{num(a, fmt)} / {num(b, fmt)}"


def format_load_table(rows: list[dict]) -> str:
    header = ["streams", "server", "agg tok/s", "stream tok/s p50", "TTFT p50/p99 s",
              "ITL p50/p99 ms", "accepted/proposed", "errors", "agg ratio", "stream ratio",
              "TTFT ratio"]
    lines = [header]
    for r in rows:
        ms = {k: None if r[k] is None else r[k] * 1000 for k in ("itl_p50_s", "itl_p99_s")}
        acceptance = ("-" if r["proposed"] is None else
                      f"{r['accepted']}/{r['proposed']} {num(r['acceptance_rate'], '.3f')}")
        lines.append([
            str(r["concurrency"]), r["server"], num(r["aggregate_tps"], ".1f"),
            num(r["stream_tps_p50"], ".1f"), _pair(r["ttft_p50_s"], r["ttft_p99_s"], ".3f"),
            _pair(ms["itl_p50_s"], ms["itl_p99_s"], ".1f"), acceptance,
            f"{r['errors']}/{r['requests']}",
            *(num(r[k], ".2f") + ("x" if r[k] is not None else "") for k in RATIOS.values()),
        ])
    return aligned(lines)


# ------------------------------------------------------------------------------ command line
def _levels(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4: {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,2,4: {text!r}")
    return list(dict.fromkeys(values))


def parse_server(text: str) -> Server:
    """`URL` or `NAME=URL`; the label is NAME, else the URL."""
    name, sep, url = text.partition("=")
    if not sep or "://" in name:
        name, url = "", text
    url = url.rstrip("/").removesuffix("/v1")
    return Server(label=name or url, url=url)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server.bench.load",
                                description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, type=parse_server, metavar="[NAME=]URL",
                   help="The server measured (ratios are its figures over the others').")
    p.add_argument("--compare", type=parse_server, action="append", default=[],
                   metavar="[NAME=]URL", help="A server to compare with (repeatable).")
    p.add_argument("--concurrency", type=_levels, default=list(DEFAULT_CONCURRENCY),
                   metavar="C,C,...", help="Concurrent streams per level (default 1,2,4,8,16).")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"Tokens per request (default {DEFAULT_MAX_TOKENS}).")
    p.add_argument("--requests-per-client", type=int, default=DEFAULT_REQUESTS_PER_CLIENT,
                   help="Requests each client sends, one after the other (default 1).")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"Seconds one request may take, start to [DONE] (default "
                        f"{DEFAULT_TIMEOUT_S:g}).")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help=f"Unmeasured short requests per server first (default {DEFAULT_WARMUP}).")
    p.add_argument("--api-key", help="Bearer key for the servers.")
    p.add_argument("--results-dir", type=Path, default=Path("RESULTS"),
                   help="Where the files go (default RESULTS).")
    p.add_argument("--tag", help="Appended to the results' file name.")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (tok/s needs two tokens)")
    if args.requests_per_client < 1:
        p.error("--requests-per-client must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    labels = [s.label for s in (args.server, *args.compare)]
    if len(set(labels)) != len(labels):
        p.error(f"servers need distinct names (use NAME=URL): {labels}")
    return args


def describe_server(server: Server) -> dict:
    """What the server says about itself: our /health names the models, mlx_lm's does not."""
    out: dict = {"label": server.label, "url": server.url}
    try:
        with httpx.Client(timeout=10) as client:
            health = client.get(f"{server.url}/health")
            out["health"] = health.json() if health.status_code == 200 else None
            if out["health"] and "target" in out["health"]:
                models = client.get(f"{server.url}/v1/models").json().get("data", [])
                out["models"] = [{k: m.get(k) for k in ("id", "role", "path")} for m in models]
    except (httpx.HTTPError, ValueError) as e:
        out["health_error"] = f"{type(e).__name__}: {e}"
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from server.bench.cli import environment
    from server.bench.writer import ResultsWriter, results_name

    args = parse_args(argv)
    log = sys.stderr
    servers = [args.server, *args.compare]
    settings = LoadSettings(concurrency=tuple(args.concurrency), max_tokens=args.max_tokens,
                            requests_per_client=args.requests_per_client, timeout=args.timeout,
                            warmup=args.warmup, api_key=args.api_key)
    writer = ResultsWriter(args.results_dir, results_name(args.tag, prefix="load"))
    started = time.time()
    meta = {
        "name": writer.name, "kind": "load", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": environment(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                 if k not in ("api_key", "server", "compare")},
        "servers": [describe_server(s) for s in servers],
        "prompts": "server.bench.load.prompt(i), distinct per request",
    }
    print(f"{len(settings.concurrency)} levels x {len(servers)} server(s), "
          f"{settings.requests_per_client} request(s) per client, {settings.max_tokens} tokens; "
          f"writing {writer.paths['jsonl']}", file=log)
    rows: list[dict] = []
    interrupted = False
    try:
        _, problems = asyncio.run(run_load(
            servers, settings, on_row=lambda row: (writer.write_row(row), rows.append(row)),
            log=log))
        meta["warmup_errors"] = problems
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted: writing what was done", file=log)
    meta.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                elapsed_s=round(time.time() - started, 2), interrupted=interrupted)
    written = writer.finish(meta, rows, [], plot=_plot)
    print()
    print(format_load_table(rows))
    print()
    for path in written.values():
        print(f"wrote {path}")
    return 130 if interrupted else 0


def _plot(rows: list[dict], path: Path, *, title: str = "") -> Path:
    from server.bench.plot import plot_load

    return plot_load(rows, path, title=title)


if __name__ == "__main__":
    sys.exit(main())
