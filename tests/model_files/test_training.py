"""The draft recipe (`python -m server.model_files.training`) end to end on the tiny pair's
target, each stage's output checked against what it must be; and its parts' arithmetic."""

from __future__ import annotations

import contextlib
import io
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import speculative_generate_step
from mlx_lm.utils import dequantize_model

from server.engine.models.draft_vocab import VOCAB_FILE, draft_index, read_vocab, wrap_if_sub_vocab
from server.engine.models.model_kit import load_model
from server.model_files.training import answer_archive, distill, evaluate, target_answers
from server.model_files.training.__main__ import main
from server.model_files.training.chat_requests import requests

LIMIT, ARCHIVED, SCALE, MAX_TOKENS = 48, 16, 0.5, 16


@pytest.fixture(scope="module")
def recipe(tiny_pair, tmp_path_factory):
    """The whole recipe run once: the first ARCHIVED answers restored from an archive, the
    rest decoded; (target folder, work folder, what it printed)."""
    tmp = tmp_path_factory.mktemp("recipe")
    target_answers.generate(tiny_pair[0], tmp / "decoded.jsonl", limit=ARCHIVED,
                            max_tokens=MAX_TOKENS, batch=8)
    answer_archive.pack(tmp / "decoded.jsonl", tmp / "archive.jsonl.gz")
    argv = ["draft", "--target", str(tiny_pair[0]), "--answers", str(tmp / "answers.jsonl"),
            "--archive", str(tmp / "archive.jsonl.gz"), "--limit", str(LIMIT),
            "--max-tokens", str(MAX_TOKENS), "--steps-scale", str(SCALE),
            "--out", str(tmp / "draft")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(argv)
    return tiny_pair[0], tmp, argv, printed.getvalue()


def test_answers_are_the_archives_ids_then_the_targets_greedy_answers(recipe):
    target, tmp, _, printed = recipe
    lines = target_answers.read_with_teacher(tmp / "answers.jsonl")
    assert len(lines) == LIMIT
    assert f"{ARCHIVED} answers restored" in printed and f"{LIMIT - ARCHIVED} decoded" in printed
    assert [line[:2] for line in lines[:ARCHIVED]] == target_answers.read(tmp / "archive.jsonl.gz")
    _, tokenizer = load(str(target))
    assert [line[0] for line in lines] == [  # every prompt: the request in the chat template
        tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                      add_generation_prompt=True) for t in requests(0)[:LIMIT]]
    for _, answer, (top_ids, _) in lines[ARCHIVED:]:  # decoded: greedy, the written token first
        assert 0 < len(answer) <= MAX_TOKENS and [ids[0] for ids in top_ids] == answer


def test_distill_runs_the_schedules_three_phases(recipe):
    target, tmp, _, _ = recipe
    out = tmp / "draft"
    card = json.loads((out / "training.json").read_text())
    train, held_out = target_answers.answer_split(tmp / "answers.jsonl")
    steps = [distill.steps_for(phase, len(train), SCALE) for phase in distill.SCHEDULE]
    assert steps == [6, 3, 3]  # 45 training answers: 6 batches of 8 an epoch, halved
    assert distill.phases_done(out) == 3 and card["steps"] == sum(steps)
    assert [(r["lr"], r["seed"], r["steps"]) for r in card["continued"]] == [
        (3e-4, 2, 3), (3e-4, 3, 3)]
    assert (card["lr"], card["seed"], card["epochs"], card["answers"]) == (1e-3, 0, 2, LIMIT)
    assert card["after"] == card["continued"][-1]["agreement_after"]
    assert card["soft_targets"] == len(train)
    _, tokenizer = load(str(target))
    kept, vocab = read_vocab(out)
    assert kept == distill.frequent_ids(train, distill.VOCAB, set(tokenizer.eos_token_ids))
    assert card["vocab"] == len(kept) and vocab == card["target_vocab_size"]
    index = draft_index(kept, vocab)
    assert card["held_out_coverage"] == np.mean([index[t] < len(kept) for _, a in held_out
                                                 for t in a])
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == distill.BITS
    assert config["num_hidden_layers"] == len(distill.LAYERS)


def test_evaluation_is_the_drafts_agreement_and_mlx_lms_acceptance(recipe):
    target_dir, tmp, _, _ = recipe
    evaluation = json.loads((tmp / "draft" / "evaluation.json").read_text())
    _, held_out = target_answers.answer_split(tmp / "answers.jsonl")
    draft, _ = load(str(tmp / "draft"))  # mlx_lm's own load, dequantized and wrapped apart
    draft = wrap_if_sub_vocab(dequantize_model(draft), tmp / "draft")
    draft.set_dtype(mx.float32)
    hits = sum(int((draft(mx.array([p + a]))[0, len(p) - 1: -1].argmax(-1)
                    == mx.array(a)).sum().item()) for p, a in held_out)
    tokens = sum(len(a) for _, a in held_out)
    assert evaluation["held_out"]["tokens"] == tokens
    assert evaluation["held_out"]["agreement"] == round(hits / tokens, 4)
    target, _ = load(str(target_dir))
    target.set_dtype(mx.float32)
    served = load_model(str(tmp / "draft"), dtype="float32", dequantize=True).model
    for k, measured in evaluation["held_out"]["by_k"].items():
        proposed = accepted = 0
        for prompt, answer in held_out:
            out, round_start = [], True
            for token, _, from_draft in speculative_generate_step(
                    mx.array(prompt), target, served, num_draft_tokens=int(k),
                    max_tokens=len(answer)):
                proposed += min(int(k), len(answer) - len(out)) if round_start else 0
                round_start, accepted = not from_draft, accepted + from_draft
                out.append(int(token))
            assert out == answer  # speculative greedy decoding writes the target's answer
        assert (measured["proposed"], measured["accepted"]) == (proposed, accepted)


def test_the_card_states_the_evaluation_and_a_second_run_keeps_everything(recipe, capsys):
    _, tmp, argv, _ = recipe
    out = tmp / "draft"
    evaluation = json.loads((out / "evaluation.json").read_text())
    card = (out / "README.md").read_text()
    held = evaluation["held_out"]
    assert (f"- held-out answers: {held['agreement']:.4f} ({held['answers']} answers, "
            f"{held['tokens']} tokens)") in card
    for k, r in held["by_k"].items():
        assert f"| {k} | {r['accepted']} / {r['proposed']} | {r['acceptance']:.4f} |" in card
    assert f"- a smoke run: {SCALE:g} of each phase's steps" in card
    assert f"python -m server.model_files.training draft --out {out}\n" in card
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    main(argv)
    printed = capsys.readouterr().out
    assert printed.count(": kept") == 3  # answers, distill and evaluate
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert (out / VOCAB_FILE).exists()


def test_replay_counts_rounds_as_speculative_decoding_does():
    hit = [True, True, False, True, True, True, True]
    # k=2: p=0 accepts 2 -> p=3; p=3 accepts 2 -> p=6; p=6 proposes 1, accepts 1 -> done
    assert evaluate.replay(hit, 2) == (3, 5, 5)
    # k=4: p=0 accepts 2 (miss at 2) -> p=3; p=3 proposes 4, accepts 4 -> done
    assert evaluate.replay(hit, 4) == (2, 8, 6)
    assert evaluate.replay([False, False], 3) == (2, 3, 0)  # p=0: 2 proposed; p=1: 1


def test_soft_targets_mix_the_written_token_with_the_targets_kept_distribution():
    index = np.array([0, 1, 3, 2, 3], np.uint32)  # draft ids of target ids 0..4; 3 is "other"
    examples = [([0], [1, 4]), ([0], [3])]
    teachers = [([[1, 2, 0], [4, 0]], [np.log([0.5, 0.3, 0.2]).tolist(),
                                         np.log([0.9, 0.1]).tolist()]), None]
    (ids0, p0), (ids1, p1) = distill.soft_targets(examples, teachers, index, 0.25, k=4)
    # Position 0: target ids 1 and 0 are the draft's (0.5 and 0.2, renormalised), 2 is not.
    assert ids0[0].tolist() == [1, 3, 0, 3]
    assert np.allclose(p0[0], [0.25 + 0.75 * 5 / 7, 0, 0.75 * 2 / 7, 0])
    # Position 1: the written token (4) is "other": it keeps the label's weight only.
    assert ids0[1].tolist() == [3, 0, 3, 3] and np.allclose(p0[1], [0.25, 0.75, 0, 0])
    assert ids1.tolist() == [[2, 3, 3, 3]] and p1.tolist() == [[1, 0, 0, 0]]  # no teacher

    x, y, mask, sid, sp = next(distill.batches(examples[:1], index, 1, None, [(ids0, p0)]))
    logits = mx.array(np.random.default_rng(0).normal(size=(1, 2, 4)).astype(np.float32))
    logq = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
    want = np.mean([-(p0[j] * logq[j, ids0[j]]).sum() for j in range(2)])
    assert mask.tolist() == [[1, 1]] and y.tolist() == [[1, 3]]
    assert np.isclose(distill.loss_fn(lambda _: logits, x, y, mask, sid, sp).item(), want,
                      atol=1e-5)


def test_frequent_ids_rank_by_count_and_keep_eos_and_the_schedule_warms_up():
    examples = [([5], [7, 7, 7, 3, 3, 9]), ([1], [3, 8])]
    assert distill.frequent_ids(examples, 3, {2}) == [2, 3, 7]
    schedule = distill.warmup_cosine(1e-3, 100, 10, 5e-5)
    lrs = [schedule(mx.array(step)).item() for step in (0, 5, 10, 100)]
    assert np.allclose(lrs, [0.0, 5e-4, 1e-3, 5e-5], rtol=1e-5)
    # the shipped schedule: 2 epochs, then 2 more each from lr 3e-4, over 3,790 answers
    assert [distill.steps_for(p, 3790) for p in distill.SCHEDULE] == [948, 474, 474]
