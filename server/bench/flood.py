"""`mlx-spec-bench flood`: many long prompts at once against servers in a memory cgroup.

Each server (ours, then `mlx_lm.server` with the same models) starts inside a fresh memory
cgroup limited to `--limit-gb` (v1's memory controller or v2's; root or a delegated cgroup);
`--requests` greedy text completions of about `--prompt-tokens` tokens each then arrive at
once. A row per server: the limit, what the flood's KV needs (every request's, target and
draft, priced by the models' layouts) and ours' budget (derived from the limit), the
requests, how many were answered (200), whether the server still answers afterwards (or its
exit status), the cgroup's peak memory and OOM kills, the wall time, and ours' preemptions
from /metrics. `--check-alone` then sends each request
alone to the same server and counts the answers whose text is the flood's (greedy: all).

`Cgroup` makes such a cgroup (the memory tests run a server in one too).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from server.bench import results
from server.bench.runners import RETRIES, retry_delay, wait_healthy
from server.engine.kv.kv_size import kv_layout
from server.engine.memory import MemoryCgroup, memory_cgroups
from server.model_files.bundled import demo_or_generated_pair

WORDS = ("the lighthouse keeper counted ships at dawn and wrote each name in a ledger that "
         "nobody read until the storm came over the cliffs").split()
GB = 1e9
START_TIMEOUT_S = 600


@dataclass
class Answer:
    status: int  # 0: no HTTP answer (the connection failed or timed out)
    text: str | None = None
    error: str | None = None


def kv_need(target: str, draft: str | None, tokenizer, prompts: list[str],
            max_tokens: int) -> int:
    """The bytes of every request's KV caches (target and draft) at its end, priced by the
    models' layouts (`kv_size`): what the flood would hold if all ran at once."""
    from mlx_lm import load

    layouts = [kv_layout(load(path)[0]) for path in (target, draft) if path]
    return sum(layout.bytes(len(tokenizer.encode(p)) + max_tokens)
               for p in prompts for layout in layouts)


def flood_prompts(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` distinct texts of about `tokens` tokens each (cut by `tokenizer`)."""
    prompts = []
    for i in range(count):
        words = [f"Request {i}:"] + [f"{WORDS[(i + 3 * j) % len(WORDS)]}{j % 97}"
                                     for j in range(tokens)]
        ids = tokenizer.encode(" ".join(words))[:tokens]
        prompts.append(tokenizer.decode(ids))
    return prompts


async def send_all(url: str, prompts: list[str], max_tokens: int,
                   timeout: float = 1800.0) -> list[Answer]:
    """Every prompt at once as a greedy `/v1/completions` request: the answers in order."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        return list(await asyncio.gather(*(send(client, p, max_tokens) for p in prompts)))


async def send(client: httpx.AsyncClient, prompt: str, max_tokens: int,
               sleep=asyncio.sleep) -> Answer:
    """One request; a connection that fails with no answer (a server whose listen backlog
    overflows under the burst resets some) is retried as the OpenAI SDK retries it."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    for attempt in range(RETRIES + 1):
        try:
            r = await client.post("/v1/completions", json=body)
            break
        except httpx.TransportError as e:
            if attempt == RETRIES:
                return Answer(0, error=f"{type(e).__name__}: {e}")
            await sleep(retry_delay(attempt))
        except httpx.HTTPError as e:
            return Answer(0, error=f"{type(e).__name__}: {e}")
    if r.status_code != 200:
        return Answer(r.status_code, error=r.text[:300])
    return Answer(200, text=r.json()["choices"][0]["text"])


# -- a memory cgroup for a server under test ---------------------------------------------


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here."""


@dataclass
class Cgroup:
    folder: Path
    version: int

    @classmethod
    def create(cls, name: str, limit_bytes: int | None = None) -> Cgroup:
        """A new child cgroup `name` of this process's, limited to `limit_bytes` (None: no
        limit of its own)."""
        errors = []
        for parent in memory_cgroups():
            try:
                group = cls._make(parent, name)
            except OSError as e:
                errors.append(f"{parent.folder}: {e}")
                continue
            if limit_bytes is not None:
                group.limit = limit_bytes
            return group
        raise CgroupUnavailable("; ".join(errors) or "no memory cgroup hierarchy is mounted")

    @classmethod
    def _make(cls, parent: MemoryCgroup, name: str) -> Cgroup:
        if parent.version == 2 and "memory" not in \
                (parent.folder / "cgroup.controllers").read_text().split():
            raise OSError("the memory controller is not delegated here")
        folder = parent.folder / name
        folder.mkdir(exist_ok=True)
        group = cls(folder, parent.version)
        if not (folder / group._file("limit")).exists():
            folder.rmdir()
            raise OSError("a cgroup without memory files")
        return group

    def _file(self, what: str) -> str:
        return {1: {"limit": "memory.limit_in_bytes", "peak": "memory.max_usage_in_bytes",
                    "usage": "memory.usage_in_bytes", "events": "memory.oom_control"},
                2: {"limit": "memory.max", "peak": "memory.peak", "usage": "memory.current",
                    "events": "memory.events"}}[self.version][what]

    def _read(self, what: str) -> str:
        return (self.folder / self._file(what)).read_text()

    @property
    def limit(self) -> int | None:
        text = self._read("limit").strip()
        return int(text) if text.isdigit() and int(text) < 1 << 62 else None

    @limit.setter
    def limit(self, value: int | None) -> None:
        text = str(value) if value is not None else ("max" if self.version == 2 else "-1")
        (self.folder / self._file("limit")).write_text(text)

    @property
    def usage_bytes(self) -> int:
        return int(self._read("usage"))

    @property
    def peak_bytes(self) -> int | None:
        """The most the cgroup's processes held at once (None: v2 before Linux 5.19)."""
        try:
            return int(self._read("peak"))
        except FileNotFoundError:
            return None

    def reset_peak(self) -> None:
        if self.version == 1:
            (self.folder / "memory.max_usage_in_bytes").write_text("0")

    @property
    def oom_kills(self) -> int:
        """Processes the OOM killer killed in the cgroup."""
        for line in self._read("events").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the cgroup: a shell that moves itself in, then becomes it."""
        procs = self.folder / "cgroup.procs"
        return ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *argv]

    def remove(self) -> None:
        """Remove the (empty) cgroup; what it still charged goes to its parent."""
        try:
            self.folder.rmdir()
        except OSError:
            pass


def unique_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{os.urandom(3).hex()}"


# -- the flood -------------------------------------------------------------------------------


def start_in(cgroup: Cgroup | None, argv: list[str], log: Path, port: int,
             timeout: float = START_TIMEOUT_S, env: dict | None = None
             ) -> tuple[subprocess.Popen, str]:
    """`argv` (a server on `port`) started in `cgroup`, once its /health answers 200."""
    command = cgroup.command(argv) if cgroup is not None else argv
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, log)
    except RuntimeError:
        proc.kill()
        raise
    return proc, url


def metric(url: str, name: str) -> float | None:
    """A metric's value from the server's Prometheus /metrics (None: no such metric)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    return None


def alive(proc: subprocess.Popen, url: str) -> bool:
    if proc.poll() is not None:
        return False
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def server_argv(name: str, args, port: int) -> list[str]:
    common = ["--model", args.target_model, "--port", str(port), "--host", "127.0.0.1"]
    if args.draft_model:
        common += ["--draft-model", args.draft_model]
    if name == "ours":
        return [sys.executable, "-m", "server", *common, *shlex.split(args.server_args)]
    return [sys.executable, "-m", "mlx_lm.server", *common]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flood_row(name: str, args, prompts: list[str], log_dir: Path, need: int) -> dict:
    """One server's flood in a fresh cgroup limited to `args.limit_gb` (`need`: the flood's
    KV bytes)."""
    port = free_port()
    cgroup = Cgroup.create(unique_name(f"flood-{name}"), int(args.limit_gb * GB))
    row = {"server": name, "limit_gb": args.limit_gb, "requests": len(prompts),
           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
           "kv_need_gb": round(need / GB, 3)}
    proc = None
    try:
        proc, url = start_in(cgroup, server_argv(name, args, port), log_dir / f"{name}.log",
                             port)
        cgroup.reset_peak()
        if name == "ours":  # what it derived from the cgroup's limit
            row["budget_gb"] = round(httpx.get(f"{url}/health").json()["memory"]
                                     ["budget_bytes"] / GB, 3)
        start = time.perf_counter()
        answers = asyncio.run(send_all(url, prompts, args.max_tokens, args.timeout))
        row["wall_s"] = round(time.perf_counter() - start, 3)
        row["answered"] = sum(a.status == 200 for a in answers)
        row["errors"] = sorted({a.error or str(a.status) for a in answers if a.status != 200})[:3]
        row["alive"] = alive(proc, url)
        row["exit_code"] = proc.poll()
        row["peak_gb"] = round(cgroup.peak_bytes / GB, 3) if cgroup.peak_bytes else None
        row["oom_kills"] = cgroup.oom_kills
        row["preemptions"] = metric(url, "mlx_spec_num_preemptions_total") if row["alive"] \
            else None
        if args.check_alone and row["alive"]:
            alone = [asyncio.run(send_all(url, [p], args.max_tokens, args.timeout))[0]
                     for p in prompts]
            row["equal_alone"] = sum(a.status == b.status == 200 and a.text == b.text
                                     for a, b in zip(answers, alone, strict=True))
    except RuntimeError as e:  # it did not start in the limit: a row that says so
        row.update(answered=0, alive=False, errors=[str(e)[:300]], oom_kills=cgroup.oom_kills)
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        cgroup.remove()
    return row


def table(rows: list[dict]) -> list[list[str]]:
    head = ["server", "limit GB", "KV need GB", "budget GB", "requests", "answered", "alive",
            "peak GB", "OOM kills", "wall s", "preemptions", "equal alone"]
    return [head] + [[r["server"], f"{r['limit_gb']:g}", results.num(r.get("kv_need_gb"), ".3f"),
                      results.num(r.get("budget_gb"), ".3f"), str(r["requests"]),
                      str(r["answered"]), str(r["alive"]), results.num(r.get("peak_gb"), ".3f"),
                      str(r.get("oom_kills")), results.num(r.get("wall_s"), ".1f"),
                      results.num(r.get("preemptions"), ".0f"),
                      results.num(r.get("equal_alone"), "d")] for r in rows]


def main(argv: list[str]) -> int:
    p = results.parser("flood", __doc__)
    a = p.add_argument
    a("--target-model", default=None, help="Target model folder (default: the demo pair's,"
      " else the generated small pair's, built if missing).")
    a("--draft-model", default=None, help="Draft model folder ('none': no draft).")
    a("--limit-gb", type=float, default=3.0, help="The memory cgroup's limit.")
    a("--requests", type=int, default=32, help="Requests sent at once.")
    a("--prompt-tokens", type=int, default=2000, help="Each prompt's length.")
    a("--max-tokens", type=int, default=64, help="Tokens each request generates.")
    a("--servers", default="ours,mlx_lm", help="Which servers, in order: ours, mlx_lm.")
    a("--server-args", default="", help="More flags for our server (e.g. --memory-margin-gb 0.3).")
    a("--check-alone", action="store_true", help="Then send each request alone: equal texts.")
    a("--timeout", type=float, default=1800.0, help="Seconds a request may take.")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    results.check(p, [(any(n not in ("ours", "mlx_lm") for n in names),
                       "--servers: ours and/or mlx_lm")])
    if args.target_model is None:
        target, draft = demo_or_generated_pair()
        args.target_model = str(target)
        args.draft_model = args.draft_model or str(draft)
    if args.draft_model == "none":
        args.draft_model = None
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(args.target_model))
    prompts = flood_prompts(tokenizer, args.requests, args.prompt_tokens)
    need = kv_need(args.target_model, args.draft_model, tokenizer, prompts, args.max_tokens)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    try:
        rows = [flood_row(name, args, prompts, args.results_dir, need) for name in names]
    except CgroupUnavailable as e:
        print(f"error: no memory cgroup can be made here (root, or a delegated cgroup v2, is"
              f" needed): {e}", file=sys.stderr)
        return 1
    meta = results.environment(target_model=args.target_model, draft_model=args.draft_model)
    results.save("flood", argv, args, meta, rows, table)
    return 0
