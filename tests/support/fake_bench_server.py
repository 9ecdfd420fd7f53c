"""A fake of our server for the benchmark's tests: the three streaming APIs (chat completions,
Responses, Anthropic Messages) with `from_draft` and `stats` where our contract puts them, and
non-streamed completions. Its answers are computed from the request, so tests can check exact
values: a request for n tokens with k > 0 draft tokens (2 when it names none, as a server with
a draft drafts by default) gets n tokens of which the odd-numbered ones are flagged
`from_draft` (accepted = n // 2, proposed = 2 * accepted); `cached_tokens` is 5 unless the
request says `cache_prompt: false`."""

from __future__ import annotations

import json
import random

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

PROMPT_TOKENS = 10
PEAK_GB = 0.5


def plan(body: dict, n: int) -> tuple[list[tuple[str, bool]], dict]:
    """The tokens (text, from_draft) and the `stats` of a request for n tokens."""
    k = body.get("num_draft_tokens", 2)
    tokens = [(f"t{i} ", bool(k) and i % 2 == 1) for i in range(n)]
    accepted = sum(flag for _, flag in tokens)
    cached = 0 if body.get("cache_prompt") is False else 5
    stats = {"prompt_tokens": PROMPT_TOKENS, "generation_tokens": n, "ttft_s": 0.01,
             "prompt_tps": 1000.0, "generation_tps": 100.0, "total_s": 0.1,
             "peak_memory_gb": PEAK_GB, "draft_model": "d" if k else None,
             "num_draft_tokens": k, "draft_tokens_proposed": 2 * accepted,
             "draft_tokens_accepted": accepted,
             "acceptance_rate": 0.5 if k else None, "from_draft_fraction": accepted / n,
             "mean_accepted_length": 1.0, "k_histogram": {str(k): n - accepted} if k else {},
             "cached_tokens": cached}
    return tokens, stats


def sse(events: list[dict], *, named: bool) -> str:
    """`data:` lines (with `event:` lines when `named`, as Responses and Messages send)."""
    return "".join((f"event: {e['type']}\n" if named else "") + f"data: {json.dumps(e)}\n\n"
                   for e in events)


def chat_stream(body: dict) -> str:
    tokens, stats = plan(body, body["max_tokens"])
    chunks = [{"choices": [{"index": 0, "delta": {"content": t}, "from_draft": f,
                            "finish_reason": None}]} for t, f in tokens]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                   "stats": stats})
    chunks.append({"choices": [], "usage": {"prompt_tokens": PROMPT_TOKENS,
                                            "completion_tokens": len(tokens)}})
    return sse(chunks, named=False) + "data: [DONE]\n\n"


def responses_stream(body: dict) -> str:
    tokens, stats = plan(body, body["max_output_tokens"])
    events = [{"type": "response.created", "response": {"status": "in_progress"}}]
    events += [{"type": "response.output_text.delta", "delta": t, "from_draft": f}
               for t, f in tokens]
    events.append({"type": "response.completed", "response": {
        "status": "completed", "stats": stats,
        "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": len(tokens),
                  "input_tokens_details": {"cached_tokens": stats["cached_tokens"]}}}})
    return sse(events, named=True)


def messages_stream(body: dict) -> str:
    tokens, stats = plan(body, body["max_tokens"])
    events = [{"type": "message_start", "message": {"usage": {"input_tokens": PROMPT_TOKENS}}},
              {"type": "content_block_start", "index": 0,
               "content_block": {"type": "text", "text": ""}}]
    events += [{"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": t}, "from_draft": f} for t, f in tokens]
    events += [{"type": "content_block_stop", "index": 0},
               {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                "usage": {"output_tokens": len(tokens)}, "stats": stats},
               {"type": "message_stop"}]
    return sse(events, named=True)


def fake_app() -> FastAPI:
    app = FastAPI()
    app.state.bodies = []  # (path, body) of every POST

    @app.get("/health")
    async def health():
        return {"status": "ok", "target": "fake-target", "draft": "d"}

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "fake-target", "role": "target", "path": "/fake"}]}

    @app.delete("/v1/cache")
    async def clear_cache():
        return {"cleared": True}

    for path, stream in (("/v1/chat/completions", chat_stream),
                         ("/v1/responses", responses_stream),
                         ("/v1/messages", messages_stream)):
        async def streamed(request: Request, stream=stream):
            body = await request.json()
            app.state.bodies.append((request.url.path, body))
            return StreamingResponse(iter([stream(body)]), media_type="text/event-stream")

        app.post(path)(streamed)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append((request.url.path, body))
        _, stats = plan(body, body["max_tokens"])
        text = f"answer to {body['prompt']}" + ("!" if body.get("differ") else "")
        return {"choices": [{"text": text, "finish_reason": "length"}], "stats": stats}

    return app


# A runner for `sweep` without models: plausible numbers from the speedup model itself, so the
# files look like a real run (`synthetic_sweep` puts it in place of the real runners).
SYNTHETIC_COST_RATIO = 0.1
SYNTHETIC_BASE_TPS = 50.0
SYNTHETIC_ACCEPTANCE = {"structured": 0.8, "open_ended": 0.55, "repeat_edit": 0.9}


class SyntheticRunner:
    """No models; numbers from the speedup model with 2% noise, seeded."""

    label = "synthetic"

    def describe(self) -> dict:
        return {"label": self.label, "kind": "synthetic",
                "acceptance": SYNTHETIC_ACCEPTANCE, "cost_ratio": SYNTHETIC_COST_RATIO}

    def cost_ratio(self) -> float:
        return SYNTHETIC_COST_RATIO

    def run(self, cell, *, max_tokens: int, seed: int) -> dict:
        from server.bench.runners import run_result
        from server.bench.sweep import theoretical_speedup

        k = cell.k
        rng = random.Random(f"{self.label}/{cell.kind}/{k}/{seed}")
        a = SYNTHETIC_ACCEPTANCE.get(cell.kind, 0.6)
        tps = SYNTHETIC_BASE_TPS * theoretical_speedup(a, k, SYNTHETIC_COST_RATIO)
        rounds = round(max_tokens / theoretical_speedup(a, k, 0.0)) if k else 0
        accepted = max_tokens - rounds if k else 0
        return run_result(
            tokens=max_tokens, tps=tps * (1 + rng.gauss(0, 0.02)),
            ttft_s=0.05 + rng.random() * 0.01, peak_gb=0.40 + 0.002 * k, prompt_tokens=64,
            from_draft=accepted, proposed=rounds * k, accepted=accepted, rounds=rounds or None,
            finish_reason="length")

    def close(self) -> None:
        pass


def synthetic_sweep(monkeypatch) -> None:
    """`mlx-spec-bench sweep` runs on a `SyntheticRunner` instead of loading models."""
    from server.bench import sweep

    monkeypatch.setattr(sweep, "make_runners", lambda args, log: ([SyntheticRunner()], {}))
