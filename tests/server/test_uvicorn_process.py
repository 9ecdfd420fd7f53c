"""A real `python -m server` process: the OpenAI SDK against it, and client disconnects."""

from __future__ import annotations

import time

import httpx
import pytest
from mlx_lm import generate
from support.servers import running_server


@pytest.fixture(scope="module")
def server_url(tiny_pair, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(["--model", str(tiny_pair[0]), "--draft-model", str(tiny_pair[1]),
                         "--num-draft-tokens", "3"], log) as url:
        yield url


@pytest.fixture(scope="module")
def sdk(server_url):
    openai = pytest.importorskip("openai")  # a dev extra; `make test` installs it
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused")


def test_sdk_non_streaming_matches_mlx(sdk, loaded_pair, tiny_pair):
    target, tokenizer, _ = loaded_pair
    messages = [{"role": "user", "content": "Write a function"}]
    expected = generate(target, tokenizer,
                        tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                        max_tokens=16)
    r = sdk.chat.completions.create(model=str(tiny_pair[0]), messages=messages, max_tokens=16,
                                    temperature=0)
    assert r.choices[0].message.content == expected
    assert r.usage.completion_tokens == 16
    assert r.model_extra["stats"]["draft_tokens_proposed"] > 0


def test_sdk_streaming(sdk, tiny_pair):
    messages = [{"role": "user", "content": "Write a function"}]
    full = sdk.chat.completions.create(model=str(tiny_pair[0]), messages=messages,
                                       max_tokens=16).choices[0].message.content
    stream = sdk.chat.completions.create(model=str(tiny_pair[0]), messages=messages,
                                         max_tokens=16, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == 16
    flags = [c.choices[0].model_extra["from_draft"] for c in chunks
             if c.choices and c.choices[0].finish_reason is None]
    assert len(flags) == 16 and any(flags)
    completion = sdk.completions.create(model=str(tiny_pair[0]), prompt="def f(", max_tokens=5)
    assert completion.usage.completion_tokens == 5


def test_sdk_error_is_raised_as_bad_request(sdk):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="x", messages=[], max_tokens=3)


def test_client_disconnect_frees_the_worker(server_url):
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 100_000,
            "stream": True, "use_draft": False}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{server_url}/v1/chat/completions", json=body) as r:
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data:")
                if lines == 3:
                    break
        deadline = time.monotonic() + 10
        while client.get(f"{server_url}/health").json()["queue_depth"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get(f"{server_url}/health").json()["queue_depth"] == 0
        r = client.post(f"{server_url}/v1/chat/completions",
                        json={"messages": body["messages"], "max_tokens": 3})
        assert r.status_code == 200


def test_head_is_get_without_the_body(server_url):
    for path in ["/health", "/v1/models", "/"]:
        got, head = httpx.get(server_url + path), httpx.head(server_url + path)
        assert head.status_code == got.status_code == 200, path
        assert head.content == b"" and head.headers["content-length"] == str(len(got.content))
        assert head.headers["content-type"] == got.headers["content-type"]
    r = httpx.head(server_url + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.content == b""
    r = httpx.request("HEAD", server_url + "/v1/nothing")
    assert r.status_code == 404
