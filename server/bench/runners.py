"""Who runs a generation (the engine in this process, or a server over one of three HTTP APIs)
and how a token stream is read: tok/s is (n - 1) / (t_last - t_first) on the client for every
server. Ours flags each token `from_draft` and ends with `stats`; `mlx_lm.server` sends a chunk
when text is ready (n from its usage).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from server.bench.results import auth
from server.demo import encode_prompt
from server.engine.events import Finished
from server.engine.generation import generate_events
from server.engine.models.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams, SamplingParams, SpeculationParams
from server.engine.speculation.forward_times import time_forwards

API_PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses",
             "messages": "/v1/messages"}
TIMEOUT_S = 600.0


def wait_for(check, proc: subprocess.Popen, timeout_s: float, log: Path, poll_s: float = 0.05):
    """Poll `check()` until it returns a value (None once `timeout_s` passed; an HTTP error
    counts as no value); RuntimeError with the end of `proc`'s `log` if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n"
                               f"{log.read_text()[-4000:]}")
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value is not None:
            return value
        time.sleep(poll_s)
    return None


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Until the server `proc` started answers 200 on `url`'s /health (RuntimeError if it
    exits or does not within `timeout_s`)."""
    if wait_for(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200 or None,
                proc, timeout_s, log, poll_s=0.2) is None:
        raise RuntimeError(f"{url} did not answer /health within {timeout_s:.0f} s")


class StreamFailed(RuntimeError):
    """The server refused or broke off a request, or does not answer at all."""


FROM_STATS = {"tokens": "generation_tokens", "tps": "generation_tps", "ttft_s": "ttft_s",
              "peak_gb": "peak_memory_gb", "prompt_tokens": "prompt_tokens",
              "from_draft": "draft_tokens_accepted", "proposed": "draft_tokens_proposed",
              "accepted": "draft_tokens_accepted"}


def run_result(stats: dict | None = None, **measured) -> dict:
    """One generation as measured, from our `stats` where given (None: unknown)."""
    stats, histogram = stats or {}, (stats or {}).get("k_histogram")
    return {**{key: stats.get(name) for key, name in FROM_STATS.items()},
            "rounds": sum(histogram.values()) if histogram else None, "finish_reason": None,
            **measured}


def request_body(api: str, messages: list[dict], *, max_tokens: int, temperature: float,
                 model: str | None = None, **extra) -> dict:
    """A streamed request in `api`'s shape; `extra` (our extensions) at the top level."""
    if api == "chat":
        body = {"messages": messages, "max_tokens": max_tokens,
                "stream_options": {"include_usage": True}}
    elif api == "responses":
        body = {"input": messages, "max_output_tokens": max_tokens}
    else:
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        body = {"messages": [m for m in messages if m["role"] != "system"],
                "max_tokens": max_tokens, **({"system": system} if system else {})}
    return {**body, **({"model": model} if model else {}), "temperature": temperature,
            "stream": True, **extra}


def _usage(usage: dict | None) -> dict | None:
    """Any API's usage as {prompt_tokens, completion_tokens, cached_tokens}."""
    if not usage:
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return {"prompt_tokens": usage.get("prompt_tokens", usage.get("input_tokens")),
            "completion_tokens": usage.get("completion_tokens", usage.get("output_tokens")),
            "cached_tokens": details.get("cached_tokens", usage.get("cache_read_input_tokens"))}


@dataclass
class Stream:
    """One streamed request as the client saw it; times are the caller's clock."""

    start: float = 0.0
    end: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # one per token (ours) or text chunk
    from_draft: int | None = None
    stats: dict | None = None
    usage: dict | None = None
    finish_reason: str | None = None
    text: list[str] = field(default_factory=list)
    done: bool = False  # the API's end event seen
    error: str | None = None
    retries: int = 0  # transport failures before a response, retried

    @property
    def tokens(self) -> int:
        """Generated tokens: from our `stats`, else the usage, else the arrivals counted."""
        if self.stats is not None:
            return self.stats["generation_tokens"]
        return ((self.usage or {}).get("completion_tokens")) or len(self.arrivals)

    def feed(self, line: str, now: float) -> bool:
        """Take one SSE `data:` line; False once the stream has ended. An error event raises."""
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            self.done = True
            return False
        event = json.loads(data)
        kind = event.get("type")
        if kind in ("error", "response.failed") or (kind is None and "error" in event):
            raise StreamFailed(f"error in stream: {event.get('error') or event}")
        if kind is None:  # a chat completion chunk
            self.stats = event.get("stats") or self.stats
            self.usage = _usage(event.get("usage")) or self.usage
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                self._token(now, delta.get("content") or choice.get("text"),
                            choice.get("from_draft"))
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        elif kind == "response.output_text.delta":
            self._token(now, event.get("delta"), event.get("from_draft"))
        elif kind in ("response.completed", "response.incomplete"):
            response = event.get("response") or {}
            self.stats, self.usage = response.get("stats"), _usage(response.get("usage"))
            self.finish_reason = "stop" if kind == "response.completed" else "length"
            self.done = True
        elif kind == "content_block_delta" and event["delta"].get("type") == "text_delta":
            flag = event.get("from_draft", event["delta"].get("from_draft"))
            self._token(now, event["delta"].get("text"), flag)
        elif kind == "message_delta":
            self.stats, self.usage = event.get("stats"), _usage(event.get("usage"))
            stop = (event.get("delta") or {}).get("stop_reason")
            self.finish_reason = "length" if stop == "max_tokens" else "stop"
        elif kind == "message_stop":
            self.done = True
        return not self.done

    def _token(self, now: float, text: str | None, flag: bool | None) -> None:
        if flag is not None:  # ours: one event per token, text or not
            self.from_draft = (self.from_draft or 0) + bool(flag)
        if flag is not None or text:  # others: an event whenever text is ready
            self.arrivals.append(now)
        if text:
            self.text.append(text)

    def result(self) -> dict:
        n = self.tokens
        span = self.arrivals[-1] - self.arrivals[0] if len(self.arrivals) > 1 else 0.0
        return run_result(self.stats, tokens=n, tps=(n - 1) / span if span > 0 else None,
                          ttft_s=self.arrivals[0] - self.start if self.arrivals else None,
                          from_draft=self.from_draft, finish_reason=self.finish_reason,
                          **({} if self.stats else {"prompt_tokens": (self.usage or {}).get(
                              "prompt_tokens")}))


def server_health(name: str, url: str) -> dict:
    """GET /health; ours names the target (the model id the Responses and Messages APIs want)."""
    try:
        r = httpx.get(f"{url}/health", timeout=10)
        health = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as e:
        return {"name": name, "url": url, "health_error": f"{type(e).__name__}: {e}",
                "target": None}
    return {"name": name, "url": url, "health": health, "target": (health or {}).get("target")}


# Transport failures before any response (a refused or reset connection: a server whose
# listen backlog overflows under a burst of connections) are retried as the OpenAI SDK
# retries them: twice, after 0.5 s then 1 s, less up to a quarter at random. The wait counts
# in the stream's TTFT, as a client would see it. HTTP errors are answers and are not retried.
RETRIES = 2
RETRY_DELAY_S = 0.5


def retry_delay(attempt: int, *, rand=random.random) -> float:
    """Seconds before retry `attempt` (0-based), the OpenAI SDK's: 0.5 x 2^n, 0-25% jitter."""
    return RETRY_DELAY_S * 2 ** attempt * (1 - 0.25 * rand())


async def stream_async(client: httpx.AsyncClient, url: str, api: str, body: dict, *,
                       clock=time.perf_counter, retries: int = RETRIES,
                       sleep=asyncio.sleep) -> Stream:
    """One streamed request; whatever goes wrong becomes the stream's `error`."""
    stream = Stream(start=clock())
    try:
        while True:
            responded = False
            try:
                async with client.stream("POST", url + API_PATHS[api], json=body) as r:
                    responded = True
                    await _read(stream, r, clock)
                break
            except httpx.TransportError:
                if responded or stream.retries >= retries:
                    raise
                await sleep(retry_delay(stream.retries))
                stream.retries += 1
    except (httpx.HTTPError, StreamFailed, ValueError, KeyError, TypeError) as e:
        stream.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        stream.end = clock()
    return stream


async def _read(stream: Stream, r: httpx.Response, clock) -> None:
    if r.status_code != 200:
        stream.error = f"HTTP {r.status_code}: {(await r.aread()).decode()}"[:300]
        return
    async for line in r.aiter_lines():
        if line.startswith("data:") and not stream.feed(line, clock()):
            break
    if not stream.done:
        stream.error = "stream ended before its end event"


class EngineRunner:
    """The server's engine in this process: `ModelKit` + `generate_events`, no HTTP."""

    def __init__(self, target: str, draft: str | None, *, speculation: SpeculationParams,
                 temperature: float):
        self.kit = ModelKit(load_model(target))
        if draft is not None and speculation.source != "prompt_lookup":
            self.kit.load_draft(draft)
        self.speculation, self.temperature, self.label = speculation, temperature, "local"

    def describe(self) -> dict:
        models = {"target": self.kit.target, "draft": self.kit.draft}
        return {"label": self.label, "kind": "engine", "models": {
            role: {"path": m.path, "parameters": m.parameter_count()}
            for role, m in models.items() if m is not None}}

    def run(self, cell, *, max_tokens: int, seed: int) -> dict:
        params = GenerationParams(
            prompt_tokens=tuple(encode_prompt(self.kit.target.tokenizer, cell.prompt, chat=True)),
            max_tokens=max_tokens, sampling=SamplingParams(temperature=self.temperature, seed=seed),
            speculation=replace(self.speculation, num_draft_tokens=cell.k))
        done = [e for e in generate_events(self.kit, params) if isinstance(e, Finished)][-1]
        return run_result(done.stats.to_dict(), finish_reason=done.finish_reason)

    def cost_ratio(self) -> float | None:
        """c: a draft forward's time over the target's (one token, the fastest of 32)."""
        if self.kit.draft is None:
            return None
        target, draft = (time_forwards(m.model, rows=(1,), tokens=(1,), reps=32)
                         for m in (self.kit.target, self.kit.draft))
        return draft.seconds[0][0] / target.seconds[0][0]

    def close(self) -> None:
        self.kit.unload_draft()


def engine_stats(engine, params):
    """One request through a started `InferenceEngine`, to its end: its `GenerationStats`."""
    async def run():
        async for event in engine.submit(params):  # raises what the request raised
            if isinstance(event, Finished):
                return event.stats

    return asyncio.run(run())


class HttpRunner:
    """Runs through an OpenAI-compatible server (ours or `mlx_lm.server`), one API of three."""

    def __init__(self, url: str, *, speculation: SpeculationParams, temperature: float,
                 api: str = "chat", api_key: str | None = None, timeout: float = TIMEOUT_S,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.url = self.label = url.rstrip("/").removesuffix("/v1")
        self.speculation, self.temperature, self.api = speculation, temperature, api
        self.loop = asyncio.new_event_loop()  # one client, its connection kept alive
        self.client = httpx.AsyncClient(timeout=timeout, transport=transport, headers=auth(api_key))
        try:  # a server that does not answer is an error, not an mlx_lm.server
            r = self.loop.run_until_complete(self.client.get(self.url + "/health"))
            self.health = r.json() if r.status_code == 200 else {}
        except httpx.HTTPError as e:
            raise StreamFailed(f"{self.url} does not answer GET /health: {e!r}") from e
        except ValueError:
            self.health = {}
        self.flavor = "ours" if "target" in self.health else "mlx_lm"  # its /health: status only

    def describe(self) -> dict:  # our /health names the target and the draft
        return {"label": self.label, "kind": f"http ({self.flavor})", "api": self.api,
                "health": self.health, "acceptance_reported": self.flavor == "ours"}

    def request_body(self, cell, *, max_tokens: int, seed: int) -> dict:
        extra: dict = {"seed": seed} if self.temperature > 0 else {}
        spec = self.speculation
        if self.flavor == "ours" and cell.k:
            extra.update(draft=spec.source, acceptance=spec.acceptance, adaptive=spec.adaptive,
                         draft_p_min=spec.draft_p_min, hybrid_min_match=spec.hybrid_min_match)
        elif self.flavor != "ours" and cell.k == 0:
            extra["draft_model"] = None  # mlx_lm.server: its baseline unloads the draft
        elif self.flavor != "ours" and spec.source != "model":
            raise StreamFailed(f"draft={spec.source} is an extension of our server only")
        if self.flavor == "ours" or cell.k:
            extra["num_draft_tokens"] = cell.k
        model = self.health.get("target") if self.api != "chat" else None
        return request_body(self.api, [{"role": "user", "content": cell.prompt}], model=model,
                            max_tokens=max_tokens, temperature=self.temperature, **extra)

    def run(self, cell, *, max_tokens: int, seed: int) -> dict:
        body = self.request_body(cell, max_tokens=max_tokens, seed=seed)
        stream = self.loop.run_until_complete(stream_async(self.client, self.url, self.api, body))
        if stream.error:
            raise StreamFailed(stream.error)
        return stream.result()

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()
