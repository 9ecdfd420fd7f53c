"""OpenAI's Predicted Outputs: the guess drafts the answer, which stays the target's own
(equal to mlx_lm's), alone and in a batch; how the guess is aligned with the answer; the
usage fields, through the SDK. And prompt lookup's longer rounds, which predictions share."""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest
from mlx_lm import generate
from support.engine import alone, params, run_batch, tokens_of
from support.http import chat_body
from support.servers import served

from server.engine.params import SpeculationParams
from server.engine.speculation.policy import SpeculationPolicy
from server.engine.speculation.prediction import PredictionDraft

pytestmark = pytest.mark.anyio
MAX = 48


def test_the_guess_starts_the_answer_and_follows_it():
    guess = PredictionDraft([10, 11, 12, 13, 10, 11, 14, 15])
    assert guess.propose([], 3) == ([10, 11, 12], 3)
    assert guess.propose([10, 11], 2) == ([12, 13], 2)
    # `10 11` occurs twice: after the answer passed the first, the second one continues it.
    assert guess.propose([10, 11, 12, 13, 10, 11], 4) == ([14, 15], 3)
    assert guess.propose([99], 3) == ([], 0)  # the answer left the guess
    assert guess.propose([99, 13], 2) == ([], 0)  # a 1-token match does not count
    assert guess.propose([99, 13], 2, min_ngram=1) == ([10, 11], 1)
    assert guess.propose([99, 12, 13], 2) == ([10, 11], 2)  # a 2-token one does


def test_a_rewritten_part_realigns_on_the_next_matching_ngram():
    guess = PredictionDraft(list(range(100, 120)))
    assert guess.propose([100, 101, 102], 2) == ([103, 104], 3)
    assert guess.propose([100, 101, 102, 7, 8, 110, 111], 3) == ([112, 113, 114], 2)


@pytest.mark.parametrize("k", [1, 4])
def test_a_right_guess_drafts_nearly_everything_and_changes_nothing(kit, k):
    plain = params(kit, 0, k=k, max_tokens=MAX)
    expected = alone(kit, plain)
    p = replace(plain, prediction=tuple(expected),
                speculation=replace(plain.speculation, lookup_draft_tokens=16))
    events, (seq,) = run_batch(kit, [p])
    assert tokens_of(events[0]) == expected
    stats = seq.stats()
    assert stats.accepted_prediction_tokens >= MAX - 8, stats
    assert stats.rejected_prediction_tokens == MAX - stats.accepted_prediction_tokens
    assert max(stats.k_histogram) > 4  # a guess drafts longer runs than the model's k


def test_a_wrong_or_edited_guess_changes_nothing_in_a_batch(kit):
    requests = [params(kit, i, k=4, max_tokens=MAX) for i in range(3)]
    expected = [alone(kit, p) for p in requests]
    edited = expected[0][:10] + [5, 6, 7] + expected[0][20:]
    requests = [replace(requests[0], prediction=tuple(edited)),
                replace(requests[1], prediction=tuple(range(40, 90))),
                requests[2]]
    events, seqs = run_batch(kit, requests)
    assert [tokens_of(e) for e in events] == expected
    assert seqs[0].stats().accepted_prediction_tokens > 20
    assert seqs[2].stats().accepted_prediction_tokens is None


async def test_the_prediction_reaches_the_engine_as_its_tokens(client, loaded_pair):
    target, tokenizer, _ = loaded_pair
    body = chat_body(max_tokens=16, temperature=0)
    prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
    expected = generate(target, tokenizer, prompt, max_tokens=16)
    guess = "def binary_search(items):\n    return 0\n"
    r = await client.post("/v1/chat/completions",
                          json={**body, "prediction": {"type": "content", "content": guess}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected
    details = r.json()["usage"]["completion_tokens_details"]
    n = len(tokenizer.encode(guess, add_special_tokens=False))
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == n
    plain = (await client.post("/v1/chat/completions", json=body)).json()
    assert "completion_tokens_details" not in plain["usage"]


@pytest.mark.parametrize("off", [{"use_draft": False}, {"num_draft_tokens": 0}])
async def test_a_prediction_with_drafting_off_is_400(client, off):
    r = await client.post("/v1/chat/completions", json={
        **chat_body(max_tokens=4), **off, "prediction": {"type": "content", "content": "x"}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prediction"


def test_the_sdk_sends_a_prediction_and_reads_its_usage(live_server):
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
        prediction={"type": "content", "content": [{"type": "text", "text": "hello there"}]})
    details = out.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0


@pytest.mark.parametrize("k, adaptive, lookup_k",
                         [(None, True, 16), (4, True, 0), (None, False, 0)])
def test_lookup_rounds_may_draft_16_when_k_is_left_to_the_server(k, adaptive, lookup_k):
    spec = SpeculationPolicy().for_request(
        use_draft=None, num_draft_tokens=k, draft=None, draft_loaded=True,
        defaults=SpeculationParams(source="hybrid", adaptive=adaptive))
    assert (spec.num_draft_tokens, spec.lookup_draft_tokens) == (4, lookup_k)


async def test_a_repeating_answer_is_looked_up_in_long_rounds(client, loaded_pair):
    """The tiny target soon repeats itself: prompt lookup drafts it in rounds longer than the
    server's k of 4, and the text is still mlx_lm's."""
    target, tokenizer, _ = loaded_pair
    body = chat_body(max_tokens=160, temperature=0, draft="prompt_lookup")
    prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
    r = (await client.post("/v1/chat/completions", json=body)).json()
    assert r["choices"][0]["message"]["content"] == generate(target, tokenizer, prompt,
                                                             max_tokens=160)
    assert max(map(int, r["stats"]["k_histogram"])) > 4
    assert r["stats"]["num_draft_tokens"] == 4


async def test_a_prediction_drafts_on_a_server_without_a_draft_model(tiny_pair, loaded_pair):
    """No draft model is loaded: plain requests draft with the host drafters only (the
    default hybrid's), one with a prediction drafts from it."""
    target, tokenizer, _ = loaded_pair
    body = chat_body(max_tokens=MAX, temperature=0)
    prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
    expected = generate(target, tokenizer, prompt, max_tokens=MAX)
    async with served(tiny_pair[0], None) as (client, _):
        plain = (await client.post("/v1/chat/completions", json=body)).json()
        assert plain["stats"]["draft_model"] == "prompt_lookup+suffix"
        guessed = {**body, "prediction": {"type": "content", "content": expected}}
        r = (await client.post("/v1/chat/completions", json=guessed)).json()
    assert plain["choices"][0]["message"]["content"] == expected
    assert r["choices"][0]["message"]["content"] == expected
    # The guess is the text re-encoded, whose tokens a random model's answer only partly shares.
    assert r["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert r["stats"]["draft_tokens_accepted"] > 0
