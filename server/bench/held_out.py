"""`python -m server.bench.held_out --server URL --setting NAME=JSON ...`: drafting settings
compared through our server on many requests no draft trained on, instead of the two bench
prompts.

    python -m server.bench.held_out --server http://127.0.0.1:8100 \\
        --setting plain='{"num_draft_tokens": 0}' \\
        --setting match1='{"draft": "hybrid", "hybrid_min_match": 1}' \\
        --setting match2='{"draft": "hybrid", "hybrid_min_match": 2}' [--count 16]

The requests: the first `--count` held-out code requests of `target_answers`' file and the first
`--count` prose requests kept for measuring (`--eval-prose`), sent as token ids to
`/v1/completions`, greedy, `--max-tokens` each, without the prefix cache. Each request runs
under every setting in turn (the order rotates per request, so a drift of the machine does not
favour one). A setting's decode time is the sum over its requests of generation_tokens /
generation_tps (our `stats`: from the first token to the last, prefill left out). Printed per
family: tokens, decode seconds, tok/s, tok/s over the first setting's, accepted/proposed; and
whether every setting gave the first setting's text (greedy speculation must).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx

from server.bench.report import aligned


def parse_setting(text: str) -> tuple[str, dict]:
    name, _, body = text.partition("=")
    try:
        fields = json.loads(body)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{name}: not JSON: {e}") from e
    if not name or not isinstance(fields, dict):
        raise argparse.ArgumentTypeError("expected NAME={...request fields...}")
    return name, fields


def run(client: httpx.Client, prompt: list[int], fields: dict, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "cache_prompt": False, **fields}
    r = client.post("/v1/completions", json=body)
    r.raise_for_status()
    answer = r.json()
    return {"text": answer["choices"][0]["text"], **answer["stats"]}


def summary(names: list[str], results: dict[str, list[dict]]) -> list[list[str]]:
    """One line per setting: tokens, decode s, tok/s, over the first, accepted/proposed."""
    def tps(name):
        rs = results[name]
        return sum(r["generation_tokens"] for r in rs) / decode_s(rs)

    lines = []
    for name in names:
        rs = results[name]
        accepted = sum(r["draft_tokens_accepted"] for r in rs)
        proposed = sum(r["draft_tokens_proposed"] for r in rs)
        lines.append([name, str(sum(r["generation_tokens"] for r in rs)),
                      f"{decode_s(rs):.1f}", f"{tps(name):.1f}",
                      f"{tps(name) / tps(names[0]):.2f}x", f"{accepted}/{proposed}"])
    return lines


def decode_s(rs: list[dict]) -> float:
    return sum(r["generation_tokens"] / r["generation_tps"] for r in rs if r["generation_tps"])


def main(argv: list[str] | None = None) -> int:
    from mlx_lm.utils import load_tokenizer

    from server.bench.round_replay import held_out_by_family
    from server.model_files.default_model import DEFAULT_TARGET_DIR
    from server.model_files.training import target_answers

    ap = argparse.ArgumentParser(prog="python -m server.bench.held_out", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", required=True, help="Our server's base URL.")
    ap.add_argument("--setting", type=parse_setting, action="append", required=True,
                    metavar="NAME=JSON", help="Request fields of one setting (repeatable; the "
                    "first is the baseline).")
    ap.add_argument("--answers", type=Path, default=target_answers.DEFAULT_OUT)
    ap.add_argument("--model", default=str(DEFAULT_TARGET_DIR), help="For its tokenizer.")
    ap.add_argument("--count", type=int, default=16, help="Requests per family.")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    names = [name for name, _ in args.setting]
    fields = dict(args.setting)
    families = held_out_by_family(args.answers, args.count, load_tokenizer(Path(args.model)))
    same = True
    with httpx.Client(base_url=args.server, timeout=600) as client:
        for family, examples in families.items():
            results: dict[str, list[dict]] = {name: [] for name in names}
            for i, (prompt, _) in enumerate(examples):
                order = names[i % len(names):] + names[: i % len(names)]
                texts = {}
                for name in order:
                    r = run(client, prompt, fields[name], args.max_tokens)
                    results[name].append(r)
                    texts[name] = r["text"]
                same &= len(set(texts.values())) == 1
            print(f"\n{family}: {len(examples)} requests, {args.max_tokens} tokens at most")
            print(aligned([["setting", "tokens", "decode s", "tok/s", "over first",
                            "accepted/proposed"], *summary(names, results)]))
    print(f"\nevery setting gave the same text as {names[0]}: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
