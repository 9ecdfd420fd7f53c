"""`python -m server.demo`: its stats block against the engine's own numbers, and its errors."""

from __future__ import annotations

import re

import pytest
from mlx_lm.utils import load_tokenizer

from server.demo import DEFAULT_NUM_DRAFT_TOKENS, encode_prompt, main, parse_args
from server.engine.events import Finished
from server.engine.generation import generate_events
from server.engine.params import GenerationParams, SamplingParams, SpeculationParams

PROMPT = "def binary_search(items, target):"


def engine_run(kit, speculation: SpeculationParams, max_tokens: int,
               sampling: SamplingParams | None = None):
    tokens = tuple(kit.target.tokenizer.encode(PROMPT))
    params = GenerationParams(tokens, max_tokens, sampling=sampling or SamplingParams(),
                              speculation=speculation)
    events = list(generate_events(kit, params))
    assert isinstance(events[-1], Finished)
    return "".join(e.text for e in events[:-1]), events[-1].stats


def demo(argv, capsys):
    main(argv)
    captured = capsys.readouterr()
    text, _, block = captured.out.rpartition("\nGeneration stats:\n")
    return text, block, captured.err


def stat(block: str, name: str) -> str:
    return re.search(rf"^ - {re.escape(name)}: (.*)$", block, re.M).group(1)


def test_stats_match_the_engine_with_a_draft(tiny_pair, kit, capsys):
    target, draft = map(str, tiny_pair)
    text, block, err = demo(["--model", target, "--draft-model", draft, "--num-draft-tokens",
                             "3", "--prompt", PROMPT, "--max-tokens", "24"], capsys)
    expected_text, stats = engine_run(kit, SpeculationParams(num_draft_tokens=3), 24)
    assert text == expected_text
    assert stat(block, "Total tokens generated") == str(stats.generation_tokens) == "24"
    proposed, accepted = stats.draft_tokens_proposed, stats.draft_tokens_accepted
    assert proposed > 0
    assert stat(block, "Draft tokens proposed / accepted") == (
        f"{proposed} / {accepted} ({100 * accepted / proposed:.1f}%)")
    for name in ("Time to first token", "Total time"):
        assert re.fullmatch(r"\d+\.\d\ds", stat(block, name))
    assert float(stat(block, "Tokens per second")) > 0
    assert err.splitlines()[:4] == [f"Loading model from {target}", "Model loaded",
                                    f"Loading draft model from {draft}", "Draft model loaded"]


def test_stats_match_the_engine_without_a_draft(tiny_pair, kit, capsys):
    text, block, err = demo(["--model", str(tiny_pair[0]), "--prompt", PROMPT,
                             "--max-tokens", "12", "--no-adaptive"], capsys)
    expected_text, stats = engine_run(kit, SpeculationParams(), 12)
    assert text == expected_text
    assert stat(block, "Total tokens generated") == str(stats.generation_tokens)
    assert "Draft tokens" not in block and "Loading draft" not in err
    assert block.count("\n") == 4  # exactly the four lines


@pytest.mark.parametrize("draft", [False, True])
def test_prompt_progress_and_chat(tiny_pair, capsys, draft):
    extra = ["--draft-model", str(tiny_pair[1])] if draft else []
    _, block, err = demo(["--model", str(tiny_pair[0]), "--prompt", "hi", "--chat",
                          "--max-tokens", "4", "--print-prompt-progress", *extra], capsys)
    lines = re.findall(r"Prompt processing: (\d+)/(\d+) tokens", err)
    n = len(encode_prompt(load_tokenizer(tiny_pair[0]), "hi", chat=True))
    assert lines[0] == ("0", str(n)) and lines[-1] == (str(n), str(n))
    assert stat(block, "Total tokens generated") == "4"


def test_encode_prompt(kit):
    tok = kit.target.tokenizer
    assert encode_prompt(tok, "hi", chat=True) == list(tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True))
    assert encode_prompt(tok, "hi", chat=False) == list(tok.encode("hi"))


@pytest.mark.parametrize("argv, message", [
    (["--num-draft-tokens", "3"], "--num-draft-tokens needs a drafter"),
    (["--draft", "prompt_lookup", "--draft-model", "d"], "drop --draft-model"),
    (["--draft", "model"], "--draft model needs --draft-model PATH"),
    (["--draft", "hybrid"], "--draft hybrid needs --draft-model PATH"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    ([], None),
])
def test_argument_errors_exit_2(argv, message, capsys):
    if message is None:  # --model is required
        with pytest.raises(SystemExit) as e:
            parse_args(argv)
    else:
        with pytest.raises(SystemExit) as e:
            main(["--model", "m", *argv])
        assert message in capsys.readouterr().err
    assert e.value.code == 2


def test_without_speculation_flags_the_demo_drafts_as_the_engine_does(tiny_pair, kit, capsys):
    """No --num-draft-tokens, --draft, --acceptance or --no-adaptive: the same text and draft
    counts as the engine's defaults. Sampled and seeded, so that the acceptance rule and the
    adaptive schedule both show in the counts."""
    target, draft = map(str, tiny_pair)
    text, block, _ = demo(["--model", target, "--draft-model", draft, "--prompt", PROMPT,
                           "--max-tokens", "24", "--temp", "0.8", "--seed", "3"], capsys)
    expected_text, stats = engine_run(
        kit, SpeculationParams(num_draft_tokens=DEFAULT_NUM_DRAFT_TOKENS), 24,
        SamplingParams(temperature=0.8, seed=3))
    assert text == expected_text
    proposed, accepted = stats.draft_tokens_proposed, stats.draft_tokens_accepted
    assert proposed > 0
    assert stat(block, "Draft tokens proposed / accepted").startswith(f"{proposed} / {accepted} (")


def test_missing_model_is_a_clean_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tmp_path / "nope")])
    assert e.value.code == 1
    assert "model path not found" in capsys.readouterr().err
