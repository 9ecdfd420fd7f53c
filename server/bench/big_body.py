"""`mlx-spec-bench big-body --server URL`: what one client's huge request costs everyone else.

Against a running server (`make serve`), for each size: a stream decodes, /health is polled
every 50 ms, and a chat request of that many MB is sent. Per size: the big request's status and
seconds to its answer (a 413 past `server.max_body_mb`), /health's slowest answer while it ran,
and the stream's longest gap between tokens then, each beside the same figure measured alone
just before (ratios near 1: nobody waited for the big request).
"""

from __future__ import annotations

import json
import threading
import time

import httpx

from server.bench import results
from server.bench.results import num

POLL_S = 0.05
BASELINE_S = 2.0


def big_body(mb: float) -> bytes:
    """A chat request of `mb` MB (10^6 bytes) of prose."""
    words = "The quick brown fox jumps over the lazy dog. "
    text = (words * (int(mb * 1e6) // len(words) + 1))[:int(mb * 1e6) - 200]
    return json.dumps({"messages": [{"role": "user", "content": text}],
                       "max_tokens": 8}).encode()


class Watch:
    """/health polled, and a stream read, in threads, until `stop`: each poll's latency and
    each token's arrival, with the time they came."""

    def __init__(self, url: str, headers: dict):
        self.url, self.headers = url, headers
        self.polls: list[tuple[float, float]] = []  # (when, seconds)
        self.tokens: list[float] = []
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._poll,
                                                                            self._stream)]

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(30)

    def _poll(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                client.get(f"{self.url}/health")
                self.polls.append((started, time.monotonic() - started))
                self.stop.wait(POLL_S)

    def _stream(self) -> None:
        body = {"messages": [{"role": "user", "content": "Count to a thousand."}],
                "max_tokens": 2_000, "ignore_eos": True, "stream": True}
        while not self.stop.is_set():  # a stream that ran to the context starts again
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                              headers=self.headers, timeout=120) as r:
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if line.startswith("data: {"):
                        self.tokens.append(time.monotonic())

    def between(self, start: float, end: float) -> tuple[float | None, float | None]:
        """(/health's slowest answer, the stream's longest gap) in [start, end]."""
        polls = [s for when, s in self.polls if start <= when <= end]
        arrivals = [t for t in self.tokens if start <= t <= end]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
        return max(polls, default=None), max(gaps, default=None)


def measure(url: str, mb: float, headers: dict) -> dict:
    body = big_body(mb)
    with Watch(url, headers) as watch:
        while len(watch.tokens) < 5:  # the stream decodes
            time.sleep(0.05)
        time.sleep(BASELINE_S)
        before = watch.between(time.monotonic() - BASELINE_S, time.monotonic())
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", content=body, timeout=600,
                       headers={**headers, "Content-Type": "application/json"})
        ended = time.monotonic()
        during = watch.between(started, ended)
    return {"size_mb": mb, "bytes": len(body), "status": r.status_code,
            "code": (r.json().get("error") or {}).get("code") if r.status_code >= 400 else None,
            "answer_s": ended - started, "health_max_s": during[0],
            "health_max_alone_s": before[0], "health_ratio": results.ratio(during[0], before[0]),
            "token_gap_max_s": during[1], "token_gap_max_alone_s": before[1],
            "token_gap_ratio": results.ratio(during[1], before[1]),
            "health_polls": len([1 for when, _ in watch.polls if started <= when <= ended])}


def table(rows: list[dict]) -> list[list[str]]:
    lines = [["MB", "answer", "in", "/health slowest (alone)", "ratio",
              "token gap longest (alone)", "ratio"]]
    for r in rows:
        lines.append([num(r["size_mb"], "g"), f"{r['status']} {r['code'] or ''}".strip(),
                      num(r["answer_s"], ".2f", suffix=" s"),
                      f"{num(r['health_max_s'], '.3f')} ({num(r['health_max_alone_s'], '.3f')}) s",
                      num(r["health_ratio"], ".1f", suffix="x"),
                      f"{num(r['token_gap_max_s'], '.3f')} "
                      f"({num(r['token_gap_max_alone_s'], '.3f')}) s",
                      num(r["token_gap_ratio"], ".1f", suffix="x")])
    return lines


def main(argv: list[str]) -> int:
    p = results.parser("big-body", __doc__)
    p.add_argument("--server", type=results.named_url, required=True, metavar="URL",
                   help="The running server (make serve: http://127.0.0.1:8000).")
    p.add_argument("--sizes-mb", default="6,60", help="Request sizes in MB, comma-separated.")
    p.add_argument("--api-key", help="Bearer key for the server.")
    args = p.parse_args(argv)
    _, url = args.server
    sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    rows = [measure(url, mb, results.auth(args.api_key)) for mb in sizes]
    health = httpx.get(f"{url}/health", timeout=10).json()
    results.save("big-body", argv, args, results.environment(
        target_model=health.get("target"), draft_model=health.get("draft")), rows, table)
    return 0
