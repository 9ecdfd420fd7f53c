"""`models.more_targets`: a request that names another configured target switches the server to
it once the requests on the current one have finished; nothing in flight is lost. Texts are
compared with mlx_lm on the models loaded directly."""

from __future__ import annotations

import asyncio
import json

import pytest
from mlx_lm import load
from support.http import chat_body, read_sse
from support.models import corrupt_copy, mlx_lm_chat
from support.servers import served, wait_for_disk_entries

from server.config import Settings

pytestmark = pytest.mark.anyio
MAX = 12


def mlx_lm_text(path, max_tokens=MAX, content="Write a function"):
    return mlx_lm_chat(path, content, max_tokens)


@pytest.fixture()
async def two_targets(tiny_pair, foreign_model):
    more = [{"model": str(foreign_model), "model_name": "foreign"}]
    async with served(*tiny_pair, models={"model_name": "tiny", "more_targets": more}) as env:
        yield env


async def chat(client, model, max_tokens=MAX, **extra):
    r = await client.post("/v1/chat/completions", json=chat_body(
        model=model, max_tokens=max_tokens, temperature=0, **extra))
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_request_naming_another_target_switches_to_it_and_back(
        two_targets, tiny_pair, foreign_model):
    client, engine = two_targets
    listed = (await client.get("/v1/models")).json()["data"]
    roles = [(m["id"], m["role"]) for m in listed]
    assert roles == [("tiny", "target"), (str(tiny_pair[1]), "draft"), ("foreign", "standby")]
    foreign_config = json.loads((foreign_model / "config.json").read_text())
    assert listed[2]["max_model_len"] == foreign_config["max_position_embeddings"]

    out = await chat(client, "foreign")
    assert out["model"] == "foreign"  # without the draft: hybrid drafts on the host
    assert out["stats"]["draft_model"] == "prompt_lookup+suffix"
    assert out["choices"][0]["message"]["content"] == mlx_lm_text(foreign_model)
    roles = [(m["id"], m["role"]) for m in (await client.get("/v1/models")).json()["data"]]
    assert roles == [("foreign", "target"), ("tiny", "standby")]
    assert (await client.get("/v1/models/tiny")).json()["role"] == "standby"

    # Back by its path, with its draft: speculation again, the target's own text.
    out = await chat(client, str(tiny_pair[0]), num_draft_tokens=2)
    assert out["model"] == "tiny" and out["stats"]["draft_tokens_proposed"] > 0
    assert out["choices"][0]["message"]["content"] == mlx_lm_text(tiny_pair[0])
    # A request naming no model, or the serving one, never switches.
    await chat(client, "")
    await chat(client, "tiny")
    assert engine.switcher.switches == 2
    assert "mlx_spec_target_switches 2.0" in (await client.get("/metrics")).text


async def test_running_requests_finish_first_and_later_ones_wait_their_turn(
        two_targets, tiny_pair, foreign_model):
    client, engine = two_targets
    done = []
    long = chat_body(model="tiny", max_tokens=1000, ignore_eos=True, temperature=0)

    async def streamed(body):  # its route returns at its first token: the gate is open again
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**body, "stream": True}) as r:
            events = await read_sse(r)
        done.append("long")
        return "".join(e["choices"][0]["delta"].get("content") or ""
                       for e in events[:-1] if e["choices"])

    async def then(model):
        out = await chat(client, model)
        done.append(model)
        return out["choices"][0]["message"]["content"]

    running = asyncio.create_task(streamed(long))
    while engine.batch_size == 0:
        await asyncio.sleep(0.01)
    foreign = asyncio.create_task(then("foreign"))
    await asyncio.sleep(0.1)
    tiny = asyncio.create_task(then("tiny"))  # queues behind the switch to "foreign"
    await asyncio.sleep(0.1)
    assert not running.done() and engine.queue_depth == 0 and engine.batch_size == 1
    text_long, text_foreign, text_tiny = await asyncio.gather(running, foreign, tiny)

    assert done == ["long", "foreign", "tiny"]
    assert text_foreign == mlx_lm_text(foreign_model)
    assert text_tiny == mlx_lm_text(tiny_pair[0])
    assert engine.switcher.switches == 2
    # The long request was not cut: its text is the one it has alone.
    alone = (await client.post("/v1/chat/completions", json=long)).json()
    assert alone["usage"]["completion_tokens"] == 1000
    assert text_long == alone["choices"][0]["message"]["content"]


async def test_every_route_that_tokenizes_switches(two_targets, foreign_model):
    client, _ = two_targets
    foreign_ids = load(str(foreign_model))[1].encode("hello world")
    r = await client.post("/tokenize", json={"model": "foreign", "prompt": "hello world",
                                              "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["tokens"] == foreign_ids
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hello",
                                                    "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    r = await client.post("/v1/messages/count_tokens", json={
        "model": "foreign", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    r = await client.post("/v1/responses", json={"model": "tiny", "input": "hi",
                                                  "max_output_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


async def test_unknown_names_are_404s_that_list_the_targets(two_targets):
    client, _ = two_targets
    r = await client.post("/v1/chat/completions", json=chat_body(model="other", max_tokens=1))
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and "'tiny' or 'foreign'" in error["message"]


async def test_a_target_that_fails_to_load_is_a_503_and_the_current_one_serves_on(
        tiny_pair, model_dir):
    corrupt = corrupt_copy(tiny_pair[0], model_dir / "corrupt-switch")
    more = [{"model": str(corrupt), "model_name": "broken"}]
    async with served(*tiny_pair, models={"more_targets": more}) as (client, _):
        r = await client.post("/v1/chat/completions", json=chat_body(model="broken",
                                                                     max_tokens=2))
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_unavailable"
        assert "'broken' could not be loaded" in r.json()["error"]["message"]
        out = await chat(client, str(tiny_pair[0]))
        assert out["choices"][0]["message"]["content"] == mlx_lm_text(tiny_pair[0])


def test_settings_refuse_two_targets_of_one_name(tiny_pair):
    with pytest.raises(ValueError, match="two targets are named 'tiny'"):
        Settings.load(None, models={"model": str(tiny_pair[0]), "model_name": "tiny",
                                    "more_targets": [{"model": "x", "model_name": "tiny"}]})
    settings = Settings.load(None, models={"more_targets": ["some/path"]})
    assert settings.models.more_targets[0].name == "some/path"  # a path alone


@pytest.mark.parametrize("case", ["incompatible draft", "missing folder"])
async def test_a_target_that_could_never_serve_fails_the_start(tiny_pair, foreign_model,
                                                               tmp_path, case):
    if case == "missing folder":
        more, error = [{"model": str(tmp_path / "nowhere")}], "model path not found"
    else:
        more, error = [{"model": str(foreign_model), "draft_model": str(tiny_pair[1])}], \
            "cannot draft for"
    with pytest.raises(Exception, match=error):
        async with served(*tiny_pair, models={"more_targets": more}):
            pass


class FakeEngine:
    """What TargetSwitcher needs of the engine: which entry serves, and a switch."""

    def __init__(self, entry):
        self.serving_entry, self.loads = entry, []

    async def switch_target(self, entry):
        await asyncio.sleep(0.01)
        self.loads.append(entry.name)
        self.serving_entry = entry


def fake_switcher(names="abc"):
    from server.engine.scheduling.switching import TargetEntry, TargetSwitcher

    entries = [TargetEntry(f"/m/{n}", n) for n in names]
    engine = FakeEngine(entries[0])
    return TargetSwitcher(engine, entries, max_waiting=8), engine


async def test_switches_follow_arrival_order_and_serve_every_waiter_of_a_target():
    switcher, engine = fake_switcher()
    log = []
    release = {name: asyncio.Event() for name in ("b1", "b2", "c", "a")}

    async def request(tag, model):
        async with switcher.hold(model):
            log.append((tag, engine.serving_entry.name))
            await release[tag].wait()

    async with switcher.hold("a"):
        tasks = [asyncio.create_task(request(tag, model)) for tag, model in
                 (("b1", "b"), ("c", "c"), ("a", "a"), ("b2", "b"))]
        await asyncio.sleep(0.05)
        assert log == [] and switcher.waiting == 4  # "a" queues behind the switch too
    await asyncio.sleep(0.05)
    assert log == [("b1", "b"), ("b2", "b")]  # one switch serves both
    release["b1"].set()
    await asyncio.sleep(0.05)
    assert engine.loads == ["b"]  # b2 still holds "b"
    release["b2"].set()
    await asyncio.sleep(0.05)
    release["c"].set()
    release["a"].set()
    await asyncio.gather(*tasks)
    assert engine.loads == ["b", "c", "a"] and switcher.waiting == 0
    assert [tag for tag, _ in log] == ["b1", "b2", "c", "a"]


async def test_a_waiter_that_goes_away_leaves_no_switch_behind():
    switcher, engine = fake_switcher()
    async with switcher.hold("a"):
        waiter = asyncio.create_task(switcher.hold("b").__aenter__())
        later = asyncio.create_task(switcher.hold("a").__aenter__())
        await asyncio.sleep(0.01)
        assert not later.done()
        waiter.cancel()
        await asyncio.sleep(0.01)
        assert later.done() and switcher.waiting == 0  # no longer behind a switch
    await asyncio.sleep(0.05)
    assert engine.loads == []


async def test_with_a_disk_cache_each_targets_prompts_come_back_after_a_switch(
        tiny_pair, foreign_model, tmp_path):
    more = [{"model": str(foreign_model), "model_name": "foreign"}]
    cache = {"disk_dir": str(tmp_path), "disk_max_gb": 1}
    body = chat_body("A long enough system of words " * 6, max_tokens=6, model="tiny")
    async with served(*tiny_pair, cache=cache,
                      models={"model_name": "tiny", "more_targets": more}) as (client, engine):
        first = (await client.post("/v1/chat/completions", json=body)).json()
        assert first["stats"]["cached_tokens"] == 0
        await wait_for_disk_entries(client, tmp_path)
        await chat(client, "foreign")  # the in-memory cache is emptied by the switch
        again = (await client.post("/v1/chat/completions", json=body)).json()
        assert engine.switcher.switches == 2 and again["stats"]["cached_tokens"] > 0
        assert again["choices"][0]["message"] == first["choices"][0]["message"]


async def test_after_an_admin_loaded_another_target_a_named_one_is_switched_back_to(
        tiny_pair, foreign_model, model_dir):
    more = [{"model": str(foreign_model), "model_name": "foreign"}]
    async with served(*tiny_pair, model_roots=[model_dir],
                      models={"model_name": "tiny", "more_targets": more}) as (client, engine):
        r = await client.post("/v1/models/target", json={"model": str(foreign_model),
                                                          "model_name": "adhoc"})
        assert r.status_code == 200
        roles = {m["id"]: m["role"] for m in (await client.get("/v1/models")).json()["data"]}
        assert roles == {"adhoc": "target", "tiny": "standby", "foreign": "standby"}
        assert (await chat(client, ""))["model"] == "adhoc"  # no name: whatever serves
        out = await chat(client, "tiny")
        assert out["model"] == "tiny" and engine.switcher.switches == 1
        assert out["choices"][0]["message"]["content"] == mlx_lm_text(tiny_pair[0])


async def test_discovered_targets_are_every_local_model_by_its_folder(tiny_pair, foreign_model,
                                                                      tmp_path):
    """`models.discover_targets`: each other model under the roots (a plain folder, and one
    in a Hugging Face cache's layout) is a standby target named by its folder, with its
    automatic draft; a request naming it switches to it and gets its own text."""
    import shutil

    root = tmp_path / "models"
    shutil.copytree(tiny_pair[0], root / "tiny")
    shutil.copytree(tiny_pair[1], root / "tiny-draft")
    snapshot = root / "hub" / "models--acme--foreign" / "snapshots" / "0123abc"
    shutil.copytree(foreign_model, snapshot)
    models = {"model_name": "served", "discover_targets": True, "model_roots": [str(root)]}
    async with served(root / "tiny", None, models=models,
                      model_roots=[root]) as (client, engine):
        listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert {name: m["role"] for name, m in listed.items()} == {
            "served": "target", "tiny-draft": "standby", "acme/foreign": "standby"}
        out = await chat(client, "acme/foreign")
        assert out["model"] == "acme/foreign"
        assert out["choices"][0]["message"]["content"] == mlx_lm_text(snapshot)
        # back to the first, and to the draft as a target of its own
        out = await chat(client, "served")
        assert out["choices"][0]["message"]["content"] == mlx_lm_text(root / "tiny")
        out = await chat(client, "tiny-draft")
        assert out["choices"][0]["message"]["content"] == mlx_lm_text(root / "tiny-draft")
    by_name = {e.name: e for e in engine.switcher.entries}
    assert by_name["served"].draft is None  # none was asked for at start
    assert by_name["acme/foreign"].draft is None  # no smaller model shares its tokenizer
