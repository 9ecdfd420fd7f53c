"""The prefix cache on disk: survives a restart, changes no output, and a damaged file or a
changed model means a warning and a cold prefill, never a failure."""

from __future__ import annotations

import json
import logging
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache
from support.engine import run_to_end
from support.servers import disk_cache_files as files
from support.servers import served, wait_for_disk_entries

from server.engine.events import TokenEvent
from server.engine.generation import generate_events
from server.engine.kv.disk_cache import DiskPromptCache
from server.engine.kv.prefix_cache import PrefixCache
from server.engine.models.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig

SYSTEM = "You are a careful assistant who answers in full sentences. " * 8


def restarted(kit, folder, disk_bytes=1 << 30) -> Scheduler:
    """A fresh scheduler (empty memory) over the disk cache in `folder`: a restart."""
    scheduler = Scheduler(kit, SchedulerConfig(prefill_chunk=32))
    disk = DiskPromptCache(folder, disk_bytes)
    disk.register_model(kit.target.path, kit.target.fingerprint)
    scheduler.prefix_cache = PrefixCache(1 << 30, disk)
    return scheduler


def run(scheduler, p: GenerationParams):
    """`p` run to its end, its entries then written to disk."""
    out = run_to_end(scheduler, p)
    scheduler.prefix_cache.disk.flush()
    return out


def request(kit, text, *, k=0, max_tokens=12):
    return GenerationParams(tuple(kit.target.tokenizer.encode(text)), max_tokens,
                            speculation=SpeculationParams(num_draft_tokens=k))


def uncached(kit, p):
    return [e.token for e in generate_events(kit, p) if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("k", [0, 4])
def test_a_restart_is_served_from_disk_with_identical_output(kit, tmp_path, k):
    p = request(kit, SYSTEM + "Question one?", k=k)
    first, stats = run(restarted(kit, tmp_path), p)
    assert stats.cached_tokens == 0 and first == uncached(kit, p)
    assert len(files(tmp_path)) == 1  # the prompt's entry, superseded by prompt + answer

    again, stats = run(restarted(kit, tmp_path), p)
    assert again == first
    assert stats.cached_tokens == len(p.prompt_tokens) - 1  # one token left for the logits

    other = request(kit, SYSTEM + "Another, longer question than the first one?", k=k)
    scheduler = restarted(kit, tmp_path)
    out, stats = run(scheduler, other)  # a partial hit: the shared system prompt
    assert out == uncached(kit, other)
    shared = len(kit.target.tokenizer.encode(SYSTEM))
    assert shared - 2 <= stats.cached_tokens < len(other.prompt_tokens) - 1
    assert scheduler.prefix_cache.disk.hit_tokens == stats.cached_tokens


def test_a_memory_hit_wins_and_a_plain_entry_serves_a_drafting_request(kit, tmp_path):
    scheduler = restarted(kit, tmp_path)
    plain = request(kit, SYSTEM + "Q?")
    run(scheduler, plain)
    _, stats = run(scheduler, plain)
    assert stats.cached_tokens > 0 and scheduler.prefix_cache.disk.hit_tokens == 0
    # The target's entry on disk serves a drafting request, which starts without the draft
    # (no draft KV in it): the tokens of no cache at all.
    drafting = request(kit, SYSTEM + "Q?", k=4)
    out, stats = run(restarted(kit, tmp_path), drafting)
    assert stats.cached_tokens > 0 and out == uncached(kit, drafting)


def test_a_long_entry_is_not_read_for_a_short_shared_prefix(kit, tmp_path):
    from server.engine.kv.disk_cache import MIN_USED_FRACTION

    long = request(kit, SYSTEM * 4 + "Long?")
    run(restarted(kit, tmp_path), long)
    entry_tokens = len(long.prompt_tokens) + 11
    shared = request(kit, SYSTEM + "Short?")  # shares len(SYSTEM) tokens, under the fraction
    assert len(kit.target.tokenizer.encode(SYSTEM)) < MIN_USED_FRACTION * entry_tokens
    _, stats = run(restarted(kit, tmp_path), shared)
    assert stats.cached_tokens == 0
    half = request(kit, SYSTEM * 3 + "Half?")
    _, stats = run(restarted(kit, tmp_path), half)
    assert stats.cached_tokens >= len(kit.target.tokenizer.encode(SYSTEM * 3)) - 2


def test_files_are_mlx_lm_prompt_caches(kit, tmp_path):
    p = request(kit, SYSTEM + "Format?")
    run(restarted(kit, tmp_path / "ours"), p)
    [ours] = files(tmp_path / "ours")
    cache, meta = load_prompt_cache(str(ours), return_metadata=True)
    tokens = [int(t) for t in meta["tokens"].split(",")]
    assert tokens[: len(p.prompt_tokens)] == list(p.prompt_tokens)
    assert len(cache) == len(kit.target.model.layers)
    assert all(c.offset == len(tokens) for c in cache)
    # mlx_lm writes the same tensors and the same header for the same caches.
    theirs = tmp_path / "theirs.safetensors"
    save_prompt_cache(str(theirs), cache, meta)
    a, meta_a = mx.load(str(ours), return_metadata=True)
    b, meta_b = mx.load(str(theirs), return_metadata=True)
    assert meta_a == meta_b and a.keys() == b.keys()
    assert all(mx.array_equal(a[n], b[n]).item() and a[n].dtype == b[n].dtype for n in a)


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) - 100]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, when", [("flipped", "before start"), ("truncated", "before start"),
                                       ("truncated", "while serving"),
                                       ("flipped", "while serving")])
def test_a_damaged_entry_is_a_warning_and_a_cold_prefill(kit, tmp_path, caplog, how, when):
    p = request(kit, SYSTEM + "Damage?")
    expected, _ = run(restarted(kit, tmp_path), p)
    [entry] = files(tmp_path)
    if when == "before start":
        _damage(entry, how)
    with caplog.at_level(logging.WARNING, logger="server.engine.kv.disk_cache"):
        scheduler = restarted(kit, tmp_path)
        if when == "while serving":
            _damage(entry, how)
        out, stats = run(scheduler, p)
    assert stats.cached_tokens == 0 and out == expected == uncached(kit, p)
    assert entry.name in caplog.text and "deleted" in caplog.text
    again, stats = run(restarted(kit, tmp_path), p)  # rewritten: the next restart hits
    assert stats.cached_tokens > 0 and again == expected


def test_changed_weights_are_a_warning_and_a_miss(tiny_pair, tmp_path, caplog):
    folder = tmp_path / "target"
    shutil.copytree(tiny_pair[0], folder)
    before = ModelKit(load_model(str(folder)))
    p = request(before, SYSTEM + "Weights?")
    run(restarted(before, tmp_path / "cache"), p)

    weights = mx.load(str(folder / "model.safetensors"))
    name = next(n for n in weights if "layers.0.self_attn.k_proj" in n)
    weights[name] = weights[name] * 1.5
    mx.save_safetensors(str(folder / "model.safetensors"), weights, {"format": "mlx"})
    after = ModelKit(load_model(str(folder)))
    assert after.target.fingerprint != before.target.fingerprint
    with caplog.at_level(logging.WARNING, logger="server.engine.kv.disk_cache"):
        out, stats = run(restarted(after, tmp_path / "cache"), p)
    assert "another version" in caplog.text and str(folder) in caplog.text
    assert stats.cached_tokens == 0 and out == uncached(after, p)


def test_lru_eviction_keeps_the_folder_under_its_bound(kit, tmp_path):
    probe = tmp_path / "probe"
    run(restarted(kit, probe), request(kit, "Prompt number 0: " + "words " * 60))
    one = files(probe)[0].stat().st_size
    folder, budget = tmp_path / "bounded", int(one * 2.5)
    scheduler = restarted(kit, folder, budget)
    first = request(kit, "Prompt number 0: " + "words " * 60)
    for i in range(5):
        run(scheduler, request(kit, f"Prompt number {i}: " + "words " * 60))
        if i >= 1:  # use the first one again: it becomes the most recent
            scheduler.prefix_cache.clear()
            _, stats = run(scheduler, first)
            assert stats.cached_tokens > 0
        assert sum(f.stat().st_size for f in files(folder)) <= budget
    assert len(files(folder)) == 2
    # A restart reads the order from the files' modification times.
    assert restarted(kit, folder, budget).prefix_cache.info()["disk_entries"] == 2
    _, stats = run(restarted(kit, folder, budget), first)
    assert stats.cached_tokens > 0


def test_files_of_another_kind_are_left_alone(kit, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "model.safetensors").write_bytes(b"not ours")
    scheduler = restarted(kit, tmp_path)
    assert scheduler.prefix_cache.info()["disk_entries"] == 0
    assert scheduler.prefix_cache.clear_disk() == 0
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "model.safetensors").exists()


@pytest.mark.anyio
async def test_http_restart_health_and_admin_clear(tiny_pair, tmp_path):
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "hello"}], "max_tokens": 6}
    cache = {"disk_dir": str(tmp_path), "disk_max_gb": 1}
    async with served(*tiny_pair, cache=cache) as (client, _):
        first = (await client.post("/v1/chat/completions", json=body)).json()
        assert first["stats"]["cached_tokens"] == 0
        await wait_for_disk_entries(client, tmp_path)
    async with served(*tiny_pair, cache=cache) as (client, _):
        again = (await client.post("/v1/chat/completions", json=body)).json()
        assert again["stats"]["cached_tokens"] > 0
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        r = await client.delete("/v1/cache")
        assert r.status_code == 200 and r.json()["disk_entries"] >= 1
        health = (await client.get("/health")).json()
        assert health["disk_cache_entries"] == 0 and health["disk_cache_bytes"] == 0
        assert files(tmp_path) == []


def test_settings_and_environment(monkeypatch, tmp_path):
    from server.config import Settings
    from server.engine.kv.disk_cache import DEFAULT_DISK_MAX_GB

    assert Settings.load(None).cache.disk_dir is None
    assert Settings.load(None).cache.disk_max_gb == DEFAULT_DISK_MAX_GB
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"cache": {"disk_dir": "/tmp/a", "disk_max_gb": 2}}))
    monkeypatch.setenv("MLX_SPEC_CACHE__DISK_DIR", "/tmp/b")
    settings = Settings.load(config)
    assert (settings.cache.disk_dir, settings.cache.disk_max_gb) == ("/tmp/b", 2)


def test_restart_benchmark_runs_on_the_tiny_pair(capsys):
    from server.bench.chat import restart_main as main

    [row] = main(["--tiny", "--prompt-tokens", "96"])
    assert row["prompt_tokens"] == 96 and row["restart_cached_tokens"] == 95
    assert "TTFT after restart / cold" in capsys.readouterr().out


def test_a_state_of_token_ids_round_trips(tmp_path):
    """A recurrent state may hold integers (LongCat's n-gram layers keep token ids as int64):
    the file keeps their dtype and values."""
    from mlx_lm.models.cache import ArraysCache

    disk = DiskPromptCache(tmp_path, 1 << 30)
    disk.register_model("m", "fp")
    state = ArraysCache(2)
    state[0] = mx.array([[2**40, 7, -3]], dtype=mx.int64)
    state[1] = mx.array([[0.5, 1.5]], dtype=mx.float32)
    tokens = list(range(40))
    disk.store(("fp",), tokens, [state])
    assert disk.flush()
    entry, length = disk.best(("fp",), tokens)
    [loaded] = disk.load(entry, length)
    assert loaded[0].dtype == mx.int64 and loaded[0].tolist() == [[2**40, 7, -3]]
    assert loaded[1].tolist() == [[0.5, 1.5]]
