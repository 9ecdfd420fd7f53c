"""The target sharded over 2 ranks (`mlx.launch --backend ring -n 2` over loopback), the draft
on rank 0: greedy output token-identical to the single-process server, alone and in a batch,
with and without the draft; stop and failure leave no rank behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from support.servers import free_port, free_ports

pytestmark = pytest.mark.slow

LAUNCHER = Path(sys.executable).parent / "mlx.launch"
PROMPTS = ["Write a function", "The quick brown fox jumps over the lazy dog"]


class Launch:
    """`mlx.launch --backend ring -n 2 -- python -m server ...` in its own process group."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        ring_port = free_ports(2)
        cmd = [str(LAUNCHER), "--backend", "ring", "-n", "2", "--starting-port", str(ring_port),
               "--", sys.executable, "-m", "server", *args, "--port", str(self.port)]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=os.environ.copy())
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                pytest.fail(f"launch exited: {log.read_text()}")
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"the distributed server did not start: {log.read_text()}")

    def follower_pid(self) -> int:
        """Rank 1's pid, as its log line says."""
        match = re.search(r"rank 1 of 2 \(pid (\d+)\)", self.log.read_text())
        assert match, self.log.read_text()
        return int(match.group(1))

    def wait_all_gone(self, timeout: float) -> float:
        """Seconds until no process of the launch is left; fails past `timeout`."""
        started = time.monotonic()
        while _group_pids(self.proc.pid):
            if time.monotonic() - started > timeout:
                self.kill()
                pytest.fail(f"processes left behind: {self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        return time.monotonic() - started

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _group_pids(pgid: int) -> list[int]:
    """Live processes of the group (`ps`: Linux and macOS)."""
    out = subprocess.run(["ps", "-A", "-o", "pid=,pgid=,stat="], capture_output=True,
                         text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return [int(r[0]) for r in rows if int(r[1]) == pgid and not r[2].startswith("Z")]


@pytest.fixture(scope="module")
def launch(tiny_pair, tmp_path_factory):
    if not LAUNCHER.exists() or shutil.which("bash") is None:
        pytest.fail("mlx.launch is part of mlx: it must be installed")
    target, draft = tiny_pair
    folder = tmp_path_factory.mktemp("dist")
    config = folder / "config.yaml"
    config.write_text("engine:\n  drain_timeout_s: 1\n")
    run = Launch(["--model", str(target), "--draft-model", str(draft), "--config", str(config)],
                 folder / "log.txt")
    yield run
    run.kill()


def complete(url: str, prompt: str, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat(url: str, content: str, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 16,
            "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def text(response: dict) -> str:
    choice = response["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_health_reports_the_layout(launch):
    layout = httpx.get(f"{launch.url}/health").json()["distributed"]
    assert layout["world_size"] == 2 and layout["backend"] == "ring"
    assert layout["mode"] == "tensor"
    assert len(layout["rank_memory_gb"]) == 2 and all(m > 0 for m in layout["rank_memory_gb"])


def test_single_process_health_has_no_layout(live_server):
    assert "distributed" not in httpx.get(f"{live_server}/health").json()


@pytest.mark.parametrize("use_draft", [True, False])
def test_greedy_alone_matches_the_single_process_server(launch, live_server, use_draft):
    for prompt in PROMPTS:
        ours = complete(launch.url, prompt, use_draft=use_draft, cache_prompt=False)
        theirs = complete(live_server, prompt, use_draft=use_draft, cache_prompt=False)
        assert text(ours) == text(theirs)
        assert ours["usage"] == theirs["usage"]
        if use_draft:
            assert ours["stats"]["draft_tokens_accepted"] == \
                theirs["stats"]["draft_tokens_accepted"]
    stats = complete(launch.url, PROMPTS[0], use_draft=True)["stats"]
    assert stats["draft_tokens_accepted"] > 0 and stats["draft_model"] is not None


def test_greedy_batch_matches_the_single_process_server(launch, live_server):
    jobs = [(p, d, n) for p in PROMPTS for d, n in ((True, 8), (False, 24), (True, 24))]

    def run(url):
        with ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(lambda j: text(chat(url, j[0], use_draft=j[1],
                                                     max_tokens=j[2])), jobs))

    assert run(launch.url) == run(live_server)


def test_prefix_cache_hit_gives_the_same_output(launch, live_server):
    prompt = "Tell me about the prefix cache " * 8
    first = chat(launch.url, prompt, max_tokens=16)
    second = chat(launch.url, prompt, max_tokens=16)
    assert second["stats"]["cached_tokens"] > 0
    assert text(first) == text(second) == text(chat(live_server, prompt, max_tokens=16))


def test_structured_output_matches(launch, live_server):
    extra = {"response_format": {"type": "json_object"}, "max_tokens": 40}
    ours = chat(launch.url, "Give me JSON", **extra)
    assert text(ours) == text(chat(live_server, "Give me JSON", **extra))


def test_prompt_scoring_and_choices_match(launch, live_server):
    """`echo` + `logprobs` scores the prompt on the sharded target (chunks of 128 tokens),
    then generates from what it prefilled; `n` siblings share the prompt."""
    body = {"prompt": "The quick brown fox " * 40, "echo": True, "logprobs": 2,
            "max_tokens": 6, "n": 2}
    ours, theirs = complete(launch.url, **body), complete(live_server, **body)
    assert [c["text"] for c in ours["choices"]] == [c["text"] for c in theirs["choices"]]
    for a, b in zip(ours["choices"], theirs["choices"], strict=True):
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(
            b["logprobs"]["token_logprobs"][1:], abs=1e-3)
    assert ours["usage"]["completion_tokens"] == 12


def test_a_stream_that_is_cancelled_frees_its_row(launch, live_server):
    body = {"prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", f"{launch.url}/v1/completions", json=body, timeout=60) as r:
        for count, _ in enumerate(r.iter_lines()):
            if count > 5:
                break
    deadline = time.monotonic() + 10
    while httpx.get(f"{launch.url}/health").json()["batch_size"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert text(complete(launch.url, "after")) == text(complete(live_server, "after"))


def test_draft_unload_and_reload(launch, live_server, tiny_pair):
    assert httpx.delete(f"{launch.url}/v1/models/draft").status_code == 200
    try:
        plain = complete(launch.url, PROMPTS[1])
        assert plain["stats"]["draft_model"] == "prompt_lookup+suffix"  # hybrid goes on
        assert text(plain) == text(complete(live_server, PROMPTS[1]))
    finally:
        r = httpx.post(f"{launch.url}/v1/models/draft", json={"model": str(tiny_pair[1])},
                       timeout=60)
        assert r.status_code == 200, r.text
    drafted = complete(launch.url, PROMPTS[1])
    assert drafted["stats"]["draft_tokens_accepted"] > 0
    assert text(drafted) == text(plain)


def _stream_until_done(url: str, lines: list, done: threading.Event) -> None:
    body = {"prompt": "go", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
    except httpx.HTTPError as e:
        lines.append(f"transport error: {e}")
    finally:
        done.set()


def _start_stream(url: str) -> tuple[list, threading.Event]:
    lines, done = [], threading.Event()
    threading.Thread(target=_stream_until_done, args=(url, lines, done), daemon=True).start()
    deadline = time.monotonic() + 30
    while len(lines) < 3:
        assert time.monotonic() < deadline and not done.is_set(), lines
        time.sleep(0.05)
    return lines, done


def test_sigterm_on_the_launcher_drains_and_stops_every_rank(launch):
    """Last in the module: ends the shared launch. SIGTERM on mlx.launch alone (its ranks
    are orphaned): rank 0 drains its running stream, stops the follower, and all exit."""
    lines, done = _start_stream(launch.url)
    assert launch.follower_pid() in _group_pids(launch.proc.pid)
    os.kill(launch.proc.pid, signal.SIGTERM)
    assert done.wait(30)
    assert lines[-1] == "[DONE]", lines[-3:]
    assert "shutting down" in json.loads(lines[-2])["error"]["message"]
    assert launch.wait_all_gone(timeout=30) < 30


def test_a_rank_that_dies_ends_requests_with_503_and_every_rank_exits(tiny_pair, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("distributed:\n  timeout_s: 3\n  heartbeat_s: 1\n"
                      "engine:\n  drain_timeout_s: 20\n")
    run = Launch(["--model", str(tiny_pair[0]), "--draft-model", "none", "--config", str(config)],
                 tmp_path / "log.txt")
    try:
        lines, done = _start_stream(run.url)
        os.kill(run.follower_pid(), signal.SIGKILL)
        assert done.wait(30)
        assert lines[-1] == "[DONE]", lines[-3:]
        error = json.loads(lines[-2])["error"]
        assert error["code"] == "shutting_down" or "stopped answering" in error["message"]
        # within the collective timeout (3 s), well before the drain's 20 s
        assert run.wait_all_gone(timeout=15) < 15
    finally:
        run.kill()


def llama_as_qwen2(llama_folder: Path, out: Path) -> Path:
    """The tiny llama target as a qwen2 model (zero q/k/v biases): the same function, in an
    architecture with `PipelineMixin`, saved with the index pipeline loading reads."""
    import mlx.core as mx
    from mlx_lm.models import qwen2
    from mlx_lm.utils import save_model

    config = json.loads((llama_folder / "config.json").read_text())
    config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    weights = mx.load(str(llama_folder / "model.safetensors"))
    for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight",
                                                   "v_proj.weight"))]:
        weights[name[: -len("weight")] + "bias"] = mx.zeros((weights[name].shape[0],))
    model = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    model.load_weights(list(weights.items()))
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config))
    for f in llama_folder.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def test_pipeline_mode_matches_the_single_process_server(tiny_pair, live_server, tmp_path):
    target = llama_as_qwen2(tiny_pair[0], tmp_path / "qwen2")
    run = Launch(["--model", str(target), "--draft-model", str(tiny_pair[1]),
                  "--distributed-mode", "pipeline"], tmp_path / "log.txt")
    try:
        assert httpx.get(f"{run.url}/health").json()["distributed"]["mode"] == "pipeline"
        for use_draft in (True, False):
            ours = complete(run.url, PROMPTS[0], use_draft=use_draft)
            assert text(ours) == text(complete(live_server, PROMPTS[0], use_draft=use_draft))
        assert ours["stats"]["draft_tokens_accepted"] == 0
        assert complete(run.url, PROMPTS[0])["stats"]["draft_tokens_accepted"] > 0
        with ThreadPoolExecutor(4) as pool:
            batch = list(pool.map(lambda p: text(chat(run.url, p)), PROMPTS * 2))
        assert batch == [text(chat(live_server, p)) for p in PROMPTS * 2]
    finally:
        os.kill(run.proc.pid, signal.SIGTERM)
        run.wait_all_gone(timeout=30)


def test_a_model_without_shard_is_refused_naming_the_supported_architectures(tiny_pair,
                                                                            tmp_path):
    import mlx.core as mx

    from server.engine.distributed.service import DistributedLayout, load_sharded
    from server.engine.errors import ModelLoadError

    folder = tmp_path / "gemma"
    shutil.copytree(tiny_pair[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gemma", head_dim=16)
    (folder / "config.json").write_text(json.dumps(config))
    layout = DistributedLayout(0, 1, "ring", "tensor", mx.distributed.init())
    with pytest.raises(ModelLoadError) as error:
        load_sharded(str(folder), layout)
    message = str(error.value)
    assert "tensor mode" in message and "llama" in message and "qwen3" in message


def test_the_distributed_benchmark_runs_on_the_tiny_pair(tiny_pair, tmp_path, capsys):
    """`mlx-spec-bench distributed` (smoke): both layouts measured, the ratios printed, and the
    JSON holds the same figures (each rank's memory, forwards of 1 and k + 1 tokens)."""
    from server.bench import main

    target, draft = tiny_pair
    out = tmp_path / "dist.json"
    assert main(["distributed", "--target-model", str(target), "--draft-model", str(draft),
                 "--reps", "1", "--max-tokens", "8", "--context", "16", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "decode tok/s, draft" in printed and "rank memory GB" in printed
    figures = json.loads(out.read_text())
    assert len(figures["distributed"]["rank_memory_gb"]) == 2
    assert set(figures["single"]["forward_s"]) == set(figures["distributed"]["forward_s"]) \
        == {"1", "5"}
