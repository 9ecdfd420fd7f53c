"""`models.chat_template` and `models.chat_template_kwargs` against `mlx_lm.load(...,
tokenizer_config={"chat_template": ...})`, the way `mlx_lm.server --chat-template` loads one."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from mlx_lm import generate, load
from pydantic import ValidationError
from support.http import chat_body
from support.servers import make_settings

from server.config import Settings
from server.engine.errors import ModelLoadError
from server.engine.models.model_kit import load_model

TEMPLATE = ("{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
            "{% if greeting is defined %}({{ greeting }}) {% endif %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Write a function"}]
MAX = 16


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """mlx_lm with the template: (model, tokenizer)."""
    return load(str(tiny_pair[0]), tokenizer_config={"chat_template": TEMPLATE})


@pytest.fixture(scope="module")
def client(tiny_pair, template_file):
    from server.http.app import build_engine, create_app

    settings = make_settings(*tiny_pair)
    settings.models.chat_template = str(template_file)
    settings.models.chat_template_kwargs = {"greeting": "hello"}
    engine = build_engine(settings)
    engine.start()
    try:
        with TestClient(create_app(settings, engine)) as client:
            yield client
    finally:
        engine.stop()


def rendered(tokenizer, **kwargs) -> list[int]:
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs)


def test_the_file_replaces_the_tokenizers_template(client, reference):
    model, tokenizer = reference
    r = client.post("/tokenize", json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == rendered(tokenizer, greeting="hello")
    expected = generate(model, tokenizer, rendered(tokenizer, greeting="hello"), max_tokens=MAX)
    for extra in ({"num_draft_tokens": 3}, {"use_draft": False}):
        body = {"messages": MESSAGES, "max_tokens": MAX, "temperature": 0, **extra}
        r = client.post("/v1/chat/completions", json=body)
        assert r.json()["choices"][0]["message"]["content"] == expected


def test_a_requests_variables_win_over_the_servers(client, reference):
    _, tokenizer = reference
    r = client.post("/tokenize", json={"messages": MESSAGES,
                                       "chat_template_kwargs": {"greeting": "hey"}})
    assert r.json()["tokens"] == rendered(tokenizer, greeting="hey")
    assert r.json()["tokens"] != rendered(tokenizer, greeting="hello")
    r = client.post("/v1/chat/completions",
                    json=chat_body(max_tokens=2, chat_template_kwargs={"tools": []}))
    assert r.status_code == 400  # reserved, as without a server default


def test_an_inline_template_and_a_broken_one(tiny_pair, reference):
    loaded = load_model(str(tiny_pair[0]), chat_template=TEMPLATE)
    assert loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True) == \
        rendered(reference[1])
    with pytest.raises(ModelLoadError, match="cannot render a user message"):
        load_model(str(tiny_pair[0]), chat_template="{% for m in messages %}{{ m.content }}")
    with pytest.raises(ModelLoadError, match="chat template file not found"):
        load_model(str(tiny_pair[0]), chat_template="no/such/template.jinja")


def test_reserved_variables_are_refused_in_the_settings():
    with pytest.raises(ValidationError, match="may not set add_generation_prompt"):
        Settings.load(None, models={"chat_template_kwargs": {"add_generation_prompt": False}})
