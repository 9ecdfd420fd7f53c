"""The target's own greedy answers to the chat requests: the draft's training data.

A draft is accepted as often as it predicts what the target itself writes, so the best text to
train it on is the target's output, and the best signal its whole next-token distribution
there. The requests (`chat_requests`) are answered greedily by the target with `mlx_lm`'s
`BatchGenerator` and appended to a JSONL file as they finish, in the requests' order, one line
per answer: `{"prompt": [ids], "answer": [ids], "top_ids": [[ids]], "top_logprobs": [[lp]]}`,
the last two the target's most likely tokens (at most `TOP_K`, log-probability above
`MIN_LOGPROB`) at each answer position. A second run resumes where the file ends.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_load
from mlx_lm.generate import BatchGenerator

from server.model_files.training.chat_requests import requests

DEFAULT_OUT = Path("models/generated/target-answers.jsonl")
# Answers to prose requests no training request used, written by the recipe at 16de7eb
# (`target_answers --eval-prose`); `mlx-spec-bench held-out` adds them to its prose family.
EVAL_PROSE_OUT = Path("models/generated/target-answers-eval-prose.jsonl")
MAX_TOKENS = 160  # per answer
BATCH = 32  # answers decoded at once
TOP_K = 16  # the target's most likely tokens kept per answer position ...
MIN_LOGPROB = -9.0  # ... of those more likely than this (p > 1.2e-4)
VAL_FRACTION = 0.05  # the answers' last 5%: the held-out split

Line = tuple[list[int], list[int], tuple | None]  # (prompt, answer, teacher or None)


def top_row(lp: np.ndarray) -> tuple[list[int], list[float]]:
    """The most likely ids of one row of log-probabilities and theirs, most likely first."""
    ids = np.argpartition(-lp, TOP_K)[:TOP_K]
    ids = ids[np.argsort(-lp[ids], kind="stable")]
    ids = ids[lp[ids] > MIN_LOGPROB]
    return ids.tolist(), np.round(lp[ids], 3).tolist()


def done_count(path: Path) -> int:
    """The lines a file holds (0 when it does not exist)."""
    if not path.exists():
        return 0
    with path.open() as f:
        return sum(1 for _ in f)


def generate(target_dir: Path, out: Path, *, limit: int, max_tokens: int = MAX_TOKENS,
             batch: int = BATCH, seed: int = 0, minutes: float | None = None) -> int:
    """Append the answers to `requests(seed)[:limit]` that `out` lacks (until `minutes` pass,
    if given); returns how many were appended."""
    from tqdm import tqdm

    texts = requests(seed)[done_count(out): limit]
    if not texts:
        return 0
    model, tokenizer = mlx_load(str(target_dir))
    model.set_dtype(mx.float32)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                             add_generation_prompt=True) for t in texts]
    gen = BatchGenerator(model, max_tokens=max_tokens,
                         stop_tokens=[[e] for e in tokenizer.eos_token_ids],
                         completion_batch_size=batch, prefill_batch_size=batch)
    deadline = time.monotonic() + (minutes * 60 if minutes is not None else float("inf"))
    answers: dict[int, dict] = {}
    uids: dict[int, int] = {}
    next_prompt = written = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), desc="decode answers", unit="answer", mininterval=5)
    with out.open("a") as f:
        while True:
            # Keep twice a batch queued, in prompt order, so the file stays in `texts` order.
            while next_prompt < len(prompts) and len(uids) < 2 * batch \
                    and time.monotonic() < deadline:
                uids[gen.insert([prompts[next_prompt]], [max_tokens])[0]] = next_prompt
                answers[next_prompt] = {"answer": [], "top_ids": [], "top_logprobs": []}
                next_prompt += 1
            if not uids:
                break
            for r in gen.next_generated():
                answer = answers[uids[r.uid]]
                answer["answer"].append(int(r.token))
                top_ids, top_logprobs = top_row(np.array(r.logprobs.astype(mx.float32)))
                answer["top_ids"].append(top_ids)
                answer["top_logprobs"].append(top_logprobs)
                if r.finish_reason is not None:
                    del uids[r.uid]
                    bar.update(1)
            busy = set(uids.values())  # write the finished answers that continue the file
            while written in answers and written not in busy:
                f.write(json.dumps({"prompt": prompts[written], **answers.pop(written)}) + "\n")
                written += 1
            f.flush()
    bar.close()
    return written


def read_with_teacher(path: Path, limit: int | None = None) -> list[Line]:
    """The first `limit` lines of an answers file (JSONL, or gzipped JSONL as `answer_archive`
    packs it) as (prompt, answer, teacher): the teacher is the target's (top_ids, top_logprobs)
    at each answer position, None for a line without them."""
    with (gzip.open(path, "rt") if Path(path).suffix == ".gz" else open(path)) as f:
        return [(d["prompt"], d["answer"],
                 (d["top_ids"], d["top_logprobs"]) if "top_ids" in d else None)
                for d in map(json.loads, f)][:limit]


def read(path: Path, limit: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Per line, (prompt, answer)."""
    return [(prompt, answer) for prompt, answer, _ in read_with_teacher(path, limit)]


def answered(path: Path, limit: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Per line (of the first `limit`) whose answer is not empty, (prompt, answer)."""
    return [(prompt, answer) for prompt, answer in read(path, limit) if answer]


def held_out_start(examples: list) -> int:
    """Where the held-out answers begin: the last VAL_FRACTION of the answered lines (the end
    of the request order: code requests only)."""
    return int(len(examples) * (1 - VAL_FRACTION))


def answer_split(path: Path, limit: int | None = None) -> tuple[list, list]:
    """An answers file's (prompt, answer) lines with an answer, as (training, held-out)."""
    lines = answered(path, limit)
    return lines[: held_out_start(lines)], lines[held_out_start(lines):]
