"""Hostile and careless input (issue 12): every input the issue lists, as a table input -> status.

`pytest tests/test_hardening.py -v` prints the table: each row's id is the input, its expected
status is in the row. After each one a normal request must still be served.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from support.http import chat_body
from support.paths import ROOT
from support.servers import make_settings, served

from server.http.app import create_app

pytestmark = pytest.mark.anyio

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
LOAD, COMPAT = "/v1/models/draft", "/v1/models/draft/compatibility"
MSG = [{"role": "user", "content": "hi"}]
VOCAB = "<vocab>"  # replaced by the loaded model's vocabulary size
CONTEXT = 4096  # the tiny pair's max_position_embeddings


def sampled(**extra):
    return {"messages": MSG, "max_tokens": 4, "temperature": 0.7, "use_draft": False, **extra}


# (input, url, body (dict, or raw bytes), status, error param or None)
GENERATION_INPUTS = [
    ("top_k = vocab size (the poisoning request)", CHAT, sampled(top_k=VOCAB), 200, None),
    ("top_k = vocab size + 1", CHAT, sampled(top_k=f"{VOCAB}+1"), 400, "top_k"),
    ("seed -1", CHAT, sampled(seed=-1), 400, "seed"),
    ("seed 2**64", CHAT, sampled(seed=2**64), 400, "seed"),
    ("seed 2**64 - 1", CHAT, sampled(seed=2**64 - 1), 200, None),
    ("logit_bias key '²'", CHAT, sampled(logit_bias={"²": 1}), 400, "logit_bias"),
    ("logit_bias key '--5'", CHAT, sampled(logit_bias={"--5": 1}), 400, "logit_bias"),
    ("logit_bias key '-5'", CHAT, sampled(logit_bias={"-5": 1}), 400, "logit_bias"),
    ("logit_bias key of 5000 digits", CHAT, sampled(logit_bias={"9" * 5000: 1}), 400,
     "logit_bias"),
    ("logit_bias key = vocab size", CHAT, sampled(logit_bias={VOCAB: 1}), 400, "logit_bias"),
    ("logit_bias value Infinity", CHAT, b'{"messages": [{"role": "user", "content": "hi"}],'
     b' "logit_bias": {"1": Infinity}}', 400, "logit_bias.1"),
    ("repetition_penalty 5e-324 with logprobs", CHAT,
     sampled(repetition_penalty=5e-324, logprobs=True), 400, "repetition_penalty"),
    ("repetition_penalty 0.01 with logprobs", CHAT,
     sampled(repetition_penalty=0.01, logprobs=True, top_logprobs=20), 200, None),
    ("prompt of 6,408 tokens (context 4,096)", TEXT,
     {"prompt": [5] * 6408, "max_tokens": 4}, 400, "prompt"),
    ("chat prompt longer than the context", CHAT,
     {"messages": [{"role": "user", "content": "hi " * 9000}], "max_tokens": 4}, 400,
     "messages"),
    ("max_tokens 10**9", CHAT, sampled(max_tokens=10**9), 400, "max_tokens"),
    ("max_tokens 2**63", CHAT, sampled(max_tokens=2**63), 400, "max_tokens"),
    ("max_completion_tokens 10**9", CHAT, sampled(max_completion_tokens=10**9), 400,
     "max_completion_tokens"),
    ("temperature 1e-300", CHAT, sampled(temperature=1e-300), 400, "temperature"),
    ("temperature 1e-5 (the minimum)", CHAT, sampled(temperature=1e-5), 200, None),
    ("temperature NaN", CHAT, b'{"messages": [{"role": "user", "content": "hi"}],'
     b' "temperature": NaN}', 400, "temperature"),
    ('n "1"', CHAT, sampled(n="1"), 400, "n"),
    ('stream "yes"', CHAT, sampled(stream="yes"), 400, "stream"),
    ('max_tokens "4"', CHAT, sampled(max_tokens="4"), 400, "max_tokens"),
    ('temperature "0.5"', CHAT, sampled(temperature="0.5"), 400, "temperature"),
    ("max_tokens 4.0", CHAT, sampled(max_tokens=4.0), 400, "max_tokens"),
    ("logprobs 1 (chat takes a bool)", CHAT, sampled(logprobs=1), 400, "logprobs"),
    ("top_k 4.5", CHAT, sampled(top_k=4.5), 400, "top_k"),
    ("lone surrogate in a message", CHAT,
     b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 3}', 400, None),
    ("lone surrogate in a prompt", TEXT, b'{"prompt": "a\\udfff", "max_tokens": 3}', 400, None),
    ("lone surrogate in a logit_bias key", CHAT,
     b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"\\udc00": 1}}', 400,
     None),
    ("model name of 100,000 characters", CHAT, sampled(model="m" * 100_000), 400, "model"),
    ("prompt token id -1", TEXT, {"prompt": [-1], "max_tokens": 3}, 400, "prompt"),
    ("JSON nested 5,000 deep", CHAT, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     None),
    ("max_tokens of 5,000 digits", CHAT,
     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + b"0" * 5000 + b"}",
     400, None),
]


def _fill(value, vocab: int):
    if value == VOCAB:
        return vocab
    if value == f"{VOCAB}+1":
        return vocab + 1
    if isinstance(value, dict):
        return {_fill_key(k, vocab): _fill(v, vocab) for k, v in value.items()}
    return value


def _fill_key(key, vocab: int):
    return str(vocab) if key == VOCAB else key


async def _post(client, url, body, vocab):
    if isinstance(body, bytes):
        return await client.post(url, content=body, headers={"content-type": "application/json"})
    return await client.post(url, json=_fill(body, vocab))


def _assert_error(r, status, param):
    assert r.status_code == status, r.text
    if status >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param is not None:
            assert error["param"] == param, error


@pytest.mark.parametrize("name, url, body, status, param", GENERATION_INPUTS,
                         ids=[row[0] for row in GENERATION_INPUTS])
async def test_generation_input(client, engine, name, url, body, status, param):
    r = await _post(client, url, body, engine.target.vocab_size)
    _assert_error(r, status, param)
    if status == 200:
        json.loads(r.text)  # strict JSON: no NaN/Infinity literals
    ok = await client.post(CHAT, json=chat_body(max_tokens=2))
    assert ok.status_code == 200, ok.text


async def test_context_errors_name_both_numbers(client):
    r = await client.post(TEXT, json={"prompt": [5] * 6408, "max_tokens": 4})
    message = r.json()["error"]["message"]
    assert "4096" in message and "6408" in message, message
    r = await client.post(CHAT, json=sampled(max_tokens=10**9))
    message = r.json()["error"]["message"]
    assert str(CONTEXT) in message and str(10**9) in message and "at most" in message, message


async def test_default_max_tokens_is_cut_to_the_context_left(client):
    """No max_tokens: OpenAI-style, generation stops where the context ends (finish: length)."""
    prompt = [5] * (CONTEXT - 3)
    r = await client.post(TEXT, json={"prompt": prompt, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] <= 3
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] <= CONTEXT


async def test_poisoning_request_then_20_sampled_requests(client, engine):
    """Issue 12's sequence: top_k = vocab once, then 20 unseeded sampled requests: all 200."""
    poison = sampled(top_k=engine.target.vocab_size)
    assert (await client.post(CHAT, json=poison)).status_code == 200
    statuses = [(await client.post(CHAT, json=sampled())).status_code for _ in range(20)]
    assert statuses == [200] * 20, statuses


def test_non_finite_logprobs_are_sent_as_openai_does():
    from api_schemas.openai import LOGPROB_FLOOR, CompletionLogprobs, TokenLogprob, TopLogprob

    top = TopLogprob(token="a", logprob=-math.inf)
    token = TokenLogprob(token="b", logprob=math.nan, top_logprobs=[top])
    assert json.loads(token.model_dump_json())["logprob"] == LOGPROB_FLOOR
    dumped = token.model_dump(mode="json")
    assert dumped["logprob"] == LOGPROB_FLOOR
    assert dumped["top_logprobs"][0]["logprob"] == LOGPROB_FLOOR
    text = CompletionLogprobs(tokens=["a"], token_logprobs=[-math.inf],
                              top_logprobs=[{"a": -math.inf}], text_offset=[0])
    assert json.loads(json.dumps(text.model_dump(mode="json"), allow_nan=False)) == {
        "tokens": ["a"], "token_logprobs": [LOGPROB_FLOOR],
        "top_logprobs": [{"a": LOGPROB_FLOOR}], "text_offset": [0]}


# ------------------------------------------------------------------------- paths and hub ids
@pytest.fixture()
async def path_env(tiny_pair, model_dir, monkeypatch):
    """Default roots (models/ under the working directory, the start-up models' folders) plus
    HOME, so `~/...` is allowed and its absence shows as a 404."""
    monkeypatch.chdir(ROOT)
    async with served(*tiny_pair, model_roots=[Path("models"), model_dir, Path.home()]) as env:
        yield env


def _corrupt_folders(tiny_pair, model_dir) -> dict[str, Path]:
    """Copies of the draft: garbage weights, weights cut short, no weights, no config."""
    out = {}
    for name, damage in {
        "garbage weights": lambda d: (d / "model.safetensors").write_bytes(b"not safetensors"),
        "truncated weights": lambda d: _truncate(d / "model.safetensors"),
        "no weights": lambda d: (d / "model.safetensors").unlink(),
        "no config.json": lambda d: (d / "config.json").unlink(),
    }.items():
        folder = model_dir / ("hardening-" + name.replace(" ", "-").replace(".", "-"))
        if not folder.exists():
            shutil.copytree(tiny_pair[1], folder)
            damage(folder)
        out[name] = folder
    return out


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


PATH_INPUTS = [
    # (input, model string, load status, compatibility status)
    ("missing relative path with a slash", "models/no-such-model", 404, 404),
    ("missing ./ path", "./models/no-such-model", 404, 404),
    ("missing ~ path", "~/no-such-model-xyz", 404, 404),
    ("missing absolute path under a root", "{model_dir}/no-such-model", 404, 404),
    ("NUL byte", "models/x\x00y", 400, 400),
    ("NUL byte in a hub-looking id", "org/na\x00me", 400, 400),
    ("~user that does not exist", "~nosuchuser/models/x", 400, 400),
    ("path traversal", "models/../../../etc", 403, 403),
    ("absolute path outside the roots", "/etc", 403, 403),
    ("hub id without an admin key", "some-org/some-model", 403, 403),
    ("a 2,000-character path", "models/" + "a" * 2000, 400, 400),
    ("a 300-character file name", "models/" + "a" * 300, 400, 400),
]


@pytest.mark.parametrize("name, ref, load_status, compat_status", PATH_INPUTS,
                         ids=[row[0] for row in PATH_INPUTS])
async def test_model_path_input(path_env, model_dir, tiny_pair, name, ref, load_status,
                                compat_status):
    client, _ = path_env
    ref = ref.format(model_dir=model_dir)
    for url, status in ((LOAD, load_status), (COMPAT, compat_status)):
        r = await client.post(url, json={"model": ref})
        _assert_error(r, status, "model")
        _assert_no_server_paths(r.json()["error"]["message"], model_dir)
    health = (await client.get("/health")).json()
    assert health["draft"] == str(tiny_pair[1])  # a failed load leaves the draft in place
    assert (await client.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200


def _assert_no_server_paths(message: str, model_dir: Path) -> None:
    for path in (Path.cwd(), Path.home(), model_dir, Path("models").resolve()):
        assert str(path) not in message or str(path) == "/", message


@pytest.mark.parametrize("damage", ["garbage weights", "truncated weights", "no weights",
                                    "no config.json"])
async def test_corrupt_folder_is_not_compatible(path_env, tiny_pair, model_dir, damage):
    client, _ = path_env
    folder = _corrupt_folders(tiny_pair, model_dir)[damage]
    r = await client.post(COMPAT, json={"model": str(folder)})
    assert r.status_code == 200, r.text
    verdict = r.json()
    assert verdict["compatible"] is False and verdict["reason"], verdict
    _assert_no_server_paths(verdict["reason"], model_dir)
    r = await client.post(LOAD, json={"model": str(folder)})
    assert r.status_code in (400, 404), r.text
    _assert_no_server_paths(r.json()["error"]["message"], model_dir)
    assert (await client.get("/health")).json()["draft"] == str(tiny_pair[1])


async def test_error_messages_hide_the_roots(path_env, tmp_path, model_dir):
    client, _ = path_env
    r = await client.post(LOAD, json={"model": str(tmp_path)})
    assert r.status_code == 403
    message = r.json()["error"]["message"]
    assert str(model_dir) not in message and str(Path.home()) + "/" not in message, message


# --------------------------------------------------------------------------- safe defaults
async def test_public_bind_without_admin_key_refuses_model_changes(tiny_pair, engine, caplog):
    settings = make_settings(*tiny_pair, host="0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="server.http.common.auth"):
        app = create_app(settings, engine)
    assert any("admin_api_key" in rec.getMessage() for rec in caplog.records)
    assert app.state.access.allow_hub is False
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        for method, url, body in (("POST", LOAD, {"model": str(tiny_pair[1])}),
                                  ("DELETE", LOAD, None)):
            r = await client.request(method, url, json=body)
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["code"] == "model_changes_disabled"
            assert "admin_api_key" in error["message"]
        r = await client.post(COMPAT, json={"model": str(tiny_pair[1])})
        assert r.status_code == 200 and r.json()["compatible"] is True
        assert (await client.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200


@pytest.mark.parametrize("host, admin_key, allow_hub, hub", [
    ("127.0.0.1", None, None, False),
    ("127.0.0.1", None, True, False),  # hub downloads are for admin-key holders only
    ("127.0.0.1", "k", None, True),
    ("0.0.0.0", "k", False, False),
])
def test_hub_default_follows_the_admin_key(tiny_pair, engine, host, admin_key, allow_hub, hub):
    settings = make_settings(*tiny_pair, host=host, admin_api_key=admin_key)
    settings.models.allow_hub = allow_hub
    assert create_app(settings, engine).state.access.allow_hub is hub


@pytest.fixture()
async def hub_env(tiny_pair, model_dir, monkeypatch):
    """An admin key and hub access; the 'download' returns the tiny draft and notes its thread."""
    import server.http.admin.model_access as model_access

    threads = []

    def fake_download(repo_id):
        threads.append(threading.current_thread().name)
        return str(tiny_pair[1])

    monkeypatch.setattr(model_access, "_download", fake_download)
    async with served(*tiny_pair, model_roots=[model_dir], admin_api_key="admin") as (c, e):
        yield c, e, threads


async def test_hub_ids_only_for_admin_key_holders_and_off_the_mlx_thread(hub_env):
    client, _, threads = hub_env
    admin = {"Authorization": "Bearer admin"}
    for url in (LOAD, COMPAT):
        r = await client.post(url, json={"model": "some-org/some-model"})
        assert r.status_code == 401, r.text
    assert threads == []
    r = await client.post(COMPAT, json={"model": "some-org/some-model"}, headers=admin)
    assert r.status_code == 200 and r.json()["compatible"] is True, r.text
    r = await client.post(LOAD, json={"model": "some-org/some-model"}, headers=admin)
    assert r.status_code == 200, r.text
    assert len(threads) == 2 and all(name != "mlx-engine" for name in threads), threads
    assert threading.main_thread().name not in threads  # not the event loop either


async def test_admin_strict_types(path_env, tiny_pair):
    client, _ = path_env
    r = await client.post(LOAD, json={"model": str(tiny_pair[1]), "num_draft_tokens": "3"})
    _assert_error(r, 400, "num_draft_tokens")
    r = await client.post(COMPAT, json={"model": 5})
    _assert_error(r, 400, "model")


# ------------------------------------------------------------------------------ OpenAPI
async def test_openapi_lists_real_statuses_and_event_streams(client):
    doc = (await client.get("/openapi.json")).json()
    assert "422" not in json.dumps(doc["paths"])
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    error_ref = "#/components/schemas/ErrorResponse"
    expected = {
        ("/v1/chat/completions", "post"): {"200", "400", "401", "404", "413", "503"},
        ("/v1/completions", "post"): {"200", "400", "401", "404", "413", "503"},
        ("/v1/models/draft", "post"): {"200", "400", "401", "403", "404", "409", "413"},
        ("/v1/models/draft", "delete"): {"200", "401", "403", "404"},
        ("/v1/models/draft/compatibility", "post"): {"200", "400", "401", "403", "404",
                                                      "413"},
    }
    for (path, method), codes in expected.items():
        responses = doc["paths"][path][method]["responses"]
        assert set(responses) == codes, (path, method, set(responses))
        for code in codes - {"200"}:
            assert responses[code]["content"]["application/json"]["schema"]["$ref"] == error_ref
    for path in ("/v1/chat/completions", "/v1/completions"):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
    assert "Retry-After" in doc["paths"][CHAT]["post"]["responses"]["503"]["headers"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    seed = next(s for s in chat["seed"]["anyOf"] if s.get("type") == "integer")
    assert seed["minimum"] == 0 and seed["exclusiveMaximum"] == 2**64


# ------------------------------------------------------- one request cannot break the next
@pytest.mark.parametrize("asked", [{"use_draft": False}, {}],
                         ids=["use_draft false", "draft by default"])
async def test_request_that_did_not_ask_for_the_draft_survives_its_unload(tiny_pair, asked):
    import asyncio

    async with served(*tiny_pair) as (client, engine):
        body = chat_body(max_tokens=2000, ignore_eos=True, **asked)
        running = asyncio.create_task(client.post(CHAT, json=body))
        while engine.batch_size == 0:  # decoding has started
            await asyncio.sleep(0.005)
        assert (await client.delete(LOAD)).status_code == 200
        assert not running.done()  # the unload came mid-generation
        r = await running
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 2000
        assert (await client.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200


# ------------------------------------------------- an explicit drafter must be available
NO_DRAFT_MODEL = [
    # (request fields, server default drafter, status, param)
    ({"draft": "model"}, "model", 400, "draft"),
    ({"draft": "hybrid"}, "model", 400, "draft"),
    ({"draft": "hybrid", "num_draft_tokens": 3}, "hybrid", 400, "draft"),
    ({"num_draft_tokens": 3}, "model", 400, "num_draft_tokens"),
    ({"use_draft": True}, "model", 400, "use_draft"),
    ({"draft": "prompt_lookup", "num_draft_tokens": 3}, "model", 200, "prompt_lookup"),
    ({"num_draft_tokens": 3}, "hybrid", 400, "num_draft_tokens"),  # asked: the draft model
    ({"use_draft": True}, "hybrid", 400, "use_draft"),
    # the server's default goes on quietly with the host drafters
    ({}, "hybrid", 200, "prompt_lookup+suffix"),
    ({"draft": "suffix"}, "model", 200, "suffix"),
    ({}, "model", 200, None),
    ({"draft": "model", "use_draft": False}, "model", 200, None),  # off wins
]


@pytest.mark.parametrize("url", [CHAT, TEXT])
@pytest.mark.parametrize("fields, default, status, expected", NO_DRAFT_MODEL,
                         ids=[f"{d} default, {f}" for f, d, _, _ in NO_DRAFT_MODEL])
async def test_an_explicit_drafter_that_is_not_loaded_is_a_400(tiny_pair, monkeypatch, url,
                                                               fields, default, status,
                                                               expected):
    """`expected`: the 400's param, or the 200's stats.draft_model."""
    monkeypatch.setenv("MLX_SPEC_DEFAULTS__DRAFT", default)
    body = {"max_tokens": 4, **fields, **({"messages": MSG} if url == CHAT else {"prompt": "a"})}
    async with served(tiny_pair[0], None) as (client, _):
        r = await client.post(url, json=body)
        stream = await client.post(url, json={**body, "stream": True})
    assert (r.status_code, stream.status_code) == (status, status), r.text
    if status == 400:
        _assert_error(r, 400, expected)
        message = r.json()["error"]["message"]
        assert "Drafters available now: prompt_lookup" in message, message
        assert stream.json() == r.json()
    else:
        assert r.json()["stats"]["draft_model"] == expected


def test_a_scheduler_call_whose_event_loop_closed_leaves_the_engine_running(engine, tiny_pair,
                                                                           caplog):
    """An admin or embedding call settles its future on the event loop that asked; when that
    loop has closed (its server stopped), the MLX thread must not raise: it would fail every
    running request (the batch test's case for a request's events)."""
    import asyncio

    from server.engine.service import _settler

    loop = asyncio.new_event_loop()
    future = loop.create_future()
    loop.close()
    ran = threading.Event()
    engine.scheduler.call(ran.set, _settler(loop, future))
    assert ran.wait(10)

    async def still_serving() -> int:
        app = create_app(make_settings(*tiny_pair), engine)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as client:
            r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=3))
            return r.status_code

    assert asyncio.run(still_serving()) == 200
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
