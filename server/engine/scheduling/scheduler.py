"""The scheduler: one loop on the MLX thread that decides what runs at each step.

A step is: take new requests and control calls, admit waiting requests into free batch slots,
prefill one group of prompts (or one chunk of a long one), run one decoding round for every
decoding request, and retire the ones that finished, were cancelled or whose client went away.
Prefill is chunked (`prefill_chunk` tokens) and interleaved with decoding rounds, so a long new
prompt stalls the running streams by at most one chunk per round; a wave of short prompts is
prefilled back to back instead, the running streams waiting for it once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import trim_prompt_cache

from server.engine.errors import (
    EngineFailed,
    InvalidRequest,
    ModelReplaced,
    QueueFull,
    ShuttingDown,
)
from server.engine.kv.batch import ModelBatch, new_cache, prefill, prefill_rows
from server.engine.kv.layers import arrays_of, covered
from server.engine.memory import step_transient
from server.engine.models.model_kit import ModelKit
from server.engine.params import GenerationParams
from server.engine.scheduling.decoder import CATCH_UP_WIDTH, RoundResult, decode_round, first_token
from server.engine.scheduling.memory_gate import ADMISSION_GROWTH_TOKENS, MemoryGate
from server.engine.scheduling.sequence import Phase, Sequence, Sink, drafter_name
from server.engine.speculation.cost_model import (
    DrafterRates,
    DraftingShare,
    RowOption,
    StepCosts,
    decision_rate,
    drafting_saving,
    prefill_repaid,
)
from server.engine.speculation.forward_source import DEFAULT_BUDGET_S, CostSource
from server.engine.speculation.forward_store import DEFAULT_CACHE_DIR
from server.engine.speculation.policy import SpeculationPolicy, speculates_at_own_k
from server.engine.speculation.suffix import PROMPT_TAIL, SuffixIndex
from server.engine.speculation.yield_learner import YieldLearner, learned_path

log = logging.getLogger(__name__)

# A 2048-token prompt arriving while a stream decodes (generated pair, 2-core CPU): 128 tokens
# per step stalled the stream ~1 s at most and prefilled as fast as 256 or 1024 (which stalled
# it 1.9 s and 7.7 s); the whole prompt at once stalled it 15 s.
DEFAULT_PREFILL_CHUNK = 128
# Requests prefilling or decoding at once: as many as mlx_lm.server's BatchGenerator decodes.
DEFAULT_MAX_BATCH_SIZE = 32
# `mlx-spec-bench load --in-process` (N requests at once, generated pair, two runs): 1024 while
# nothing decodes took ours from 0.90x to 0.97-1.00x of mlx_lm's BatchGenerator at 16 requests
# and from 1.00x to 1.03-1.05x at 8.
DEFAULT_IDLE_PREFILL_CHUNK = 1024
# A row that joins the draft late (`_catch_up_drafts`) prefills its whole context into the draft
# first: not worth it for its last few tokens.
CATCH_UP_MIN_REMAINING = 8
# Prefill groups that may go before the oldest waiting prompt (shorter ones go first).
MAX_PASSED_OVER = 4
# What one more prefill forward costs, in prompt tokens, until forward times are measured
# (`Scheduler._group_overhead`; both pairs' measured tables: 25 tokens).
DEFAULT_GROUP_OVERHEAD = 32
# A wave of prompts (clients that finished together send their next requests) is prefilled
# back to back, the decoding rows waiting once for all of it, as mlx_lm's BatchGenerator does:
# at least WAVE_MIN_PROMPTS prompts, one per WAVE_ROWS_PER_PROMPT decoding rows, with at most
# WAVE_MAX_TOKENS prompt tokens left. In process (generated pair, 16 / 32 requests at once,
# against BatchGenerator): aggregate 0.97x -> 1.09x / 1.10x, ITL p99 3.8x -> 1.02x at 16 (the
# streams were stalled once per group, then by every 128-token chunk of the wave's rest).
WAVE_MIN_PROMPTS = 2
WAVE_ROWS_PER_PROMPT = 4
WAVE_MAX_TOKENS = 2048


def _growth(seq: Sequence, tokens: int) -> int:
    """What a row may add to its cache: `tokens` more (at most what it has left to generate)
    and one decoding round (its last token and a draft)."""
    return min(seq.remaining, tokens) + seq.round_tokens


def _keep_rows(cache: list, rows: list[int], count: int) -> None:
    """Keep only `rows` of a batch cache of `count` rows."""
    if len(rows) < count:
        for c in cache:
            c.filter(mx.array(rows))


def _fits(group: list[int], width: int, rest: int, budget: int, overhead: int) -> bool:
    """Whether a prompt whose rest is `rest` tokens joins a prefill group of rests `group`
    padded to `width`: the group, padded to the longer, still fits `budget`, and the padding
    it adds (to the others if it is longer, to itself if shorter) costs no more than a forward
    of its own (`overhead` tokens)."""
    if not group:
        return rest <= budget  # else the prompt is prefilled in chunks
    padding = len(group) * max(rest - width, 0) + max(width - rest, 0)
    return (len(group) + 1) * max(width, rest) <= budget and padding <= overhead


def _last_group(order: list[Sequence], budget: int, overhead: int) -> list[Sequence]:
    """The last group when `order` (shortest first) is cut into groups by `_fits` (before the
    prefix cache shortens any)."""
    start, group, width = 0, [], 0
    for i, seq in enumerate(order):
        if not _fits(group, width, seq.unprefilled, budget, overhead):
            start, group, width = i, [], 0
        group.append(seq.unprefilled)
        width = max(width, seq.unprefilled)
    return order[start:]


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # requests prefilling or decoding at once
    max_queue_size: int = 64  # requests waiting for a slot; beyond it: QueueFull (503)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    # the same while no request decodes, more prompts wait than rows decode, or for a wave
    idle_prefill_chunk: int = DEFAULT_IDLE_PREFILL_CHUNK


class SchedulerObserver:
    """Hooks for metrics (called on the MLX thread; keep them cheap)."""

    def on_admitted(self, queue_wait_s: float) -> None: ...

    def on_round(self, batch_size: int, results: dict[int, RoundResult]) -> None: ...

    def on_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None: ...

    def on_preempted(self) -> None: ...


class ObserverList(SchedulerObserver):
    """Forwards to every registered observer (one per app serving this engine)."""

    def __init__(self):
        self.observers: list[SchedulerObserver] = []

    def on_admitted(self, queue_wait_s: float) -> None:
        for o in self.observers:
            o.on_admitted(queue_wait_s)

    def on_round(self, batch_size: int, results: dict[int, RoundResult]) -> None:
        for o in self.observers:
            o.on_round(batch_size, results)

    def on_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        for o in self.observers:
            o.on_prefix_lookup(queried_tokens, hit_tokens)

    def on_preempted(self) -> None:
        for o in self.observers:
            o.on_preempted()


class Scheduler:
    def __init__(self, kit: ModelKit, config: SchedulerConfig | None = None,
                 policy: SpeculationPolicy | None = None,
                 observer: SchedulerObserver | None = None):
        self.kit = kit
        self.config = config or SchedulerConfig()
        self.policy = policy or SpeculationPolicy()
        self.observer = observer or SchedulerObserver()
        self.prefix_cache = None  # a PrefixCache, when one is configured
        self.memory: MemoryGate | None = None  # admission and preemption by memory
        self.suffix_index: SuffixIndex | None = None  # served texts, for suffix drafting
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._idle_calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._waiting_count = 0  # submitted, not yet admitted (any thread reads it)
        self._draining = False
        self.failure: EngineFailed | None = None  # the worker died: every request gets it
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.paused: deque[Sequence] = deque()  # preempted, oldest admitted first
        self.preemptions = 0
        self.kv_in_use = 0  # bytes of the running requests' KV caches after the last step
        self._admissions = 0
        self.target = ModelBatch(kit.target.model)
        self.draft = ModelBatch(kit.draft.model) if kit.draft is not None else None
        self.costs: StepCosts | None = None  # forward times: the k per row and round
        # what each round shape measurably yields; the tables are its prior (`use_cost_model`)
        self.learner: YieldLearner | None = None
        self.cost_source: CostSource | None = None  # where they come from (`use_cost_model`)
        self.rates = DrafterRates()
        self.drafting_share = DraftingShare()

    # -- any thread ---------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        return self._waiting_count

    @property
    def batch_size(self) -> int:
        """Requests prefilling or decoding."""
        return len(self.target) + len(self.prefilling)

    @property
    def draining(self) -> bool:
        """Shutdown began: no new requests are admitted."""
        return self._draining

    @property
    def paused_count(self) -> int:
        """Requests preempted for memory, waiting to resume."""
        return len(self.paused)

    @property
    def idle(self) -> bool:
        """No request waits, prefills, decodes or is paused."""
        return self._waiting_count == 0 and self.batch_size == 0 and not self.paused

    def submit(self, params: GenerationParams, sink: Sink) -> Sequence:
        if not params.prompt_tokens:  # every route refuses one; a prefill of none would fail
            raise InvalidRequest("the prompt has no tokens", "prompt")  # its whole group
        kit = self.kit
        suffix = self.suffix_index
        draft_name = drafter_name(params.speculation.source,
                                  kit.draft.name if kit.draft is not None else None,
                                  suffix is not None)
        if params.target and params.target != kit.target.fingerprint:
            raise ModelReplaced("the target model was replaced; send the request again")
        if self.memory is not None:
            self.memory.check(len(params.prompt_tokens), params.max_tokens)
        seq = Sequence(params, tokenizer=kit.target.tokenizer, vocab_size=kit.target.vocab_size,
                       sink=sink, draft_name=draft_name, suffix=suffix)
        with self._lock:
            if self.failure is not None:
                raise self.failure
            if self._draining:
                raise ShuttingDown("the server is shutting down")
            if self._waiting_count >= self.config.max_queue_size:
                raise QueueFull(f"{self._waiting_count} requests are already waiting")
            self._waiting_count += 1
        self._incoming.put(seq)
        self._wake.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        seq.cancelled = True
        self._wake.set()

    def call(self, fn: Callable[[], object], done: Callable[[object, BaseException | None], None]):
        """Run `fn` between two steps on the MLX thread; `done(result, error)` gets the outcome
        (EngineFailed once the worker died)."""
        with self._lock:
            if self.failure is None:
                self._calls.put((fn, done))
                self._wake.set()
                return
        done(None, self.failure)

    def call_when_idle(self, fn: Callable[[], object],
                       done: Callable[[object, BaseException | None], None]):
        """As `call`, at the first step when no request waits or runs (the caller stops new
        submissions first); ShuttingDown once a drain began."""
        with self._lock:
            if not self._draining and self.failure is None:
                self._idle_calls.put((fn, done))
                self._wake.set()
                return
        done(None, self.failure or ShuttingDown("the server is shutting down"))

    def wake(self) -> None:
        self._wake.set()

    def begin_drain(self) -> None:
        """Stop admitting: new submits raise ShuttingDown, waiting requests are answered, and
        so are calls waiting for an idle moment."""
        with self._lock:
            self._draining = True
        self._fail_calls(self._idle_calls, ShuttingDown("the server is shutting down"))
        self._wake.set()

    # -- the MLX thread -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.paused or self.prefilling or len(self.target))

    def step(self) -> bool:
        """One scheduler step; False when there was nothing to do. Decoding rows wait while a
        wave of prompts is prefilled (`_in_wave`). Rows that would outgrow the memory budget
        are paused first (`_preempt_over_budget`)."""
        self._take_incoming()
        self._run_calls(self._calls)
        if not self.has_work() and self._waiting_count == 0:
            self._run_calls(self._idle_calls)
        self._retire_cancelled()
        self._preempt_over_budget()
        self._admit()
        if self.memory is not None:  # the prefix cache makes room for this step's growth
            self._give_way(self.memory.need(*self._widths(0)))
        wave = self._in_wave()
        did = self._prefill_step(wave)
        if not (wave and self.prefilling):
            did = self._decode_step() or did
        if did:
            self.kv_in_use = self.kv_bytes()
            self._give_way(self.kv_in_use)
            if self.memory is not None:
                self.memory.observe(step_transient())
        return did or self._measure_when_idle()

    def _give_way(self, running_bytes: int) -> None:
        """The prefix cache keeps what the running requests leave of its budget (and of the
        memory budget): it gives way before any request is paused."""
        if self.prefix_cache is not None:
            budget = self.memory.budget_bytes if self.memory is not None else None
            self.prefix_cache.give_way(running_bytes, budget)

    def kv_bytes(self) -> int:
        """The bytes the running requests' KV caches hold: the batches' buffers (both models),
        and those of prompts still being prefilled."""
        batches = [c for b in (self.target, self.draft) if b is not None and b.cache
                   for c in b.cache]
        prompts = [c for seq in self.prefilling
                   for c in (seq.target_cache or []) + (seq.draft_cache or [])]
        return sum(c.nbytes for c in batches + prompts)

    def run_forever(self, stop: threading.Event) -> None:
        """Step until `stop` is set; then end whatever still runs with ShuttingDown. A step
        that raises (an MLX error, a bug) leaves the batch in no state to go on from: every
        request and call ends with EngineFailed, and the error propagates (`fail`)."""
        try:
            self._loop(stop)
        except BaseException as e:
            self.fail(e)
            raise
        if self.learner is not None:
            self.learner.save()
        self.begin_drain()
        self._take_incoming()
        self._fail_all(ShuttingDown("the server stopped"))

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.step():
                self._wake.wait(0.05)
                self._wake.clear()

    def fail(self, cause: BaseException) -> EngineFailed:
        """The worker died of `cause`: refuse what comes (EngineFailed), and end every request
        (waiting, paused, prefilling, decoding) and every call with it. Touches no MLX array:
        MLX itself may be what failed."""
        error = EngineFailed(f"the inference engine failed ({type(cause).__name__}: {cause});"
                             " the server is restarting")
        with self._lock:
            self.failure = error
            self._draining = True
        log.critical("the MLX worker died: ending every request", exc_info=cause)
        self._take_incoming()
        rows = [*self.waiting, *self.paused, *self.prefilling, *self.target.rows]
        self.waiting.clear()
        self.paused.clear()
        self.prefilling.clear()
        for seq in rows:
            seq.error = error
            try:
                seq.finish()
            except Exception:  # noqa: BLE001 - the others must still hear of it
                log.exception("could not end a request")
        with self._lock:
            self._waiting_count = 0
        self._fail_calls(self._calls, error)
        self._fail_calls(self._idle_calls, error)
        return error

    def fail_running(self, error: BaseException) -> None:
        """End every running request with `error` (used at the end of a drain)."""
        self._fail_all(error)

    def _take_incoming(self) -> None:
        while True:
            try:
                seq = self._incoming.get_nowait()
            except queue.Empty:
                break
            self.waiting.append(seq)
        if self._draining:
            while self.waiting:
                seq = self.waiting.popleft()
                self._left_queue()
                seq.error = self.failure or ShuttingDown("the server is shutting down")
                seq.finish()

    @staticmethod
    def _run_calls(calls: queue.SimpleQueue) -> None:
        while True:
            try:
                fn, done = calls.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                done(None, e)
            else:
                done(result, None)

    @staticmethod
    def _fail_calls(calls: queue.SimpleQueue, error: BaseException) -> None:
        while True:
            try:
                _, done = calls.get_nowait()
            except queue.Empty:
                return
            done(None, error)

    def _left_queue(self) -> None:
        with self._lock:
            self._waiting_count -= 1

    def _retire_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            self._left_queue()
            seq.finish()
        for seq in [s for s in self.paused if s.cancelled]:
            self.paused.remove(seq)
            seq.finish()
        for seq in [s for s in self.prefilling if s.cancelled]:
            self.prefilling.remove(seq)
            self._keep_partial_prefill(seq)
            seq.finish()
        self._retire([s for s in self.target.rows if s.cancelled])

    def _admit(self) -> None:
        """Fill free slots: requests paused for memory first (the oldest admitted first), then
        waiting ones, the lowest `priority` first, the oldest among equals; each only when it
        fits the memory budget beside the running rows (`_fits_beside`), else it and those
        behind it wait."""
        while (self.paused or self.waiting) and self.batch_size < self.config.max_batch_size:
            resuming = bool(self.paused)
            seq = self.paused[0] if resuming else \
                min(self.waiting, key=lambda s: s.params.priority)  # the first of the lowest
            if not self._fits_beside(seq):
                return
            if resuming:
                self.paused.popleft()
            else:
                self.waiting.remove(seq)
                self._left_queue()
            if seq.params.max_tokens <= 0:
                seq.finish("length")
                continue
            try:
                self._start(seq)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                seq.error = e
                seq.finish()
                continue
            if not resuming:
                self.observer.on_admitted(time.perf_counter() - seq.submitted_at)

    def _start(self, seq: Sequence) -> None:
        spec = seq.params.speculation
        if seq.uses_draft_model and self.kit.draft is None:
            if seq.drafter == "model" and spec.required:
                raise InvalidRequest("the draft model was unloaded before this request ran",
                                     "num_draft_tokens")
            seq.lose_draft_model()
        if not seq.resumed:  # a resumed request keeps its times (its TTFT, its prefill rate)
            seq.started_at = time.perf_counter()
        if not seq.admitted:  # a resumed request keeps its place: the newest goes first
            self._admissions += 1
            seq.admitted = self._admissions
        seq.target_cache = new_cache(self.kit.target.model)
        seq.phase = Phase.PREFILL
        self.prefilling.append(seq)

    # -- memory ---------------------------------------------------------------------------------
    def _fits_beside(self, seq: Sequence) -> bool:
        """Whether `seq` may join: alone it always may (`submit` refused what never fits);
        else every row, `seq` among them, must fit the budget once each grew by
        `ADMISSION_GROWTH_TOKENS` (its draft is priced when it is decided: `_draft_fits`)."""
        if self.memory is None or not (len(self.target) or self.prefilling):
            return True
        return self.memory.fits(*self._widths(ADMISSION_GROWTH_TOKENS, joining=[seq]))

    def _draft_fits(self, seq: Sequence, width: int) -> bool:
        """Whether the draft may follow `seq` too (a draft cache `width` positions wide)."""
        if self.memory is None:
            return True
        target, draft = self._widths(ADMISSION_GROWTH_TOKENS)
        draft.append(width + _growth(seq, ADMISSION_GROWTH_TOKENS))
        return self.memory.fits(target, draft)

    def _widths(self, growth: int, joining: list[Sequence] = ()
                ) -> tuple[list[int], list[int]]:
        """Each row's width in the target's and the draft's batch once it grew by `growth`
        tokens (at most what it has left) and fed its next round: the rows decoding, those
        prefilling (as wide as what they prefill) and `joining`."""
        target, draft = [], []
        width = self.target.width
        target += [width + _growth(seq, growth) for seq in self.target.rows]
        if self.draft is not None and len(self.draft):
            width = self.draft.width
            draft += [width + _growth(seq, growth) for seq in self.draft.rows]
        for seq in (*self.prefilling, *joining):
            width = len(seq.prefill_tokens) + _growth(seq, growth)
            target.append(width)
            if seq.draft_cache is not None:
                draft.append(width)
        return target, draft

    def _preempt_over_budget(self) -> None:
        """While the running rows would not fit the budget in their next round (and prompts
        being prefilled, once prefilled), pause the newest: vLLM's recompute preemption. A
        row alone goes on (it fits alone: `submit`)."""
        if self.memory is None:
            return
        while len(self.target) + len(self.prefilling) > 1 and \
                not self.memory.fits(*self._widths(0)):
            self._preempt(max([*self.target.rows, *self.prefilling], key=lambda s: s.admitted))

    def _preempt(self, seq: Sequence) -> None:
        """Pause `seq` and release its KV: what it holds goes to the prefix cache (where it
        fits), from which it resumes; else its context is prefilled again."""
        if seq in self.prefilling:
            self.prefilling.remove(seq)
            self._keep_partial_prefill(seq)
        else:
            self._keep_in_prefix_cache(seq)
            self.target.remove([seq])
            if self.draft is not None:
                self.draft.remove([seq])
        seq.pause()
        mx.clear_cache()  # Metal keeps freed buffers for reuse: give them back
        self.paused.append(seq)
        self.paused = deque(sorted(self.paused, key=lambda s: s.admitted))
        self.preemptions += 1
        self.observer.on_preempted()
        log.info("memory: paused a request after %d tokens (%d running, %d paused)",
                 len(seq.output), self.batch_size, len(self.paused))

    def _prefill_step(self, wave: bool = False) -> bool:
        """One prefill forward (per model) of at most `prefill_chunk` prompt tokens, padding
        included (`idle_prefill_chunk` in a wave or unless `_protect_decoding`): the shortest
        prompts whose rests fit together, in one group; or, when the first alone does not fit,
        the next chunk of it."""
        if not self.prefilling:
            return False
        protect = not wave and self._protect_decoding()
        budget = self.config.prefill_chunk if protect else self.config.idle_prefill_chunk
        group, first = self._whole_prompt_group(budget, wave)
        if group:
            self._prefill_group(group)
        else:
            self._prefill_chunk(first, budget)
        mx.clear_cache()
        return True

    def _in_wave(self) -> bool:
        """Whether the prompts prefilling are a wave (`WAVE_MIN_PROMPTS`...): prefilled back to
        back while the decoding rows wait, once, instead of a decoding round per chunk."""
        waiting = len(self.prefilling)
        return (waiting >= WAVE_MIN_PROMPTS and waiting * WAVE_ROWS_PER_PROMPT >= len(self.target)
                and sum(seq.unprefilled for seq in self.prefilling) <= WAVE_MAX_TOKENS)

    def _protect_decoding(self) -> bool:
        """Whether this step's prefill is held to `prefill_chunk`, to bound the stall of the
        streams decoding: unless more prompts wait than rows decode. With nothing decoding
        nothing can stall; and when a wave of prompts arrives (clients that finished together
        send their next requests), stalling the few rows already decoding once lets the whole
        wave share one large forward and join the batch together, instead of many small
        decoding rounds while the wave trickles in 128 tokens at a time."""
        return len(self.target) >= len(self.prefilling)

    def _prefill_chunk(self, seq: Sequence, budget: int) -> None:
        """Prefill the next `budget` tokens of a prompt too long to finish in this step."""
        try:
            chunk = seq.prefill_tokens[seq.prefilled: seq.prefilled + budget]
            prefill(self.kit.target.model, seq.target_cache, chunk)
            if seq.draft_cache is not None:
                prefill(self.kit.draft.model, seq.draft_cache, chunk)
            seq.prefilled += len(chunk)
        except Exception as e:  # noqa: BLE001 - this request's own failure
            log.exception("prefill failed")
            self.prefilling.remove(seq)
            seq.error = e
            seq.finish()

    def _begin(self, seq: Sequence) -> None:
        """Before a request's first prefill: does it draft (is the batch small enough), and how
        much of its prompt does the prefix cache already hold."""
        if seq.prefill_begun:
            return
        seq.prefill_begun = True
        if seq.uses_draft_model and self._draft_may_pay(seq) and \
                self._draft_fits(seq, len(seq.prefill_tokens)):
            seq.draft_cache = new_cache(self.kit.draft.model)
        if self._caching(seq):
            self._restore(seq, seq.prefill_tokens)

    def _draft_may_pay(self, seq: Sequence) -> bool:
        """Whether a new row's draft prefill is worth it: it may draft in a batch this large
        and, with measured costs, drafting with the model pays there at the drafter's rate, in
        as many rounds as batches this large recently drafted in (`DraftingShare`)."""
        share = self.drafting_share.share(self.batch_size)
        return (self.policy.drafts(seq, self.batch_size)
                and self._draft_repaid(seq, seq.unprefilled, share))

    def _draft_repaid(self, seq: Sequence, tokens: int, share: float = 1.0,
                      savings: dict[int, float | None] | None = None) -> bool:
        """Whether, with measured costs, drafting with the model pays in a batch this large at
        the drafter's rate, by enough to repay the draft's prefill of `tokens` over what the
        row may still generate, drafting in `share` of its rounds (`prefill_repaid`). A
        seeded sampled row drafts anyway. `savings` keeps what drafting saves per k for the
        calls of one step: the same for every row of a batch."""
        if self.costs is None or speculates_at_own_k(seq):
            return True
        size, k = self.batch_size, seq.params.speculation.num_draft_tokens
        savings = {} if savings is None else savings
        if k not in savings:
            rate = decision_rate(0, 0, self.rates.prior("model"), size)
            savings[k] = drafting_saving(size, k, rate, self.costs)
        return prefill_repaid(savings[k], self.costs, tokens, seq.remaining, share)

    def _whole_prompt_group(self, budget: int,
                            wave: bool = False) -> tuple[list[Sequence], Sequence]:
        """The shortest prefilling requests (drafting or not) whose prompts' rests fit in
        `budget` together once padded to the longest, and pad each other no more than a
        forward of their own would cost (`_fits`): they are prefilled in one forward, each
        from wherever it stands (nothing, a restored prefix, earlier chunks). Also the first
        candidate, which is chunked when even it does not fit alone.

        Shortest first: rows of like lengths pad little (padding is computed like any token),
        and short prompts reach their first token first. The oldest request goes first once
        `MAX_PASSED_OVER` groups have gone before it, so a long prompt is never starved. A
        request consults the prefix cache (`_begin`) only when it is about to be prefilled, so
        it finds what the groups before it stored (a system prompt shared by a burst).

        In a wave the groups go longest first (`_last_group`): the decoding rows wait for the
        whole wave anyway, and a row that got its first token waits for every group after
        its own, so the group with the most rows, the shortest prompts', goes last."""
        oldest = self.prefilling[0]
        order = list(self.prefilling)
        overhead = self._group_overhead()
        if oldest.prefill_passed_over < MAX_PASSED_OVER:
            order.sort(key=lambda s: s.unprefilled)
            if wave:
                order = _last_group(order, budget, overhead)
        group, rests, width = [], [], 0
        for seq in order:
            # the rest before `_begin` is an upper bound: a restored prefix only shortens it
            if group and (len(group) + 1) * max(width, seq.unprefilled) > budget:
                break
            self._begin(seq)
            if not _fits(rests, width, seq.unprefilled, budget, overhead):
                break
            group.append(seq)
            rests.append(seq.unprefilled)
            width = max(width, seq.unprefilled)
        if all(seq is not oldest for seq in group) and order[0] is not oldest:
            oldest.prefill_passed_over += 1
        return group, order[0]

    def _group_overhead(self) -> int:
        """A prefill forward's fixed cost in prompt tokens: one token's forward over what a
        token of a large forward costs (the weights are read once per forward, whatever its
        size). Padding a group by more than that costs more than a group of its own."""
        if self.costs is None:
            return DEFAULT_GROUP_OVERHEAD
        times = self.costs.target
        return max(1, round(times.at(1, 1) / times.per_token()))

    def _prefill_group(self, group: list[Sequence]) -> None:
        """Prefill the rest of each prompt in `group` in one forward per model (the draft's
        over the rows that draft); each row takes its first token and joins the batch with the
        group's caches. The first tokens go out before the draft's prefill, which they do not
        need."""
        chunks = [seq.prefill_tokens[seq.prefilled:] for seq in group]
        for seq in group:
            self.prefilling.remove(seq)
        drafters = [i for i, seq in enumerate(group) if seq.draft_cache is not None]
        try:
            logits, cache = prefill_rows(self.kit.target.model,
                                         [seq.target_cache for seq in group], chunks)
            # a resumed row's next token comes from decoding: its last one is still to be fed
            finished = [not seq.resumed and first_token(seq, logits[i])
                        for i, seq in enumerate(group)]
            draft_cache = (prefill_rows(self.kit.draft.model,
                                        [group[i].draft_cache for i in drafters],
                                        [chunks[i] for i in drafters])[1]
                           if drafters else None)
        except Exception as e:  # noqa: BLE001 - these requests' own failure
            log.exception("prefill failed")
            for seq in group:
                seq.error = e
                seq.finish()
            return
        for i, seq in enumerate(group):
            seq.prefilled, seq.target_cache = len(seq.prefill_tokens), None
            if self._caching(seq) and not seq.resumed:  # a resumed one stored it when paused
                caches = [[c.extract(i) for c in cache]]
                if i in drafters:
                    caches.append([c.extract(drafters.index(i)) for c in draft_cache])
                self.prefix_cache.store(self._cache_key(seq), seq.prompt, caches)
            seq.draft_cache = None
            if finished[i]:
                seq.finish()
        joining = [i for i in range(len(group)) if not finished[i]]
        if joining:
            self._join(group, joining, drafters, cache, draft_cache)

    def _join(self, group: list[Sequence], joining: list[int], drafters: list[int],
              cache: list, draft_cache: list | None) -> None:
        """The rows `joining` of a prefilled group join the decoding batch with the group's
        caches, and those of them among `drafters` (the rows the draft prefilled) the draft's
        batch: it then still has to see each one's first token. The batches' caches are
        evaluated now, so the next round's time is the round's (the calibration reads it),
        layer by layer: each layer's old buffers are freed before the next one's copy (all
        layers at once added 0.09-0.17 GB to the peak at 16-32 rows)."""
        _keep_rows(cache, joining, len(group))
        self.target.add_batch([group[i] for i in joining], cache)
        evaluate = [self.target]
        drafting = [i for i in joining if i in drafters]
        if drafting:
            _keep_rows(draft_cache, [drafters.index(i) for i in drafting], len(drafters))
            self._draft_batch().add_batch([group[i] for i in drafting], draft_cache)
            evaluate.append(self.draft)
        for batch in evaluate:
            for c in batch.cache:
                mx.eval(arrays_of([c]))
        for i in drafting:
            group[i].draft_pending = [group[i].output[-1]]
        for i in joining:
            group[i].phase = Phase.DECODE

    def use_cost_model(self, cache_dir: Path | None = DEFAULT_CACHE_DIR,
                       budget_s: float | None = DEFAULT_BUDGET_S) -> None:
        """Let forward times choose each row's k (`cost_model`): a prior from now on, the
        tables measured in idle moments (`_measure_when_idle`, `budget_s` of machine time at
        most; None: no bound) when they are ready. Tables are kept in `cache_dir` per model
        and machine (None: measured every time)."""
        self.cost_source = CostSource(self.kit, cache_dir, budget_s)
        self.costs = self.cost_source.costs()
        self.learner = YieldLearner(learned_path(self.kit, cache_dir))

    def measure_costs(self, cache_dir: Path | None = DEFAULT_CACHE_DIR,
                      budget_s: float | None = None) -> None:
        """`use_cost_model` with the measurement run to its end now (benchmarks)."""
        self.use_cost_model(cache_dir, budget_s)
        self.cost_source.finish()
        self.costs = self.cost_source.costs()

    def _measure_when_idle(self) -> bool:
        """One forward of the forward-time measurement, when no request waits or runs (one
        that arrives meanwhile waits for this forward alone); True if it ran."""
        source = self.cost_source
        if source is None or not source.pending or self.has_work() or self._waiting_count \
                or self._draining:
            return False
        if source.step():
            self.costs = source.costs()  # a measured table: the prior's calibration goes too
        return True

    def _draft_batch(self) -> ModelBatch:
        if self.draft is None:
            self.draft = ModelBatch(self.kit.draft.model)
        return self.draft

    def _decode_step(self) -> bool:
        if not len(self.target):
            return False
        step_start = time.perf_counter()  # the learner counts the round's planning and catch-up
        rows = self.target.rows
        options, joining = self._able_to_draft(self.policy.round_options(
            rows, self.batch_size, self.rates, self._draft_cost(len(rows)),
            learned=self.learner is not None and self.costs is not None))
        draft_rows = (len(self.draft) if self.draft is not None else 0) + len(joining)
        ks = self.policy.choose(options, len(rows), draft_rows, self.costs, self.learner)
        model_rows = [seq for seq in rows if seq.uses_draft_model]
        if model_rows:
            self.drafting_share.record(len(rows), any(
                ks.get(id(seq)) and seq.round_drafter == "model" for seq in model_rows))
        self._catch_up_drafts([seq for seq in joining if ks.get(id(seq))])
        draft = self.draft if self.draft is not None and len(self.draft) else None
        start = time.perf_counter()
        results = decode_round(self.target, draft, ks, self.rates)
        if self.costs is not None:
            end = time.perf_counter()
            self._calibrate(rows, ks, len(draft) if draft is not None else 0, end - start)
            self._learn(results, end - step_start)
        self.observer.on_round(len(self.target), results)
        self._retire([s for s in self.target.rows if s.finish_reason is not None])
        return True

    def _draft_cost(self, rows: int) -> float:
        """A draft forward's time over the target's at this batch size (0: not measured)."""
        if self.costs is None or self.costs.draft is None:
            return 0.0
        return self.costs.draft.at(rows, 1) / max(self.costs.target.at(rows, 1), 1e-9)

    def _learn(self, results: dict[int, RoundResult], seconds: float) -> None:
        """What the round's shape yielded: the tokens it committed in the seconds its step took
        (its forwards, and the drafters' planning and the draft's catch-ups that drafting
        costs besides: timed by their forwards alone, hybrid pair, 8 streams, drafting rounds
        yielded 1.18x plain ones where the clients saw 0.91x)."""
        if self.learner is not None:
            self.learner.round_done(sum(r.emitted for r in results.values()), seconds)

    def _calibrate(self, rows: list[Sequence], ks: dict[int, int], draft_rows: int,
                   seconds: float) -> None:
        """Record the round's measured time against the tables' estimate for it."""
        width = max(ks.values(), default=0)
        model_k = max((ks.get(id(seq), 0) for seq in rows if seq.round_drafter == "model"),
                      default=0)
        estimate = self.costs.table_seconds(len(rows), width, model_k, draft_rows)
        self.costs.calibration.record(len(rows), width > 0, seconds, estimate)

    def _able_to_draft(self, options: list[RowOption]) -> tuple[list[RowOption], list[Sequence]]:
        """The round's options less the rows whose draft model cannot draft for them this
        round; and the rows among them that would join the draft's batch first (catch up).
        The round is priced with the rows that really draft: 3 of 16 rows drafting made all
        16 pay for a verify position (default pair, 16 streams: 0.22 s rounds against 0.147 s
        plain ones, for 2 more tokens).

        A row in the draft's batch can draft: one it fell behind on is fed `CATCH_UP_WIDTH`
        tokens of its backlog per round (`decoder`) first, unless its end comes before that.
        A row that joined the batch where speculation did not pay skipped the draft's prefill
        (work for drafts nobody would use); to draft now (the batch shrank) the draft prefills
        its whole context first, unless fewer than `CATCH_UP_MIN_REMAINING` tokens remain or
        drafting would not repay that prefill (`_draft_repaid`). Rows catch up one after
        another until `prefill_chunk` context tokens are fed in a step; the others wait for
        the next rounds (many rows at once, when a large batch shrank, stalled every stream by
        seconds)."""
        rows = {id(seq): seq for seq in self.target.rows}
        drafting = set(map(id, self.draft.rows)) if self.draft is not None else set()
        able, joining, fed, savings = [], [], 0, {}
        for option in options:
            seq = rows[option.key]
            if not (option.by_model and seq.uses_draft_model):
                able.append(option)
            elif option.key in drafting:
                behind = -(-len(seq.draft_pending) // CATCH_UP_WIDTH) - 1
                if not behind or seq.remaining - behind >= CATCH_UP_MIN_REMAINING:
                    able.append(option)
            elif (seq.remaining >= CATCH_UP_MIN_REMAINING and fed < self.config.prefill_chunk
                    and self._draft_repaid(seq, len(seq.context), savings=savings)
                    and self._draft_fits(seq, len(seq.context))):
                able.append(option)
                joining.append(seq)
                fed += len(seq.context)
        return able, joining

    def _catch_up_drafts(self, joining: list[Sequence]) -> None:
        """The draft prefills the context of rows that draft with it from this round on."""
        chunk = self.config.prefill_chunk
        for seq in joining:
            cache = new_cache(self.kit.draft.model)
            context = seq.context[:-1]
            for start in range(0, len(context), chunk):
                prefill(self.kit.draft.model, cache, context[start: start + chunk])
            self._draft_batch().add(seq, cache)
            seq.draft_pending = seq.context[-1:]

    def _retire(self, done: list[Sequence]) -> None:
        if not done:
            return
        for seq in done:
            self._keep_in_prefix_cache(seq)
            self._remember(seq)
        self.target.remove(done)
        if self.draft is not None:
            self.draft.remove(done)
        for seq in done:
            seq.finish()

    def _remember(self, seq: Sequence) -> None:
        """A finished (or cancelled: its client may retry) request's answer, with its prompt's
        tail, goes to the suffix index for the requests that follow; unless the request asked
        not to be kept (`cache_prompt: false`)."""
        if self.suffix_index is not None and seq.error is None and seq.params.cache_prompt \
                and seq.output:
            self.suffix_index.add(seq.params.tenant, seq.prompt[-PROMPT_TAIL:] + seq.output)

    # -- the prefix cache -----------------------------------------------------------------------
    def _keep_in_prefix_cache(self, seq: Sequence) -> None:
        """A decoding row's caches (both models', where it drafts) as an entry of its context."""
        if self._caching(seq) and seq.error is None:
            # The target's cache holds the context but its last token; the draft's what
            # it was fed (its pending tokens not yet).
            caches = [self.target.extract(seq)]
            lengths = [covered(caches[0], len(seq.context) - 1)]
            if self.draft is not None and seq in self.draft:
                caches.append(self.draft.extract(seq))
                lengths.append(covered(caches[1],
                                       len(seq.context) - len(seq.draft_pending)))
            self.prefix_cache.store(self._cache_key(seq), seq.context, caches, lengths)

    def _keep_partial_prefill(self, seq: Sequence) -> None:
        """A request cancelled part way through a long prompt (its client timed out) leaves
        what it prefilled to the prefix cache: the client's retry resumes from there instead
        of starting over, and a retry that times out again still gets further."""
        if not self._caching(seq) or seq.target_cache is None or \
                seq.prefilled <= seq.cached_tokens:
            return
        caches = [seq.target_cache] + ([seq.draft_cache] if seq.draft_cache is not None else [])
        self.prefix_cache.store(self._cache_key(seq), list(seq.prefill_tokens[:seq.prefilled]),
                                caches)

    def keep_prefill(self, tokens: list[int], target_cache: list) -> None:
        """A prompt the target prefilled outside any request (`scoring`) serves the requests
        that follow it, as a prefix-cache entry."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(self._entry_key(False), list(tokens), [target_cache])

    def _caching(self, seq: Sequence) -> bool:
        return self.prefix_cache is not None and seq.params.cache_prompt

    def _cache_key(self, seq: Sequence) -> tuple[str, ...]:
        """Entries of drafting requests hold both models' caches; plain ones the target's."""
        drafting = seq.draft_cache is not None or (self.draft is not None and seq in self.draft)
        return self._entry_key(drafting)

    def _entry_key(self, with_draft: bool) -> tuple[str, ...] | None:
        """The key of entries holding the target's cache (and the draft's): the models'
        fingerprints, so no entry outlives the weights it was computed with. None: no draft."""
        if not with_draft:
            return (self.kit.target.fingerprint,)
        if self.kit.draft is None:
            return None
        return (self.kit.target.fingerprint, self.kit.draft.fingerprint)

    def _restore(self, seq: Sequence, context: list[int]) -> None:
        """Restore the longest cached prefix of `context`. An entry of a drafting request holds
        the target's cache too, so it serves a row that does not draft; an entry with the
        target's alone serves a drafting row, which then starts without the draft, as a row
        that joined a batch too large to draft (its draft may catch up later, where that
        pays). A row prefers entries like its own on a tie."""
        drafting = seq.draft_cache is not None
        keys = [self._entry_key(with_draft) for with_draft in (drafting, not drafting)]
        cache, hit, key = self.prefix_cache.lookup([k for k in keys if k is not None], context)
        self.observer.on_prefix_lookup(len(context), hit)
        if cache is None:
            return
        layers = len(seq.target_cache)
        if drafting and key == self._entry_key(False):
            seq.draft_cache = None
        cache = cache[:layers] + (cache[layers:] if seq.draft_cache is not None else [])
        if hit == len(context):  # keep one token to prefill: its logits give the first token
            trim_prompt_cache(cache, 1)
            hit -= 1
        seq.target_cache = cache[:layers]
        if seq.draft_cache is not None:
            seq.draft_cache = cache[layers:]
        seq.prefilled = hit
        if not seq.resumed:  # what the request's usage reports: its prompt's first lookup
            seq.cached_tokens = hit

    def _fail_all(self, error: BaseException) -> None:
        rows = list(self.target.rows) + list(self.prefilling) + list(self.paused)
        self.prefilling.clear()
        self.paused.clear()
        self.target = ModelBatch(self.kit.target.model)
        self.draft = ModelBatch(self.kit.draft.model) if self.kit.draft is not None else None
        for seq in rows:
            seq.error = error
            seq.finish()

    # -- model changes (run through `call`, between steps) ---------------------------------------
    def target_changed(self) -> None:
        """The target was replaced (and the draft with it, `draft_changed`): every request
        waiting or running ends with ModelReplaced, its prompt having been tokenized for the
        previous target."""
        error = ModelReplaced("the target model was replaced; send the request again")
        self._fail_all(error)
        while self.waiting:
            seq = self.waiting.popleft()
            self._left_queue()
            seq.error = error
            seq.finish()
        if self.suffix_index is not None:  # another model's answers: another model's drafts
            self.suffix_index.clear()
        self.draft_changed()

    def draft_changed(self) -> None:
        """The draft was unloaded or replaced: running rows continue without it (hybrid rows
        by prompt lookup, the others without drafting)."""
        for seq in list(self.target.rows) + list(self.prefilling) + list(self.paused):
            if seq.uses_draft_model:
                seq.lose_draft_model()
                seq.draft_cache = None
                seq.draft_pending = []
        self.draft = ModelBatch(self.kit.draft.model) if self.kit.draft is not None else None
        self.rates = DrafterRates()
        self.drafting_share = DraftingShare()
        if self.cost_source is not None:  # the target's times stay when only the draft changed
            source = self.cost_source
            self.cost_source = CostSource(self.kit, source.cache_dir, source.budget.seconds,
                                          previous=source)
            self.costs = self.cost_source.costs()
            self.learner.save()  # what the old pair taught; the new pair learns its own
            self.learner = YieldLearner(learned_path(self.kit, source.cache_dir))
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
