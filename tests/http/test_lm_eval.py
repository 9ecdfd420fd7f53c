"""lm-evaluation-harness (`local-completions`, its remote tokenizer) against the server: a
multiple-choice task's loglikelihoods and a generation task's answers, each equal to what the
target computes itself (`mlx_lm`)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm import generate

QUESTIONS = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"], 0),
    ("Water freezes at", [" zero degrees", " a hundred degrees", " noon"], 0),
    ("The largest planet is", [" Mars", " Jupiter", " the Moon"], 1),
    ("Two plus two equals", [" five", " four", " three"], 1),
    ("The sun rises in the", [" west", " north", " east"], 2),
]
TASKS = """
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
MULTIPLE_CHOICE = """output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GENERATION = """output_type: generate_until
doc_to_text: "Question: {{{{question}}}}?\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture()
def tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    for name, body in (("served_mc", MULTIPLE_CHOICE), ("served_gen", GENERATION)):
        (tmp_path / f"{name}.yaml").write_text(TASKS.format(name=name, data=data) +
                                               body.format())
    return tmp_path


def loglikelihood(target, tokenizer, context: str, continuation: str) -> float:
    """As lm-eval splits them: the whole text's tokens, the context's count of them."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    n = len(tokenizer.encode(context, add_special_tokens=False))
    logits = target(mx.array(whole)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(n, len(whole)))


def test_lm_eval_tasks_match_the_target(live_server, loaded_pair, tasks):
    import lm_eval
    from lm_eval.tasks import TaskManager

    target, tokenizer, _ = loaded_pair
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "", "base_url": f"{live_server}/v1/completions",
                    "num_concurrent": 2, "tokenized_requests": True,
                    "tokenizer_backend": "remote"},
        tasks=["served_mc", "served_gen"], task_manager=TaskManager(include_path=str(tasks)),
        batch_size=3, log_samples=True)
    samples = out["samples"]
    assert len(samples["served_mc"]) == len(QUESTIONS)
    for sample in samples["served_mc"]:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"],
                                                 strict=True):
            got = float(resp[0][0])
            want = loglikelihood(target, tokenizer, context, continuation)
            assert got == pytest.approx(want, abs=1e-3)
    for sample in samples["served_gen"]:
        prompt = sample["arguments"][0][0]
        text = generate(target, tokenizer, tokenizer.encode(prompt, add_special_tokens=False),
                        max_tokens=12)
        assert sample["resps"][0][0] == text.split("\n")[0]
