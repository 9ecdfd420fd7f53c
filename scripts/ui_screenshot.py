"""Screenshot the playground page (GET /) answering a prompt: the README's picture.

    python scripts/ui_screenshot.py [--url http://127.0.0.1:8000] [--out docs/playground.png]
        [--prompt TEXT] [--max-tokens N] [--no-compare]

Needs a running server (`make serve`) and Debian's Chromium (`apt-get install chromium`) driven
by playwright (the dev extra): playwright's own browser download is not used. The page sends the
prompt, streams the answer with draft tokens coloured, then (unless --no-compare) runs Compare:
the same prompt with and without speculation. `capture_screenshot(base_url, path)` does the same
from Python (scripts/readme_examples.py); `chromium()` is the browser the tests use too.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

# Debian's package; CHROMIUM_PATH points elsewhere (macOS: a Chrome or Chromium binary).
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_OUT = Path("docs/playground.png")
DEFAULT_PROMPT = "Write a Python function `is_palindrome(s)` with a docstring."
VIEWPORT = {"width": 1280, "height": 900}
GENERATION_TIMEOUT_S = 300


class BrowserUnavailable(RuntimeError):
    """No browser to drive here: playwright or Chromium is not installed."""


@contextmanager
def _without_ld_preload() -> Iterator[None]:
    # `make test` preloads OpenBLAS; playwright's node driver inherits the environment and fails
    # to start with it (`pthread_create: Invalid argument`). The browser inherits the driver's.
    saved = os.environ.pop("LD_PRELOAD", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["LD_PRELOAD"] = saved


@contextmanager
def chromium(executable: str = CHROMIUM):
    """A headless Chromium (playwright's sync `Browser`), closed on exit."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise BrowserUnavailable(f"the playwright package is not installed ({e}); "
                                 "pip install -e '.[dev]'") from e
    if not Path(executable).exists():
        raise BrowserUnavailable(f"{executable} not found; install Debian's chromium as root "
                                 "(apt-get install chromium; `make test` tries)")
    with _without_ld_preload():
        playwright = sync_playwright().start()
        try:
            browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        except BaseException:
            playwright.stop()
            raise
    try:
        yield browser
    finally:
        browser.close()
        playwright.stop()


def finished_runs(page) -> int:
    """How many generations (send or compare) the page has finished, failed ones included."""
    page.wait_for_selector("body[data-runs]", state="attached")
    return int(page.get_attribute("body", "data-runs"))


def run_and_wait(page, button: str, timeout_s: float = GENERATION_TIMEOUT_S) -> None:
    """Press `button` (#send or #compare) and wait until that generation has ended."""
    before = finished_runs(page)
    page.click(button)
    # A selector, not a JS predicate: the page's Content-Security-Policy forbids eval.
    page.wait_for_selector(f"body:not([data-runs='{before}'])", state="attached",
                           timeout=timeout_s * 1000)


def page_error(page) -> str | None:
    """The server error the page shows, if any."""
    box = page.locator("#error")
    return None if box.is_hidden() else box.inner_text()


def ask(page, prompt: str, button: str = "#send") -> None:
    """Type `prompt`, press `button` (#send or #compare), wait for the answer; raise on an error
    the page shows."""
    page.fill("textarea#prompt", prompt)
    run_and_wait(page, button)
    error = page_error(page)
    if error:
        raise RuntimeError(f"the page shows an error: {error}")


def capture_screenshot(base_url: str, path: str | Path, *, prompt: str = DEFAULT_PROMPT,
                       max_tokens: int = 96, compare: bool = True, browser=None) -> Path:
    """Open the playground at `base_url`, ask `prompt` (then Compare it), save a PNG at `path`.

    `browser`: a running playwright Browser to use (one playwright per thread); default: start
    `chromium()` for this call."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        browser = browser or stack.enter_context(chromium())
        context = browser.new_context(viewport=VIEWPORT)
        stack.callback(context.close)
        page = context.new_page()
        page.goto(base_url.rstrip("/") + "/")
        page.fill("#max-tokens", str(max_tokens))
        ask(page, prompt)
        if compare:
            ask(page, prompt, "#compare")
        page.screenshot(path=str(path), full_page=True)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=DEFAULT_URL, help="the server's base URL")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the PNG goes")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--no-compare", action="store_true", help="only the chat answer")
    args = p.parse_args(argv)
    out = capture_screenshot(args.url, args.out, prompt=args.prompt, max_tokens=args.max_tokens,
                             compare=not args.no_compare)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
