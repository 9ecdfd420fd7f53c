"""`python -m server.bench`: arguments, statistics, the speedup model, the writer, and whole
sweeps: synthetic (`--dry-run`), in-process on the tiny pair, and through HTTP servers."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import httpx
import numpy as np
import pytest

from server.bench.cells import PROMPT_KINDS, Cell, plan_cells
from server.bench.cli import main, parse_args
from server.bench.http_runner import HttpRunner
from server.bench.stats import (
    per_token_acceptance,
    summarize,
    theoretical_speedup,
    verdict_beats_baseline,
    verdict_interior_maximum,
    verdict_structured_accepts_more,
)
from server.bench.writer import ResultsWriter
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
    writer = ResultsWriter(tmp_path, "w")
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
    assert len((tmp_path / "w.jsonl").read_text().splitlines()) == 2
    rows[1]["tps_reps"] = [1.0]  # csv cannot tell [] from None; keep the check exact
    written = writer.finish({"m": 1}, rows, [])
    assert set(written) == {"jsonl", "csv", "json", "png"}
    doc = json.loads((tmp_path / "w.json").read_text())
    assert doc["metadata"] == {"m": 1} and doc["verdicts"] == []
    table = list(csv.DictReader(open(tmp_path / "w.csv", newline="")))
    assert table[0]["tps_reps"] == "50.0;50.5;51.0" and table[1]["error"] == "RuntimeError: boom"
    assert table[0]["accept_rate_median"] == ""


# ------------------------------------------------------------------------------ whole sweeps
def test_dry_run_end_to_end(tmp_path, capsys):
    assert main(["--dry-run", "--results-dir", str(tmp_path), "--tag", "t", "--reps", "3",
                 "--draft-tokens", "1,4,16"]) == 0
    out = capsys.readouterr().out
    rows, doc, table = read_results(tmp_path)
    assert [(r["kind"], r["k"]) for r in rows] == [
        (kind, k) for kind in ("structured", "open_ended") for k in (0, 1, 4, 16)]
    assert_files_agree(rows, doc, table)
    assert all(r["reps"] == 3 and len(r["tps_reps"]) == 3 and r["error"] is None for r in rows)
    assert doc["metadata"]["dry_run"] and doc["metadata"]["args"]["reps"] == 3
    for key in ("machine", "os", "python", "mlx", "mlx_lm"):
        assert doc["metadata"]["environment"][key]
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
        assert r.tokens == 6 and r.prompt_tokens == 9 and r.finish_reason == "length"
        assert r.from_draft is None and r.proposed is None and r.peak_gb is None
        assert r.tps is None or (r.tps > 0 and math.isfinite(r.tps))
    lookup = HttpRunner("http://mlx", speculation=SpeculationParams(source="prompt_lookup"),
                        temperature=0.0, transport=_mlx_lm_like_server(bodies))
    with pytest.raises(RuntimeError, match="extension of our server"):
        lookup.run(Cell("repeat_edit", 2), max_tokens=6, seed=0)


def test_draft_p_min_reaches_our_server_with_the_speculation_settings():
    from server.bench.cli import speculation_of

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
        "import server.__main__, server.http.app, server.demo, server.bench.cli\n"
        "import server.bench.load, server.bench.http_runner\n"
        "from server.bench.writer import ResultsWriter\n"
        "w = ResultsWriter(sys.argv[1], 'x')\n"
        "w.write_row({'a': 1})\n"
        "written = w.finish({}, [{'a': 1}], [])\n"
        "print(' '.join(sorted(written)))\n"
        "print(json.load(open(written['json']))['metadata']['plot_error'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    files, error = done.stdout.splitlines()
    assert files == "csv json jsonl"
    assert error.startswith("ModuleNotFoundError") and "matplotlib" in error
    assert not (tmp_path / "x.png").exists()


def test_default_models_are_the_demo_pair_else_the_generated_one(tmp_path, monkeypatch):
    from server.bench.cli import resolve_models
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


def test_verify_cost_finds_the_acceptance_a_speedup_needs():
    from server.bench.verify_cost import needed_p

    # k=1: (1 + p) * one / round = s  ->  p = s * round / one - 1
    assert abs(needed_p(1, 100.0, 80.0, 1.5) - 0.875) < 1e-6
    # k=2, a round costing one step: 1 + p + p^2 = 1.75  ->  p = 0.5
    assert abs(needed_p(2, 50.0, 50.0, 1.75) - 0.5) < 1e-6


def test_lookup_vs_draft_scores_each_position_by_its_lookup_match():
    from server.bench.lookup_vs_draft import lookup_match, positions, table

    assert lookup_match([1, 2, 3, 9, 1, 2, 3], 2) == (3, [9, 1])
    assert lookup_match([5, 2, 7, 2], 4) == (1, [7, 2])
    assert lookup_match([1, 2, 3], 4) == (0, [])
    # prompt [1, 2, 3, 4]; answer [1, 2, 5]; the draft predicts 1, 9, 5
    rows = list(positions([1, 2, 3, 4], [1, 2, 5], [1, 9, 5], k=2))
    # j=0: context ends in 4 (no match); the draft's run: 1 right, 9 wrong -> 1
    # j=1: ends in 4, 1 -> only "1" matched before (n = 1), lookup proposes 2, 3: run 1
    # j=2: ends in 1, 2 -> n = 2, lookup proposes 3, 4 against 5: run 0; the draft: 5 -> 1
    assert rows == [(0, 0, 1), (1, 1, 0), (2, 0, 1)]
    text = table(np.array(rows), 2)
    assert text.splitlines()[1].split() == ["0", "0.33", "0.00", "1.00", "0.00", "1.00"]


def test_draft_sizes_picks_each_drafts_best_k_and_its_adaptive_run(tmp_path, capsys):
    from server.bench.draft_sizes import main as draft_sizes

    draft = tmp_path / "draft-2l"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    (draft / "model.safetensors").write_bytes(b"\0" * 1_500_000)

    def row(kind, k, speedup, acc):
        return {"kind": kind, "k": k, "speedup": speedup, "accept_rate_median": acc,
                "cost_ratio": 0.09, "error": None, "accepted": int((acc or 0) * 100),
                "proposed": 100}

    def result(name, adaptive, rows, drafter="model"):
        path = tmp_path / name
        path.write_text(json.dumps({"metadata": {"args": {"draft_model": str(draft),
                                                          "adaptive": adaptive,
                                                          "draft": drafter}},
                                    "rows": rows}))
        return str(path)

    fixed = result("fixed.json", False, [
        row("structured", 0, 1.0, None), row("structured", 1, 1.10, 0.4),
        row("structured", 2, 1.25, 0.3), row("structured", 4, 0.9, 0.2),
        row("open_ended", 1, 1.3, 0.5)])
    adaptive = result("adaptive.json", True, [row("structured", 4, 1.2, 0.35)])
    hybrid = result("hybrid.json", True, [row("open_ended", 4, 1.5, 0.45)], drafter="hybrid")
    draft_sizes([fixed, adaptive, hybrid])
    lines = [line.split() for line in capsys.readouterr().out.splitlines()[1:3]]
    assert lines[0] == [str(draft), "model", "2", "1.5", "0.090", "1.25x", "k=2", "(0.30,",
                        "30/100)", "1.20x", "(0.35,", "35/100)", "1.30x", "k=1", "(0.50,",
                        "50/100)", "-"]
    assert lines[1] == [str(draft), "hybrid", "2", "1.5", "0.090", "-", "-", "-",
                        "1.50x", "(0.45,", "45/100)"]


def test_ab_gives_each_drafts_runs_their_median_and_counts(tmp_path, capsys):
    from server.bench.ab import main as ab

    def result(name, draft, speedups, tps, counts, drafter="hybrid", **args):
        rows = [{"kind": kind, "k": k, "speedup": speedup, "tps_median": t, "error": None,
                 "adaptive": True, "accepted": acc, "proposed": prop}
                for kind in ("structured", "open_ended")
                for k, speedup, t, (acc, prop) in ((0, 1.0, 15.0, (0, 0)),
                                                   (4, speedups, tps, counts))]
        path = tmp_path / name
        path.write_text(json.dumps({"metadata": {"args": {"draft_model": draft,
                                                          "draft": drafter, **args}},
                                    "rows": rows}))
        return str(path)

    files = [result("n1.json", "new", 1.5, 24.0, (120, 246)),
             result("o1.json", "old", 1.4, 22.0, (106, 256)),
             result("n2.json", "new", 1.7, 26.0, (120, 246)),
             result("o2.json", "old", 1.3, 21.0, (106, 256)),
             result("n3.json", "new", 1.6, 25.0, (121, 246)),
             result("m1.json", "new", 1.1, 18.0, (80, 250), drafter="model"),
             result("l1.json", None, 1.2, 19.0, (70, 150), drafter="prompt_lookup")]
    ab(files)
    lines = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    ab([result("h1.json", "new", 1.5, 24.0, (120, 246), hybrid_min_match=1),
        result("h2.json", "new", 1.6, 25.0, (126, 240), hybrid_min_match=2)])
    hybrids = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[2:4]]
    assert hybrids == [["new", "hybrid,match>=1"], ["new", "hybrid,match>=2"]]
    ab([result("p0.json", "new", 1.4, 21.0, (130, 290), draft_p_min=0.0),
        result("p6.json", "new", 1.3, 20.0, (120, 200), draft_p_min=0.6),
        result("q6.json", "new", 1.2, 19.0, (100, 190), drafter="model", draft_p_min=0.75)])
    cut_offs = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[2:5]]
    assert cut_offs == [["new", "hybrid"], ["new", "hybrid,p_min=0.6"],
                        ["new", "model,p_min=0.75"]]
    assert lines[:3] == [
        ["new", "hybrid", "open_ended", "adaptive", "1.50", "1.70", "1.60", "1.60x", "25.0",
         "120/246", "121/246"],
        ["old", "hybrid", "open_ended", "adaptive", "1.40", "1.30", "1.35x", "21.5", "106/256"],
        ["new", "model", "open_ended", "adaptive", "1.10", "1.10x", "18.0", "80/250"]]
    assert lines[3][:4] == ["-", "prompt_lookup", "open_ended", "adaptive"]  # no draft model
    assert [line[:3] for line in lines[4:8]] == [["new", "hybrid", "structured"],
                                                 ["old", "hybrid", "structured"],
                                                 ["new", "model", "structured"],
                                                 ["-", "prompt_lookup", "structured"]]


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


def test_round_replay_counts_and_prices_each_round():
    from server.bench.round_replay import Costs, plain_ms, replay

    costs = Costs(verify={1: 10.0, 2: 11.0, 3: 13.0}, draft_step=2.0, host=1.0)
    answer = [5, 6, 7, 8, 9]
    # Round 1 at j=0: lookup proposes [5, 6] (both right): emits 5, 6, 7 -> j=3.
    # Round 2 at j=3: the model proposes [0, 9] (first wrong): emits 8 -> j=4.
    # Round 3 at j=4: nothing proposed: emits 9.
    plan = {0: ("prompt_lookup", [5, 6]), 3: ("model", [0, 9]), 4: ("model", [])}
    r = replay(answer, plan.__getitem__, costs)
    assert (r.rounds, r.proposed, r.accepted) == (3, 4, 2)
    assert r.ms == (13 + 1) + (13 + 2 * 2 + 1) + (10 + 1)
    assert plain_ms(answer, costs) == 5 * 11


def test_round_replay_hybrid_leaves_short_matches_to_the_draft_when_told():
    from server.bench.round_replay import policies

    # Context [1, 2, 3, 2] + answer: at j=0 only the 1-gram (2,) matches (earlier 2 -> 3, 2).
    prompt, answer = [1, 2, 3, 2], [7, 7, 7, 7]
    draft_next = [8, 8, 8, 8]
    found = policies(prompt, answer, draft_next, None)
    assert found["hybrid lookup 4 / model 2"](0) == ("prompt_lookup", [3, 2])
    # the draft model's rounds also say how many draft steps they ran
    assert found["hybrid lookup 4 from a 2-match / model 2"](0) == ("model", [8, 8], 2)
    assert found["hybrid lookup 4 from a 2-match / model 4"](0) == ("model", [8, 8, 8, 8], 4)
    # the draft model alone ignores the lookup match, and its last round is cut at the answer
    assert found["draft model k=4"](0) == ("model", [8, 8, 8, 8], 4)
    assert found["draft model k=4"](2) == ("model", [8, 8], 2)


def test_round_replay_ngram_table_proposes_only_confident_continuations():
    from server.bench.round_replay import NgramTable

    # After (1, 2, 3): 4 twice and 9 once; after (7, 8, 3): 5 once.
    table = NgramTable([([0], [1, 2, 3, 4]), ([0], [1, 2, 3, 4]), ([0], [1, 2, 3, 9]),
                        ([0], [7, 8, 3, 5])])
    assert table.propose([1, 2, 3], 1) == [4]  # seen 3 times, 4 holds 2/3
    assert table.propose([7, 8, 3], 1) == []  # seen once: below min_count
    assert table.propose([7, 8, 3], 1, min_count=1) == [5]
    assert table.propose([6, 6, 3], 1) == []  # no 3-gram seen: the 1-gram (3,) is not asked
    assert table.propose([6, 6, 3], 1, min_n=1, min_count=1, min_share=0.5) == [4]  # 2 of 4


def test_round_replay_adaptive_follows_the_servers_schedule():
    """The replayed adaptive policy moves k as the server's DraftSchedule does, per drafter,
    and chooses lookup only from its minimum match."""
    from server.bench.round_replay import Adaptive, Costs, replay

    costs = Costs(verify={w: 10.0 for w in range(1, 6)}, draft_step=1.0, host=0.0)
    answer = list(range(10))
    # No lookup match anywhere; a draft that is always right: two rounds of 4 (k stays 4).
    right = replay(answer, Adaptive([100, 101], answer, answer, max_k=4), costs)
    assert (right.rounds, right.proposed, right.accepted) == (2, 8, 8)
    # A draft that is always wrong: k goes 4, 2 (half after an early miss), then 1.
    wrong = replay(answer[:5], Adaptive([100, 101], answer[:5], [99] * 5, max_k=4), costs)
    assert (wrong.rounds, wrong.proposed, wrong.accepted) == (5, 4 + 2 + 1 + 1 + 1, 0)
    # The 1-gram "7" occurred before (then 1, 2, 7): lookup from a 1-match, else the model.
    prompt, answer = [7, 1, 2, 7], [1, 2, 3]
    # (drafter, proposed, draft-model steps run)
    assert Adaptive(prompt, answer, [5, 5, 5], 4, lookup_from=1)(0) == ("prompt_lookup",
                                                                        [1, 2, 7], 0)
    assert Adaptive(prompt, answer, [5, 5, 5], 4, lookup_from=2)(0) == ("model", [5, 5, 5], 3)
    alone = Adaptive(prompt, answer, [5, 5, 5], 4, drafters=("prompt_lookup",))
    assert alone(0) == ("prompt_lookup", [1, 2, 7], 0)


def test_round_replay_draft_p_min_cuts_the_draft_models_rounds():
    """Under draft_p_min the draft model proposes up to its first token below it and runs
    that token's step too; replayed rounds are priced with the steps run."""
    from server.bench.round_replay import Adaptive, Costs, confident_draft, policies, replay

    draft_next, confidence = [5, 6, 7, 8], [0.9, 0.6, 0.2, 0.9]
    assert confident_draft(draft_next, confidence, 0, 4, 0.0) == ([5, 6, 7, 8], 4)
    assert confident_draft(draft_next, confidence, 0, 4, 0.5) == ([5, 6], 3)
    assert confident_draft(draft_next, confidence, 2, 4, 0.5) == ([], 1)
    assert confident_draft(draft_next, confidence, 0, 2, 0.5) == ([5, 6], 2)  # k ends it
    # No lookup match in [100, 101] + answer: the draft model drafts, cut at position 2.
    answer = [5, 6, 7, 8]
    found = policies([100, 101], answer, draft_next, None, confidence)
    assert found["hybrid k=4, draft_p_min 0.3"](0) == ("model", [5, 6], 3)
    assert found["hybrid k=4, draft_p_min 0.2"](0) == ("model", [5, 6, 7, 8], 4)
    costs = Costs(verify={w: 10.0 + w for w in range(1, 6)}, draft_step=2.0, host=0.0)
    # Round 1: proposes 5, 6 (3 steps), accepts both, emits 7 -> j=3; round 2 at j=3:
    # 8 (0.9) proposed and k covers the answer's end: 1 step; accepted, the answer is done.
    r = replay(answer, Adaptive([100, 101], answer, draft_next, 4, p_min=0.5,
                                confidence=confidence), costs)
    assert (r.rounds, r.proposed, r.accepted) == (2, 3, 3)
    assert r.ms == (13 + 3 * 2) + (12 + 1 * 2)


def test_held_out_bench_sums_decode_time_per_setting():
    import argparse

    from server.bench.held_out import parse_setting, run, summary

    assert parse_setting('m2={"hybrid_min_match": 2}') == ("m2", {"hybrid_min_match": 2})
    for bad in ("m2=[1]", '={"a": 1}', "m2={oops"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_setting(bad)
    sent = []

    def ours(request):
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"text": "hi"}], "stats": {
            "generation_tokens": 10, "generation_tps": 5.0, "draft_tokens_accepted": 3,
            "draft_tokens_proposed": 4}})

    with httpx.Client(base_url="http://ours", transport=httpx.MockTransport(ours)) as client:
        r = run(client, [1, 2], {"draft": "hybrid"}, 8)
    assert r["text"] == "hi" and r["generation_tokens"] == 10
    assert sent == [{"prompt": [1, 2], "max_tokens": 8, "temperature": 0.0,
                     "cache_prompt": False, "draft": "hybrid"}]
    results = {"plain": [{"generation_tokens": 10, "generation_tps": 5.0,  # 2 s
                          "draft_tokens_accepted": 0, "draft_tokens_proposed": 0}] * 2,
               "fast": [{"generation_tokens": 10, "generation_tps": 10.0,  # 1 s
                         "draft_tokens_accepted": 3, "draft_tokens_proposed": 4},
                        {"generation_tokens": 10, "generation_tps": 5.0,  # 2 s
                         "draft_tokens_accepted": 1, "draft_tokens_proposed": 4}]}
    assert summary(["plain", "fast"], results) == [
        ["plain", "20", "4.0", "5.0", "1.00x", "0/0"],
        ["fast", "20", "3.0", "6.7", "1.33x", "4/8"]]
