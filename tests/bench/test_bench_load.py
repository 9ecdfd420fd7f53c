"""`mlx-spec-bench load`: the figures on known timings, the protocol of both kinds of server
(ours and one like `mlx_lm.server`) through in-process fakes with a ticking clock, the errors it
counts, and a short run against our app on the tiny pair."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import re
import time

import httpx
import pytest
from support.servers import free_port

from server.bench import runners
from server.bench.load import (
    add_ratios,
    answered,
    k_histogram,
    level_figures,
    main,
    parse_args,
    prompt,
    run_load,
    table,
)
from server.bench.results import aligned, named_url, percentile
from server.bench.runners import Stream, retry_delay


# ------------------------------------------------------------------------------ figures
def test_percentile_by_hand():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)  # 3 + 0.97 * (4 - 3)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def record(start, arrivals, end, tokens, *, error=None, from_draft=None):
    return Stream(start=start, end=end, arrivals=list(arrivals), error=error,
                  stats={"generation_tokens": tokens}, from_draft=from_draft)


def test_level_figures_on_known_timings():
    f = level_figures([
        record(0.0, [0.5, 0.6, 0.8, 1.0], 1.1, 4, from_draft=3),
        record(0.2, [1.2, 1.3, 1.4], 1.5, 3, from_draft=1),
        record(0.1, [], 0.15, 0, error="HTTP 503: busy"),
    ])
    assert (f["requests"], f["completed"], f["errors"]) == (3, 2, 1)
    assert f["error_messages"] == ["HTTP 503: busy"]
    assert f["span_s"] == 1.5 and f["tokens"] == 7
    assert f["aggregate_tps"] == pytest.approx(7 / 1.5)
    assert f["ttft_p50_s"] == pytest.approx(0.75)  # TTFT 0.5 and 1.0
    # gaps 0.1 0.2 0.2 | 0.1 0.1 -> sorted 0.1 0.1 0.1 0.2 0.2; p99 at rank 3.96
    assert f["itl_p50_s"] == pytest.approx(0.1) and f["itl_p99_s"] == pytest.approx(0.2)
    assert f["from_draft_fraction"] == pytest.approx(4 / 7)


def test_level_figures_without_draft_flags_or_successes():
    f = level_figures([record(0.0, [1.0, 3.0], 4.0, 2)])
    assert f["from_draft_fraction"] is None and f["aggregate_tps"] == 0.5
    failed = level_figures([record(0.0, [], 2.0, 0, error="timeout after 1s")])
    assert failed["completed"] == 0 and failed["aggregate_tps"] is None
    assert failed["ttft_p50_s"] is None and failed["itl_p99_s"] is None


def test_rounds_by_k_are_summed_over_our_streams_and_runs():
    ours = [record(0.0, [1.0], 2.0, 1), record(0.0, [1.0], 2.0, 1), record(0.0, [1.0], 2.0, 1)]
    ours[0].stats = {"generation_tokens": 1, "k_histogram": {"2": 3, "0": 1}}
    ours[1].stats = {"generation_tokens": 1, "k_histogram": {"2": 1, "10": 2}}
    assert level_figures(ours)["k_histogram"] == {"0": 1, "2": 4, "10": 2}
    assert level_figures([record(0.0, [1.0], 2.0, 1)])["k_histogram"] is None  # not ours
    runs = [level_figures(ours), level_figures(ours[:1])]
    assert k_histogram({"k_histogram": r["k_histogram"]} for r in runs) == {
        "0": 2, "2": 7, "10": 2}


def test_ratios_are_ours_over_each_other():
    def row(agg, ttft, itl, peak):
        return {"aggregate_tps": agg, "ttft_p50_s": ttft, "itl_p99_s": itl, "peak_rss_gb": peak}

    rows = [row(30.0, 0.2, 0.1, 2.0), row(20.0, None, 0.2, 1.0), row(60.0, 0.1, 0.05, None)]
    add_ratios(rows)
    assert [r["ratio_aggregate"] for r in rows] == [None, 1.5, 0.5]
    assert [r["ratio_ttft"] for r in rows] == [None, None, 2.0]
    assert [r["ratio_itl_p99"] for r in rows] == [None, 0.5, 2.0]
    assert [r["ratio_peak_rss"] for r in rows] == [None, 2.0, None]


def test_prompts_are_distinct_and_of_varied_length():
    prompts = [prompt(i) for i in range(300)]
    assert len(set(prompts)) == 300
    assert len({p.count(".") for p in prompts}) == 6  # 0 to 5 context sentences
    assert prompt(7) == prompt(7)


# ------------------------------------------------------------------------------ arguments
def test_server_names():
    assert named_url("ours=http://h:1/v1/") == ("ours", "http://h:1")
    assert named_url("http://h:1/?a=b") == ("http://h:1/?a=b", "http://h:1/?a=b")
    assert named_url("http://h:2/") == ("http://h:2", "http://h:2")
    args = parse_args(["--server", "http://a", "--compare", "m=http://b", "--compare",
                       "http://c", "--concurrency", "4,1,4"])
    assert [name for name, _ in args.servers] == ["http://a", "m", "http://c"]
    assert args.concurrency == [4, 1]
    assert parse_args(["--server", "http://a"]).concurrency == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize("argv", [
    [], ["--server", "http://a", "--concurrency", "0,2"], ["--server", "http://a",
                                                          "--max-tokens", "1"],
    ["--server", "http://a", "--runs", "0"],
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
    transports = {"ours": fake_server("ours", log, ours_like),
                  "mlx": fake_server("mlx", log, mlx_lm_like)}
    args = parse_args(["--server", "ours=http://ours", "--compare", "mlx=http://mlx",
                       "--concurrency", "1,2", "--max-tokens", "4",
                       "--timeout", "10"])
    rows = asyncio.run(run_load(args.servers, args, transports=transports,
                                clock=ticking_clock()))
    # warm-up (request 0 on each), then level 1 (request 1) ours first, level 2
    # (requests 2-3) mlx first; both servers get the same prompts at a level
    order = [(name, n) for name, n, _ in log]
    assert order[:2] == [("ours", 0), ("mlx", 0)]
    assert order[2:4] == [("ours", 1), ("mlx", 1)]
    assert [name for name, _ in order[4:]] == ["mlx"] * 2 + ["ours"] * 2
    assert sorted(n for name, n in order[4:] if name == "ours") == [2, 3]
    bodies = [body for _, _, body in log]
    assert all(b["stream"] and b["temperature"] == 0 and b["max_tokens"] == 4
               for b in bodies[2:])
    assert bodies[0]["max_tokens"] == 8  # the warm-up is short
    assert [(r["server"], r["concurrency"]) for r in rows] == [
        ("ours", 1), ("mlx", 1), ("ours", 2), ("mlx", 2)]
    ours1, mlx1, ours2, mlx2 = rows
    # One stream: start, a tick per data line (4 tokens, final, usage, [DONE]), end: 0..8.
    # Ours: tokens at +1..+4.
    assert ours1["tokens"] == 4 and ours1["completed"] == 1 and ours1["all_answered"]
    assert ours1["aggregate_tps"] == 4 / 8
    assert (ours1["ttft_p50_s"], ours1["itl_p50_s"], ours1["itl_p99_s"]) == (1, 1, 1)
    assert ours1["from_draft_fraction"] == 0.5  # 2 of each 4 tokens flagged
    # mlx_lm-like: tokens from usage (4), text at +1, +2, +4: gaps 1, 2
    assert mlx1["tokens"] == 4 and mlx1["aggregate_tps"] == 4 / 8
    assert (mlx1["ttft_p50_s"], mlx1["itl_p50_s"]) == (1, 1.5)
    assert mlx1["itl_p99_s"] == pytest.approx(1.99)  # gaps 1 2: rank 0.99 is 1.99
    assert mlx1["from_draft_fraction"] is None
    assert mlx1["ratio_aggregate"] == 1.0 and ours1["ratio_aggregate"] is None
    assert mlx1["ratio_itl_p99"] == pytest.approx(1 / 1.99)
    for row in (ours2, mlx2):
        assert (row["requests"], row["completed"], row["errors"], row["tokens"]) == (2, 2, 0, 8)
    text = aligned(table(rows))
    assert text.splitlines()[2].split()[:3] == ["1", "ours", "0.5"]
    assert "1.00x" in text and "2/2" in text


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
    args = parse_args(["--server", "s=http://s", "--concurrency", "5", "--max-tokens", "4",
                       "--timeout", "0.5", "--warmup", "0"])
    started = time.monotonic()
    (row,) = asyncio.run(run_load(args.servers, args,
                                  transports={"s": fake_server("s", log, answer)}))
    assert time.monotonic() - started < 20  # bounded by the timeout, not by the stall
    assert (row["requests"], row["completed"], row["errors"]) == (5, 1, 4)
    assert row["tokens"] == 4
    messages = " | ".join(row["error_messages"])
    assert "HTTP 503" in messages and "error in stream" in messages
    assert "ended before its end event" in messages and not row["all_answered"]
    assert len(row["error_messages"]) == 3  # at most three distinct messages kept


class CutAfterFirstChunk(httpx.AsyncByteStream):
    """A 200 whose body breaks off after its first line, as a reset connection would."""

    async def __aiter__(self):
        yield b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
        raise httpx.ReadError("connection reset mid-stream")


def test_connection_failures_before_a_response_are_retried_as_the_openai_sdk_does(
        monkeypatch):
    """A reset before any response is retried (the wait in the stream's TTFT), at most twice;
    a stream cut after its response began is an error, not retried: it may have been served."""
    monkeypatch.setattr(runners, "RETRY_DELAY_S", 0.001)
    attempts: dict[int, int] = {}

    def answer(body):
        n = request_number(body)
        attempts[n] = attempts.get(n, 0) + 1
        if n == 0 and attempts[n] <= 2:  # twice reset, then served
            raise httpx.ReadError("connection reset by peer")
        if n == 1:  # always refused: 1 try + 2 retries
            raise httpx.ConnectError("connection refused")
        if n == 2:
            return httpx.Response(200, stream=CutAfterFirstChunk(),
                                  headers={"content-type": "text/event-stream"})
        return mlx_lm_like(body)

    args = parse_args(["--server", "s=http://s", "--concurrency", "3", "--max-tokens", "4",
                       "--warmup", "0"])
    (row,) = asyncio.run(run_load(args.servers, args,
                                  transports={"s": fake_server("s", [], answer)}))
    assert attempts == {0: 3, 1: 3, 2: 1}
    assert (row["requests"], row["completed"], row["errors"], row["retries"]) == (3, 1, 2, 4)
    assert row["tokens"] == 4 and answered(row) == "1/3 (4 retried)"
    messages = " | ".join(row["error_messages"])
    assert "ConnectError" in messages and "ReadError: connection reset mid-stream" in messages


def test_retry_delays_are_the_openai_sdks():
    # openai._base_client: min(0.5 * 2 ** n, 8) * (1 - 0.25 * random())
    assert [retry_delay(n, rand=lambda: 0.0) for n in (0, 1)] == [0.5, 1.0]
    assert [retry_delay(n, rand=lambda: 1.0) for n in (0, 1)] == [0.375, 0.75]


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
        assert 0 <= r["from_draft_fraction"] <= 1  # our server flags every token
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
    assert "health_error" in doc["metadata"]["servers"][0]
    assert row["retries"] == 4  # each refused connection retried twice
    assert "0/2 (4 retried)" in capsys.readouterr().out  # the answered column
