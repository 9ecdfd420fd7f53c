"""Which `model` names select the target: its served name, its path, "", and
`models.model_aliases` (names agents hard-code; "*" for any)."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
import pytest
from support.servers import make_settings, served_url, uvicorn_thread


@pytest.fixture(scope="module")
def aliased(tiny_pair):
    """A server with the aliases "gpt-4o-mini" and "claude-haiku-4-5": its URL and engine."""
    from server.http.app import build_engine, create_app

    settings = make_settings(*tiny_pair)
    settings.models.model_name = "served"
    settings.models.model_aliases = ["gpt-4o-mini", "claude-haiku-4-5"]
    engine = build_engine(settings)
    engine.start()
    try:
        with uvicorn_thread(create_app(settings, engine)) as url:
            yield url, engine
    finally:
        engine.stop()


def test_an_alias_selects_the_target_and_replies_name_the_served_model(aliased):
    url, _ = aliased
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for name in ("gpt-4o-mini", "served", ""):
        out = client.chat.completions.create(model=name, max_tokens=2,
                                             messages=[{"role": "user", "content": "hi"}])
        assert out.model == "served"
    assert client.models.retrieve("gpt-4o-mini").id == "served"
    with pytest.raises(openai.NotFoundError, match="'served'"):
        client.chat.completions.create(model="gpt-4o", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert "gpt-4o-mini" not in [m.id for m in client.models.list()]  # listed: served names


def test_an_anthropic_client_with_its_own_model_name(aliased):
    url, _ = aliased
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    message = client.messages.create(model="claude-haiku-4-5", max_tokens=2,
                                     messages=[{"role": "user", "content": "hi"}])
    assert message.model == "served"
    assert client.models.retrieve("claude-haiku-4-5").id == "served"


def test_the_star_alias_takes_any_name(aliased):
    url, engine = aliased
    body = {"model": "anything", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 404
    aliases, engine.model_aliases = engine.model_aliases, frozenset({"*"})
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == "served"
    finally:
        engine.model_aliases = aliases


def test_openai_agents_runs_with_the_name_config_yaml_serves(tiny_pair):
    """The Agents SDK reads a model string as `prefix/name` and refuses an unknown prefix
    (`models/...` of a path): config.yaml's served name is one it takes; the path still
    selects the target for the clients that send it."""
    from typing import Literal

    import agents
    from pydantic import BaseModel
    from support.paths import ROOT

    from server.config import Settings

    name = Settings.load(ROOT / "config.yaml").models.model_name

    class Sky(BaseModel):
        sky: Literal["sunny", "rainy"]

    with served_url(*tiny_pair, models={"model_name": name}) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(name="sky", instructions="Answer briefly.", model=name,
                             output_type=Sky, model_settings=agents.ModelSettings(
                                 temperature=0, max_tokens=60))
        config = agents.RunConfig(model_provider=agents.MultiProvider(openai_client=client),
                                  tracing_disabled=True)

        async def run():
            async with client:
                return await agents.Runner.run(agent, "Sunny?", run_config=config)

        result = asyncio.run(run())
        assert isinstance(result.final_output, Sky)
        by_path = httpx.post(f"{url}/v1/chat/completions", json={
            "model": str(tiny_pair[0]), "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        assert by_path.status_code == 200 and by_path.json()["model"] == name
