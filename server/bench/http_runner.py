"""Run cells through an OpenAI-compatible server's streaming chat API (ours or `mlx_lm.server`).

tok/s is measured here, on the client, the same way for every server: from the arrival of the
first token to the arrival of the last, (n - 1) / (t_last - t_first). Our server marks every
token chunk with `from_draft` and ends with `stats` (acceptance, peak memory); `mlx_lm.server`
sends a chunk only when text is ready and reports no draft statistics, so there n comes from
the usage chunk and acceptance and peak memory are unknown.

Baselines: our server takes `num_draft_tokens: 0`. `mlx_lm.server` has no such switch for a
loaded draft (0 still runs its speculative loop), so its baseline asks for `"draft_model":
null`, which makes it reload the target without the draft (before the first token, so outside
the timed span; the warm-up runs absorb it).
"""

from __future__ import annotations

import json
import time

import httpx

from server.bench.cells import Cell
from server.bench.runners import RunResult
from server.engine.params import SpeculationParams

TIMEOUT_S = 600.0


class CellFailed(RuntimeError):
    """The server refused or broke off this cell."""


class ServerUnreachable(RuntimeError):
    """The server does not answer at all."""


class _NotStarted(Exception):
    """The connection failed before the server answered."""


def _json_or_empty(r: httpx.Response) -> dict:
    try:
        return r.json() if r.status_code == 200 else {}
    except ValueError:
        return {}


class HttpRunner:
    def __init__(self, url: str, *, speculation: SpeculationParams, temperature: float,
                 api_key: str | None = None, timeout: float = TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.label = self.url
        self.speculation = speculation
        self.temperature = temperature
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers, transport=transport)
        self.health = self._health()
        # Our /health names the target; mlx_lm.server's says only {"status": "ok"}.
        self.flavor = "ours" if "target" in self.health else "mlx_lm"

    def _health(self) -> dict:
        """GET /health; a server that does not answer is an error, not an mlx_lm.server (taking
        it for one would send our requests without our fields, adaptive k among them)."""
        try:
            r = self.client.get(self.url + "/health")
        except httpx.HTTPError as e:
            raise ServerUnreachable(f"{self.url} does not answer GET /health: {e!r}") from e
        return _json_or_empty(r)

    def _get_json(self, path: str) -> dict:
        try:
            return _json_or_empty(self.client.get(self.url + path))
        except httpx.HTTPError:
            return {}

    def describe(self) -> dict:
        # mlx_lm.server's /v1/models scans the Hugging Face cache (and can fail): ask ours only.
        models = self._get_json("/v1/models").get("data", []) if self.flavor == "ours" else []
        return {
            "label": self.label, "kind": f"http ({self.flavor})", "health": self.health,
            "models": [{k: m.get(k) for k in ("id", "role", "path") if k in m} for m in models],
            "acceptance_reported": self.flavor == "ours",
        }

    def request_body(self, cell: Cell, *, max_tokens: int, seed: int) -> dict:
        body = {
            "messages": [{"role": "user", "content": cell.prompt}],
            "max_tokens": max_tokens, "temperature": self.temperature, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.temperature > 0:
            body["seed"] = seed
        spec = self.speculation
        if self.flavor == "ours":
            body["num_draft_tokens"] = cell.k
            if cell.k:
                body.update(draft=spec.source, acceptance=spec.acceptance, adaptive=spec.adaptive,
                            draft_p_min=spec.draft_p_min, hybrid_min_match=spec.hybrid_min_match)
        elif cell.k == 0:
            body["draft_model"] = None
        elif spec.source != "model":
            raise CellFailed(f"draft={spec.source} is an extension of our server only")
        else:
            body["num_draft_tokens"] = cell.k
        return body

    def run(self, cell: Cell, *, max_tokens: int, seed: int) -> RunResult:
        body = self.request_body(cell, max_tokens=max_tokens, seed=seed)
        try:
            return self._stream(body)
        except _NotStarted:
            # A server may close a kept-alive connection after an error (uvicorn does after a
            # 500): the next request then fails before it starts. Retry that once, fresh.
            return self._stream(body, retry=False)

    def _stream(self, body: dict, *, retry: bool = True) -> RunResult:
        start = time.perf_counter()
        stream = SseStreamReader()
        request = self.client.build_request("POST", f"{self.url}/v1/chat/completions", json=body)
        try:
            response = self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError) as e:
            if retry:
                raise _NotStarted from e
            raise
        try:
            if response.status_code >= 400:
                response.read()
                raise CellFailed(f"HTTP {response.status_code}: {_error_message(response)}")
            for line in response.iter_lines():
                if not stream.feed(line, time.perf_counter()):
                    break
        finally:
            response.close()
        return stream.result(start)

    def close(self) -> None:
        self.client.close()


class SseStreamReader:
    """Collects token arrival times, `from_draft` flags, `stats` and `usage` from SSE lines.

    A token arrives with every chunk that carries `from_draft` (ours: one chunk per token, even
    when the detokenizer holds its text back) or, from other servers, non-empty text.
    """

    def __init__(self):
        self.arrivals: list[float] = []
        self.from_draft: int | None = None
        self.stats: dict | None = None
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.done = False  # `[DONE]` seen: the stream ended as the protocol says

    @property
    def tokens(self) -> int:
        """Generated tokens: from our `stats`, else the usage chunk, else the chunks counted."""
        if self.stats is not None:
            return self.stats["generation_tokens"]
        if self.usage is not None:
            return self.usage["completion_tokens"]
        return len(self.arrivals)

    def feed(self, line: str, now: float) -> bool:
        """Take one line; False at `[DONE]`. An error object in the stream raises CellFailed."""
        if not line.startswith("data:"):
            return True
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = True
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            raise CellFailed(f"error in stream: {chunk['error']}")
        self.stats = chunk.get("stats") or self.stats
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            flag = choice.get("from_draft")
            text = (choice.get("delta") or {}).get("content") or choice.get("text")
            if flag is not None:  # ours: one chunk per token, text or not
                self.from_draft = (self.from_draft or 0) + bool(flag)
                self.arrivals.append(now)
            elif text:  # others: a chunk whenever text is ready
                self.arrivals.append(now)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return True

    def result(self, start: float) -> RunResult:
        n = self.tokens
        span = self.arrivals[-1] - self.arrivals[0] if len(self.arrivals) > 1 else 0.0
        tps = (n - 1) / span if span > 0 else None
        ttft = self.arrivals[0] - start if self.arrivals else None
        common = dict(tps=tps, ttft_s=ttft, finish_reason=self.finish_reason)
        if self.stats is not None:
            return RunResult.from_stats(self.stats, from_draft=self.from_draft, **common)
        prompt = self.usage.get("prompt_tokens") if self.usage else None
        return RunResult(tokens=n, peak_gb=None, prompt_tokens=prompt,
                         from_draft=self.from_draft, proposed=None, accepted=None, rounds=None,
                         **common)


def _error_message(response: httpx.Response) -> str:
    try:
        err = response.json().get("error")
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return response.text[:300]
