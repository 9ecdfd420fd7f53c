"""The engine's generation loop against mlx_lm.stream_generate, and stop strings."""

from __future__ import annotations

import pytest
from mlx_lm import stream_generate

from server.engine.generation import generate_events
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.scheduling.stop_sequences import StopMatcher


def prompt_of(kit, text="Write a function"):
    return kit.target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def run(kit, prompt, max_tokens, k=0, **kw):
    spec = SpeculationParams(num_draft_tokens=k, adaptive=False, acceptance="exact")
    events = list(generate_events(kit, GenerationParams(tuple(prompt), max_tokens,
                                                        speculation=spec, **kw)))
    return events[:-1], events[-1]


@pytest.mark.parametrize("k", [0, 2, 4])
def test_matches_mlx_stream_generate(kit, k):
    prompt = prompt_of(kit)
    tokens, done = run(kit, prompt, 40, k)
    extra = {"draft_model": kit.draft.model, "num_draft_tokens": k} if k else {}
    ref = list(stream_generate(kit.target.model, kit.target.tokenizer, prompt, max_tokens=40,
                               **extra))
    assert [e.token for e in tokens] == [r.token for r in ref]
    assert "".join(e.text for e in tokens) == "".join(r.text for r in ref)
    if k == 0:
        assert not any(e.from_draft for e in tokens)
    assert done.finish_reason == ref[-1].finish_reason == "length"
    assert done.stats.generation_tokens == len(tokens) == 40
    assert done.stats.draft_tokens_accepted == sum(e.from_draft for e in tokens)
    assert done.stats.draft_tokens_accepted <= done.stats.draft_tokens_proposed


def test_eos_ends_with_stop(kit):
    eos = next(iter(kit.target.tokenizer.eos_token_ids))
    prompt = prompt_of(kit)
    tokens, _ = run(kit, prompt, 12)
    # Bias the EOS token up so the model must emit it first.
    bias = ((eos, 1e4),)
    from server.engine.params import SamplingParams

    tokens, done = run(kit, prompt, 12, sampling=SamplingParams(logit_bias=bias))
    assert [e.token for e in tokens] == [eos]
    assert tokens[0].text == ""
    assert done.finish_reason == "stop"


def test_stop_string_truncates_and_finishes(kit):
    prompt = prompt_of(kit)
    tokens, _ = run(kit, prompt, 30)
    text = "".join(e.text for e in tokens)
    stop = text[10:14]
    cut, done = run(kit, prompt, 30, stop=(stop,))
    assert "".join(e.text for e in cut) == text[: text.index(stop)]
    assert done.finish_reason == "stop"
    assert len(cut) < len(tokens)


def test_cancel_stops_within_a_token(kit):
    calls = []
    events = generate_events(kit, GenerationParams(tuple(prompt_of(kit)), 1000),
                             cancelled=lambda: len(calls) >= 3)
    n = 0
    for event in events:
        calls.append(event)
        n += 1
    assert n == 4  # three tokens, then Finished


@pytest.mark.parametrize(
    "segments, stops, expected",
    [
        (["Hello", " wor", "ld"], ["world"], ("Hello ", True)),
        (["ab", "c", "d"], ["cx"], ("abcd", False)),
        (["a", "b"], [], ("ab", False)),
        (["x<", "|end", "|> tail"], ["<|end|>"], ("x", True)),
    ],
)
def test_stop_matcher(segments, stops, expected):
    matcher, out, hit = StopMatcher(stops), "", False
    for i, seg in enumerate(segments):
        text, hit = matcher.feed(seg, final=i == len(segments) - 1)
        out += text
        if hit:
            break
    assert (out, hit) == expected


def test_stop_matcher_holds_back_partial_match():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abcST") == ("abc", False)
    assert matcher.feed("xy") == ("STxy", False)
