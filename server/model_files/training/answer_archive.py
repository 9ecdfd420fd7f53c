"""The target's answers kept small enough for git, and their teacher distributions rebuilt.

    python -m server.model_files.training.answer_archive pack SRC.jsonl ARCHIVE.jsonl.gz
    python -m server.model_files.training.answer_archive restore ARCHIVE.jsonl.gz OUT.jsonl
        [--target PATH] [--batch-tokens 4096] [--limit N]
    python -m server.model_files.training.answer_archive compare DECODED.jsonl RESTORED.jsonl

`target_answers` writes, per answer position, the target's 16 most likely tokens and their
log-probabilities: ~200 bytes a token, hundreds of MB for the draft's data, and hours of greedy
decoding on a CPU to make again. The answers themselves are ~2 bytes a token once compressed.
`pack` keeps only the prompt and answer ids (gzip, byte for byte the same for the same input);
`restore` rebuilds `target_answers`' file from them: one teacher-forced forward pass of the target
over each prompt and answer, batched by length, gives the same distributions the decoding saw
(the same model, float32: equal to within float rounding, as `tests/test_answer_archive.py`
checks) in 0.6 of the decoding's time. `restore` resumes where `OUT` ends; `compare` counts
how far a restored file's distributions are from the decoded one's.
`data/target-answers/` holds the archives of the answers the shipped draft's data runs wrote
(`scripts/reproduce_figures.sh` restores them before generating any it lacks).
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_load

from server.engine.head import split_of
from server.model_files.training import target_answers

DEFAULT_BATCH_TOKENS = 4096


def pack(src: Path, archive: Path) -> int:
    """Write `src`'s prompts and answers, without the teacher, to `archive`; returns the lines."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    lines = target_answers.read(src)
    with open(archive, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for prompt, answer in lines:
            f.write((json.dumps({"prompt": prompt, "answer": answer}) + "\n").encode())
    return len(lines)


def unpacked(archive: Path) -> list[tuple[list[int], list[int]]]:
    """The archive's (prompt, answer) lines."""
    with gzip.open(archive, "rt") as f:
        return [(d["prompt"], d["answer"]) for d in map(json.loads, f)]


def teacher(model, lines: list[tuple[list[int], list[int]]]) -> list[tuple[list, list]]:
    """For each (prompt, answer), the target's (top_ids, top_logprobs) at each answer position,
    from one forward pass over the batch (right-padded: causal attention keeps the padding out
    of every real position; the output head only where an answer token is predicted)."""
    rows = [prompt + answer[:-1] for prompt, answer in lines]
    width = max(len(r) for r in rows)
    padded = mx.array([r + [0] * (width - len(r)) for r in rows])
    split = split_of(model)  # the output head over the answer positions only, where it can
    if split.body is None:
        whole = model(padded)
        logits_at = lambda b, start, end: whole[b, start:end]  # noqa: E731
    else:
        hidden = split.body(padded)
        logits_at = lambda b, start, end: split.head(hidden[b, start:end])  # noqa: E731
    out = []
    for b, (prompt, answer) in enumerate(lines):
        at = logits_at(b, len(prompt) - 1, len(prompt) - 1 + len(answer)).astype(mx.float32)
        lp = np.array(at - mx.logsumexp(at, axis=-1, keepdims=True))
        tops = [target_answers.top_row(row) for row in lp]
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


def restore(archive: Path, out: Path, target_dir: Path,
            batch_tokens: int = DEFAULT_BATCH_TOKENS, limit: int | None = None) -> int:
    """Append to `out` the archive's lines it lacks (of its first `limit`), with the target's
    distributions, in the archive's order; returns how many were appended."""
    from tqdm import tqdm

    lines = unpacked(archive)[:limit][target_answers.done_count(out):]
    if not lines:
        return 0
    model, _ = mlx_load(str(target_dir))
    model.set_dtype(mx.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    done: dict[int, str] = {}
    written = 0
    bar = tqdm(total=sum(len(a) for _, a in lines), desc=f"restore {out.name}", unit="tok",
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


def compare(decoded: Path, restored: Path) -> dict:
    """How a restored file's distributions differ from the decoded file's (same answers)."""
    a, b = (target_answers.read_with_teacher(path) for path in (decoded, restored))
    if [line[:2] for line in a] != [line[:2] for line in b]:
        raise ValueError(f"{decoded} and {restored} hold different prompts or answers")
    out = {"positions": 0, "same_top1": 0, "max_logprob_diff": 0.0, "other_kept_ids": 0}
    for (_, _, ta), (_, _, tb) in zip(a, b, strict=True):
        for ids_a, lps_a, ids_b, lps_b in zip(*ta, *tb, strict=True):
            da, db = dict(zip(ids_a, lps_a, strict=True)), dict(zip(ids_b, lps_b, strict=True))
            out["positions"] += 1
            out["same_top1"] += ids_a[0] == ids_b[0]
            out["max_logprob_diff"] = max([out["max_logprob_diff"],
                                           *(abs(da[i] - db[i]) for i in da.keys() & db.keys())])
            out["other_kept_ids"] += da.keys() != db.keys()
    return out


def main(argv=None) -> None:
    from server.model_files.default_model import target_folder

    p = argparse.ArgumentParser(prog="python -m server.model_files.training.answer_archive",
                                description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="Keep a target_answers file's prompts and answers.")
    pk.add_argument("src", type=Path, help="A target_answers JSONL file.")
    pk.add_argument("archive", type=Path, help="The .jsonl.gz to write.")
    rs = sub.add_parser("restore", help="Rebuild a target_answers file from an archive.")
    rs.add_argument("archive", type=Path, help="A .jsonl.gz that pack wrote.")
    rs.add_argument("out", type=Path, help="The JSONL file to append to (resumes).")
    rs.add_argument("--target", help="Target model folder or GGUF (default: the default target).")
    rs.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                    help="Padded tokens per forward pass.")
    rs.add_argument("--limit", type=int, default=None,
                    help="Restore the archive's first N lines at most.")
    cp = sub.add_parser("compare", help="A restored file's distributions against the decoded.")
    cp.add_argument("decoded", type=Path, help="A target_answers file.")
    cp.add_argument("restored", type=Path, help="The same answers, restored from an archive.")
    args = p.parse_args(argv)
    if args.command == "compare":
        c = compare(args.decoded, args.restored)
        print(f"{c['positions']} answer positions: the same top-1 at {c['same_top1']}, "
              f"log-probabilities within {c['max_logprob_diff']:.4f}, another set of kept ids "
              f"at {c['other_kept_ids']}")
        return
    if args.command == "pack":
        print(f"{pack(args.src, args.archive)} answers packed into {args.archive}")
        return
    n = restore(args.archive, args.out, target_folder(args.target), args.batch_tokens,
                args.limit)
    print(f"{n} answers restored to {args.out} ({target_answers.done_count(args.out)} in all)")


if __name__ == "__main__":
    main()
