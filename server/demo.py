"""`python -m server.demo`: generate once from the command line, streaming, then print stats.

    python -m server.demo --model PATH [--draft-model PATH] [--num-draft-tokens N]
        [--prompt TEXT] [--chat] [--temp T] [--max-tokens N] [--seed S]
        [--print-prompt-progress] [--draft model|prompt_lookup|hybrid|suffix]
        [--acceptance exact|rejection] [--no-adaptive]

Runs the server's own engine (`ModelKit` + `generate_events`) in this process, no HTTP: the
numbers it prints are the ones the server would put in `stats`. Logs go to stderr; the text
and the stats block go to stdout.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TextIO

from server.blas import blas_report, ensure_fast_blas
from server.config import ModelSettings
from server.engine.params import DraftSource, GenerationParams, SamplingParams, SpeculationParams
from server.engine.prompts import chat_tokens, text_tokens

DEFAULT_PROMPT = "Write a Python function `binary_search(items, target)` and explain it."
DEFAULT_MAX_TOKENS = 256
DEFAULT_NUM_DRAFT_TOKENS = ModelSettings.model_fields["num_draft_tokens"].default
_SPEC_DEFAULTS = SpeculationParams()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server.demo",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Target model: mlx_lm folder or hub id.")
    p.add_argument("--draft-model", help="Draft model: mlx_lm folder or hub id.")
    p.add_argument("--num-draft-tokens", type=int,
                   help=f"Draft tokens per round (default {DEFAULT_NUM_DRAFT_TOKENS}; "
                        "the maximum when adaptive). Needs a drafter.")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="Prompt text (raw unless --chat).")
    p.add_argument("--chat", action="store_true",
                   help="Wrap the prompt in the tokenizer's chat template as a user message.")
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature (0 = greedy).")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"Tokens to generate at most (default {DEFAULT_MAX_TOKENS}).")
    p.add_argument("--seed", type=int, help="Seed for sampling at --temp > 0.")
    p.add_argument("--print-prompt-progress", action="store_true",
                   help="Print prompt-processing progress lines (stderr).")
    p.add_argument("--draft", choices=[d.value for d in DraftSource], default=None,
                   help=f"Where drafts come from: the draft model (default: "
                        f"{_SPEC_DEFAULTS.source}; needs --draft-model), n-grams of the prompt, "
                        "suffix (the longest earlier match of the text's end: one run has only "
                        "its own text), or hybrid (each round the drafter expected to have the "
                        "most tokens accepted; needs --draft-model).")
    p.add_argument("--acceptance", choices=["exact", "rejection"],
                   default=_SPEC_DEFAULTS.acceptance,
                   help="Acceptance rule at --temp > 0 (greedy runs always accept exact matches).")
    p.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   default=_SPEC_DEFAULTS.adaptive,
                   help="Draft exactly --num-draft-tokens every round.")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


HOST_DRAFTERS = ("prompt_lookup", "suffix")  # draft with no draft model


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    lookup = args.draft in HOST_DRAFTERS
    if args.num_draft_tokens is not None and not (args.draft_model or lookup):
        p.error("--num-draft-tokens needs a drafter: add --draft-model PATH "
                "or --draft prompt_lookup")
    if lookup and args.draft_model:
        p.error(f"--draft {args.draft} drafts from the text: drop --draft-model")
    if args.draft in ("model", "hybrid") and not args.draft_model:
        p.error(f"--draft {args.draft} needs --draft-model PATH "
                "(without one, only --draft prompt_lookup can draft)")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 0:
        p.error("--num-draft-tokens must be >= 0")
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if args.temp < 0:
        p.error("--temp must be >= 0")


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """Token ids as the server makes them: the chat template (or a plain fallback), or raw."""
    if chat:
        return chat_tokens(tokenizer, [{"role": "user", "content": text}])
    return text_tokens(tokenizer, text)


def speculation_from_args(args: argparse.Namespace) -> SpeculationParams:
    drafting = args.draft_model is not None or args.draft in HOST_DRAFTERS
    k = args.num_draft_tokens if args.num_draft_tokens is not None else DEFAULT_NUM_DRAFT_TOKENS
    return replace(_SPEC_DEFAULTS, num_draft_tokens=k if drafting else 0,
                   source=args.draft or _SPEC_DEFAULTS.source,
                   acceptance=args.acceptance, adaptive=args.adaptive)


def format_stats(stats) -> list[str]:
    """The "Generation stats" block, one line per entry."""
    lines = [
        "Generation stats:",
        f" - Time to first token: {stats.ttft_s:.2f}s",
        f" - Total tokens generated: {stats.generation_tokens}",
        f" - Total time: {stats.total_s:.2f}s",
        f" - Tokens per second: {stats.generation_tps:.2f}",
    ]
    if stats.num_draft_tokens:
        proposed, accepted = stats.draft_tokens_proposed, stats.draft_tokens_accepted
        rate = f"{100 * accepted / proposed:.1f}%" if proposed else "n/a"
        lines.append(f" - Draft tokens proposed / accepted: {proposed} / {accepted} ({rate})")
    return lines


def load_kit(args: argparse.Namespace, log: TextIO):
    """Load the target (and the draft, checked for compatibility) into a ModelKit."""
    from server.engine.models.model_kit import ModelKit, load_model

    print(f"Loading model from {args.model}", file=log, flush=True)
    kit = ModelKit(load_model(args.model))
    print("Model loaded", file=log, flush=True)
    if args.draft_model:
        print(f"Loading draft model from {args.draft_model}", file=log, flush=True)
        kit.load_draft(args.draft_model)
        print("Draft model loaded", file=log, flush=True)
    if (blas := blas_report()) is not None:
        print(blas[1], file=log, flush=True)
    return kit


def run(kit, params: GenerationParams, *, out: TextIO, log: TextIO, progress: bool):
    """Stream the text to `out`; return the engine's GenerationStats."""
    from server.engine.events import Finished
    from server.engine.generation import generate_events
    from server.engine.speculation.suffix import DEFAULT_SUFFIX_MAX_MB, SuffixIndex

    def report(done: int, total: int) -> None:
        print(f"Prompt processing: {done}/{total} tokens", file=log, flush=True)

    suffix = SuffixIndex(int(DEFAULT_SUFFIX_MAX_MB * 1e6)) \
        if params.speculation.source == DraftSource.SUFFIX else None
    for event in generate_events(kit, params, prompt_progress=report if progress else None,
                                 suffix=suffix):
        if isinstance(event, Finished):
            return event.stats
        out.write(event.text)
        out.flush()
    raise RuntimeError("the engine ended without a Finished event")


def main(argv: Sequence[str] | None = None) -> None:
    if argv is None:  # the command line (not a test calling main): fast BLAS first
        ensure_fast_blas()
    args = parse_args(argv)
    from server.engine.errors import IncompatibleDraft, ModelLoadError

    out, log = sys.stdout, sys.stderr
    try:
        kit = load_kit(args, log)
    except (ModelLoadError, IncompatibleDraft) as e:
        print(f"error: {e}", file=log)
        raise SystemExit(1) from e
    tokens = encode_prompt(kit.target.tokenizer, args.prompt, chat=args.chat)
    if not tokens:
        print("error: the prompt encodes to no tokens", file=log)
        raise SystemExit(1)
    params = GenerationParams(
        prompt_tokens=tuple(tokens),
        max_tokens=args.max_tokens,
        sampling=SamplingParams(temperature=args.temp, seed=args.seed),
        speculation=speculation_from_args(args),
    )
    stats = run(kit, params, out=out, log=log, progress=args.print_prompt_progress)
    print("\n" + "\n".join(format_stats(stats)), file=out, flush=True)


if __name__ == "__main__":
    main()
