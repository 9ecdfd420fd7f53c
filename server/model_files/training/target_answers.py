"""The target's own greedy answers to chat requests: training data for a draft that agrees with it.

    python -m server.model_files.training.target_answers [--target PATH] [--out FILE]
        [--minutes 25] [--max-tokens 160] [--batch 32] [--seed 0] [--limit N] [--start N]
        [--eval-prose]

A draft is accepted as often as it predicts what the target itself writes, so the best text to
train it on is the target's output (sequence-level distillation), and the best signal is the
target's whole next-token distribution there (distillation proper). The requests
(`chat_requests`: code from the Python standard library's training split, questions about it,
everyday prose) are answered greedily by the target with `mlx_lm`'s `BatchGenerator`, and
appended to a JSONL file as they finish, one line per answer: `{"prompt": [ids], "answer": [ids],
"top_ids": [[ids]], "top_logprobs": [[logprobs]]}`, the last two the target's most likely
tokens (at most `TOP_K`, log-probability above `MIN_LOGPROB`) at each answer position. A second
run resumes where the file ends. `--start N` skips the first N requests (those another file
answers: more training data beside it, its held-out split left as it is). `--eval-prose`
answers the prose requests kept for measuring (`chat_requests.eval_prose_requests`, topics no
training request uses) into `EVAL_PROSE_OUT`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load as mlx_load
from mlx_lm.generate import BatchGenerator

from server.model_files.training.chat_requests import eval_prose_requests, requests

DEFAULT_OUT = Path("models/generated/target-answers.jsonl")
EVAL_PROSE_OUT = Path("models/generated/target-answers-eval-prose.jsonl")
DEFAULT_MINUTES = 25.0
DEFAULT_MAX_TOKENS = 160
DEFAULT_BATCH = 32
TOP_K = 16  # the target's most likely tokens kept per answer position ...
MIN_LOGPROB = -9.0  # ... of those more likely than this (p > 1.2e-4)


def top_tokens(logprobs: mx.array) -> tuple[list[int], list[float]]:
    """The target's most likely next tokens and their log-probabilities, most likely first."""
    return top_row(np.array(logprobs.astype(mx.float32)))


def top_row(lp: np.ndarray) -> tuple[list[int], list[float]]:
    """`top_tokens` of one row of log-probabilities already in NumPy."""
    ids = np.argpartition(-lp, TOP_K)[:TOP_K]
    ids = ids[np.argsort(-lp[ids], kind="stable")]
    ids = ids[lp[ids] > MIN_LOGPROB]
    return ids.tolist(), np.round(lp[ids], 3).tolist()


def done_count(out: Path) -> int:
    if not out.exists():
        return 0
    with out.open() as f:
        return sum(1 for _ in f)


def generate(target_dir: Path, out: Path, *, minutes: float, max_tokens: int, batch: int,
             seed: int, limit: int | None = None, texts: list[str] | None = None,
             start: int = 0) -> int:
    """Append answers to `out` until `minutes` pass, `limit` answers are written or the
    requests (`texts`, default `requests(seed)`, from the `start`-th on) run out; returns how
    many were appended."""
    from tqdm import tqdm

    model, tokenizer = mlx_load(str(target_dir))
    model.set_dtype(mx.float32)
    texts = (requests(seed) if texts is None else texts)[start + done_count(out):]
    texts = texts[:limit] if limit is not None else texts
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                             add_generation_prompt=True) for t in texts]
    eos = [[e] for e in tokenizer.eos_token_ids]
    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=eos,
                         completion_batch_size=batch, prefill_batch_size=batch)
    deadline = time.monotonic() + minutes * 60
    answers: dict[int, dict] = {}
    uids = {}
    next_prompt, written = 0, 0
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(desc="target answers", unit="tok", mininterval=5)
    with out.open("a") as f:
        while True:
            # Keep twice a batch queued, in prompt order, so the file stays in `texts` order.
            while next_prompt < len(prompts) and len(uids) < 2 * batch \
                    and time.monotonic() < deadline:
                uid = gen.insert([prompts[next_prompt]], [max_tokens])[0]
                uids[uid] = next_prompt
                answers[next_prompt] = {"answer": [], "top_ids": [], "top_logprobs": []}
                next_prompt += 1
            if not uids:
                break
            for r in gen.next_generated():
                i = uids[r.uid]
                answers[i]["answer"].append(int(r.token))
                top_ids, top_logprobs = top_tokens(r.logprobs)
                answers[i]["top_ids"].append(top_ids)
                answers[i]["top_logprobs"].append(top_logprobs)
                bar.update(1)
                if r.finish_reason is not None:
                    del uids[r.uid]
            written = _flush(f, prompts, answers, uids, written)
    bar.close()
    return written


def _flush(f, prompts, answers, running, written: int) -> int:
    """Write the finished answers that continue the file's order."""
    busy = set(running.values())
    while written in answers and written not in busy:
        f.write(json.dumps({"prompt": prompts[written], **answers.pop(written)}) + "\n")
        written += 1
    f.flush()
    return written


def read(path: Path) -> list[tuple[list[int], list[int]]]:
    """Per line, (prompt, answer)."""
    return [(prompt, answer) for prompt, answer, _ in read_with_teacher(path)]


def answered(path: Path) -> list[tuple[list[int], list[int]]]:
    """Per line whose answer is not empty, (prompt, answer)."""
    return [(prompt, answer) for prompt, answer, _ in answered_with_teacher(path)]


def answered_with_teacher(path: Path) -> list[tuple[list[int], list[int], tuple | None]]:
    """`read_with_teacher`'s lines whose answer is not empty."""
    return [line for line in read_with_teacher(path) if line[1]]


def read_with_teacher(path: Path) -> list[tuple[list[int], list[int], tuple | None]]:
    """Per line, (prompt, answer, teacher): the teacher is the target's (top_ids, top_logprobs)
    at each answer position, None for a line written without them."""
    with path.open() as f:
        return [(d["prompt"], d["answer"],
                 (d["top_ids"], d["top_logprobs"]) if "top_ids" in d else None)
                for d in map(json.loads, f)]


def main(argv=None) -> None:
    from server.model_files.default_model import target_folder

    p = argparse.ArgumentParser(prog="python -m server.model_files.training.target_answers",
                                description=__doc__.splitlines()[0])
    p.add_argument("--target", help="Target model folder or GGUF (default: the default target).")
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSONL file (appended to; default {DEFAULT_OUT}, with --eval-prose "
                        f"{EVAL_PROSE_OUT}).")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="Time budget.")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="Per answer.")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="Answers decoded at once.")
    p.add_argument("--seed", type=int, default=0, help="Order of the requests.")
    p.add_argument("--limit", type=int, default=None, help="At most this many answers.")
    p.add_argument("--start", type=int, default=0,
                   help="Skip the first N requests (answered in another file).")
    p.add_argument("--eval-prose", action="store_true",
                   help="Answer the prose requests kept for measuring instead.")
    args = p.parse_args(argv)
    out = args.out or (EVAL_PROSE_OUT if args.eval_prose else DEFAULT_OUT)
    n = generate(target_folder(args.target), out, minutes=args.minutes,
                 max_tokens=args.max_tokens, batch=args.batch, seed=args.seed, limit=args.limit,
                 texts=eval_prose_requests() if args.eval_prose else None, start=args.start)
    print(f"{n} answers appended to {out} ({done_count(out)} in all)")


if __name__ == "__main__":
    main()
