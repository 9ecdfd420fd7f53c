"""`mlx-spec-bench held-out`: drafting settings through our server on requests no draft trained on.

Each `--setting NAME='{request fields}'` (the first the baseline) in turn on held-out code and
prose requests to `/v1/completions`, greedy, uncached; exits 1 unless every text is the same.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
from mlx_lm.utils import load_tokenizer

from server.bench import results
from server.model_files.default_model import DEFAULT_TARGET_DIR
from server.model_files.training import target_answers
from server.model_files.training.chat_requests import prose_requests
from server.model_files.training.distill import answer_split


def parse_setting(text: str) -> tuple[str, dict]:
    name, _, body = text.partition("=")
    try:
        fields = json.loads(body)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{name}: not JSON: {e}") from e
    if not name or not isinstance(fields, dict):
        raise argparse.ArgumentTypeError("expected NAME={...request fields...}")
    return name, fields


def held_out_by_family(path: Path, count: int, model: str) -> dict[str, list[list[int]]]:
    """The first `count` held-out prompts, code and prose apart, plus the measuring prose's."""
    tokenizer, prose = load_tokenizer(Path(model)), prose_requests()
    families: dict[str, list] = {"code": [], "prose": []}
    for prompt, _ in answer_split(path)[1][:count]:
        text = tokenizer.decode(prompt)
        families["prose" if any(r in text for r in prose) else "code"].append(prompt)
    if target_answers.EVAL_PROSE_OUT.exists():
        families["prose"] += [p for p, _ in target_answers.answered(
            target_answers.EVAL_PROSE_OUT)[:count]]
    return {name: prompts for name, prompts in families.items() if prompts}


def setting_rows(family: str, names: list[str], answers: dict[str, list[dict]]) -> list[dict]:
    """One row per setting: tokens, decode seconds, tok/s and over the first, acceptance."""
    rows = []
    for name in names:
        rs = answers[name]
        tokens = sum(r["generation_tokens"] for r in rs)
        decode_s = sum(r["generation_tokens"] / r["generation_tps"]
                       for r in rs if r["generation_tps"])
        rows.append({"family": family, "setting": name, "requests": len(rs), "tokens": tokens,
                     "decode_s": decode_s, "tps": tokens / decode_s if decode_s else None,
                     "accepted": sum(r["draft_tokens_accepted"] for r in rs),
                     "proposed": sum(r["draft_tokens_proposed"] for r in rs)})
    for row in rows:
        row["over_first"] = results.ratio(row["tps"], rows[0]["tps"])
    return rows


def table(rows: list[dict]) -> list[list[str]]:
    return [["family", "setting", "tokens", "decode s", "tok/s", "over first",
             "accepted/proposed"]] + [
        [r["family"], r["setting"], str(r["tokens"]), f"{r['decode_s']:.1f}",
         f"{r['tps'] or 0:.1f}", f"{r['over_first'] or 0:.2f}x",
         f"{r['accepted']}/{r['proposed']}"] for r in rows]


def main(argv: list[str]) -> int:
    p = results.parser("held-out", __doc__)
    a = p.add_argument
    a("--server", required=True, help="Our server's base URL.")
    a("--setting", type=parse_setting, action="append", required=True, metavar="NAME=JSON",
      help="Request fields of one setting (repeatable; the first is the baseline).")
    a("--answers", type=Path, default=target_answers.DEFAULT_OUT, help="The target's answers.")
    a("--model", default=str(DEFAULT_TARGET_DIR), help="For its tokenizer.")
    a("--count", type=int, default=16, help="Requests per family.")
    a("--max-tokens", type=int, default=128, help="Tokens per request.")
    a("--api-key", help="Bearer key for the server.")
    args = p.parse_args(argv)
    names, fields = [name for name, _ in args.setting], dict(args.setting)
    rows, same = [], True
    client = httpx.Client(base_url=args.server, timeout=600, headers=results.auth(args.api_key))
    with client:
        for family, prompts in held_out_by_family(args.answers, args.count, args.model).items():
            answers: dict[str, list[dict]] = {name: [] for name in names}
            for i, prompt in enumerate(prompts):
                texts = set()
                for name in names[i % len(names):] + names[:i % len(names)]:  # rotating
                    answer = client.post("/v1/completions", json={
                        "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
                        "cache_prompt": False, **fields[name]}).raise_for_status().json()
                    answers[name].append(answer["stats"])
                    texts.add(answer["choices"][0]["text"])
                same &= len(texts) == 1
            rows += setting_rows(family, names, answers)
    results.save("held-out", argv, args, results.environment(model=args.model), rows, table,
                 same_text=same)
    print(f"every setting gave the same text as {names[0]}: {same}")
    return 0 if same else 1
