"""The target's answers kept small enough for git, and their teacher distributions rebuilt.

`target_answers` writes, per answer position, the target's 16 most likely tokens and their
log-probabilities: ~200 bytes a token, hundreds of MB for the draft's data, and hours of greedy
decoding on a CPU to make again. The answers themselves are ~2 bytes a token once compressed.
`pack` keeps only the prompt and answer ids (gzip, byte for byte the same for the same input);
`restore` rebuilds `target_answers`' file from them: one teacher-forced forward pass of the
target over each prompt and answer, batched by length, gives the distributions the decoding saw
(the same model in float32: equal to within float rounding) in 0.6 of the decoding's time.
`restore` resumes where its output ends. `data/target-answers/answers.jsonl.gz` holds the
shipped draft's 3,990 answers.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_load

from server.engine.models.head import split_of
from server.model_files.training import target_answers

DEFAULT_ARCHIVE = Path("data/target-answers/answers.jsonl.gz")
BATCH_TOKENS = 4096  # padded tokens per forward pass


def pack(src: Path, archive: Path) -> int:
    """Write `src`'s prompts and answers, without the teacher, to `archive`; returns the lines."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    lines = target_answers.read(src)
    with open(archive, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for prompt, answer in lines:
            f.write((json.dumps({"prompt": prompt, "answer": answer}) + "\n").encode())
    return len(lines)


def teacher(model, lines: list[tuple[list[int], list[int]]]) -> list[tuple[list, list]]:
    """For each (prompt, answer), the target's (top_ids, top_logprobs) at each answer position,
    from one forward pass over the batch (right-padded: causal attention keeps the padding out
    of every real position; the output head only where an answer token is predicted)."""
    rows = [prompt + answer[:-1] for prompt, answer in lines]
    width = max(len(r) for r in rows)
    padded = mx.array([r + [0] * (width - len(r)) for r in rows])
    split = split_of(model)
    if split.body is None:
        whole = model(padded)
        logits_at = lambda b, start, end: whole[b, start:end]  # noqa: E731
    else:
        hidden = split.body(padded)
        logits_at = lambda b, start, end: split.head(hidden[b, start:end])  # noqa: E731
    out = []
    for b, (prompt, answer) in enumerate(lines):
        at = logits_at(b, len(prompt) - 1, len(prompt) - 1 + len(answer)).astype(mx.float32)
        tops = [target_answers.top_row(row)
                for row in np.array(at - mx.logsumexp(at, axis=-1, keepdims=True))]
        out.append(([ids for ids, _ in tops], [lps for _, lps in tops]))
    return out


def batches(lines: list, batch_tokens: int, chunk: int = 256) -> list[list[int]]:
    """Indices of `lines` in batches padded to at most `batch_tokens` (a longer line is a batch
    of its own): `chunk` lines at a time in the file's order, by length within a chunk, so the
    lines can be written in order as each chunk ends."""
    out = []
    for start in range(0, len(lines), chunk):
        order = sorted(range(start, min(start + chunk, len(lines))),
                       key=lambda i: len(lines[i][0]) + len(lines[i][1]))
        batch: list[int] = []
        for i in order:
            width = len(lines[i][0]) + len(lines[i][1])
            if batch and width * (len(batch) + 1) > batch_tokens:
                out.append(batch)
                batch = []
            batch.append(i)
        out.append(batch)
    return out


def restore(archive: Path, out: Path, target_dir: Path, batch_tokens: int = BATCH_TOKENS,
            limit: int | None = None) -> int:
    """Append to `out` the archive's lines it lacks (of its first `limit`), with the target's
    distributions, in the archive's order; returns how many were appended."""
    from tqdm import tqdm

    lines = target_answers.read(archive, limit)[target_answers.done_count(out):]
    if not lines:
        return 0
    model, _ = mlx_load(str(target_dir))
    model.set_dtype(mx.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    done: dict[int, str] = {}
    written = 0
    bar = tqdm(total=sum(len(a) for _, a in lines), desc="restore answers", unit="tok",
               mininterval=5)
    with out.open("a") as f:
        for batch in batches(lines, batch_tokens):
            answered = [i for i in batch if lines[i][1]]
            tops = dict(zip(answered, teacher(model, [lines[i] for i in answered]) if answered
                            else [], strict=True))
            for i in batch:
                top_ids, top_logprobs = tops.get(i, ([], []))
                done[i] = json.dumps({"prompt": lines[i][0], "answer": lines[i][1],
                                      "top_ids": top_ids, "top_logprobs": top_logprobs})
                bar.update(len(lines[i][1]))
            while written in done:  # in the archive's order, so a later run resumes
                f.write(done.pop(written) + "\n")
                written += 1
            f.flush()
    bar.close()
    return written


def ensure(out: Path, target_dir: Path, archive: Path, limit: int, **decoding) -> str:
    """The answers stage: `out` holds the answers to the first `limit` requests, restored from
    `archive` where it has them, decoded by the target after (`target_answers.generate`'s
    `decoding` options). Returns what it did, in words."""
    have = target_answers.done_count(out)
    if have >= limit:
        return f"{out} holds {have} answers: kept"
    restored = restore(archive, out, target_dir, limit=limit) if archive.exists() else 0
    decoded = target_answers.generate(target_dir, out, limit=limit, **decoding)
    return (f"{restored} answers restored from {archive} and {decoded} decoded into {out} "
            f"({target_answers.done_count(out)} in all)")
