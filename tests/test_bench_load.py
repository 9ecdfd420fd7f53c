"""`python -m server.bench.load`: the figures on known timings, the protocol of both kinds of
server (ours and one like `mlx_lm.server`) through in-process fakes with a ticking clock, the
errors it counts, and a short run against our app on the tiny pair."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import re
import time

import httpx
import mlx.core as mx
import pytest
from conftest import free_port

from server.bench.load import (
    LoadSettings,
    Server,
    StreamRecord,
    add_ratios,
    format_load_table,
    level_figures,
    main,
    parse_args,
    parse_server,
    percentile,
    prompt,
    run_load,
    server_order,
)


# ------------------------------------------------------------------------------ figures
def test_percentile_by_hand():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)  # 3 + 0.97 * (4 - 3)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def record(start, arrivals, end, tokens, *, error=None, proposed=None, accepted=None,
           from_draft=None):
    return StreamRecord("s", 2, 0, start=start, end=end, arrivals=list(arrivals),
                        tokens=tokens, error=error, proposed=proposed, accepted=accepted,
                        from_draft=from_draft)


def test_level_figures_on_known_timings():
    records = [
        record(0.0, [0.5, 0.6, 0.8, 1.0], 1.1, 4, proposed=6, accepted=3, from_draft=3),
        record(0.2, [1.2, 1.3, 1.4], 1.5, 3, proposed=2, accepted=1, from_draft=1),
        record(0.1, [], 0.15, 0, error="HTTP 503: busy"),
    ]
    f = level_figures(records)
    assert (f["requests"], f["completed"], f["errors"]) == (3, 2, 1)
    assert f["error_messages"] == ["HTTP 503: busy"]
    assert f["span_s"] == 1.5 and f["tokens"] == 7 and f["tokens_per_stream"] == 3.5
    assert f["token_chunks"] == 7
    assert f["aggregate_tps"] == pytest.approx(7 / 1.5)
    # per stream: (4 - 1) / 0.5 = 6 and (3 - 1) / 0.2 = 10
    assert f["stream_tps_p50"] == pytest.approx(8.0)
    assert f["stream_tps_min"] == pytest.approx(6.0)
    # TTFT 0.5 and 1.0: p99 = 0.5 + 0.99 * 0.5
    assert f["ttft_p50_s"] == pytest.approx(0.75) and f["ttft_p99_s"] == pytest.approx(0.995)
    # gaps 0.1 0.2 0.2 | 0.1 0.1 -> sorted 0.1 0.1 0.1 0.2 0.2; p99 at rank 3.96
    assert f["itl_p50_s"] == pytest.approx(0.1) and f["itl_p99_s"] == pytest.approx(0.2)
    assert (f["proposed"], f["accepted"], f["acceptance_rate"]) == (8, 4, 0.5)
    assert f["from_draft_fraction"] == pytest.approx(4 / 7)


def test_level_figures_without_draft_statistics_or_successes():
    f = level_figures([record(0.0, [1.0, 3.0], 4.0, 2)])
    assert f["acceptance_rate"] is None and f["from_draft_fraction"] is None
    assert f["aggregate_tps"] == 0.5 and f["stream_tps_p50"] == 0.5
    failed = level_figures([record(0.0, [], 2.0, 0, error="timeout after 1s")])
    assert failed["completed"] == 0 and failed["aggregate_tps"] is None
    assert failed["ttft_p50_s"] is None and failed["stream_tps_p50"] is None


def test_ratios_are_the_first_server_over_each_other():
    rows = [{"role": "server", "aggregate_tps": 30.0, "stream_tps_p50": 10.0, "ttft_p50_s": 0.2},
            {"role": "compare", "aggregate_tps": 20.0, "stream_tps_p50": 20.0,
             "ttft_p50_s": None},
            {"role": "compare", "aggregate_tps": 60.0, "stream_tps_p50": 5.0, "ttft_p50_s": 0.1}]
    add_ratios(rows)
    assert [r["ratio_aggregate"] for r in rows] == [None, 1.5, 0.5]
    assert [r["ratio_stream"] for r in rows] == [None, 0.5, 2.0]
    assert [r["ratio_ttft"] for r in rows] == [None, None, 2.0]


def test_prompts_are_distinct_and_of_varied_length():
    prompts = [prompt(i) for i in range(300)]
    assert len(set(prompts)) == 300
    assert len({p.count(".") for p in prompts}) == 6  # 0 to 5 context sentences
    assert prompt(7) == prompt(7)


def test_servers_take_turns_going_first():
    a, b, c = (Server(x, f"http://{x}") for x in "abc")
    assert [[s.label for s in server_order([a, b, c], i)] for i in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


# ------------------------------------------------------------------------------ arguments
def test_server_names():
    assert parse_server("ours=http://h:1/v1/") == Server("ours", "http://h:1")
    assert parse_server("http://h:1/?a=b") == Server("http://h:1/?a=b", "http://h:1/?a=b")
    assert parse_server("http://h:2/") == Server("http://h:2", "http://h:2")
    args = parse_args(["--server", "http://a", "--compare", "m=http://b", "--compare",
                       "http://c", "--concurrency", "4,1,4"])
    assert [s.label for s in (args.server, *args.compare)] == ["http://a", "m", "http://c"]
    assert args.concurrency == [4, 1]


@pytest.mark.parametrize("argv", [
    [], ["--server", "http://a", "--concurrency", "0,2"], ["--server", "http://a",
                                                          "--max-tokens", "1"],
    ["--server", "http://a", "--requests-per-client", "0"],
    ["--server", "http://a", "--timeout", "0"], ["--server", "http://a", "--compare", "http://a"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


# ------------------------------------------------------------------------------ fake servers
def sse(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def request_number(body: dict) -> int:
    return int(re.search(r"\(Request (\d+)\.\)", body["messages"][0]["content"]).group(1))


def fake_server(name: str, log: list, answer) -> httpx.MockTransport:
    """An in-process server: `answer(body)` gives the SSE text; `log` gets (name, request no.)."""
    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        log.append((name, request_number(body), body))
        result = answer(body)
        if isinstance(result, httpx.Response):
            return result
        if asyncio.iscoroutine(result):
            return await result
        return httpx.Response(200, text=result, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def ours_like(body: dict) -> str:
    """Like our server: one chunk per token, `from_draft` on each (the second's text is held
    back by the detokenizer), `stats` on the final chunk, then usage."""
    tokens = [("def", False), ("", True), (" f", True), ("()", False)]
    chunks = [{"choices": [{"delta": {"content": t}, "from_draft": d}]} for t, d in tokens]
    stats = {"generation_tokens": 4, "draft_tokens_proposed": 4, "draft_tokens_accepted": 2}
    chunks.append({"choices": [{"delta": {}, "finish_reason": "length"}], "stats": stats})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
    return sse(chunks)


def mlx_lm_like(body: dict) -> str:
    """Like `mlx_lm.server`: a chunk when text is ready, none for a token without text (so one
    of its 4 tokens has no chunk), an empty-text final chunk, the usage chunk."""
    chunks = [{"choices": [{"delta": {"content": t}, "finish_reason": None}]}
              for t in ("def", " f", "", "()")]
    chunks.append({"choices": [{"delta": {"content": ""}, "finish_reason": "length"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}})
    return sse(chunks)


def ticking_clock():
    """Each reading is one tick later: times are counts of the runner's clock readings."""
    return itertools.count().__next__


def test_both_protocols_on_a_ticking_clock():
    log: list = []
    servers = [Server("ours", "http://ours", fake_server("ours", log, ours_like)),
               Server("mlx", "http://mlx", fake_server("mlx", log, mlx_lm_like))]
    settings = LoadSettings(concurrency=(1, 2), max_tokens=4, requests_per_client=2,
                            timeout=10, warmup=1)
    rows, problems = asyncio.run(run_load(servers, settings, clock=ticking_clock()))
    assert problems == []
    # warm-up (request 0 on each), then level 1 (requests 1-2) ours first, level 2
    # (requests 3-6) mlx first; both servers get the same prompts at a level
    order = [(name, n) for name, n, _ in log]
    assert order[:2] == [("ours", 0), ("mlx", 0)]
    assert order[2:6] == [("ours", 1), ("ours", 2), ("mlx", 1), ("mlx", 2)]
    assert [name for name, _ in order[6:]] == ["mlx"] * 4 + ["ours"] * 4
    assert sorted(n for name, n in order[6:] if name == "ours") == [3, 4, 5, 6]
    bodies = [body for _, _, body in log]
    assert all(b["stream"] and b["temperature"] == 0 and b["max_tokens"] == 4
               for b in bodies[2:])
    assert bodies[0]["max_tokens"] == 8  # the warm-up is short
    assert [(r["server"], r["concurrency"], r["order"]) for r in rows] == [
        ("ours", 1, 0), ("mlx", 1, 1), ("ours", 2, 1), ("mlx", 2, 0)]
    ours1, mlx1, ours2, mlx2 = rows
    # One client, one stream at a time: start, a tick per data line (4 tokens, final, usage,
    # [DONE]), end: 0..8, then 9..17 for the second request. Ours: tokens at +1..+4.
    assert ours1["span_s"] == 17 and ours1["tokens"] == 8 and ours1["completed"] == 2
    assert ours1["token_chunks"] == 8  # the chunk whose text was held back counts
    assert ours1["aggregate_tps"] == 8 / 17
    assert (ours1["ttft_p50_s"], ours1["itl_p50_s"], ours1["itl_p99_s"]) == (1, 1, 1)
    assert ours1["stream_tps_p50"] == 1.0  # (4 - 1) / 3 ticks
    assert (ours1["proposed"], ours1["accepted"], ours1["acceptance_rate"]) == (8, 4, 0.5)
    assert ours1["from_draft_fraction"] == 0.5  # 2 of each 4 tokens flagged
    # mlx_lm-like: tokens from usage (4), text at +1, +2, +4: gaps 1, 2
    assert mlx1["span_s"] == 17 and mlx1["tokens"] == 8 and mlx1["token_chunks"] == 6
    assert (mlx1["ttft_p50_s"], mlx1["itl_p50_s"]) == (1, 1.5)
    assert mlx1["itl_p99_s"] == 2  # gaps 1 2 1 2 -> sorted 1 1 2 2: rank 2.97 is 2
    assert mlx1["stream_tps_p50"] == 1.0  # (4 - 1) / 3 ticks
    assert mlx1["proposed"] is None and mlx1["from_draft_fraction"] is None
    assert mlx1["ratio_aggregate"] == 1.0 and ours1["ratio_aggregate"] is None
    for row in (ours2, mlx2):
        assert (row["requests"], row["completed"], row["errors"], row["tokens"]) == (4, 4, 0, 16)
    table = format_load_table(rows)
    assert table.splitlines()[2].split()[:3] == ["1", "ours", "0.5"]
    assert "4/8 0.500" in table and "1.00x" in table


def test_errors_are_counted_and_the_run_ends():
    """A 503, an error object in the stream, a stream cut short, and one that stalls past the
    timeout: four errors, one success, and the run ends by itself."""
    async def stall():
        await asyncio.sleep(30)

    def answer(body):
        n = request_number(body)
        if n == 1:
            return httpx.Response(503, json={"error": {"message": "queue full"}})
        if n == 2:
            return sse([{"error": {"message": "boom"}}])
        if n == 3:
            return sse([{"choices": [{"delta": {"content": "x"}}]}]).removesuffix(
                "data: [DONE]\n\n")
        if n == 4:
            return stall()
        return mlx_lm_like(body)

    log: list = []
    server = Server("s", "http://s", fake_server("s", log, answer))
    settings = LoadSettings(concurrency=(5,), max_tokens=4, timeout=0.5, warmup=0)
    started = time.monotonic()
    (row,), _ = asyncio.run(run_load([server], settings))
    assert time.monotonic() - started < 20  # bounded by the timeout, not by the stall
    assert (row["requests"], row["completed"], row["errors"]) == (5, 1, 4)
    assert row["tokens"] == 4
    messages = " | ".join(row["error_messages"])
    assert "HTTP 503" in messages and "error in stream" in messages
    assert "without [DONE]" in messages
    assert len(row["error_messages"]) == 3  # at most three distinct messages kept


# ------------------------------------------------------------------------------ our app
@pytest.mark.slow
def test_against_our_app_on_the_tiny_pair(live_server, tmp_path, capsys):
    url = live_server
    assert main(["--server", f"ours={url}", "--compare", f"again={url}/v1", "--concurrency",
                 "1,2", "--max-tokens", "6", "--timeout", "120", "--results-dir", str(tmp_path),
                 "--tag", "t"]) == 0
    (jsonl,) = tmp_path.glob("load-*-t.jsonl")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    doc = json.loads(jsonl.with_suffix(".json").read_text())
    table = list(csv.DictReader(open(jsonl.with_suffix(".csv"), newline="")))
    assert doc["rows"] == rows and len(table) == len(rows) == 4
    assert [(r["server"], r["concurrency"]) for r in rows] == [
        ("ours", 1), ("again", 1), ("ours", 2), ("again", 2)]
    for r, line in zip(rows, table, strict=True):
        assert r["errors"] == 0 and r["completed"] == r["concurrency"]
        # greedy on the same server: every stream generates max_tokens, counted from stats
        assert r["tokens"] == 6 * r["concurrency"] and r["aggregate_tps"] > 0
        assert 0 <= r["accepted"] <= r["proposed"]
        assert float(line["tokens"]) == r["tokens"] and line["server"] == r["server"]
    assert doc["metadata"]["servers"][0]["health"]["target"]
    assert doc["metadata"]["servers"][1]["url"] == url
    out = capsys.readouterr().out
    assert "agg tok/s" in out and "again" in out


def test_a_server_that_is_down_is_errors_not_a_crash(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["--server", url, "--concurrency", "2", "--max-tokens", "4", "--timeout", "5",
                 "--results-dir", str(tmp_path)]) == 0
    (jsonl,) = tmp_path.glob("load-*.jsonl")
    (row,) = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert (row["requests"], row["completed"], row["errors"]) == (2, 0, 2)
    assert row["error_messages"][0].startswith("ConnectError")
    doc = json.loads(jsonl.with_suffix(".json").read_text())
    assert doc["metadata"]["warmup_errors"][0].startswith(f"{url}: ConnectError")
    assert "health_error" in doc["metadata"]["servers"][0]
    assert "2/2" in capsys.readouterr().out  # the errors column


def test_engine_load_and_prefill_shapes_run_on_the_tiny_pair(tiny_pair, capsys):
    """The in-process benchmarks run end to end and print one numeric row per level."""
    from server.bench import engine_load, prefill_shapes

    engine_load.main(["--streams", "2,3", "--reps", "1", "--target-model", str(tiny_pair[0]),
                      "--draft-model", str(tiny_pair[1])])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["2", "3"]
    assert all(float(v) > 0 for r in rows for v in r[1:4]) and all(r[4].endswith("x") for r in rows)
    prefill_shapes.main(["--prompts", "2", "--lengths", "8,16", "--model", str(tiny_pair[0])])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["8", "16"] and all(r[-1].endswith("x") for r in rows)


def test_fused_and_prefill_head_run_on_the_tiny_pair(tiny_pair, capsys):
    from server.bench import fused, prefill_head

    fused.main(["--model", str(tiny_pair[0]), "--reps", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:3] for r in rows] == [["1", "x", "1"], ["8", "x", "1"], ["8", "x", "2"],
                                     ["16", "x", "1"]]
    assert all(r[-1].endswith("x") and float(r[3]) > 0 for r in rows)
    prefill_head.main(["--model", str(tiny_pair[0]), "--lengths", "8,16", "--rows", "1,2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["1", "8"], ["1", "16"], ["2", "8"], ["2", "16"]]


def test_bench_prompts_stay_inside_the_vocabulary(loaded_pair):
    """Ids past the embedding are no error in MLX: the gather reads out of bounds (a crash)."""
    from server.bench.tokens import random_tokens, vocab_size

    model = loaded_pair[0]
    assert vocab_size(model) == model.model.embed_tokens.weight.shape[0] == 512
    ids = random_tokens(model, (64, 256))
    assert ids.dtype == mx.uint32 and ids.shape == (64, 256)
    assert 0 <= ids.min().item() and ids.max().item() == 511  # 16,384 draws cover all 512
