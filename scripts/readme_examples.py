"""Run every command README.md shows and capture what it prints.

    python scripts/readme_examples.py [--config config.yaml] [--model P] [--draft-model P]
        [--out build/readme] [--write-readme | --check]

Starts `python -m server` (the models `config.yaml` serves unless `--model/--draft-model` say
otherwise), runs each example against it (the curl commands as httpx calls with the same JSON
bodies, the OpenAI SDK snippet, `python -m server.demo`, the bench smoke), and writes each output
to `OUT/<name>.json|txt` plus `OUT/meta.json` (date, machine, cores, models, commit).

- `--write-readme` replaces what lies between `<!-- readme-example: NAME -->` and
  `<!-- /readme-example -->` in README.md with the command and its captured output (the text
  around the markers stays hand-written), and captures the playground page answering into
  docs/playground.png (scripts/ui_screenshot.py; needs Chromium).
- `--check` compares each captured output with the README's block of the same name by shape
  (JSON keys, line structure; not numbers or generated text) and exits 1 on any difference, or
  when the README and this script do not name the same examples.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path("build/readme")  # git ignores build/
SHOWN_URL = "http://127.0.0.1:8000"  # what the README's commands say
MARKER = re.compile(r"<!-- readme-example: ([\w-]+) -->\n(.*?)<!-- /readme-example -->",
                    re.DOTALL)
# A code block; its fence is longer than any run of backticks inside (model output may hold ```).
FENCE = re.compile(r"^(`{3,})(\w*)\n(.*?)\n\1[ \t]*$", re.DOTALL | re.MULTILINE)
STARTUP_TIMEOUT_S = 600  # the first start of the default model converts it
REQUEST_TIMEOUT_S = 300

CHAT_BODY = {
    "messages": [{"role": "user", "content": "Write a Python function `is_palindrome(s)`"}],
    "max_tokens": 128,
}
STREAM_BODY = {
    "messages": [{"role": "user", "content": "Write a Python function `add(a, b)`"}],
    "max_tokens": 32, "stream": True, "stream_options": {"include_usage": True},
}
SDK_SNIPPET = '''\
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
for chunk in client.chat.completions.create(
    model={model}, stream=True, max_tokens=6,
    messages=[{{"role": "user", "content": "Write a Python function `fib(n)`"}}],
    extra_body={{"num_draft_tokens": 4}},  # our extensions go in extra_body
):
    if chunk.choices and chunk.choices[0].finish_reason is None:
        print(repr(chunk.choices[0].delta.content), chunk.choices[0].model_extra["from_draft"])
    elif chunk.choices:  # the chunk with finish_reason carries the stats
        print(chunk.model_extra["stats"]["acceptance_rate"])
'''


# -- shapes: what must stay the same between the README and a fresh run ------------------------
def json_shape(value):
    """Keys all the way down; scalars reduced to nothing; maps keyed by numbers to 'map'."""
    if isinstance(value, dict):
        if value and all(re.fullmatch(r"\d+", str(k)) for k in value):
            return "map"
        return {k: json_shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        shapes = []
        for item in value:
            s = json_shape(item)
            if s not in shapes:
                shapes.append(s)
        return ["list", *shapes] if shapes and shapes != [None] else ["list"]
    return None


def shape_of_json(text: str):
    return json_shape(json.loads(text))


def shape_of_sse(text: str):
    """One entry per shown line: the JSON keys of a chunk, '[DONE]', or '...'."""
    out = []
    for line in text.strip().splitlines():
        if line == "...":
            out.append("...")
        elif line == "data: [DONE]":
            out.append("[DONE]")
        else:
            out.append(json_shape(json.loads(line.removeprefix("data: "))))
    return out


def shape_of_sdk(text: str):
    """A float (or None) line for the acceptance rate, then `'token' True|False` lines."""
    lines = text.rstrip("\n").splitlines()
    streamed = [line for line in lines if re.fullmatch(r"'.*' (True|False)", line)]
    rate = [line for line in lines if re.fullmatch(r"\d+(\.\d+)?|None", line)]
    return {"acceptance line": len(rate) >= 1, "streamed lines": len(streamed) >= 1}


# -- examples -------------------------------------------------------------------------------
@dataclass
class Context:
    url: str
    client: httpx.Client
    target: str  # the served target: its id and path
    target_path: str
    draft: str | None
    out: Path
    python: str


@dataclass
class Example:
    name: str
    command: Callable[[Context], str] | None  # what the README shows (None: output only)
    command_lang: str
    run: Callable[[Context], str]  # what it printed
    lang: str  # "json" or "text"
    shape: Callable[[str], object]


def curl(path: str, body: dict | None = None, method: str | None = None, stream=False) -> str:
    flags = "-sN" if stream else "-s"
    parts = [f"curl {flags}"] + ([f"-X {method}"] if method else []) + [f"{SHOWN_URL}{path}"]
    if body is None:
        return " ".join(parts)
    parts.append("-H 'Content-Type: application/json'")
    fields = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in body.items())
    return " ".join(parts) + " -d '{\n" + fields + "\n}'"


def pretty(value) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def post(ctx: Context, path: str, body: dict) -> dict:
    r = ctx.client.post(ctx.url + path, json=body)
    r.raise_for_status()
    return r.json()


def stream(ctx: Context) -> str:
    lines = []
    with ctx.client.stream("POST", ctx.url + "/v1/chat/completions", json=STREAM_BODY) as r:
        r.raise_for_status()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    (ctx.out / "stream-full.txt").write_text("\n".join(lines) + "\n")
    return "\n".join(lines[:2] + ["..."] + lines[-3:])


def sdk_code(ctx: Context) -> str:
    return SDK_SNIPPET.format(model=json.dumps(ctx.target))


def sdk(ctx: Context) -> str:
    code = sdk_code(ctx).replace(SHOWN_URL, ctx.url)
    p = subprocess.run([ctx.python, "-c", code], capture_output=True, text=True,
                       timeout=REQUEST_TIMEOUT_S, check=False)
    if p.returncode:
        raise RuntimeError(f"the SDK snippet failed:\n{p.stderr}")
    return p.stdout.rstrip("\n")


def get(ctx: Context, path: str) -> httpx.Response:
    r = ctx.client.get(ctx.url + path)
    r.raise_for_status()
    return r


def bench_argv(ctx: Context) -> list[str]:
    argv = ["--smoke", "--target-model", ctx.target_path]
    if ctx.draft:
        argv += ["--draft-model", ctx.draft]
    return argv + ["--results-dir", shown_path(ctx.out / "bench"), "--tag", "smoke"]


def bench(ctx: Context) -> str:
    for old in (ctx.out / "bench").glob("bench-*-smoke.*"):  # keep only this capture's files
        old.unlink()
    p = subprocess.run([ctx.python, "-m", "server.bench", *bench_argv(ctx)],
                       capture_output=True, text=True, timeout=2 * REQUEST_TIMEOUT_S,
                       check=False)
    if p.returncode:
        raise RuntimeError(f"server.bench --smoke failed:\n{p.stderr}")
    return p.stdout.strip("\n")


def shown_path(path: Path | str) -> str:
    """Repository-relative when inside the repository (as a reader would type it)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


RESPONSES_BODY = {"input": "Write a Python function `fib(n)`", "max_output_tokens": 32}
RESPONSES_FILTER = ("{status, text: .output[0].content[0].text, "
                    "accepted: .stats.draft_tokens_accepted}")
MESSAGES_BODY = {"model": "", "max_tokens": 32, "temperature": 0,
                 "messages": [{"role": "user", "content": "Write a Python function `fib(n)`"}]}
MESSAGES_FILTER = "{stop_reason, text: .content[0].text, acceptance: .stats.acceptance_rate}"


def responses(ctx: Context) -> str:
    r = post(ctx, "/v1/responses", RESPONSES_BODY)
    return pretty({"status": r["status"], "text": r["output"][0]["content"][0]["text"],
                   "accepted": r["stats"]["draft_tokens_accepted"]})


def messages(ctx: Context) -> str:
    r = post(ctx, "/v1/messages", MESSAGES_BODY)
    return pretty({"stop_reason": r["stop_reason"], "text": r["content"][0]["text"],
                   "acceptance": r["stats"]["acceptance_rate"]})


def config_table(ctx: Context | None = None) -> str:
    """Every settings key with its default and description, from server/config.py."""
    from server.config import Settings

    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for section, field in Settings.model_fields.items():
        for key, info in field.annotation.model_fields.items():
            default = info.get_default(call_default_factory=True)
            shown = json.dumps(default) if default is not None else "null"
            text = (info.description or "").replace("|", "\\|")
            rows.append(f"| `{section}.{key}` | `{shown}` | {text} |")
    return "\n".join(rows)


EXAMPLES = [
    Example("stream", lambda c: curl("/v1/chat/completions", STREAM_BODY, stream=True), "bash",
            stream, "text", shape_of_sse),
    Example("sdk", sdk_code, "python", sdk, "text", shape_of_sdk),
    Example("responses",
            lambda c: curl("/v1/responses", RESPONSES_BODY) + f" | jq '{RESPONSES_FILTER}'",
            "bash", responses, "json", shape_of_json),
    Example("messages",
            lambda c: curl("/v1/messages", MESSAGES_BODY) + f" | jq '{MESSAGES_FILTER}'",
            "bash", messages, "json", shape_of_json),
    Example("config", None, "", config_table, "markdown", lambda text: text.strip()),
]
NEEDS_DRAFT: set[str] = set()


PLAYGROUND_PNG = Path("docs/playground.png")  # the README's picture of the page at /


def screenshot(url: str, path: Path) -> None:
    """The playground answering on the served models (scripts/ui_screenshot.py)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from ui_screenshot import capture_screenshot

    capture_screenshot(url, path)
    print(f"playground   {shown_path(path)}", file=sys.stderr, flush=True)


# -- the server -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "server", "--config", str(args.config), "--port", str(port)]
    if args.model:
        argv += ["--model", args.model]
    if args.draft_model:
        argv += ["--draft-model", args.draft_model]
    log = log_path.open("w")
    return subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    from server.bench.runners import wait_healthy  # MLX and the engine: only when serving

    wait_healthy(url, proc, STARTUP_TIMEOUT_S, log_path)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def machine() -> dict:
    def git(*a: str) -> str | None:
        p = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False)
        return p.stdout.strip() or None

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": platform.machine(), "cores": os.cpu_count(),
            "os": platform.platform(), "python": platform.python_version(),
            "git_commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted": (git("status", "--porcelain", "--", "server", "api_schemas")
                            or "").splitlines()}


# -- README ---------------------------------------------------------------------------------
def readme_regions(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in MARKER.finditer(text)}


def fenced(text: str, lang: str) -> str:
    longest = max((len(run) for run in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}\n"


def region_text(command: str | None, command_lang: str, output: str, lang: str) -> str:
    if command is None:  # generated markdown, shown as it is
        return output.rstrip() + "\n"
    return fenced(command, command_lang) + "\n" + fenced(output, lang)


def captured_text(meta: dict) -> str:
    draft = f"`{meta['draft']}`" if meta["draft"] else "no draft"
    return (f"Captured {meta['date']} on {meta['machine']} ({meta['cores']} cores, "
            f"{meta['device']}), commit {meta['git_commit']}"
            f"{' with uncommitted changes to the server' if meta.get('uncommitted') else ''}"
            f": target `{meta['target']}`, "
            f"draft {draft}; requests that name no drafter use "
            f"`{meta.get('default_drafter', 'model')}`. "
            f"`scripts/readme_examples.py --write-readme` reruns every example "
            f"below and rewrites these blocks.\n")


def write_readme(path: Path, regions: dict[str, str]) -> None:
    def replace(m: re.Match) -> str:
        name = m.group(1)
        body = regions.get(name, m.group(2))
        return f"<!-- readme-example: {name} -->\n{body}<!-- /readme-example -->"

    path.write_text(MARKER.sub(replace, path.read_text()))


def check_readme(path: Path, outputs: dict[str, str]) -> list[str]:
    """Differences between the README's output blocks and fresh outputs, by shape."""
    regions = readme_regions(path.read_text())
    problems = []
    shown = set(regions) - {"captured"}
    for name in sorted(shown - set(outputs)):
        problems.append(f"{name}: marked in the README but not run by this script")
    for name in sorted(set(outputs) - shown):
        problems.append(f"{name}: run by this script but not marked in the README")
    examples = {e.name: e for e in EXAMPLES}
    for name in sorted(shown & set(outputs)):
        example = examples[name]
        blocks = FENCE.findall(regions[name])
        if example.command is None:
            blocks = [None, (None, None, regions[name])]
        elif len(blocks) != 2:
            problems.append(f"{name}: expected a command block and an output block")
            continue
        try:
            expected = example.shape(blocks[1][2])
        except Exception as e:  # noqa: BLE001 - a README block that no longer parses
            problems.append(f"{name}: the README's block does not parse: {e!r}")
            continue
        got = example.shape(outputs[name])
        if got != expected:
            problems.append(f"{name}: shape differs\n  README: {expected}\n  now:    {got}")
    return problems


# -- main -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("config.yaml"))
    p.add_argument("--model", help="Target model (default: what the config serves).")
    p.add_argument("--draft-model", help="Draft model ('none' for none).")
    p.add_argument("--out", type=Path,
                   help="Where the captured outputs go (default build/readme; with --check,"
                        " a temporary folder).")
    p.add_argument("--readme", type=Path, default=Path("README.md"))
    p.add_argument("--only", help="Comma-separated example names (default: all).")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write-readme", action="store_true",
                      help="Replace the marked blocks in the README with the outputs.")
    mode.add_argument("--check", action="store_true",
                      help="Compare the outputs' shapes with the README's blocks; exit 1 if any"
                           " differs.")
    return p.parse_args(argv)


def run_examples(ctx: Context, names: set[str] | None, log) -> dict[str, tuple[str, str]]:
    """{name: (command, output)} for each example that applies to the served models."""
    done = {}
    for ex in EXAMPLES:
        if (names and ex.name not in names) or (ex.name in NEEDS_DRAFT and not ctx.draft):
            continue
        started = time.monotonic()
        output = ex.run(ctx)
        suffix = "json" if ex.lang == "json" else "txt"
        command = ex.command(ctx) if ex.command else None
        (ctx.out / f"{ex.name}.{suffix}").write_text(output + "\n")
        done[ex.name] = (command, output)
        shown = (command or ex.name).splitlines()[0][:70]
        print(f"{ex.name:14s} {time.monotonic() - started:6.1f}s  {shown}", file=log, flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="readme-")) if args.check else RESULTS_DIR
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = args.out / "server.log"
    proc = start_server(args, port, log_path)
    try:
        wait_ready(url, proc, log_path)
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            models = client.get(url + "/v1/models").json()["data"]
            target = next(m for m in models if m["role"] == "target")
            draft = next((m for m in models if m["role"] == "draft"), None)
            ctx = Context(url=url, client=client, target=target["id"],
                          target_path=shown_path(target["path"]),
                          draft=shown_path(draft["path"]) if draft else None,
                          out=args.out, python=sys.executable)
            names = set(args.only.split(",")) if args.only else None
            done = run_examples(ctx, names, sys.stderr)
            if args.write_readme and not names:
                screenshot(url, ROOT / PLAYGROUND_PNG)
    finally:
        stop_server(proc)
    import mlx.core as mx

    from server.config import Settings

    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    meta = {**machine(), "device": device, "target": ctx.target_path, "draft": ctx.draft,
            "default_drafter": Settings.load(args.config).defaults.draft,
            "examples": {name: command for name, (command, _) in done.items()}}
    (args.out / "meta.json").write_text(pretty(meta) + "\n")
    outputs = {name: output for name, (_, output) in done.items()}
    if args.check:
        problems = check_readme(args.readme, outputs)
        for problem in problems:
            print(f"README mismatch: {problem}", file=sys.stderr)
        print(f"{len(outputs)} examples ran; {len(problems)} README mismatch(es)")
        return 1 if problems else 0
    if args.write_readme:
        examples = {e.name: e for e in EXAMPLES}
        regions = {name: region_text(cmd, examples[name].command_lang, out, examples[name].lang)
                   for name, (cmd, out) in done.items()}
        if any(examples[name].command is not None for name in done):  # not only the table
            regions["captured"] = captured_text(meta)
        write_readme(args.readme, regions)
        print(f"rewrote {len(regions)} blocks in {args.readme}")
    print(f"{len(outputs)} examples ran; outputs in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
