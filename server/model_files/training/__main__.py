"""`python -m server.model_files.training`: the shipped draft's recipe, whole or stage by stage.

    draft     answers, distill, evaluate and card in turn, each skipped when its output exists
    answers   the target's answers: restored from the archive, decoded where it lacks them
    distill   the draft: the phases of distill.SCHEDULE its folder has not had
    evaluate  held-out agreement and acceptance at k: OUT/evaluation.json
    card      OUT/README.md from training.json, config.json and evaluation.json
    pack      an answers file's ids into a gzipped archive (how data/target-answers was made)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from server.model_files.training import answer_archive, distill, target_answers
from server.model_files.training.card import write_card


def _common(p: argparse.ArgumentParser, *, answers=True, target=True, out=True) -> None:
    if answers:
        p.add_argument("--answers", type=Path, default=target_answers.DEFAULT_OUT,
                       help="The target's answers: JSONL from the answers stage (evaluate "
                            "reads a packed .jsonl.gz too).")
        p.add_argument("--limit", type=int, default=distill.ANSWERS,
                       help="Answers to the first N requests (a smoke run: a few dozen).")
    if target:
        p.add_argument("--target", default=None,
                       help="Target model folder or GGUF (None: the converted SmolLM2 "
                            "target, fetched on first use).")
    if out:
        p.add_argument("--out", type=Path, default=distill.DEFAULT_OUT,
                       help="The draft's folder.")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server.model_files.training",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    sub = p.add_subparsers(dest="command", required=True)
    stages = {name: sub.add_parser(name, help=help, description=help,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
              for name, help in (
        ("draft", "All four stages."), ("answers", "The target's answers."),
        ("distill", "Train the draft."), ("evaluate", "Measure the draft."),
        ("card", "Write the model card."))}
    for name, s in stages.items():
        _common(s, answers=name != "card", target=name in ("draft", "answers", "distill"),
                out=name != "answers")
    for s in (stages["draft"], stages["answers"]):
        s.add_argument("--archive", type=Path, default=answer_archive.DEFAULT_ARCHIVE,
                       help="Packed answers to restore before decoding any.")
        s.add_argument("--max-tokens", type=int, default=target_answers.MAX_TOKENS,
                       help="Per decoded answer.")
    for s in (stages["draft"], stages["distill"]):
        s.add_argument("--steps-scale", type=float, default=1.0,
                       help="Train this fraction of each phase's steps and warmup (a smoke "
                            "run: 0.01).")
    pk = sub.add_parser("pack", help="Pack an answers file's ids (no distributions).")
    pk.add_argument("src", type=Path, help="An answers file (JSONL).")
    pk.add_argument("archive", type=Path, help="The .jsonl.gz to write.")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "pack":
        print(f"{answer_archive.pack(args.src, args.archive)} answers packed into "
              f"{args.archive}")
        return
    if args.command in ("draft", "answers", "distill"):
        from server.model_files.default_model import target_folder

        target_dir = target_folder(args.target)
    if args.command in ("draft", "answers"):
        print("answers:", answer_archive.ensure(args.answers, target_dir, args.archive,
                                                args.limit, max_tokens=args.max_tokens),
              flush=True)
    if args.command in ("draft", "distill"):
        print("distill:", distill.distill(args.answers, target_dir, args.out, args.limit,
                                          args.steps_scale), flush=True)
    if args.command in ("draft", "evaluate"):
        evaluation = args.out / "evaluation.json"
        if args.command == "draft" and evaluation.exists():
            print(f"evaluate: {evaluation} exists: kept")
        else:
            from server.model_files.training.evaluate import evaluate

            held_out = evaluate(args.out, args.answers, args.limit)["held_out"]
            print(f"evaluate: held-out agreement {held_out['agreement']:.4f} over "
                  f"{held_out['tokens']} tokens; {evaluation} written", flush=True)
    if args.command in ("draft", "card"):
        write_card(args.out)
        print(f"card: {args.out / 'README.md'} written")


if __name__ == "__main__":
    main()
