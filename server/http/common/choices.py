"""The engine jobs of one request's choices: `n` per prompt, prompt i's j-th at index i * n + j.

Siblings (the `n` choices of one prompt) share its prefill: the first of each prompt is
submitted alone, and once its first token came (its prompt is then in the prefix cache) the
others follow and prefill one token each. Each job's events come out tagged with its index,
merged in the order they arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from server.engine import GenerationParams, InferenceEngine, RequestHandle
from server.http.common.errors import APIError


def sibling_params(params: GenerationParams, j: int) -> GenerationParams:
    """Choice j of a prompt: with a seed, seed + j (so choice j equals a request of n = 1 with
    that seed); without one, each choice draws its own randomness anyway."""
    seed = params.sampling.seed
    if j == 0 or seed is None:
        return params
    return replace(params, sampling=replace(params.sampling, seed=(seed + j) % 2**64))


class Choices:
    def __init__(self, engine: InferenceEngine, prompts: list[GenerationParams], n: int):
        count, limit = len(prompts) * n, engine.scheduler_config.max_queue_size
        if count > limit:
            raise APIError(400, f"{count} choices (n times the prompts) exceed this server's "
                           f"queue of {limit}", param="n", code="invalid_value")
        self.engine, self.n = engine, n
        self.params = [sibling_params(p, j) for p in prompts for j in range(n)]
        self.jobs: list[RequestHandle | None] = [None] * count
        self._iterators: list[AsyncIterator | None] = [None] * count
        self._firsts: list = [None] * count

    def __len__(self) -> int:
        return len(self.params)

    async def start(self) -> None:
        """Submit every choice and fetch each one's first event, so that an early failure
        (queue full, a bad request the engine found) is still an HTTP error."""
        try:
            if self.n > 1 and self.engine.caches_prompts and self.params[0].cache_prompt:
                await self._start(range(0, len(self), self.n))
                await self._start([i for i in range(len(self)) if i % self.n])
            else:
                await self._start(range(len(self)))
        except BaseException:
            self.cancel()
            raise

    async def _start(self, indices) -> None:
        for i in indices:
            self.jobs[i] = self.engine.submit(self.params[i])
            self._iterators[i] = self.jobs[i].__aiter__()
        for i in indices:
            self._firsts[i] = await self._iterators[i].__anext__()

    def cancel(self) -> None:
        for job in self.jobs:
            if job is not None:
                job.cancel()

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        """(index, event) until every choice finished; a job's error is raised here."""
        for i, first in enumerate(self._firsts):
            yield i, first
        if len(self) == 1:
            async for event in self._iterators[0]:
                yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for event in self._iterators[i]:
                    queue.put_nowait((i, event))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self))]
        try:
            running = len(tasks)
            while running:
                i, event = await queue.get()
                if event is None:
                    running -= 1
                elif isinstance(event, BaseException):
                    raise event
                else:
                    yield i, event
        finally:
            for task in tasks:
                task.cancel()
