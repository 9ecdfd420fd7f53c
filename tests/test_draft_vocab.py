"""Drafts that predict a subset of the target's vocabulary (server.engine.draft_vocab), and the
training path that makes them (target_answers -> distill), on the tiny pair."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models import llama

from server.engine.draft_vocab import (
    VOCAB_FILE,
    SubVocabModel,
    draft_index,
    read_vocab,
    write_vocab,
)
from server.engine.events import TokenEvent
from server.engine.generation import generate_events
from server.engine.model_kit import ModelKit, ModelLoadError, load_model
from server.engine.params import GenerationParams, SamplingParams, SpeculationParams
from server.model_files.training import distill, distill_eval, target_answers
from server.model_files.training.chat_requests import requests

KEPT = [*range(0, 120), *range(200, 330)]  # 250 of the tiny vocabulary's 512 ids


def sliced_draft(draft_dir, out, kept):
    """The tiny draft with only the `kept` rows of its embedding and head (+ a zero row)."""
    model, _, config = load(str(draft_dir), return_config=True)
    params = dict(tree_flatten(model.parameters()))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = params[name]
        params[name] = mx.concatenate([w[mx.array(kept)], mx.zeros((1, w.shape[1]), w.dtype)])
    config = {**config, "vocab_size": len(kept) + 1}
    small = llama.Model(llama.ModelArgs.from_dict(config))
    small.load_weights(list(params.items()))
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(small.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    for f in draft_dir.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    write_vocab(out, kept, 512)
    return model


def test_logits_over_the_kept_ids_are_the_full_drafts_and_the_rest_is_blocked(tiny_pair,
                                                                               tmp_path):
    full = sliced_draft(tiny_pair[1], tmp_path / "small", KEPT)
    wrapped = load_model(str(tmp_path / "small")).model
    assert isinstance(wrapped, SubVocabModel)
    x = mx.array([KEPT[5::7][:20]])  # inputs the small draft knows
    got, expected = wrapped(x), full(x)
    assert got.shape == expected.shape
    np.testing.assert_allclose(np.array(got[..., mx.array(KEPT)]),
                               np.array(expected[..., mx.array(KEPT)]), rtol=1e-5, atol=1e-5)
    blocked = np.setdiff1d(np.arange(512), KEPT)
    assert np.all(np.isneginf(np.array(got[..., mx.array(blocked)])))

    assert wrapped.vocab_size == 512
    assert wrapped.inner.args.vocab_size == len(KEPT) + 1  # the rows of its own embedding


def test_serving_with_a_sub_vocab_draft_keeps_greedy_output_and_drafts_only_kept_ids(
        tiny_pair, tmp_path):
    sliced_draft(tiny_pair[1], tmp_path / "small", KEPT)
    kit = ModelKit(load_model(str(tiny_pair[0])))
    kit.load_draft(str(tmp_path / "small"))
    prompt = tuple(kit.target.tokenizer.encode("def hello(world):\n    return"))
    plain = GenerationParams(prompt, 40, sampling=SamplingParams())
    drafted = GenerationParams(prompt, 40, speculation=SpeculationParams(num_draft_tokens=4))
    alone = [e for e in generate_events(kit, plain) if isinstance(e, TokenEvent)]
    events = [e for e in generate_events(kit, drafted) if isinstance(e, TokenEvent)]
    assert [e.token for e in events] == [e.token for e in alone]
    from_draft = [e.token for e in events if e.from_draft]
    assert from_draft and set(from_draft) <= set(KEPT)


def test_a_bad_vocab_file_is_a_load_error(tiny_pair, tmp_path):
    sliced_draft(tiny_pair[1], tmp_path / "small", KEPT)
    (tmp_path / "small" / VOCAB_FILE).write_text(json.dumps(
        {"target_vocab_size": 512, "target_ids": [1, 2, 600]}))
    with pytest.raises(ModelLoadError, match="target_ids"):
        load_model(str(tmp_path / "small"))


def test_frequent_ids_rank_by_count_and_keep_eos():
    examples = [([5], [7, 7, 7, 3, 3, 9]), ([1], [3, 8])]
    assert distill.frequent_ids(examples, 3, {2}) == [2, 3, 7]


def test_target_answers_then_distillation_make_a_draft_the_server_uses(tiny_pair, tmp_path,
                                                                       monkeypatch):
    answers = tmp_path / "answers.jsonl"
    n = target_answers.generate(tiny_pair[0], answers, minutes=5, max_tokens=24, batch=8,
                                seed=0, limit=80)
    assert n == 80 == target_answers.done_count(answers)
    target, tokenizer = load(str(tiny_pair[0]))
    prompt, answer = target_answers.read(answers)[3]
    expected = [int(t) for t, _ in _greedy(target, prompt, len(answer))]
    assert answer == expected  # the file holds the target's own greedy answers
    _, _, (top_ids, top_logprobs) = target_answers.read_with_teacher(answers)[3]
    assert [ids[0] for ids in top_ids] == answer  # ... and its distribution, most likely first
    logits = target(mx.array([prompt + answer]))[0, len(prompt) - 1: -1]
    reference = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for j, (ids, lps) in enumerate(zip(top_ids, top_logprobs, strict=True)):
        assert len(ids) <= target_answers.TOP_K and np.allclose(reference[j, ids], lps, atol=2e-3)

    # The tiny random target is near-uniform (its top tokens within 0.5 nats), so its
    # distribution teaches no agreement: train on what it wrote (--hard-weight 1).
    out = tmp_path / "draft"
    clip, norms = distill.optim.clip_grad_norm, []
    monkeypatch.setattr(distill.optim, "clip_grad_norm",
                        lambda g, max_norm: norms.append(max_norm) or clip(g, max_norm))
    distill.main(["--answers", str(answers), "--target", str(tiny_pair[0]),
                          "--out", str(out), "--layers", "0,1", "--vocab", "60",
                          "--epochs", "3", "--batch", "4", "--lr", "3e-3", "--warmup", "2",
                          "--clip-norm", "0.5", "--hard-weight", "1"])
    card = json.loads((out / "training.json").read_text())
    assert norms == [0.5] * card["steps"]  # --clip-norm 0.5: every step's gradient clipped
    assert (card["warmup"], card["clip_norm"]) == (2, 0.5)
    assert card["vocab"] == len(json.loads((out / VOCAB_FILE).read_text())["target_ids"]) == 60
    assert card["after"] > card["before"]
    kit = ModelKit(load_model(str(tiny_pair[0])))
    kit.load_draft(str(out))
    p = GenerationParams(tuple(prompt), 24, speculation=SpeculationParams(num_draft_tokens=3))
    tokens = [e.token for e in generate_events(kit, p) if isinstance(e, TokenEvent)]
    text = [t for t in answer if t not in tokenizer.eos_token_ids]
    assert tokens[: len(text)] == text[: len(tokens)]

    # Trained further from the saved draft (--init-from): its weights, tokens and card go on.
    warm, kept, _ = distill.warm_start(out)
    quantized, _ = load(str(out))  # mlx_lm's own load of the saved 8-bit draft
    ids = mx.array([list(range(0, 60, 3))])
    assert np.allclose(warm(ids), quantized(ids).astype(mx.float32), rtol=1e-2, atol=5e-2)
    assert kept == json.loads((out / VOCAB_FILE).read_text())["target_ids"]
    more = tmp_path / "draft-more"
    distill.main(["--answers", str(answers), "--target", str(tiny_pair[0]), "--out", str(more),
                  "--init-from", str(out), "--epochs", "1", "--batch", "4", "--lr", "1e-3",
                  "--warmup", "0", "--clip-norm", "0", "--hard-weight", "1", "--seed", "1"])
    assert (more / VOCAB_FILE).read_text() == (out / VOCAB_FILE).read_text()
    card_more = json.loads((more / "training.json").read_text())
    (run,) = card_more["continued"]
    assert run["steps"] == distill.held_out_start(list(range(80))) // 4
    assert card_more["steps"] == card["steps"] + run["steps"]
    assert card_more["losses"][: len(card["losses"])] == card["losses"]
    assert card_more["before"] == card["before"]  # the first run's initialisation
    # it starts from the saved draft (8-bit): its agreement is the warm-started model's
    target_vocab = json.loads((out / VOCAB_FILE).read_text())["target_vocab_size"]
    held_out = distill.answer_split(answers)[1]
    assert run["agreement_before"] == distill.agreement(
        warm, held_out, draft_index(kept, target_vocab), len(kept))

    distill_eval.main(["--target", str(tiny_pair[0]), "--draft", str(out), "--k", "1,3",
                       "--max-tokens", "16", "--answers", str(answers),
                       "--eval-prose", str(tmp_path / "none.jsonl")])
    evaluation = json.loads((out / "evaluation.json").read_text())
    held_out = evaluation["agreement"]["held-out code"]
    assert held_out["answers"] == 80 - distill.held_out_start(list(range(80)))
    assert "prose, unseen topics" not in evaluation["agreement"]  # no such file
    # the tiny tokenizer's requests name no functions: none of the held-out is seen
    assert evaluation["agreement"]["held-out code, functions no training request names"] == (
        held_out)
    seen = evaluation["agreement"]["training answers (seen)"]
    train_split = distill.answer_split(answers)[0]
    picked = sorted(np.random.default_rng(0).choice(len(train_split), len(train_split), False))
    assert seen == distill_eval.answer_agreement(distill_eval.load_draft(out),
                                                 [train_split[i] for i in picked])
    runs = [r for row in evaluation["prompts"].values() for r in row["by_k"].values()]
    assert runs and all(r["identical_to_target"] for r in runs)
    assert all(0 <= r["accepted"] <= r["proposed"] for r in runs)
    card = (out / "README.md").read_text()
    assert "predicts only the 60 tokens" in card and f"trained: {card_after(out)}" in card
    assert f"- held-out code: {held_out['agreement']:.3f} ({held_out['answers']} answers" in card
    distill_eval.write_card(more, evaluation)  # the continued draft's card names its runs
    card = (more / "README.md").read_text()
    # the first run's command, its options unlike distill's defaults
    assert (f"    python -m server.model_files.training.distill --out {more} --layers 0,1 --vocab"
            " 60 --epochs 3 --batch 4 --lr 0.003 --warmup 2 --clip-norm 0.5 --hard-weight 1\n"
            ) in card
    assert (f"--init-from {more} --out {more} --epochs 1 --lr 0.001 --warmup 0 --clip-norm 0 "
            "--seed 1\n") in card
    assert (f"- batch 4, {card_more['steps'] - run['steps']} steps from lr 0.003 (cosine after 2"
            " warmup steps, gradient clipped to norm 0.5), seed"
            f" 0; then {run['steps']} more steps from lr 0.001 (cosine again), seed 1: agreement"
            f" {run['agreement_before']:.3f} -> {run['agreement_after']:.3f}; in all"
            f" {card_more['steps']} steps") in card


class _Echo:  # a draft that predicts that the last token repeats
    def __call__(self, x):
        return mx.eye(16)[x]


def test_answer_agreement_counts_the_positions_where_the_draft_predicts_the_answer():
    examples = [([1, 2], [2, 2, 5]), ([3], [4, 4])]  # hits: 2 after 2, 2 after 2; 4 after 4
    assert distill_eval.answer_agreement(_Echo(), examples) == {
        "answers": 2, "tokens": 5, "agreement": round(3 / 5, 4)}


def test_unseen_held_out_drops_the_requests_naming_what_a_training_request_names():
    texts = {1: "Write a Python function `f(x, y)` that adds.",
             2: "Write a Python module with two functions: `h(a)` that ...; `g(b)` that ...",
             3: "What does the Python function `f` do?",  # f: asked for in training
             4: "Write a Python function `g(s)` that splits.",  # g: in training's module
             5: "Write a Python function `k(n)` that counts.",
             6: "Write a short story about a snow day."}  # names nothing
    held_out = [([3], [7]), ([4], [8]), ([5], [9]), ([6], [10])]
    unseen = distill_eval.unseen_held_out(held_out, [([1], [0]), ([2], [0])],
                                          lambda prompt: texts[prompt[0]])
    assert unseen == [([5], [9]), ([6], [10])]


def test_family_agreement_measures_the_unseen_held_out_answers_apart(tmp_path):
    answers = tmp_path / "answers.jsonl"  # 40 lines: 38 training, 2 held out
    prompts = [[i // 16, i % 16] for i in range(40)]
    answers.write_text("".join(json.dumps({"prompt": p, "answer": [p[1], p[1], 3]}) + "\n"
                               for p in prompts))
    texts = {**{i: f"Write `f{i}(x)`." for i in range(38)}, 38: "What does `f3` do?",
             39: "Write `g(s)`."}

    def decode(prompt):
        return texts.get(prompt[0] * 16 + prompt[1], "What does `g` do?")

    families = distill_eval.family_agreement(_Echo(), answers, tmp_path / "none.jsonl",
                                             decode=decode)
    # line 39 alone is unseen: the echo draft hits its answer's first two tokens, not its 3rd
    assert families["held-out code, functions no training request names"] == {
        "answers": 1, "tokens": 3, "agreement": round(2 / 3, 4)}
    assert families["held-out code"]["answers"] == 2
    seen_g = [([15, 15], [1])]  # an extra answer whose request names g: nothing is unseen
    assert "held-out code, functions no training request names" not in (
        distill_eval.family_agreement(_Echo(), answers, tmp_path / "none.jsonl", decode=decode,
                                      extra=seen_g))


def test_trained_extra_is_the_extra_answers_the_drafts_largest_such_run_read(tmp_path):
    extra = tmp_path / "extra.jsonl"
    extra.write_text("".join(json.dumps({"prompt": [i], "answer": [i, i] if i != 1 else []})
                             + "\n" for i in range(6)))
    runs = [{"steps": 3}, {"extra_answers": 2, "extra_answers_file": str(extra)},
            {"extra_answers": 4, "extra_answers_file": str(extra)}]
    (tmp_path / "training.json").write_text(json.dumps({"continued": runs}))
    # the empty answer (line 1) is not one distill read
    assert distill_eval.trained_extra(tmp_path) == [([0], [0, 0]), ([2], [2, 2]),
                                                    ([3], [3, 3]), ([4], [4, 4])]
    (tmp_path / "training.json").write_text(json.dumps({"continued": runs[:1]}))
    assert distill_eval.trained_extra(tmp_path) == []


def test_agreement_by_confidence_groups_positions_by_the_targets_top_probability():
    def teacher(*top_p):  # only the top-1 log-probability matters here
        return [[0]] * len(top_p), [[math.log(p)] for p in top_p]

    lines = [([1, 2], [2, 2, 5], teacher(0.95, 0.6, 0.3)),  # hit, hit, miss
             ([3], [4, 4], teacher(0.8, 0.95)),  # miss, hit
             ([3], [3, 3], None)]  # no stored distribution: skipped
    assert distill_eval.agreement_by_confidence(_Echo(), lines) == [
        {"target_p": "0.0-0.5", "tokens": 1, "share": 0.2, "agreement": 0.0},
        {"target_p": "0.5-0.7", "tokens": 1, "share": 0.2, "agreement": 1.0},
        {"target_p": "0.7-0.9", "tokens": 1, "share": 0.2, "agreement": 0.0},
        {"target_p": "0.9-1.0", "tokens": 2, "share": 0.4, "agreement": 1.0}]


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

    batch = next(distill.batches(examples[:1], index, 1, None, [(ids0, p0)]))
    x, y, mask, sid, sp = batch
    logits = mx.array(np.random.default_rng(0).normal(size=(1, 2, 4)).astype(np.float32))

    class Fixed:
        def __call__(self, _):
            return logits
    logq = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
    want = np.mean([-(p0[j] * logq[j, ids0[j]]).sum() for j in range(2)])
    assert mask.tolist() == [[1, 1]] and y.tolist() == [[1, 3]]
    assert np.isclose(distill.loss_fn(Fixed(), x, y, mask, sid, sp).item(), want, atol=1e-5)


def card_after(out) -> str:
    return f"{json.loads((out / 'training.json').read_text())['after']:.3f}"


def _greedy(model, prompt, n):
    from mlx_lm.generate import generate_step

    return generate_step(mx.array(prompt), model, max_tokens=n)


def test_distill_warms_up_then_decays_and_its_options_parse():
    from server.model_files.training.train import warmup_cosine

    schedule = warmup_cosine(1e-3, 100, 10, 5e-5)
    lrs = [schedule(mx.array(step)).item() for step in (0, 5, 10, 100)]
    assert np.allclose(lrs, [0.0, 5e-4, 1e-3, 5e-5], rtol=1e-5)
    plain, cosine = warmup_cosine(1e-3, 100, 0, 5e-5), mx.array(0)  # no warmup: cosine alone
    assert plain(cosine).item() == pytest.approx(1e-3)
    assert plain(mx.array(100)).item() == pytest.approx(5e-5)

    args = distill.parse_args(["--warmup", "50", "--clip-norm", "1.5"])
    assert (args.warmup, args.clip_norm) == (50, 1.5)
    assert (distill.parse_args([]).warmup, distill.parse_args([]).clip_norm) == (
        distill.DEFAULT_WARMUP, distill.DEFAULT_CLIP_NORM)


def test_first_steps_reports_distills_own_first_updates(tiny_pair, tmp_path):
    import mlx.nn as nn

    from server.model_files.training import first_steps

    answers = tmp_path / "answers.jsonl"
    target_answers.generate(tiny_pair[0], answers, minutes=5, max_tokens=16, batch=8, seed=0,
                            limit=24)
    opts = ["--answers", str(answers), "--target", str(tiny_pair[0]), "--layers", "0,1",
            "--vocab", "60", "--batch", "4", "--lr", "3e-3", "--hard-weight", "1"]
    steps = first_steps.first_steps(distill.parse_args(opts), 3)
    # step 1, computed apart: the loss and the gradient's norm on the run's first batch
    s = distill.setup(distill.parse_args(opts))
    batch = next(distill.batches(s.train, s.index, 4, np.random.default_rng(0), s.soft))
    loss, grads = nn.value_and_grad(s.draft, distill.loss_fn)(s.draft, *batch)
    norm = np.sqrt(sum(float((g * g).sum()) for _, g in tree_flatten(grads)))
    assert len(steps) == 3 and steps[0] == pytest.approx((loss.item(), norm), rel=1e-4)
    assert steps[1] != steps[0]
    assert first_steps.summary([(5.0, 2.0), (9.0, 1.0), (4.0, 3.0), (2.0, 1.0)]) == (
        "largest loss 9.00 (step 2), largest gradient norm 3.0 (step 3); mean loss of steps "
        "3-4: 3.00")


def test_a_card_from_before_epochs_warmup_and_clipping_were_recorded_rebuilds_as_it_ran():
    card = {"answers": 3990, "batch": 8, "steps": 1896, "layers_from_target": [0, 1, 2],
            "vocab": 8192, "lr": 0.001, "seed": 0, "hard_weight": 0.5, "bits": 8,
            "continued": [{"epochs": 1.0, "steps": 474, "lr": 0.0003, "seed": 3}]}
    # 1,422 first steps over 474 an epoch (3,790 training answers, batch 8): 3 epochs
    assert distill_eval._distill_command(card, distill.DEFAULT_OUT) == (
        "python -m server.model_files.training.distill --layers 0,1,2 --epochs 3 --warmup 0 "
        "--clip-norm 0")
    assert distill_eval._changed_flags(card["continued"][0], ("warmup", "clip-norm")) == (
        " --warmup 0 --clip-norm 0")


def test_extra_answers_go_on_past_the_first_files_requests_and_train_beside_its_split(
        tiny_pair, tmp_path):
    answers, extra = tmp_path / "answers.jsonl", tmp_path / "extra.jsonl"
    target_answers.generate(tiny_pair[0], answers, minutes=5, max_tokens=8, batch=8, seed=0,
                            limit=24)
    assert target_answers.generate(tiny_pair[0], extra, minutes=5, max_tokens=8, batch=8,
                                   seed=0, limit=8, start=24) == 8
    _, tokenizer = load(str(tiny_pair[0]))
    expected = [tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                              add_generation_prompt=True)
                for t in requests(0)[24:32]]
    assert [prompt for prompt, _ in target_answers.read(extra)] == expected
    out = tmp_path / "draft"
    distill.main(["--answers", str(answers), "--target", str(tiny_pair[0]), "--out", str(out),
                  "--layers", "0", "--vocab", "40", "--steps", "5", "--batch", "4",
                  "--hard-weight", "1", "--extra-answers", str(extra)])
    card = json.loads((out / "training.json").read_text())
    held_out = distill.answer_split(answers)[1]  # the held-out split is the first file's alone
    assert (card["answers"], card["extra_answers"]) == (24, 8)
    per_epoch = -(-(distill.held_out_start(range(24)) + 8) // 4)  # 30 answers, batch 4: 8
    assert (card["steps"], card["fixed_steps"], card["epochs"]) == (5, 5, 5 / per_epoch)
    assert card["soft_targets"] == distill.held_out_start(range(24)) + 8  # both files'
    kept, _ = read_vocab(out)
    index = draft_index(kept, card["target_vocab_size"])
    assert card["held_out_coverage"] == np.mean([index[t] < len(kept) for _, a in held_out
                                                 for t in a])
    run = {"extra_answers": 8, "extra_answers_file": str(extra), "epochs": 0.625,
           "fixed_steps": 5, "lr": 3e-4, "warmup": 50, "clip_norm": 1.0, "seed": 3}
    assert distill_eval._continued_commands(run, 24, Path("d")) == [
        f"    python -m server.model_files.training.target_answers --start 24 --limit 8 --out "
        f"{extra} --minutes 120",
        "    python -m server.model_files.training.distill --init-from d --out d --steps 5 "
        f"--lr 0.0003 --seed 3 --extra-answers {extra}"]
    assert distill_eval._extra_text(run) == (
        " over the training answers and 8 more (the target's answers to the requests after "
        "those, all code)")
    assert distill_eval._extra_text({"steps": 5}) == ""
    # A later run over the same file, grown to 20 answers: its command appends the 12 new ones.
    later = {**run, "extra_answers": 20, "fixed_steps": 7, "seed": 4}
    assert distill_eval._rebuild_continued({"answers": 24, "continued": [run, later]},
                                           Path("d"))[2:] == [
        f"    python -m server.model_files.training.target_answers --start 24 --limit 12 --out "
        f"{extra} --minutes 120",
        "    python -m server.model_files.training.distill --init-from d --out d --steps 7 "
        f"--lr 0.0003 --seed 4 --extra-answers {extra}"]
