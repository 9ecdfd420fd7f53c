"""A dead MLX worker (fault injection: its decoding round raises what Metal raises when memory
runs out): every request waiting or running ends with an error in its API's shape, /health
answers 503, and whatever comes next is refused, in process (the process exit is
tests/server/test_engine_failure.py's)."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from support.servers import served_url, started_engine

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

INJECTED = "[metal::malloc] Attempting to allocate 40000000000 bytes (injected fault)"


def inject_fault(engine) -> threading.Event:
    """The scheduler's next decoding round raises once the returned event is set."""
    scheduler = engine.scheduler
    original = scheduler._decode_step
    armed = threading.Event()

    def faulty():
        if armed.is_set():
            raise RuntimeError(INJECTED)
        return original()

    scheduler._decode_step = faulty
    return armed


async def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


async def test_a_dead_worker_fails_every_request_in_its_apis_shape(tiny_pair):
    long = {"max_tokens": 4000, "ignore_eos": True}
    with started_engine(*tiny_pair, engine={"max_batch_size": 1}) as engine, \
            served_url(*tiny_pair, engine=engine) as url:
        armed = inject_fault(engine)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            lines: list[str] = []

            async def stream():  # running when the worker dies: an in-band error
                body = {"messages": [{"role": "user", "content": "go"}], "stream": True, **long}
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])

            running = asyncio.create_task(stream())
            await wait_for(lambda: len(lines) >= 2, "the stream's first tokens")
            model = engine.model_name
            waiting = [asyncio.create_task(client.post(path, json=body)) for path, body in (
                ("/v1/messages", {"model": model, "max_tokens": 5,
                                  "messages": [{"role": "user", "content": "a"}]}),
                ("/api/chat", {"model": model, "options": {"num_predict": 5},
                               "messages": [{"role": "user", "content": "b"}]}),
                ("/v1/completions", {"prompt": "c", "max_tokens": 5}))]
            await wait_for(lambda: engine.queue_depth == 3, "three requests waiting")
            armed.set()
            await asyncio.wait_for(running, 30)
            anthropic, ollama, openai = await asyncio.gather(*waiting)

            assert lines[-1] == "[DONE]"
            error = json.loads(lines[-2])["error"]
            assert error["code"] == "engine_failed" and INJECTED in error["message"]
            assert anthropic.status_code == 529, anthropic.text  # Anthropic's "overloaded"
            assert anthropic.json()["type"] == "error"
            assert anthropic.json()["error"]["type"] == "overloaded_error"
            assert ollama.status_code == 503 and INJECTED in ollama.json()["error"]
            assert openai.status_code == 503 and openai.json()["error"]["code"] == "engine_failed"
            assert openai.headers["retry-after"].isdigit()

            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            after = await client.post("/v1/completions", json={"prompt": "d", "max_tokens": 2})
            assert after.status_code == 503 and after.json()["error"]["code"] == "engine_failed"
            admin = await client.delete("/v1/cache")  # a call to the MLX thread
            assert admin.status_code == 503, admin.text
            assert engine.queue_depth == 0 and engine.batch_size in (0, 1)
