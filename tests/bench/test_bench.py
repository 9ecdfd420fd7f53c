"""`mlx-spec-bench sweep`: arguments, statistics, the speedup model, the writer, and whole
sweeps: synthetic (`fake_bench_server.SyntheticRunner`), in-process on the tiny pair, and
through HTTP servers."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import httpx
import pytest
from support.fake_bench_server import synthetic_sweep

from server.bench.results import ResultsWriter, summarize
from server.bench.runners import HttpRunner
from server.bench.sweep import (
    PROMPT_KINDS,
    Cell,
    main,
    parse_args,
    per_token_acceptance,
    plan_cells,
    theoretical_speedup,
    verdict_beats_baseline,
    verdict_interior_maximum,
    verdict_structured_accepts_more,
)
from server.engine.params import SpeculationParams


# ------------------------------------------------------------------------------ arguments
def test_lists_keep_their_order_and_drop_repeats():
    args = parse_args(["--draft-tokens", "2,4,4,3", "--prompt-kinds",
                       "repeat_edit,structured,repeat_edit"])
    assert args.draft_tokens == [2, 4, 3]
    assert args.prompt_kinds == ["repeat_edit", "structured"]


def test_smoke_narrows_the_sweep():
    args = parse_args(["--smoke", "--draft-tokens", "4,8,16", "--prompt-kinds",
                       "open_ended,structured"])
    assert (args.reps, args.warmup) == (1, 0)
    assert args.prompt_kinds == ["open_ended"]
    assert args.draft_tokens == [4, 8]


@pytest.mark.parametrize("argv", [
    ["--draft-tokens", "1,x"], ["--draft-tokens", "0,2"], ["--prompt-kinds", "poetry"],
    ["--compare", "http://b"], ["--reps", "0"], ["--warmup", "-1"], ["--max-tokens", "1"],
    ["--draft", "prompt_lookup", "--draft-model", "d"], ["--temp", "-1"],
    ["--target-model", "t"], ["--server", "http://a", "--timeout", "0"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cells_put_the_baseline_first():
    assert plan_cells(["structured", "open_ended"], [1, 4]) == [
        Cell("structured", 0), Cell("structured", 1), Cell("structured", 4),
        Cell("open_ended", 0), Cell("open_ended", 1), Cell("open_ended", 4)]
    code = PROMPT_KINDS["repeat_edit"].split("```python\n")[1]
    assert 35 <= code.count("\n") <= 55


# ------------------------------------------------------------------------------ statistics
def test_summary_by_hand():
    s = summarize([10, 12, 11, 13, 30])  # sorted 10 11 12 13 30
    assert (s.median, s.q1, s.q3, s.iqr) == (12, 11, 13, 2)
    assert s.cv == pytest.approx(2 / 12 / 1.349)  # 0.1236 > 0.10
    assert s.noisy
    s = summarize([1.0, 2.0, 3.0, 4.0])  # linear quartiles: 1.75, 3.25
    assert (s.median, s.q1, s.q3, s.iqr) == (2.5, 1.75, 3.25, 1.5)
    assert s.cv == pytest.approx(1.5 / 2.5 / 1.349)
    s = summarize([100.0, 101.0, 102.0])
    assert s.cv == pytest.approx(1.0 / 101.0 / 1.349) and not s.noisy
    assert summarize([7.0]).iqr == 0 and summarize([7.0]).cv == 0
    assert summarize([None, None]).median is None


def test_theoretical_speedup_by_hand():
    # (1 - a^(k+1)) / ((1 - a)(1 + k c))
    assert theoretical_speedup(0.5, 2, 0.1) == pytest.approx(0.875 / (0.5 * 1.2))  # 1.4583
    assert theoretical_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))
    assert theoretical_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)  # a == 1: (k + 1)/(1+kc)
    assert theoretical_speedup(0.0, 4, 0.25) == pytest.approx(1 / 2)  # a == 0: 1/(1+kc)
    assert theoretical_speedup(0.7, 0, 0.3) == 1.0
    with pytest.raises(ValueError):
        theoretical_speedup(1.2, 2, 0.1)


def test_per_token_acceptance_inverts_accepted_over_proposed():
    # a = 0.5, k = 2: accepted/proposed = a (1 - a^2) / (k (1 - a)) = 0.375
    assert per_token_acceptance(0.375, 2) == pytest.approx(0.5, abs=1e-9)
    assert per_token_acceptance(0.0, 8) == 0.0
    assert per_token_acceptance(1.0, 8) == 1.0
    assert per_token_acceptance(0.6, 1) == 0.6
    for rate, k, c in [(0.3, 4, 0.1), (0.9, 16, 0.02), (0.55, 3.5, 0.2)]:
        a = per_token_acceptance(rate, k)
        assert theoretical_speedup(a, k, c) == pytest.approx((1 + rate * k) / (1 + k * c))


def _row(kind, k, tps, q1=None, q3=None, accepted=None, proposed=None, server="s"):
    return {"server": server, "kind": kind, "k": k, "error": None, "tps_median": tps,
            "tps_q1": tps if q1 is None else q1, "tps_q3": tps if q3 is None else q3,
            "accepted": accepted, "proposed": proposed}


def test_verdicts():
    rows = [_row("structured", 0, 50, 49, 51), _row("structured", 2, 60, 52, 61),
            _row("structured", 4, 70, 69, 71), _row("structured", 8, 55)]
    p1 = verdict_beats_baseline(rows)
    assert p1.verdict == "PASS" and "k=4" in p1.detail and "1.40x" in p1.detail
    overlapping = [_row("structured", 0, 50, 45, 58), _row("structured", 2, 55, 50, 60)]
    assert verdict_beats_baseline(overlapping).verdict == "FAIL"
    assert verdict_beats_baseline(rows[1:]).verdict == "N-A"
    assert verdict_interior_maximum(rows).verdict == "PASS"
    assert verdict_interior_maximum(rows[:3]).verdict == "N-A"  # two k values
    edge = rows[:3] + [_row("structured", 8, 80)]
    assert verdict_interior_maximum(edge).verdict == "FAIL"
    acc = [_row("structured", 2, 60, accepted=80, proposed=100),
           _row("open_ended", 2, 60, accepted=50, proposed=100)]
    assert verdict_structured_accepts_more(acc).verdict == "PASS"
    acc[1]["accepted"] = 90
    assert verdict_structured_accepts_more(acc).verdict == "FAIL"
    assert verdict_structured_accepts_more(acc[:1]).verdict == "N-A"


# ------------------------------------------------------------------------------ files
def read_results(directory):
    """(jsonl rows, json document, csv rows) of the one sweep written into `directory`."""
    (jsonl,) = directory.glob("*.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    doc = json.loads(jsonl.with_suffix(".json").read_text())
    with open(jsonl.with_suffix(".csv"), newline="") as f:
        table = list(csv.DictReader(f))
    assert jsonl.with_suffix(".png").stat().st_size > 1000
    return rows, doc, table


def assert_files_agree(rows, doc, table):
    assert doc["rows"] == rows
    assert len(table) == len(rows)
    for row, line in zip(rows, table, strict=True):
        assert list(line) == list(rows[0])
        for key, value in row.items():
            if value is None:
                assert line[key] == ""
            elif isinstance(value, list):
                assert [float(v) for v in line[key].split(";")] == pytest.approx(value)
            elif isinstance(value, bool):
                assert line[key] == str(value)
            elif isinstance(value, (int, float)):
                assert float(line[key]) == pytest.approx(value)
            else:
                assert line[key] == value


def test_writer_files_agree(tmp_path):
    writer = ResultsWriter(tmp_path, "sweep", "w")
    name = writer.name
    assert name.startswith("sweep-") and name.endswith("-w")
    rows = [
        {"server": "local", "kind": "structured", "k": 0, "error": None, "tps_median": 50.5,
         "tps_q1": 50.0, "tps_q3": 51.0, "flagged": False, "tps_reps": [50.0, 50.5, 51.0],
         "accept_rate_median": None},
        {"server": "local", "kind": "structured", "k": 2, "error": "RuntimeError: boom",
         "tps_median": None, "tps_q1": None, "tps_q3": None, "flagged": False, "tps_reps": [],
         "accept_rate_median": None},
    ]
    for row in rows:
        writer.write_row(row)
    # flushed as written: a crash after this point keeps the rows
    assert len((tmp_path / f"{name}.jsonl").read_text().splitlines()) == 2
    rows[1]["tps_reps"] = [1.0]  # csv cannot tell [] from None; keep the check exact
    written = writer.finish("mlx-spec-bench sweep", {"m": 1}, rows, verdicts=[])
    assert set(written) == {"jsonl", "csv", "json"}  # no plot asked for
    doc = json.loads((tmp_path / f"{name}.json").read_text())
    assert doc == {"subcommand": "sweep", "command": "mlx-spec-bench sweep",
                   "metadata": {"m": 1}, "rows": rows, "verdicts": []}
    table = list(csv.DictReader(open(tmp_path / f"{name}.csv", newline="")))
    assert table[0]["tps_reps"] == "50.0;50.5;51.0" and table[1]["error"] == "RuntimeError: boom"
    assert table[0]["accept_rate_median"] == ""


# ------------------------------------------------------------------------------ whole sweeps
def test_synthetic_sweep_end_to_end(tmp_path, capsys, monkeypatch):
    synthetic_sweep(monkeypatch)
    assert main(["--results-dir", str(tmp_path), "--tag", "t", "--reps", "3",
                 "--draft-tokens", "1,4,16"]) == 0
    out = capsys.readouterr().out
    rows, doc, table = read_results(tmp_path)
    assert [(r["kind"], r["k"]) for r in rows] == [
        (kind, k) for kind in ("structured", "open_ended") for k in (0, 1, 4, 16)]
    assert_files_agree(rows, doc, table)
    assert all(r["reps"] == 3 and len(r["tps_reps"]) == 3 and r["error"] is None for r in rows)
    assert doc["subcommand"] == "sweep" and doc["metadata"]["runners"][0]["kind"] == "synthetic"
    assert doc["command"] == ("mlx-spec-bench sweep --results-dir "
                              f"{tmp_path} --tag t --reps 3 --draft-tokens 1,4,16")
    for key in ("date", "machine", "cpu_count", "os", "python", "mlx", "mlx_lm"):
        assert doc["metadata"][key]
    assert [v["id"] for v in doc["verdicts"]] == ["P1", "P2", "P3"]
    # each row's speedup and theory columns, from that row's own measurements
    c = doc["metadata"]["cost_ratio"]
    for r in rows:
        base = next(b for b in rows if b["kind"] == r["kind"] and b["k"] == 0)
        assert r["speedup"] == pytest.approx(r["tps_median"] / base["tps_median"])
        assert r["tps_median"] == pytest.approx(sorted(r["tps_reps"])[1])  # 3 reps
        if r["k"]:
            k, rate = r["k_mean"], r["accepted"] / r["proposed"]
            assert r["theory"] == pytest.approx((1 + rate * k) / (1 + k * c))
    assert "tok/s median [IQR]" in out and tmp_path.name in out
    for v in doc["verdicts"]:
        assert f"{v['id']} {v['verdict']}" in out


@pytest.mark.slow
def test_smoke_on_the_tiny_pair(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    assert main(["--smoke", "--target-model", str(target), "--draft-model", str(draft),
                 "--max-tokens", "16", "--results-dir", str(tmp_path)]) == 0
    rows, doc, table = read_results(tmp_path)
    assert_files_agree(rows, doc, table)
    assert [(r["kind"], r["k"]) for r in rows] == [("structured", 0), ("structured", 1),
                                                   ("structured", 2)]
    for r in rows:
        assert r["error"] is None and r["reps"] == 1 and r["tokens_median"] == 16
        assert r["tps_median"] > 0 and r["peak_gb_median"] > 0
    base, *spec = rows
    assert base["proposed"] == 0 and base["speedup"] == 1.0
    for r in spec:
        assert 0 < r["accepted"] <= r["proposed"] and r["theory"] > 0
        assert r["from_draft_median"] == pytest.approx(r["accepted"] / 16)
    assert doc["metadata"]["cost_ratio"] > 0
    assert doc["metadata"]["runners"][0]["models"]["draft"]["path"] == str(draft)
    assert "structured  base" in capsys.readouterr().out


@pytest.mark.slow
def test_server_compare_sweep(live_server, tmp_path):
    url = live_server
    assert main(["--server", url, "--compare", url + "/v1", "--smoke", "--max-tokens", "12",
                 "--results-dir", str(tmp_path), "--cost-ratio", "0.5", "--timeout", "60"]) == 0
    rows, doc, table = read_results(tmp_path)
    assert_files_agree(rows, doc, table)
    again = url + " (again)"  # an A/A comparison: the same server twice, two names
    assert [(r["server"], r["k"]) for r in rows] == [
        (url, 0), (again, 0), (url, 1), (again, 1), (url, 2), (again, 2)]
    for r in rows:
        assert r["error"] is None and r["tokens_median"] == 12 and r["compare_ratio"] > 0
        assert r["peak_gb_median"] > 0  # from our server's stats
    for r in rows[2:]:
        assert r["proposed"] > 0 and r["from_draft_median"] == pytest.approx(r["accepted"] / 12)
        assert r["theory"] == pytest.approx(
            (1 + r["accepted"] / r["proposed"] * r["k_mean"]) / (1 + r["k_mean"] * 0.5))
    assert doc["metadata"]["runners"][0]["kind"] == "http (ours)"
    assert len(doc["verdicts"]) == 6


@pytest.mark.slow
def test_server_cell_errors_are_rows(live_server, tmp_path):
    # our server refuses more than 64 draft tokens: those cells fail, the sweep goes on
    assert main(["--server", live_server, "--draft-tokens", "2,65", "--reps", "1",
                 "--warmup", "0", "--prompt-kinds", "open_ended", "--max-tokens", "8",
                 "--results-dir", str(tmp_path), "--timeout", "60"]) == 0
    rows, _, _ = read_results(tmp_path)
    assert [r["error"] is None for r in rows] == [True, True, False]
    assert "HTTP 4" in rows[2]["error"] and rows[2]["tps_median"] is None


def _mlx_lm_like_server(bodies: list[dict]) -> httpx.MockTransport:
    """Answers like `mlx_lm.server`: bare /health, text chunks without `from_draft`, usage."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        bodies.append(json.loads(request.content))
        chunks = [{"choices": [{"delta": {"content": t}, "finish_reason": None}]}
                  for t in ("def", " f", "(x", "):")]
        chunks.append({"choices": [{"delta": {"content": ""}, "finish_reason": "length"}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6,
                                                "total_tokens": 15}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_mlx_lm_server_protocol():
    bodies: list[dict] = []
    runner = HttpRunner("http://mlx/v1", speculation=SpeculationParams(), temperature=0.0,
                        transport=_mlx_lm_like_server(bodies))
    assert runner.flavor == "mlx_lm" and runner.url == "http://mlx"
    base = runner.run(Cell("structured", 0), max_tokens=6, seed=0)
    spec = runner.run(Cell("structured", 4), max_tokens=6, seed=0)
    # its baseline unloads the draft; k goes in num_draft_tokens; no extensions sent
    assert "draft_model" in bodies[0] and bodies[0]["draft_model"] is None
    assert "num_draft_tokens" not in bodies[0]
    assert bodies[1]["num_draft_tokens"] == 4 and "draft_model" not in bodies[1]
    assert "acceptance" not in bodies[1] and "draft" not in bodies[1]
    for r in (base, spec):
        assert r["tokens"] == 6 and r["prompt_tokens"] == 9 and r["finish_reason"] == "length"
        assert r["from_draft"] is None and r["proposed"] is None and r["peak_gb"] is None
        assert r["tps"] is None or (r["tps"] > 0 and math.isfinite(r["tps"]))
    lookup = HttpRunner("http://mlx", speculation=SpeculationParams(source="prompt_lookup"),
                        temperature=0.0, transport=_mlx_lm_like_server(bodies))
    with pytest.raises(RuntimeError, match="extension of our server"):
        lookup.run(Cell("repeat_edit", 2), max_tokens=6, seed=0)


def test_draft_p_min_reaches_our_server_with_the_speculation_settings():
    from server.bench.sweep import speculation_of

    spec = speculation_of(parse_args(["--adaptive", "--draft-p-min", "0.6",
                                      "--hybrid-min-match", "1"]))
    assert spec.adaptive and spec.draft_p_min == 0.6 and spec.hybrid_min_match == 1

    def ours(request):
        return httpx.Response(200, json={"status": "ok", "target": "t"})

    runner = HttpRunner("http://ours", speculation=spec, temperature=0.0,
                        transport=httpx.MockTransport(ours))
    assert runner.flavor == "ours"
    body = runner.request_body(Cell("structured", 4), max_tokens=6, seed=0)
    assert body["num_draft_tokens"] == 4 and body["adaptive"] is True
    assert body["draft_p_min"] == 0.6 and body["hybrid_min_match"] == 1
    assert "draft_p_min" not in runner.request_body(Cell("structured", 0), max_tokens=6, seed=0)


# ------------------------------------------------------------------------------ optional extra
@pytest.mark.slow
def test_the_server_runs_without_matplotlib(tmp_path):
    """matplotlib is in the `bench` extra: the server, the demo and the benchmarks import
    without it, and the writer keeps the data and says why there is no picture."""
    code = (
        "import json, sys\n"
        "sys.modules['matplotlib'] = None  # any import of it now fails\n"
        "import server.__main__, server.http.app, server.demo, server.bench\n"
        "from server.bench import chat, held_out, load, results, structured, sweep\n"
        "from server.bench.results import ResultsWriter\n"
        "w = ResultsWriter(sys.argv[1], 'x')\n"
        "w.write_row({'a': 1})\n"
        "written = w.finish('c', {}, [{'a': 1}], plot=sweep.plot)\n"
        "print(' '.join(sorted(written)))\n"
        "print(json.load(open(written['json']))['metadata']['plot_error'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    files, error = done.stdout.splitlines()
    assert files == "csv json jsonl"
    assert error.startswith("ModuleNotFoundError") and "matplotlib" in error
    assert not list(tmp_path.glob("*.png"))


def test_default_models_are_the_demo_pair_else_the_generated_one(tmp_path, monkeypatch):
    from server.bench.sweep import resolve_models
    from server.model_files import bundled

    built = []
    monkeypatch.setattr(bundled, "DEMO_DIR", tmp_path / "demo")
    monkeypatch.setattr(bundled, "ensure_pair",
                        lambda out, preset: built.append((out, preset)) or (out / "t", out / "d"))
    generated = (str(bundled.GENERATED_DIR / "t"), str(bundled.GENERATED_DIR / "d"))
    assert resolve_models(parse_args([])) == generated
    assert built == [(bundled.GENERATED_DIR, "small")]
    for role in ("target", "draft"):
        (tmp_path / "demo" / role).mkdir(parents=True)
        (tmp_path / "demo" / role / "config.json").write_text("{}")
    demo = str(tmp_path / "demo" / "target"), str(tmp_path / "demo" / "draft")
    assert resolve_models(parse_args([])) == demo
    assert resolve_models(parse_args(["--draft-model", "d"])) == (demo[0], "d")
    assert resolve_models(parse_args(["--draft", "prompt_lookup"])) == (demo[0], None)
    assert len(built) == 1


def test_a_server_that_does_not_answer_is_an_error_not_an_mlx_lm_server(capsys):
    """Taken for mlx_lm.server, ours would get requests without our fields (adaptive: false
    among them), so a fixed-k sweep would silently measure adaptive k."""
    def refused(request):
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(RuntimeError, match="does not answer GET /health"):
        HttpRunner("http://gone", speculation=SpeculationParams(), temperature=0.0,
                   transport=httpx.MockTransport(refused))
    assert main(["--server", "http://127.0.0.1:9", "--draft-tokens", "1", "--reps", "1"]) == 1
    assert "does not answer GET /health" in capsys.readouterr().err
