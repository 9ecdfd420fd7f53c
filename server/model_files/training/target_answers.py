"""The target's own greedy answers to chat requests: training data for a draft that agrees with it.

    python -m server.model_files.training.target_answers [--target PATH] [--out FILE]
        [--minutes 25] [--max-tokens 160] [--batch 32] [--seed 0]

A draft is accepted as often as it predicts what the target itself writes, so the best text to
train it on is the target's output (sequence-level distillation). The requests are made from the
Python standard library's training split (a function asked for by its signature and docstring; a
documented function or class asked about), shuffled with `--seed`, answered greedily by the
target with `mlx_lm`'s `BatchGenerator`, and appended to a JSONL file (`{"prompt": [ids],
"answer": [ids]}` per line) as they finish. A second run resumes where the file ends.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load as mlx_load
from mlx_lm.generate import BatchGenerator

from server.model_files.tokenizer_builder import stdlib_files
from server.model_files.training.corpus import (
    explain_pairs,
    function_pairs,
    read_source,
    split_files,
)

DEFAULT_OUT = Path("models/generated/target-answers.jsonl")
DEFAULT_MINUTES = 25.0
DEFAULT_MAX_TOKENS = 160
DEFAULT_BATCH = 32
VAL_FRACTION = 0.05  # the stdlib files no training here sees (corpus.split_files)


def requests(seed: int) -> list[str]:
    """Chat requests from the stdlib's training files, in a seeded order."""
    out = []
    for path in split_files(stdlib_files(), VAL_FRACTION).train:
        source = read_source(path)
        out += [q for q, _ in function_pairs(source)]
        out += [q for q, _ in explain_pairs(source)]
    unique = sorted(set(out))
    random.Random(seed).shuffle(unique)
    return unique


def done_count(out: Path) -> int:
    if not out.exists():
        return 0
    with out.open() as f:
        return sum(1 for _ in f)


def generate(target_dir: Path, out: Path, *, minutes: float, max_tokens: int, batch: int,
             seed: int, limit: int | None = None) -> int:
    """Append answers to `out` until `minutes` pass, `limit` answers are written or the
    requests run out; returns how many were appended."""
    from tqdm import tqdm

    model, tokenizer = mlx_load(str(target_dir))
    model.set_dtype(mx.float32)
    texts = requests(seed)[done_count(out):]
    texts = texts[:limit] if limit is not None else texts
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                             add_generation_prompt=True) for t in texts]
    eos = [[e] for e in tokenizer.eos_token_ids]
    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=eos,
                         completion_batch_size=batch, prefill_batch_size=batch)
    deadline = time.monotonic() + minutes * 60
    answers: dict[int, list[int]] = {}
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
                answers[next_prompt] = []
                next_prompt += 1
            if not uids:
                break
            for r in gen.next_generated():
                i = uids[r.uid]
                answers[i].append(int(r.token))
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
        f.write(json.dumps({"prompt": prompts[written], "answer": answers.pop(written)}) + "\n")
        written += 1
    f.flush()
    return written


def read(path: Path) -> list[tuple[list[int], list[int]]]:
    with path.open() as f:
        return [(d["prompt"], d["answer"]) for d in map(json.loads, f)]


def main(argv=None) -> None:
    from server.model_files.default_model import target_folder

    p = argparse.ArgumentParser(prog="python -m server.model_files.training.target_answers",
                                description=__doc__.splitlines()[0])
    p.add_argument("--target", help="Target model folder or GGUF (default: the default target).")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSONL file (appended to).")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="Time budget.")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="Per answer.")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="Answers decoded at once.")
    p.add_argument("--seed", type=int, default=0, help="Order of the requests.")
    p.add_argument("--limit", type=int, default=None, help="At most this many answers.")
    args = p.parse_args(argv)
    n = generate(target_folder(args.target), args.out, minutes=args.minutes,
                 max_tokens=args.max_tokens, batch=args.batch, seed=args.seed, limit=args.limit)
    print(f"{n} answers appended to {args.out} ({done_count(args.out)} in all)")


if __name__ == "__main__":
    main()
