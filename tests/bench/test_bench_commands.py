"""`mlx-spec-bench`'s subcommands end to end: the dispatcher, `--api` for each of the three
streaming APIs against a fake of our server (`fake_bench_server`), `load` (with `--pid`),
`chat`, `held-out`, `structured`, `suffix` and `load --in-process` on the tiny pair, and
`report`."""

from __future__ import annotations

import importlib
import json
import os
import shutil
from pathlib import Path

import pytest
from support.fake_bench_server import PEAK_GB, PROMPT_TOKENS, fake_app, synthetic_sweep
from support.paths import DATA, ROOT
from support.servers import uvicorn_thread

from server import bench
from server.bench import chat, held_out, load, sweep
from server.bench import results as report

EXAMPLE_MANIFEST = DATA / "benchmarks_example.yaml"


@pytest.fixture(scope="module")
def fake():
    """The fake server, served by uvicorn in a thread: (url, app)."""
    app = fake_app()
    with uvicorn_thread(app) as url:
        yield url, app


def result(directory: Path, subcommand: str) -> dict:
    """The subcommand's one `.json` in `directory`; checks it against its `.jsonl` and that
    `report` renders it as the subcommand's own table."""
    (path,) = directory.glob(f"{subcommand}-*.json")
    doc = json.loads(path.read_text())
    assert doc["subcommand"] == subcommand and doc["command"].startswith(
        f"mlx-spec-bench {subcommand} ")
    for key in ("date", "machine", "cpu_count", "mlx", "git_commit"):
        assert key in doc["metadata"]
    lines = path.with_suffix(".jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == doc["rows"]
    module = importlib.import_module(bench.SUBCOMMANDS[subcommand][0])
    rendered = report.render_json(path)
    assert rendered.startswith(report.markdown_table(module.table(doc["rows"])))
    assert f"`{doc['command']}`" in rendered
    return doc


# ------------------------------------------------------------------------------ dispatcher
def test_a_flag_first_runs_the_sweep_and_subcommands_dispatch(tmp_path, capsys, monkeypatch):
    synthetic_sweep(monkeypatch)
    assert bench.main(["--smoke", "--results-dir", str(tmp_path / "a")]) == 0
    assert bench.main(["sweep", "--smoke", "--results-dir", str(tmp_path / "b")]) == 0
    for d in ("a", "b"):
        doc = result(tmp_path / d, "sweep")
        assert [(r["kind"], r["k"]) for r in doc["rows"]] == [
            ("structured", 0), ("structured", 1), ("structured", 2)]
    assert bench.main(["nonsense"]) == 2
    assert "unknown subcommand 'nonsense'" in capsys.readouterr().err
    assert bench.main([]) == 2
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in bench.SUBCOMMANDS)


def test_the_command_line_hides_the_api_key():
    from server.bench.results import command_line

    assert command_line("load", ["--server", "u", "--api-key", "k1", "--api-key=k2"]) == (
        "mlx-spec-bench load --server u --api-key '***' '--api-key=***'")


def test_the_default_results_dir_is_ignored_by_git():
    assert str(sweep.parse_args([]).results_dir) == "bench-results"
    assert "/bench-results/" in (ROOT / ".gitignore").read_text()


# ------------------------------------------------------------------------------ --api
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_sweep_reads_from_draft_and_stats_from_each_api(fake, api, tmp_path):
    url, app = fake
    app.state.bodies.clear()
    assert sweep.main(["--server", url, "--api", api, "--smoke", "--max-tokens", "6",
                       "--cost-ratio", "0.5", "--results-dir", str(tmp_path)]) == 0
    rows = result(tmp_path, "sweep")["rows"]
    assert [r["k"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["error"] is None and r["tokens_median"] == 6
        assert r["peak_gb_median"] == PEAK_GB and r["prompt_tokens"] == PROMPT_TOKENS
        assert r["tps_median"] > 0
    assert rows[0]["proposed"] == 0 and rows[0]["from_draft_median"] == 0
    for r in rows[1:]:  # 3 of 6 tokens flagged; stats: 3 accepted of 6 proposed
        assert r["from_draft_median"] == 0.5 and (r["accepted"], r["proposed"]) == (3, 6)
        assert r["rounds"] == 3
    path, body = app.state.bodies[-1]
    assert path == runners_path(api) and body["stream"] and body["num_draft_tokens"] == 2
    if api == "responses":
        assert body["max_output_tokens"] == 6 and body["model"] == "fake-target"
        assert body["input"] == [{"role": "user", "content": sweep.STRUCTURED}]
    elif api == "messages":
        assert body["max_tokens"] == 6 and body["model"] == "fake-target"
        assert body["messages"] == [{"role": "user", "content": sweep.STRUCTURED}]
    else:
        assert body["max_tokens"] == 6 and "model" not in body


def runners_path(api: str) -> str:
    from server.bench.runners import API_PATHS

    return API_PATHS[api]


def test_load_counts_draft_tokens_and_reads_peak_memory(fake, tmp_path):
    url, app = fake
    app.state.bodies.clear()
    assert load.main(["--server", f"ours={url}", "--compare", f"theirs={url}/v1", "--api",
                      "messages", "--concurrency", "1,2", "--runs", "2", "--max-tokens", "4",
                      "--pid", f"ours={os.getpid()}", "--results-dir", str(tmp_path)]) == 0
    doc = result(tmp_path, "load")
    rows = doc["rows"]
    assert [(r["server"], r["concurrency"]) for r in rows] == [
        ("ours", 1), ("theirs", 1), ("ours", 2), ("theirs", 2)]
    for r in rows:
        assert r["runs"] == 2 and r["all_answered"] and r["errors"] == 0
        assert r["requests"] == r["completed"] == 2 * r["concurrency"]
        assert r["tokens"] == 4 * r["requests"] and r["aggregate_tps"] > 0
        assert r["from_draft_fraction"] == 0.5  # 2 of each 4 tokens flagged
        assert len(r["aggregate_tps_runs"]) == 2
    ours, theirs = rows[:2]
    assert ours["peak_rss_gb"] > 0.01 and theirs["peak_rss_gb"] is None
    assert ours["ratio_aggregate"] is None
    assert theirs["ratio_aggregate"] == pytest.approx(ours["aggregate_tps"]
                                                      / theirs["aggregate_tps"])
    # warm-up 1 per server, then 2 runs x (1 + 2) streams x 2 servers, all Messages requests
    assert len(app.state.bodies) == 2 + 12
    assert {path for path, _ in app.state.bodies} == {"/v1/messages"}
    assert doc["metadata"]["servers"][0]["health"]["target"] == "fake-target"


def test_load_from_draft_share_counts_the_flags(fake):
    import asyncio
    from argparse import Namespace

    url, _ = fake
    args = Namespace(api="responses", max_tokens=6, timeout=30,
                     api_key=None, models={})
    streams = asyncio.run(load.run_level("s", url, 2, 0, args))
    assert all(s.error is None and s.from_draft == 3 for s in streams)
    figures = load.level_figures(streams)
    assert figures["from_draft_fraction"] == 0.5 and figures["tokens"] == 12
    assert figures["completed"] == 2 and figures["ttft_p50_s"] > 0


def test_peak_rss_is_this_process_vmhwm():
    status = Path("/proc/self/status").read_text()
    kb = int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])
    assert load.peak_rss_gb(os.getpid()) == pytest.approx(kb / 1e6, rel=0.2)
    assert load.peak_rss_gb(2**22 + 12345) is None  # no such process


# ------------------------------------------------------------------------------ chat
def test_chat_turns_and_shared_prompt_through_responses(fake, tmp_path):
    url, app = fake
    app.state.bodies.clear()
    assert chat.main(["--server", f"a={url}", "--compare", f"b={url}", "--api", "responses",
                      "--turns", "2", "--clients", "2", "--max-tokens", "3",
                      "--system-chars", "200", "--results-dir", str(tmp_path)]) == 0
    rows = result(tmp_path, "chat")["rows"]
    turns = [r for r in rows if r["part"] == "turns"]
    assert [(r["server"], r["turn"]) for r in turns] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert all(r["cached_tokens"] == 5 and r["prompt_tokens"] == PROMPT_TOKENS for r in turns)
    assert turns[0]["vs_first"] == 1.0 and turns[0]["ours_over_this"] == 1.0
    shared = [r for r in rows if r["part"] == "shared"]
    assert [(r["cache_prompt"], r["cached_tokens"]) for r in shared] == [(False, 0), (True, 10)]
    # turn 2 of server a resends the history, its answer included
    a2 = [b for p, b in app.state.bodies if p == "/v1/responses"][2]
    assert [m["role"] for m in a2["input"]] == ["system", "user", "assistant", "user"]
    assert a2["input"][2]["content"] == "t0 t1 t2 " and len(a2["input"][0]["content"]) > 200


# ------------------------------------------------------------------------------ held-out
def test_held_out_sums_decode_time_and_checks_the_text(fake, tmp_path, monkeypatch):
    url, app = fake
    monkeypatch.setattr(held_out, "held_out_by_family",
                        lambda path, count, model: {"code": [[1, 2], [3]], "prose": [[4]]})
    argv = ["--server", url, "--setting", 'plain={"num_draft_tokens": 0}', "--setting",
            'fast={"num_draft_tokens": 2}', "--max-tokens", "4", "--results-dir", str(tmp_path)]
    app.state.bodies.clear()
    assert held_out.main(argv) == 0
    doc = result(tmp_path, "held-out")
    assert doc["same_text"] is True
    code_plain, code_fast = doc["rows"][:2]
    assert (code_plain["tokens"], code_plain["decode_s"], code_plain["proposed"]) == (8, 0.08, 0)
    assert (code_fast["accepted"], code_fast["proposed"]) == (4, 8)
    assert [r["family"] for r in doc["rows"]] == ["code", "code", "prose", "prose"]
    sent = [b for _, b in app.state.bodies]
    assert sent[0] == {"prompt": [1, 2], "max_tokens": 4, "temperature": 0.0,
                       "cache_prompt": False, "num_draft_tokens": 0}
    assert [b["num_draft_tokens"] for b in sent[:4]] == [0, 2, 2, 0]  # the order rotates
    shutil.rmtree(tmp_path)
    differ = [*argv[:5], 'fast={"differ": true}', *argv[6:]]
    assert held_out.main(differ) == 1


def test_held_out_rows_by_hand():
    results = {"plain": [{"generation_tokens": 10, "generation_tps": 5.0,  # 2 s
                          "draft_tokens_accepted": 0, "draft_tokens_proposed": 0}] * 2,
               "fast": [{"generation_tokens": 10, "generation_tps": 10.0,  # 1 s
                         "draft_tokens_accepted": 3, "draft_tokens_proposed": 4},
                        {"generation_tokens": 10, "generation_tps": 5.0,  # 2 s
                         "draft_tokens_accepted": 1, "draft_tokens_proposed": 4}]}
    rows = held_out.setting_rows("code", ["plain", "fast"], results)
    assert held_out.table(rows)[1:] == [
        ["code", "plain", "20", "4.0", "5.0", "1.00x", "0/0"],
        ["code", "fast", "20", "3.0", "6.7", "1.33x", "4/8"]]


# ------------------------------------------------------------------------------ tiny pair
@pytest.mark.slow
def test_structured_on_the_tiny_pair(tiny_pair, tmp_path):
    from server.bench import structured

    target, draft = tiny_pair
    assert structured.main(["--target-model", str(target), "--draft-model", str(draft),
                            "--max-tokens", "16", "--reps", "1", "--k", "3",
                            "--results-dir", str(tmp_path)]) == 0
    rows = result(tmp_path, "structured")["rows"]
    assert [(r["output"], r["drafts"]) for r in rows] == [
        ("free text", "none"), ("free text", "model k=3"),
        ("JSON schema", "none"), ("JSON schema", "model k=3")]
    for plain, spec in (rows[:2], rows[2:]):
        assert spec["same_text"] is True  # greedy speculation keeps the text
        assert spec["speedup"] == pytest.approx(spec["tps"] / plain["tps"])
        assert plain["tokens"] == spec["tokens"] == rows[2]["tokens"]


@pytest.mark.slow
def test_prediction_on_the_tiny_pair(tiny_pair, tmp_path):
    from server.bench import prediction

    target, draft = tiny_pair
    assert prediction.main(["--target-model", str(target), "--draft-model", str(draft),
                            "--max-tokens", "24", "--reps", "1",
                            "--results-dir", str(tmp_path)]) == 0
    rows = result(tmp_path, "prediction")["rows"]
    assert [r["case"] for r in rows] == ["exact answer", "edit a JSON record", "edit code",
                                         "unrelated guess"]
    for r in rows:
        assert r["same_text"] is True  # a guess never changes the greedy text
        assert r["speedup"] == pytest.approx(r["guess_tps"] / r["plain_tps"])
    assert rows[0]["accepted"] > 0


def test_suffix_on_the_tiny_pair(tiny_pair, tmp_path):
    """Every case under every drafter, the same greedy text; a repeat drafted by suffix; the
    ratios are the rows' own; the goals' verdicts and the index's memory at its bound."""
    from server.bench import suffix

    target, draft = tiny_pair
    assert suffix.main(["--target-model", str(target), "--draft-model", str(draft),
                        "--max-tokens", "16", "--reps", "1", "--turns", "2", "--index-mb", "1",
                        "--results-dir", str(tmp_path)]) == 0
    doc = result(tmp_path, "suffix")
    rows = doc["rows"]
    drafters = ["plain", "model", "suffix", "hybrid"]
    assert [(r["case"], r["drafter"]) for r in rows] == [
        (case, d) for case in ("repeat", "near repeat", "agent") for d in drafters]
    by = {(r["case"], r["drafter"]): r for r in rows}
    for r in rows:
        assert r["same_text"] is True  # greedy: every drafter writes plain decoding's text
        plain, model = by[r["case"], "plain"], by[r["case"], "model"]
        assert r["vs_plain"] == pytest.approx(r["tps"] / plain["tps"])
        assert r["vs_model"] == pytest.approx(r["tps"] / model["tps"])
        if r["case"] != "agent":
            assert r["vs_first"] == pytest.approx(r["tps"] / r["first_tps"])
    assert by["repeat", "suffix"]["same_as_first"] is True
    assert by["repeat", "suffix"]["from_draft"] >= 0.8  # the first answer, drafted
    assert by["repeat", "plain"]["from_draft"] == 0
    assert [v["id"] for v in doc["verdicts"]] == ["G1", "G2"]
    memory = doc["metadata"]["suffix_index"]
    assert memory["bound_mb"] == 1.0 and 0.5 <= memory["measured_mb"] <= 1.0


def test_suffix_bad_arguments_exit_2(tiny_pair, capsys):
    from server.bench import suffix

    with pytest.raises(SystemExit) as e:
        suffix.main(["--target-model", str(tiny_pair[0]), "--draft-model", "lookup"])
    assert e.value.code == 2 and "need a draft model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        suffix.main(["--drafters", "plain,nonsense"])


def test_the_forward_clock_times_target_forwards_and_drafting_and_prices_them(monkeypatch):
    """The target's forwards are timed and priced with the table at their (rows, tokens), the
    draft's are left to the drafting they belong to; results pass through unchanged; both
    patches are undone."""
    import types

    import mlx.core as mx

    from server.engine.kv.batch import ModelBatch
    from server.engine.scheduling import decoder
    from server.engine.speculation.cost_model import ForwardTimes

    def model(inputs, cache=None):
        return mx.broadcast_to(inputs[..., None].astype(mx.float32), (*inputs.shape, 3))

    def draft_model(inputs, cache=None):
        return -model(inputs)

    def drafting(draft, ks):
        return draft.forward(mx.array([[5]])), ks

    monkeypatch.setattr(decoder, "_draft_with_model", drafting)
    table = ForwardTimes((1, 4), (1, 5), ((0.01, 0.05), (0.04, 0.2)))
    scheduler = types.SimpleNamespace(kit=types.SimpleNamespace(
        target=types.SimpleNamespace(model=model)), costs=types.SimpleNamespace(target=table))
    target, draft = ModelBatch(model), ModelBatch(draft_model)
    original = ModelBatch.forward
    with load.forward_clock(scheduler) as clock:
        out = target.forward(mx.array([[1, 2]] * 4))
        target.forward(mx.array([[3]] * 2))
        assert clock.draft_s == 0
        proposals, ks = decoder._draft_with_model(draft, {1: 2})
    assert ModelBatch.forward is original and decoder._draft_with_model is drafting
    assert out.tolist() == [[[1.0] * 3, [2.0] * 3]] * 4
    assert proposals.tolist() == [[[-5.0] * 3]] and ks == {1: 2}
    assert clock.target_table_s == pytest.approx(table.at(4, 2) + table.at(2, 1))
    assert clock.target_s > 0 and clock.draft_s > 0
    figures = clock.figures(decoding_s=2 * (clock.target_s + clock.draft_s))
    assert figures["target_share"] + figures["draft_share"] == pytest.approx(0.5)
    assert figures["target_over_table"] == pytest.approx(clock.target_s / clock.target_table_s)


@pytest.mark.slow
def test_load_in_process_on_the_tiny_pair(tiny_pair, tmp_path, monkeypatch):
    """With forward times where a drafted token costs nothing extra (the tiny pair's own would
    be noise), so that ours+draft drafts; the forward bound is read from that table."""
    from server.engine.speculation.cost_model import ForwardTimes, StepCosts

    def table(seconds: float) -> ForwardTimes:
        return ForwardTimes((1, 2), (1, 5), ((seconds,) * 2,) * 2)

    monkeypatch.setattr(load.Scheduler, "measure_costs", lambda self: setattr(
        self, "costs", StepCosts(table(0.05), table(0.001))))
    target, draft = tiny_pair
    assert load.main(["--in-process", "--target-model", str(target), "--draft-model",
                      str(draft), "--concurrency", "2", "--runs", "2", "--max-tokens", "16",
                      "--results-dir", str(tmp_path)]) == 0
    rows = result(tmp_path, "load")["rows"]
    assert [r["server"] for r in rows] == ["ours+draft", "ours", "mlx_lm"]
    assert all(r["aggregate_tps"] > 0 and len(r["aggregate_tps_runs"]) == 2 for r in rows)
    assert rows[0]["ratio_aggregate"] is None  # ours with the draft over each other
    assert rows[2]["ratio_aggregate"] == pytest.approx(rows[0]["aggregate_tps"]
                                                       / rows[2]["aggregate_tps"])
    assert all(r["all_answered"] and r["tokens"] == 2 * 2 * 16 for r in rows)
    assert 0 < rows[0]["from_draft_fraction"] < 1 and rows[1]["from_draft_fraction"] == 0
    assert rows[2]["from_draft_fraction"] is None
    assert [r.get("forward_bound_tps") for r in rows] == [pytest.approx(2 / 0.05)] * 2 + [None]
    assert all(r["decode_tps"] > 0 for r in rows[:2]) and all(r["peak_rss_gb"] > 0 for r in rows)
    assert all(0 < r["target_share"] < 1 and r["target_over_table"] > 0 for r in rows[:2])
    assert rows[0]["draft_share"] > 0 and rows[1]["draft_share"] == 0
    assert "target_share" not in rows[2]


def test_the_long_prompt_has_the_tokens_asked_for(tiny_pair):
    from mlx_lm import load as mlx_load

    tokenizer = mlx_load(str(tiny_pair[0]))[1]
    ids = load.long_prompt(tokenizer, 300)
    assert len(ids) == 300
    assert ids[-5:] == tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                                     add_generation_prompt=True)[-5:]


@pytest.mark.parametrize("argv", [
    [], ["--in-process", "--server", "http://a"], ["--server", "http://a", "--runs", "0"],
    ["--server", "http://a", "--pid", "other=1"], ["--server", "http://a", "--pid", "x"],
    ["--in-process", "--target-model", "t"], ["--server", "http://a", "--long-prompt", "9"],
    ["--in-process", "--long-prompt", "-1"],
])
def test_load_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        load.parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


# ------------------------------------------------------------------------------ report
def example_tree(root: Path, monkeypatch) -> None:
    """The example manifest's files: a synthetic sweep, a note and the sweep's picture."""
    synthetic_sweep(monkeypatch)
    assert sweep.main(["--smoke", "--results-dir", str(root / "runs")]) == 0
    (root / "RESULTS").mkdir()
    for path in (root / "runs").iterdir():
        if path.suffix in (".json", ".png"):
            shutil.copy(path, root / "RESULTS" / f"sweep-smoke{path.suffix}")
    (root / "RESULTS" / "notes.txt").write_text("a b\n  c\n")
    (root / "docs").mkdir()
    shutil.copy(EXAMPLE_MANIFEST, root / "docs" / "benchmarks.yaml")


def test_report_renders_the_manifest_and_checks_it(tmp_path, capsys, monkeypatch):
    example_tree(tmp_path, monkeypatch)
    root = ["--root", str(tmp_path)]
    assert report.report_main([*root, "--check"]) == 1  # nothing generated yet
    assert report.report_main(root) == 0
    page = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert page.startswith("_Generated by `mlx-spec-bench report` from `docs/benchmarks.yaml`")
    doc = json.loads((tmp_path / "RESULTS" / "sweep-smoke.json").read_text())
    expected_table = report.markdown_table(sweep.table(doc["rows"]))
    for part in ("# Example benchmarks", "Methodology: medians.", "## Draft length",
                 "```bash\nmlx-spec-bench sweep --smoke\n```", expected_table,
                 f"`{doc['command']}`: {doc['metadata']['date']}",
                 "![sweep-smoke](../RESULTS/sweep-smoke.png)",
                 "`RESULTS/notes.txt`:\n\n```\na b\n  c\n```",
                 "## Tried, and did not pay\n\n- fused projections: 1.01x, not kept"):
        assert part in page, part
    assert "| structured | base |" in expected_table
    assert f"- **P1 {doc['verdicts'][0]['verdict']}**" in page
    assert report.report_main([*root, "--check"]) == 0
    (tmp_path / "RESULTS" / "notes.txt").write_text("changed\n")
    assert report.report_main([*root, "--check"]) == 1
    (tmp_path / "RESULTS" / "notes.txt").unlink()
    assert report.report_main(root) == 1
    assert "cited file is missing: RESULTS/notes.txt" in capsys.readouterr().err


def test_markdown_table_escapes_pipes():
    assert report.markdown_table([["a", "b"], ["x|y", "1"]]) == (
        "| a | b |\n| --- | --- |\n| x\\|y | 1 |")


def test_the_benchmark_page_is_generated_from_the_results_it_cites():
    """docs/benchmarks.md is what `mlx-spec-bench report` makes of docs/benchmarks.yaml and the
    RESULTS/ files it cites; every cited file exists and nothing else lives in RESULTS/."""
    import yaml

    from server.bench.results import report_main as report

    root = ROOT
    assert report(["--check", "--root", str(root)]) == 0
    manifest = yaml.safe_load((root / "docs" / "benchmarks.yaml").read_text())
    cited = {f for section in manifest["sections"] for f in section["files"]}
    readme = (root / "README.md").read_text()
    cited |= {m for m in cited if m in readme}
    on_disk = {str(p.relative_to(root)) for p in (root / "RESULTS").iterdir()}
    assert on_disk == cited
