"""The playground page at GET / (issue 44): served from package data, off with `server.ui`, and
driven in a real browser (Debian's Chromium through playwright) against a tiny-pair server.

The browser tests stream a chat with prompt lookup on a repetitive prompt (so draft tokens are
certain), check the page against the API's own non-streamed answer, run Compare, load and unload
the draft from the admin panel, show a server error, and save screenshots to tests/artifacts/.
Without a browser they skip, except in CI (CI=true), where a missing browser fails them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from contextlib import ExitStack, contextmanager
from fnmatch import fnmatch

import httpx
import pytest
from support.http import chat_body
from support.paths import ROOT
from support.servers import make_settings, started_engine, uvicorn_thread

UI_DIR = ROOT / "server" / "http" / "admin" / "ui"
ARTIFACTS = ROOT / "tests" / "artifacts"  # gitignored
ADMIN_KEY = "playground-admin-key"
# Prompt lookup drafts from the context; a repeated phrase gives it matches from the first token.
REPETITIVE = "one two three four " * 8


def _screenshot_module():
    path = ROOT / "scripts" / "ui_screenshot.py"
    spec = importlib.util.spec_from_file_location("ui_screenshot", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ui = _screenshot_module()


# --- the page as HTTP serves it ------------------------------------------------------------------
@pytest.mark.anyio
async def test_the_page_and_its_assets_are_served(client):
    page = await client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'none'" in page.headers["content-security-policy"]
    for hook in ('<textarea id="prompt"', '<button id="send"', 'id="tps"', 'id="acceptance"'):
        assert hook in page.text
    for name, media in [("app.js", "text/javascript"), ("style.css", "text/css"),
                        ("favicon.svg", "image/svg+xml")]:
        r = await client.get(f"/ui/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media)
        assert r.content == (UI_DIR / name).read_bytes()


@pytest.mark.anyio
async def test_unknown_assets_are_404s_in_the_api_error_shape(client):
    for path in ["/ui/nope.js", "/ui/..%2Fapp.py", "/ui/"]:
        r = await client.get(path)
        assert r.status_code == 404, path
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.anyio
async def test_ui_false_turns_the_page_off(engine, tiny_pair):
    from server.http.app import create_app

    settings = make_settings(*tiny_pair, ui=False)
    app = create_app(settings, engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        for path in ["/", "/ui/app.js"]:
            r = await c.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_endpoint"
        assert (await c.get("/health")).status_code == 200


def test_ui_setting_comes_from_the_file_and_the_environment(tmp_path, monkeypatch):
    from server.config import Settings

    assert Settings.load(None).server.ui is True
    config = tmp_path / "c.yaml"
    config.write_text("server:\n  ui: false\n")
    assert Settings.load(config).server.ui is False
    monkeypatch.setenv("MLX_SPEC_SERVER__UI", "true")
    assert Settings.load(config).server.ui is True


def test_the_page_loads_nothing_from_elsewhere():
    """Every src/href is one of our /ui/ assets, and no asset names another host."""
    html = (UI_DIR / "index.html").read_text()
    links = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert links and all(link.startswith("/ui/") for link in links), links
    for name in ["index.html", "app.js", "style.css"]:
        text = (UI_DIR / name).read_text()
        assert not re.search(r"(https?:)?//[\w.-]+\.\w+/", text), name
        assert "@import" not in text and "url(" not in text, name


def test_the_package_ships_every_asset():
    """pyproject's package-data globs cover each file in server/http/admin/ui (wheels get them)."""
    from server.http.admin.playground import ASSETS

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["server.http.admin"]
    files = {p.name for p in UI_DIR.iterdir() if p.is_file()}
    assert files == set(ASSETS)
    for name in files:
        assert any(fnmatch(f"ui/{name}", g) for g in globs), name


# --- in a browser ---------------------------------------------------------------------------------
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    ARTIFACTS.mkdir(exist_ok=True)
    stack = ExitStack()
    try:
        browser = stack.enter_context(ui.chromium())
    except ui.BrowserUnavailable as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI needs a browser for the playground tests: {e}")
        pytest.skip(f"no browser can be driven here: {e}")
    with stack:
        yield browser


@contextmanager
def serving(app):
    """`app` served by uvicorn in a thread on a free loopback port: its port."""
    with uvicorn_thread(app) as url:
        yield int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def ui_server(tiny_pair):
    """A fresh tiny-pair engine (the admin tests swap its draft) served by uvicorn in a thread,
    with an admin key: (url, draft path)."""
    from server.http.app import build_engine, create_app

    settings = make_settings(*tiny_pair, admin_api_key=ADMIN_KEY)
    engine = build_engine(settings)
    engine.start()
    try:
        with serving(create_app(settings, engine)) as port:
            yield f"http://127.0.0.1:{port}", str(tiny_pair[1])
    finally:
        engine.stop()


# What the page may call: its own assets and endpoints the API already has.
PAGE_PATHS = {"/", "/ui/app.js", "/ui/style.css", "/ui/favicon.svg", "/health", "/metrics",
              "/v1/models",
              "/v1/models/draft", "/v1/models/draft/candidates", "/v1/chat/completions"}


class Page:
    """A playwright page on the playground that records console errors, uncaught ones, and
    every URL it requests."""

    def __init__(self, page):
        self.page, self.errors, self.requests = page, [], []
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        page.on("request", lambda r: self.requests.append(r.url))

    def spans(self, within: str, from_draft: str) -> list[str]:
        return self.page.locator(f"{within} span.tok[data-from-draft='{from_draft}']"
                                 ).all_inner_texts()

    def text(self, selector: str) -> str:
        return self.page.inner_text(selector)


@pytest.fixture()
def page(browser, ui_server):
    context = browser.new_context(viewport=ui.VIEWPORT)
    p = Page(context.new_page())
    p.page.goto(ui_server[0] + "/")
    p.page.wait_for_selector("#model-list li[data-role='target']")
    yield p
    context.close()
    origin = ui_server[0]
    assert all(url.startswith(origin + "/") for url in p.requests), p.requests
    assert {url[len(origin):] for url in p.requests} <= PAGE_PATHS


def settings(page: Page, drafter: str, max_tokens: int, k: int | None = None) -> None:
    page.page.select_option("#drafter", drafter)
    page.page.fill("#max-tokens", str(max_tokens))
    page.page.fill("#num-draft-tokens", "" if k is None else str(k))


@slow
def test_chat_streams_tokens_coloured_by_where_they_came_from(page, ui_server):
    settings(page, "prompt_lookup", 48, k=4)
    page.page.fill("textarea#prompt", REPETITIVE)
    before = ui.finished_runs(page.page)
    page.page.press("textarea#prompt", "Enter")  # Enter sends
    page.page.wait_for_selector(f"body:not([data-runs='{before}'])", state="attached")
    assert ui.page_error(page.page) is None

    drafted, target = page.spans("#chat", "true"), page.spans("#chat", "false")
    assert drafted and target, "both colours must show"
    expected = httpx.post(f"{ui_server[0]}/v1/chat/completions", timeout=60, json=chat_body(
        REPETITIVE, max_tokens=48, temperature=0, draft="prompt_lookup", num_draft_tokens=4,
        use_draft=True)).json()
    stats = expected["stats"]
    shown = "".join(page.page.locator("#chat .assistant span.tok").all_inner_texts())
    assert shown == expected["choices"][0]["message"]["content"]
    assert page.text("#acceptance") == f"{100 * stats['acceptance_rate']:.1f}%"
    assert page.text("#from-draft") == f"{100 * stats['from_draft_fraction']:.1f}%"
    assert float(page.text("#tps")) > 0
    assert page.text("#drafter-used").startswith("prompt_lookup")
    rows = page.page.locator("#k-histogram .bar-row").all_inner_texts()
    assert [r.split()[0] for r in rows] == [f"k={k}" for k in stats["k_histogram"]]
    assert page.text("#prompt") == ""
    page.page.screenshot(path=str(ARTIFACTS / "playground-chat.png"), full_page=True)
    assert page.errors == []


def metric_sums(url: str) -> dict[str, float]:
    """Each /metrics sample name's value, its labelled series summed; and each series' own,
    under `name{label="value",...}`."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            if sample.labels:
                labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
                sums[f"{sample.name}{{{labels}}}"] = sample.value
    return sums


@slow
def test_the_server_panel_shows_every_requests_figures(page, ui_server):
    settings(page, "prompt_lookup", 24, k=4)
    ui.ask(page.page, REPETITIVE)
    httpx.post(f"{ui_server[0]}/v1/chat/completions", timeout=60, json=chat_body(
        REPETITIVE, max_tokens=8, draft="prompt_lookup"))  # another client's request
    m = metric_sums(ui_server[0])
    generated = m["mlx_spec_generated_tokens_total"]
    accepted = m["mlx_spec_spec_decode_num_accepted_tokens_total"]
    deadline = time.monotonic() + 10  # the panel refreshes every 2 s
    while page.text("#srv-tokens") != str(int(generated)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert page.text("#srv-tokens") == str(int(generated)) and accepted > 0
    assert page.text("#srv-requests") == str(int(m["mlx_spec_completions_total"]))
    assert page.text("#srv-from-draft") == f"{100 * accepted / generated:.1f}%"
    proposed = m["mlx_spec_spec_decode_num_draft_tokens_total"]
    assert page.text("#srv-acceptance") == f"{100 * accepted / proposed:.1f}%"
    assert page.text("#srv-load") == "0 / 0"
    by_drafter = {s.rsplit(" ", 1)[0]: s.rsplit(" ", 1)[1]
                  for s in page.text("#srv-drafters").split(" \u00b7 ")}
    looked_up = 'mlx_spec_drafter_{}_tokens_total{{drafter="prompt_lookup"}}'
    assert by_drafter["prompt_lookup"] == \
        f"{100 * m[looked_up.format('accepted')] / m[looked_up.format('draft')]:.1f}%"
    assert not page.page.is_visible("#target-choice")  # one target: no Model list
    assert page.errors == []


@slow
def test_shift_enter_is_a_new_line_and_the_chat_keeps_its_history(page):
    settings(page, "off", 4)
    page.page.click("textarea#prompt")
    page.page.keyboard.type("first line")
    page.page.keyboard.press("Shift+Enter")
    page.page.keyboard.type("second line")
    assert page.page.input_value("textarea#prompt") == "first line\nsecond line"
    assert page.page.locator("#chat .message").count() == 0
    ui.run_and_wait(page.page, "#send")
    ui.ask(page.page, "and again")
    assert page.page.locator("#chat .message.user").all_inner_texts() == [
        "first line\nsecond line", "and again"]
    assert page.page.locator("#chat .assistant").count() == 2
    assert page.spans("#chat", "true") == [] and page.spans("#chat", "false")
    assert page.text("#acceptance") == "– (no draft)"
    assert page.errors == []


@slow
def test_compare_runs_with_and_without_speculation(page):
    settings(page, "prompt_lookup", 48, k=4)
    ui.ask(page.page, REPETITIVE, "#compare")
    speedup = page.page.get_attribute("#speedup", "data-speedup")
    assert speedup is not None and float(speedup) > 0
    assert re.fullmatch(r"speedup \d+\.\d\dx", page.text("#speedup"))
    assert page.spans("#compare-spec", "true"), "speculation drafts on a repetitive prompt"
    assert page.spans("#compare-plain", "true") == [] and page.spans("#compare-plain", "false")
    spec = "".join(page.page.locator("#compare-spec span.tok").all_inner_texts())
    plain = "".join(page.page.locator("#compare-plain span.tok").all_inner_texts())
    assert spec == plain  # greedy: speculation changes the speed, never the text
    assert "identical" in page.text("#compare-note")
    page.page.screenshot(path=str(ARTIFACTS / "playground-compare.png"), full_page=True)
    assert page.errors == []


@slow
def test_admin_panel_unloads_and_loads_the_draft(page, ui_server):
    url, draft_path = ui_server
    assert page.page.input_value("#draft-path") == draft_path  # from GET /v1/models
    page.page.fill("#admin-key", "wrong")
    page.page.click("#unload-draft")
    page.page.wait_for_selector("#admin-status.error")
    assert "401" in page.text("#admin-status")  # the server's answer, shown
    assert httpx.get(f"{url}/health").json()["draft"] is not None
    page.errors.clear()  # the browser logs the 401 response itself

    page.page.fill("#admin-key", ADMIN_KEY)
    page.page.click("#refresh-models")  # with the key, the draft candidates are offered
    page.page.wait_for_selector("#draft-candidates option", state="attached")
    options = page.page.eval_on_selector_all("#draft-candidates option",
                                             "os => os.map(o => [o.value, o.label])")
    assert [draft_path, True] in [[v, label.endswith("(loaded)")] for v, label in options]
    page.page.click("#unload-draft")
    page.page.wait_for_selector("#model-list:not(:has(li[data-role='draft']))")
    assert page.text("#admin-status").startswith("unloaded")
    assert page.text("#draft-name") == "none"
    assert httpx.get(f"{url}/health").json()["draft"] is None

    page.page.click("#load-draft")
    page.page.wait_for_selector("#model-list li[data-role='draft']")
    assert page.text("#admin-status").startswith("loaded")
    assert httpx.get(f"{url}/health").json()["draft"] is not None
    assert page.errors == []


@slow
def test_server_errors_show_in_the_page(page):
    settings(page, "hybrid", 8)
    page.page.fill("#temperature", "5")  # the server's range is [0, 2]
    page.page.fill("textarea#prompt", "hello")
    ui.run_and_wait(page.page, "#send")
    error = ui.page_error(page.page)
    assert error is not None and error.startswith("400") and "temperature" in error
    assert page.page.input_value("textarea#prompt") == "hello"  # kept, to retry
    assert all("400" in e for e in page.errors)  # only the browser's log of the response

    page.page.fill("#temperature", "0")
    page.page.fill("#json-schema", "{not json")
    ui.run_and_wait(page.page, "#send")
    assert ui.page_error(page.page).startswith("JSON schema: not valid JSON")


@slow
def test_json_schema_box_constrains_the_answer(page):
    import json

    settings(page, "hybrid", 64)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    page.page.fill("#json-schema", json.dumps(schema))
    ui.ask(page.page, "Answer in JSON")
    answer = "".join(page.page.locator("#chat .assistant span.tok").all_inner_texts())
    assert set(json.loads(answer)) == {"ok"}
    assert page.errors == []


@slow
def test_a_predicted_output_drafts_the_answer_and_compare_leaves_it_out(page, ui_server):
    """The guess goes with the drafting request only (a plain one would refuse it), and a
    right guess drafts most of the answer: green tokens, the same text."""
    settings(page, "hybrid", 32)
    expected = httpx.post(f"{ui_server[0]}/v1/chat/completions", timeout=60, json=chat_body(
        "hello", max_tokens=32, temperature=0)).json()["choices"][0]["message"]["content"]
    page.page.fill("#prediction", expected)
    sent = []
    page.page.on("request", lambda r: r.post_data and sent.append(json.loads(r.post_data)))
    ui.ask(page.page, "hello")
    shown = "".join(page.page.locator("#chat .assistant span.tok").all_inner_texts())
    assert shown == expected
    drafted = page.spans("#chat .assistant", "true")
    assert len(drafted) > len(page.spans("#chat .assistant", "false"))
    assert sent[-1]["prediction"] == {"type": "content", "content": expected}
    ui.ask(page.page, "hello", button="#compare")
    plain = [b for b in sent if b.get("use_draft") is False]
    assert plain and all("prediction" not in b for b in plain)
    assert any("prediction" in b for b in sent[-2:])
    assert page.errors == []


@slow
def test_a_thinking_model_reasoning_shows_apart_and_is_not_sent_back(browser, thinking_pair):
    """Reasoning tokens are in italics (`data-reasoning`) and coloured too; the next turn
    sends back the answer only."""
    from support.thinking_model import PROMPT

    from server.http.app import create_app

    context = browser.new_context(viewport=ui.VIEWPORT)
    try:
        with started_engine(*thinking_pair) as engine, \
                serving(create_app(make_settings(*thinking_pair), engine)) as port:
            url = f"http://127.0.0.1:{port}"
            page = Page(context.new_page())
            page.page.goto(url + "/")
            page.page.wait_for_selector("#model-list li[data-role='target']")
            page.page.fill("#max-tokens", "24")
            ui.ask(page.page, PROMPT)
            expected = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=chat_body(
                PROMPT, max_tokens=24, temperature=0)).json()["choices"][0]["message"]
            spans = page.page.locator("#chat .assistant span.tok[data-reasoning='true']")
            assert "".join(spans.all_inner_texts()) == expected["reasoning"]
            answer = page.page.locator("#chat .assistant span.tok:not([data-reasoning])")
            assert "".join(answer.all_inner_texts()) == expected["content"]
            assert spans.first.evaluate("e => getComputedStyle(e).fontStyle") == "italic"
            sent = []
            page.page.on("request", lambda r: r.post_data and sent.append(r.post_data))
            ui.ask(page.page, "And tomorrow?")
            history = json.loads(sent[-1])["messages"]
            assert history[1] == {"role": "assistant", "content": expected["content"]}
            assert page.errors == []
    finally:
        context.close()


@pytest.fixture()
def keyed_server(engine, tiny_pair):
    """The shared engine behind an app that wants an API key on /v1, served in a thread."""
    from server.http.app import create_app

    settings = make_settings(*tiny_pair, api_key="playground-api-key")
    with serving(create_app(settings, engine)) as port:
        yield f"http://127.0.0.1:{port}"


@slow
def test_the_api_key_field_unlocks_a_keyed_server(browser, keyed_server):
    context = browser.new_context(viewport=ui.VIEWPORT)
    page = Page(context.new_page())
    try:
        page.page.goto(keyed_server + "/")
        page.page.wait_for_selector("#admin-status.error")  # GET /v1/models without the key
        assert "401" in page.text("#admin-status")
        page.page.fill("#max-tokens", "8")
        page.page.fill("textarea#prompt", "hello")
        ui.run_and_wait(page.page, "#send")
        assert "invalid API key" in ui.page_error(page.page)

        page.page.fill("#api-key", "playground-api-key")
        ui.ask(page.page, "hello")
        assert page.page.locator("#chat .assistant span.tok").count() > 0
        page.page.click("#refresh-models")
        page.page.wait_for_selector("#model-list li[data-role='draft']")
        assert page.page.locator("#admin-status.error").count() == 0
        assert all("401" in e for e in page.errors) and len(page.errors) == 2
    finally:
        context.close()


FETCH = """async ([url, body]) => {
    try {
        const r = await fetch(url, {method: "POST", body: JSON.stringify(body),
                                    headers: {"Content-Type": "application/json"}});
        return {status: r.status, body: await r.json()};
    } catch (e) { return {error: String(e)}; }
}"""


@slow
def test_a_page_of_this_machine_may_call_the_api_unless_cors_is_off(browser, engine, tiny_pair):
    """A page from http://localhost:P calls http://127.0.0.1:P (another origin): the default
    lets it, `cors_origins: []` makes the browser refuse."""
    from server.http.app import create_app

    body = chat_body(max_tokens=4)
    with ExitStack() as stack:
        default, off = (stack.enter_context(serving(create_app(
            make_settings(*tiny_pair, cors_origins=origins), engine))) for origins in (None, []))
        context = browser.new_context()
        stack.callback(context.close)
        page = context.new_page()
        page.goto(f"http://localhost:{default}/health")
        allowed = page.evaluate(FETCH, [f"http://127.0.0.1:{default}/v1/chat/completions", body])
        assert allowed["status"] == 200
        assert allowed["body"]["usage"]["completion_tokens"] == 4
        refused = page.evaluate(FETCH, [f"http://127.0.0.1:{off}/v1/chat/completions", body])
        assert refused == {"error": "TypeError: Failed to fetch"}


@slow
def test_capture_screenshot_writes_a_png(ui_server, browser):
    out = ui.capture_screenshot(ui_server[0], ARTIFACTS / "capture.png", prompt=REPETITIVE,
                                max_tokens=16, browser=browser)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@slow
def test_with_several_targets_the_model_list_switches_the_server(browser, tiny_pair,
                                                                  foreign_model):
    from server.http.app import create_app

    more = {"more_targets": [{"model": str(foreign_model), "model_name": "foreign"}]}
    context = browser.new_context(viewport=ui.VIEWPORT)
    try:
        with started_engine(*tiny_pair, models=more) as engine, \
                serving(create_app(make_settings(*tiny_pair, models=more), engine)) as port:
            url = f"http://127.0.0.1:{port}"
            page = Page(context.new_page())
            page.page.goto(url + "/")
            page.page.wait_for_selector("#target-choice:not([hidden])")
            options = page.page.locator("#target option").all_inner_texts()
            assert options == [str(tiny_pair[0]), "foreign"]
            page.page.select_option("#target", "foreign")
            page.page.fill("#max-tokens", "8")
            ui.ask(page.page, "Write a function")
            assert page.text("#target-name") == "foreign"
            assert page.page.input_value("#target") == "foreign"
            expected = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=chat_body(
                max_tokens=8, temperature=0, model="foreign")).json()
            shown = "".join(page.page.locator("#chat .assistant span.tok").all_inner_texts())
            assert shown == expected["choices"][0]["message"]["content"]
            assert engine.switcher.switches == 1 and page.errors == []
    finally:
        context.close()
