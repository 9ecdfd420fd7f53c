"""Every cache kind `mlx_lm` builds, served: hybrid (Gated DeltaNet, Mamba, short convolution
+ attention) and sliding-window models, alone and batched, with exact rollback after rejected
drafts, against `mlx_lm` itself.

Tiny random models of `mlx_lm`'s own architectures (`server.model_files.architectures`), each
with a draft made of its first layers, are built once per session. Greedy text must be
`mlx_lm`'s token for token; Mamba-2 layers (Nemotron-H, Granite 4 hybrids) compute a block of
tokens with a chunked formula and one token with a step, so their text may part from
`mlx_lm`'s one-token-at-a-time text only at a near-tie of the logits (`NEAR_TIE`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from support.engine import assert_same_or_near_tie, run_batch, run_to_end, tokens_of
from support.models import ZOO as ARCHITECTURES

from server.engine.errors import ModelLoadError
from server.engine.generation import generate_events
from server.engine.kv.batch import ModelBatch, prefill_rows
from server.engine.kv.disk_cache import DiskPromptCache
from server.engine.kv.layers import new_cache
from server.engine.kv.prefix_cache import PrefixCache
from server.engine.kv.state_cache import StateCache
from server.engine.kv.window_cache import WindowKVCache
from server.engine.models.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams, SamplingParams, SpeculationParams
from server.engine.scheduling import decoder
from server.engine.scheduling.sampling import LogitsPipeline
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from server.engine.scheduling.sequence import Phase
from server.engine.speculation.verification import verify_rejection

CHUNKED_SSM = {"nemotron_h": 1e-2}  # Mamba-2: a block and a step round differently
NEAR_TIE = 1e-4
TEXTS = ["def hello(world):\n    return", "import os\nclass Foo:", "x = 1\n" * 6,
         "Once upon a time there was a"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def kits(zoo) -> dict:
    kits = {}
    for arch, (target, draft) in zoo.items():
        kit = ModelKit(load_model(str(target)))
        kit.load_draft(str(draft))
        kits[arch] = kit
    return kits


def mlx_lm_tokens(kit, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), kit.target.model,
                                             max_tokens=max_tokens)]


def request(kit, text: str, k: int = 0, **sampling) -> GenerationParams:
    return GenerationParams(tuple(kit.target.tokenizer.encode(text)), MAX_TOKENS,
                            sampling=SamplingParams(**sampling),
                            speculation=SpeculationParams(num_draft_tokens=k))


def check(kit, arch, p: GenerationParams, got: list[int]) -> None:
    expected = mlx_lm_tokens(kit, list(p.prompt_tokens), p.max_tokens)
    assert_same_or_near_tie(kit, p, got, expected, CHUNKED_SSM.get(arch, NEAR_TIE))


# --- the kinds each architecture uses -------------------------------------------------------

def test_the_zoo_has_every_kind(kits):
    kinds = {type(c) for kit in kits.values() for c in make_prompt_cache(kit.target.model)}
    assert {KVCache, RotatingKVCache, ArraysCache} <= kinds


def test_an_unsupported_kind_is_refused_at_load_in_one_line(zoo, monkeypatch):
    from mlx_lm.models import llama
    from mlx_lm.models.cache import ChunkedKVCache

    monkeypatch.setattr(llama.Model, "make_cache", lambda self: [
        ChunkedKVCache(8) for _ in self.layers], raising=False)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(zoo["llama"][0]))
    message = str(e.value)
    assert "\n" not in message and "ChunkedKVCache" in message and "model_type llama" in message


# --- greedy text: alone, batched, every k ---------------------------------------------------

@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("k", [0, 1, 3])
def test_alone_equals_mlx_lm_at_every_k(kits, arch, k):
    kit = kits[arch]
    for text in TEXTS[:2]:
        p = request(kit, text, k)
        check(kit, arch, p, tokens_of(list(generate_events(kit, p))))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_with_drafts_chunked_prefill_and_a_cancellation(kits, arch):
    """Rows drafting 3 and none, prompts longer than the prefill chunk (prefilled alone in
    chunks, then grouped), one row cancelled mid-way: every other row is mlx_lm's."""
    kit = kits[arch]
    requests = [request(kit, text, k) for text in TEXTS for k in (0, 3)]
    events, seqs = run_batch(kit, requests, prefill_chunk=8, batch_draft_tokens=3,
                             cancel_after={1: 4})
    for i, (p, ev) in enumerate(zip(requests, events, strict=True)):
        if i != 1:
            check(kit, arch, p, tokens_of(ev))
    assert len(seqs[1].output) < MAX_TOKENS
    assert sum(s.counters.proposed for s in seqs) > 0


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text", "lfm2"])
def test_arrivals_while_others_decode(kits, arch):
    """Requests submitted at different rounds join the running batch (prefilled while the
    others decode) and each is mlx_lm's."""
    kit = kits[arch]
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=8))
    requests = [request(kit, text, k=3 if i % 2 else 0) for i, text in enumerate(TEXTS)]
    events = [[] for _ in requests]
    seqs = []
    for i, p in enumerate(requests):
        seqs.append(scheduler.submit(p, events[i].append))
        for _ in range(3):
            scheduler.step()
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for p, ev in zip(requests, events, strict=True):
        check(kit, arch, p, tokens_of(ev))


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text", "nemotron_h"])
def test_a_hybrid_target_with_a_plain_draft(zoo, arch):
    """A draft of another kind (llama's, same tokenizer) drafts for a hybrid target."""
    kit = ModelKit(load_model(str(zoo[arch][0])))
    kit.load_draft(str(zoo["llama"][1]))
    requests = [request(kit, text, 3) for text in TEXTS]
    events, seqs = run_batch(kit, requests, batch_draft_tokens=3)
    for p, ev in zip(requests, events, strict=True):
        check(kit, arch, p, tokens_of(ev))


# --- exact rollback at temperature > 0: every round's distributions are fresh forwards' -----

# A draft of another architecture (same tokenizer, unrelated weights) is often rejected.
UNRELATED_DRAFT = {"qwen3_5": "granitemoehybrid", "gemma3_text": "qwen3_5",
                   "lfm2": "gemma3_text", "granitemoehybrid": "lfm2"}


@pytest.mark.parametrize("arch", sorted(UNRELATED_DRAFT))
def test_every_verified_distribution_is_a_fresh_forwards(zoo, arch, monkeypatch):
    """With sampling, each round's target rows p (and draft rows q) equal a cache-free forward
    of the context so far plus the drafts: the recurrent states and windows of both models
    were taken back exactly after every rejection."""
    kit = ModelKit(load_model(str(zoo[arch][0])))
    kit.load_draft(str(zoo[UNRELATED_DRAFT[arch]][1]))
    sampling = SamplingParams(temperature=1.0, seed=5)
    pipeline = LogitsPipeline(sampling, kit.target.vocab_size)
    rounds = []

    def spy(p, q, d, key=None):
        result = verify_rejection(p, q, d, key)
        rounds.append((p, q, d, result[0]))
        return result

    monkeypatch.setattr(decoder, "verify_rejection", spy)
    prompt = kit.target.tokenizer.encode(TEXTS[0])
    params = GenerationParams(tuple(prompt), 20, sampling=sampling,
                              speculation=SpeculationParams(num_draft_tokens=3, adaptive=False))
    tokens = tokens_of(list(generate_events(kit, params)))

    def probs(model, sequence, rows):
        logits = model(mx.array(sequence)[None])[0, -rows:]
        return pipeline.probs(pipeline.scaled(pipeline.process(logits)))

    context, rejected = list(prompt), 0
    for p, q, d, n in rounds:
        k, drafted = d.size, d.tolist()
        assert mx.allclose(p, probs(kit.target.model, context + drafted, k + 1),
                           atol=1e-4).item()
        if k:
            assert mx.allclose(q, probs(kit.draft.model, context + drafted[:-1], k),
                               atol=1e-4).item()
        rejected += n.item() < k
        context += tokens[len(context) - len(prompt):][: n.item() + 1]
    assert rejected > 0  # rollbacks happened
    assert len(context) - len(prompt) == len(tokens)


# --- the batch caches, unit by unit ---------------------------------------------------------

def test_a_window_cache_sees_the_last_window_tokens_through_holes():
    """The window counts tokens, not slots: with holes inside the window, a query still sees
    exactly its `window` last tokens."""
    cache = WindowKVCache([0, 2], window=3)
    keys = mx.zeros((2, 1, 6, 4))
    cache.update_and_fetch(keys, keys)
    cache.drop_tail([1, 0])  # row 0: slots 0-4, slot 5 a hole; row 1: padding 0-1, slots 2-5
    cache.update_and_fetch(mx.zeros((2, 1, 1, 4)), mx.zeros((2, 1, 1, 4)))  # slot 6
    mask = np.array(cache.make_mask(1, window_size=3))[:, 0, 0]  # the query is slot 7
    assert mask.tolist() == [[False, False, False, False, True, False, True, True],
                             [False, False, False, False, False, True, True, True]]


def test_a_window_cache_with_sinks_keeps_its_first_tokens_visible():
    cache = WindowKVCache([0], window=5, keep=2)  # 2 sinks and the 3 last tokens
    keys = mx.zeros((1, 1, 8, 4))
    cache.update_and_fetch(keys, keys)
    mask = np.array(cache.make_mask(1, window_size=5))[0, 0, 0]
    assert mask.tolist() == [True, True, False, False, False, False, True, True, True]


def test_a_window_cache_forgets_only_what_no_row_can_see():
    """Row 0 holds 300 tokens, row 1 its last 280 (20 slots of padding): with a window of 4
    and a slack of 2, both need only their last 6 tokens, and the front goes."""
    cache = WindowKVCache([0, 20], window=4, slack=2)
    keys = mx.arange(2 * 300, dtype=mx.float32).reshape(2, 1, 300, 1)
    cache.update_and_fetch(keys, keys)
    before = np.array(cache.make_mask(1, window_size=4))
    cache.compact()
    assert cache._idx == 6
    kept_keys, _ = cache.keys_and_values()
    assert kept_keys[:, 0, :, 0].tolist() == [list(range(294, 300)), list(range(594, 600))]
    after = np.array(cache.make_mask(1, window_size=4))
    assert after[..., -7:].tolist() == before[..., -7:].tolist()


def test_a_state_goes_back_to_any_kept_token(kits):
    """After a verify forward of 4 tokens, each row's recurrent states equal those of feeding
    only its kept tokens."""
    kit = kits["qwen3_5"]
    model = kit.target.model
    prompts = [kit.target.tokenizer.encode(t)[:6] for t in TEXTS[:3]]
    batch = ModelBatch(model)
    _, cache = prefill_rows(model, [new_cache(model) for _ in prompts], prompts)
    batch.add_batch([object() for _ in prompts], cache)
    block = [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    batch.forward(mx.array(block, mx.uint32))
    kept = [1, 3, 4]
    batch.keep(4, kept)
    for row, (prompt, tokens, n) in enumerate(zip(prompts, block, kept, strict=True)):
        alone = new_cache(model)
        model(mx.array([prompt + tokens[:n]], mx.uint32), cache=alone)
        for mine, theirs in zip(batch.cache, alone, strict=True):
            if isinstance(mine, StateCache):
                for a, b in zip(mine.cache, theirs.cache, strict=True):
                    assert mx.allclose(a[row], b[0], atol=1e-4).item()


# --- the prefix cache: states at reusable boundaries ----------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text", "granitemoehybrid"])
def test_the_second_turn_reuses_the_first_turns_state(kits, arch, tmp_path):
    """A chat's second turn starts from the first turn's state (memory, then disk after a
    restart), and its text is mlx_lm's."""
    kit = kits[arch]
    tk = kit.target.tokenizer
    disk = DiskPromptCache(tmp_path, 1 << 30)
    disk.register_model(kit.target.path, kit.target.fingerprint)
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=32))
    scheduler.prefix_cache = PrefixCache(1 << 30, disk)
    first = tk.apply_chat_template([{"role": "user", "content": "Add two numbers " * 6}],
                                   add_generation_prompt=True)
    out, _ = run_to_end(scheduler, GenerationParams(tuple(first), 16))
    second = first + out + tk.encode("<|im_end|>\n<|im_start|>user\nNow subtract<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    p = GenerationParams(tuple(second), 16)
    got, stats = run_to_end(scheduler, p)
    assert stats.cached_tokens >= len(first) + len(out) - 1
    check(kit, arch, p, got)
    disk.flush()
    restarted = Scheduler(kit, SchedulerConfig(prefill_chunk=32))
    restarted.prefix_cache = PrefixCache(1 << 30, DiskPromptCache(tmp_path, 1 << 30))
    restarted.prefix_cache.disk.register_model(kit.target.path, kit.target.fingerprint)
    again, stats = run_to_end(restarted, p)
    assert stats.cached_tokens >= len(first) + len(out) - 1 and again == got


def test_a_state_entry_is_never_cut_to_a_shorter_prompt(kits):
    """An entry holding a recurrent state serves only prompts it is a whole prefix of: a
    prompt that shares part of it is prefilled cold, and is still mlx_lm's."""
    kit = kits["qwen3_5"]
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=32))
    scheduler.prefix_cache = PrefixCache(1 << 30)
    base = kit.target.tokenizer.encode("def add(a, b):\n    return a + b\n" * 3)
    run_to_end(scheduler, GenerationParams(tuple(base), 4))
    shorter = base[: len(base) // 2] + kit.target.tokenizer.encode("class X:")
    p = GenerationParams(tuple(shorter), 12)
    got, stats = run_to_end(scheduler, p)
    assert stats.cached_tokens == 0
    check(kit, "qwen3_5", p, got)


@pytest.mark.parametrize("keep", [0, 4])
def test_a_window_with_and_without_sinks_equals_mlx_lms_past_its_size(zoo, monkeypatch, keep):
    """A model whose layers all use `RotatingKVCache(max_size=16, keep=...)` (what
    `make_prompt_cache(max_kv_size=...)` builds): a short prompt, then decoding well past the
    window, alone and batched with drafts, gives mlx_lm's tokens (the first `keep` tokens stay
    visible, as in mlx_lm's rotating buffer)."""
    from mlx_lm.models import llama

    monkeypatch.setattr(llama.Model, "make_cache", lambda self: [
        RotatingKVCache(max_size=16, keep=keep) for _ in self.layers], raising=False)
    kit = ModelKit(load_model(str(zoo["llama"][0])))
    kit.load_draft(str(zoo["llama"][1]))
    requests = [GenerationParams(tuple(kit.target.tokenizer.encode(text))[:10], 40,
                                 speculation=SpeculationParams(num_draft_tokens=k))
                for text in TEXTS[:2] for k in (0, 3)]
    events, _ = run_batch(kit, requests, batch_draft_tokens=3)
    for p, ev in zip(requests, events, strict=True):
        expected = mlx_lm_tokens(kit, list(p.prompt_tokens), p.max_tokens)
        assert_same_or_near_tie(kit, p, tokens_of(ev), expected)
    alone = tokens_of(list(generate_events(kit, requests[1])))
    assert_same_or_near_tie(kit, requests[1], alone,
                            mlx_lm_tokens(kit, list(requests[1].prompt_tokens), 40))
