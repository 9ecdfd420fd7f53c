"""The bundled demo pair (models/demo): loads through mlx_lm, speaks one vocabulary, and
speculative greedy decoding with it reproduces plain greedy decoding token for token."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import load, stream_generate
from support.paths import ROOT

DEMO = ROOT / "models" / "demo"
PROMPT = (
    "Write a Python function `is_palindrome(s)` that returns True if s reads the same backwards."
)
MAX_TOKENS = 48


def chat_prompt(tokenizer, user: str) -> list[int]:
    """The user turn in the model's own chat template, ready for the assistant's reply."""
    messages = [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def acceptance_counts(from_draft: list[bool], k: int, max_tokens: int) -> tuple[int, int]:
    """(proposed, accepted) rebuilt from the per-token `from_draft` flags: each round proposes
    min(k, tokens still allowed) draft tokens and ends with one target token (False)."""
    proposed = accepted = 0
    round_start = True
    for i, flag in enumerate(from_draft):
        if round_start:
            proposed += min(k, max_tokens - i)
        round_start = not flag
        accepted += flag
    return proposed, accepted


@pytest.fixture(scope="module")
def demo_pair():
    """(target, tokenizer, draft, draft_tokenizer), float32 for fast CPU inference."""
    target, tokenizer = load(str(DEMO / "target"))
    draft, draft_tokenizer = load(str(DEMO / "draft"))
    target.set_dtype(mx.float32)
    draft.set_dtype(mx.float32)
    return target, tokenizer, draft, draft_tokenizer


def _generate(model, tokenizer, prompt, **kwargs):
    responses = list(stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, **kwargs))
    return (
        [r.token for r in responses],
        [r.from_draft for r in responses],
        "".join(r.text for r in responses),
    )


def test_shipped_files_are_small_float16_mlx_models():
    total = 0
    for role in ("target", "draft"):
        folder = DEMO / role
        for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
            assert (folder / name).is_file(), f"{folder / name} missing"
        weights = mx.load(str(folder / "model.safetensors"))
        assert {w.dtype for w in weights.values()} == {mx.float16}
        total += sum(p.stat().st_size for p in folder.iterdir())
    assert total < 30 * 2**20


def test_pair_shares_one_tokenizer_and_stops_at_im_end(demo_pair):
    _, tokenizer, _, draft_tokenizer = demo_pair
    assert tokenizer.get_vocab() == draft_tokenizer.get_vocab()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for role in ("target", "draft"):
        config = json.loads((DEMO / role / "config.json").read_text())
        assert config["eos_token_id"] == im_end
    assert im_end in tokenizer.eos_token_ids


def test_speculative_greedy_matches_plain_greedy(demo_pair):
    target, tokenizer, draft, _ = demo_pair
    prompt = chat_prompt(tokenizer, PROMPT)
    plain, _, text = _generate(target, tokenizer, prompt)
    spec, flags, spec_text = _generate(
        target, tokenizer, prompt, draft_model=draft, num_draft_tokens=4
    )
    assert spec == plain
    assert spec_text == text
    assert text.strip(), "the demo target should answer with some text"
    proposed, accepted = acceptance_counts(flags, 4, MAX_TOKENS)
    assert 0 < accepted <= proposed


def test_acceptance_counts_rebuilds_rounds():
    # Rounds: [D D F] [F] [D D D D F] [D] (cut by the token limit of 12 mid-round).
    flags = [True, True, False, False, True, True, True, True, False, True]
    assert acceptance_counts(flags, 4, 12) == (4 + 4 + 4 + 3, 7)
