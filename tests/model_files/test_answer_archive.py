"""answer_archive: the target's answers packed without their teacher distributions, and those
rebuilt by teacher forcing equal to what the decoding saw (tiny pair's target)."""

from __future__ import annotations

import gzip
import json

from server.model_files.training import answer_archive, target_answers

ATOL = 2e-3  # log-probabilities are written rounded to 1e-3; batched matmuls differ below that


def _close(generated: tuple, restored: tuple) -> None:
    """One answer position's (top_ids, top_logprobs) from the decoding and from teacher forcing:
    the same log-probability for every id both kept, and an id only one kept at the edge of
    what the other kept (a tie for the 16th place or with MIN_LOGPROB)."""
    g, r = (dict(zip(ids, lps, strict=True)) for ids, lps in (generated, restored))
    for i in g.keys() & r.keys():
        assert abs(g[i] - r[i]) <= ATOL
    for only, other in ((g.keys() - r.keys(), r), (r.keys() - g.keys(), g)):
        edge = min(other.values()) if len(other) == target_answers.TOP_K \
            else target_answers.MIN_LOGPROB
        for i in only:
            assert abs((g.get(i) if i in g else r[i]) - edge) <= ATOL


def test_restore_rebuilds_the_decodings_teacher_and_resumes(tiny_pair, tmp_path):
    src, archive = tmp_path / "answers.jsonl", tmp_path / "a" / "answers.jsonl.gz"
    n = target_answers.generate(tiny_pair[0], src, max_tokens=12, batch=8, limit=24)
    assert answer_archive.pack(src, archive) == n == 24
    first = archive.read_bytes()
    assert answer_archive.pack(src, archive) == 24 and archive.read_bytes() == first  # mtime 0
    assert target_answers.read(archive) == target_answers.read(src)  # ids exactly
    with gzip.open(archive, "rt") as f:
        assert set(json.loads(f.readline())) == {"prompt", "answer"}

    out = tmp_path / "restored.jsonl"
    assert answer_archive.restore(archive, out, tiny_pair[0], batch_tokens=64) == 24
    generated = target_answers.read_with_teacher(src)
    restored = target_answers.read_with_teacher(out)
    assert [(p, a) for p, a, _ in restored] == [(p, a) for p, a, _ in generated]
    positions = 0
    for (_, answer, g), (_, _, r) in zip(generated, restored, strict=True):
        assert len(r[0]) == len(answer)
        for pos in zip(zip(*g, strict=True), zip(*r, strict=True), strict=True):
            _close(*pos)
            positions += 1
    assert positions == sum(len(a) for _, a in target_answers.read(src)) > 100

    # Cut short after 10 lines, a second run appends the rest and ends as the first did.
    partial = tmp_path / "partial.jsonl"
    partial.write_text("".join(out.read_text().splitlines(keepends=True)[:10]))
    assert answer_archive.restore(archive, partial, tiny_pair[0], batch_tokens=64) == 14
    assert target_answers.read(partial) == target_answers.read(out)
    assert answer_archive.restore(archive, partial, tiny_pair[0]) == 0


def test_batches_keep_every_line_once_in_chunks_within_the_token_budget():
    lengths = [5, 40, 3, 70, 12, 12, 8, 30, 2, 90, 1, 6]
    lines = [([0] * n, [1]) for n in lengths]
    got = answer_archive.batches(lines, batch_tokens=64, chunk=5)
    assert sorted(i for b in got for i in b) == list(range(len(lines)))
    for b in got:
        width = max(len(lines[i][0]) + 1 for i in b)
        assert len(b) == 1 or width * len(b) <= 64
        assert len({i // 5 for i in b}) == 1  # never across a chunk: written in order
    assert [i for b in got for i in b][:5] == [2, 0, 4, 1, 3]  # a chunk by length


def test_the_command_line_packs(tiny_pair, tmp_path, capsys):
    from server.model_files.training.__main__ import main

    src = tmp_path / "answers.jsonl"
    target_answers.generate(tiny_pair[0], src, max_tokens=6, batch=4, seed=1, limit=5)
    archive = tmp_path / "x.jsonl.gz"
    main(["pack", str(src), str(archive)])
    assert capsys.readouterr().out == f"5 answers packed into {archive}\n"
    assert target_answers.read(archive) == target_answers.read(src)
