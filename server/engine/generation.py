"""Generation without a server: the scheduler driven on the caller's thread.

`generate_events` runs one request through exactly the path the server uses (scheduler,
prefill, batched decoder) and yields its `TokenEvent`s and one `Finished`. The demo CLI, the
benchmark's in-process runner and the tests use it; the caller's thread must be the only one
touching MLX meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from server.engine.events import Finished, TokenEvent
from server.engine.models.model_kit import ModelKit
from server.engine.params import GenerationParams
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from server.engine.scheduling.sequence import Phase
from server.engine.speculation.policy import SpeculationPolicy
from server.engine.speculation.suffix import SuffixIndex


def generate_events(
    kit: ModelKit,
    params: GenerationParams,
    *,
    cancelled: Callable[[], bool] = lambda: False,
    prompt_progress: Callable[[int, int], None] | None = None,
    config: SchedulerConfig | None = None,
    suffix: SuffixIndex | None = None,
) -> Iterator[TokenEvent | Finished]:
    """One TokenEvent per generated token (EOS included, with no text), then Finished.
    `suffix`: the served texts suffix drafting continues (kept by the caller across calls);
    None: no suffix drafting."""
    scheduler = Scheduler(kit, config or SchedulerConfig(max_queue_size=1),
                          SpeculationPolicy(max(params.speculation.num_draft_tokens, 1)))
    scheduler.suffix_index = suffix
    events: list = []
    seq = scheduler.submit(params, events.append)
    total = len(params.prompt_tokens)
    if prompt_progress is not None:
        prompt_progress(0, total)
    while seq.phase is not Phase.DONE:
        scheduler.step()
        if prompt_progress is not None and seq.phase is Phase.PREFILL:
            prompt_progress(seq.prefilled, total)
        if prompt_progress is not None and seq.phase in (Phase.DECODE, Phase.DONE):
            prompt_progress(total, total)
            prompt_progress = None
        for event in events:
            if isinstance(event, BaseException):
                raise event
            yield event
        events.clear()
        if seq.phase is not Phase.DONE and cancelled():
            # The caller stopped listening: end here, with the stats of what was generated.
            yield Finished("cancelled", seq.stats())
            scheduler.cancel(seq)
            scheduler.step()
            return
