"""Distil a small draft for the default target (SmolLM2-135M-Instruct), in one seeded command.

    python -m server.model_files.training.distill [--target PATH] [--out models/smollm2-draft]
        [--layers 0,1,2] [--steps 170] [--max-minutes M] [--seq-len 256] [--batch 4] [--seed 0]

The draft is a llama at the target's width sharing its tokenizer: the target's token embedding
(tied, frozen: it is most of the draft's size and already right), a copy of some of the target's
layers (`--layers`, by index) and its final norm. Training is teacher-forced distillation: one
forward pass of the target over a window gives its next-token distribution at every position,
and the draft minimises KL(target || draft) there. The text is what this machine has: the Python
standard library's source, and chat exchanges made from it (a function requested by its
signature and docstring, answered with the code; a function's purpose asked, answered with its
docstring), rendered with the target's own chat template.

The saved draft is 4-bit quantized (group size 32) to stay small in the repository; the
embedding is trained on its 4-bit values already, so quantizing it loses nothing.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import time
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from mlx_lm.models import llama

from server.model_files.tokenizer_builder import stdlib_files
from server.model_files.training.corpus import function_pairs, read_source, split_files

DEFAULT_OUT = Path("models/smollm2-draft")
DEFAULT_LAYERS = (0, 1, 2)
DEFAULT_SEQ_LEN = 256
DEFAULT_BATCH = 4
DEFAULT_LR = 3e-4
DEFAULT_SEED = 0
DEFAULT_STEPS = 170  # the shipped draft: 169 of them ran within --max-minutes 35 on 2 CPU cores
DEFAULT_BITS = 4
GROUP_SIZE = 32
VAL_FRACTION = 0.05
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# --- text ----------------------------------------------------------------------------------------

def explain_pairs(source: str) -> list[tuple[str, str]]:
    """(question, docstring) for documented functions and classes: prose answers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return []
    pairs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and 80 <= len(doc) <= 2000 and not node.name.startswith("_"):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                pairs.append((f"What does the Python {kind} `{node.name}` do?", doc.strip()))
    return pairs


def documents(files: list[Path], tokenizer) -> list[str]:
    """Chat exchanges (code and prose answers) and raw source, one string per document."""

    def chat(user: str, assistant: str) -> str:
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return tokenizer.apply_chat_template(messages, tokenize=False)

    docs = []
    for path in files:
        source = read_source(path)
        docs.append(source)
        docs += [chat(q, f"```python\n{code}\n```") for q, code in function_pairs(source)]
        docs += [chat(q, doc) for q, doc in explain_pairs(source)]
    return docs


def token_windows(docs: list[str], tokenizer, seq_len: int, seed: int) -> np.ndarray:
    """Documents in a seeded order, tokenized, joined and cut into windows of seq_len + 1."""
    order = np.random.default_rng(seed).permutation(len(docs))
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for i in order:
        stream += tokenizer.encode(docs[i]) + [eos]
    n = len(stream) // (seq_len + 1)
    return np.asarray(stream[: n * (seq_len + 1)], dtype=np.int32).reshape(n, seq_len + 1)


# --- the draft -----------------------------------------------------------------------------------

def draft_args(target_config: dict, num_layers: int) -> llama.ModelArgs:
    fields = {k: v for k, v in target_config.items()
              if k in llama.ModelArgs.__dataclass_fields__ and k != "quantization"}
    fields.update(num_hidden_layers=num_layers, tie_word_embeddings=True)
    return llama.ModelArgs(**fields)


def build_draft(target: nn.Module, target_config: dict, layer_ids: list[int]) -> nn.Module:
    """The target's embedding (rounded to 4 bits, as it will ship), chosen layers, final norm."""
    draft = llama.Model(draft_args(target_config, len(layer_ids)))
    params = dict(tree_flatten(target.parameters()))
    weights = {"model.embed_tokens.weight": _round_to_bits(params["model.embed_tokens.weight"]),
               "model.norm.weight": params["model.norm.weight"]}
    for new, old in enumerate(layer_ids):
        prefix = f"model.layers.{old}."
        weights.update({f"model.layers.{new}.{k[len(prefix):]}": v
                        for k, v in params.items() if k.startswith(prefix)})
    draft.load_weights(list(weights.items()))
    draft.set_dtype(mx.float32)
    draft.model.embed_tokens.freeze()
    mx.eval(draft.parameters())
    return draft


def _round_to_bits(w: mx.array, bits: int = DEFAULT_BITS) -> mx.array:
    q = mx.quantize(w.astype(mx.float32), group_size=GROUP_SIZE, bits=bits)
    return mx.dequantize(*q, group_size=GROUP_SIZE, bits=bits)


def kl_loss(draft: nn.Module, inputs: mx.array, teacher_logprobs: mx.array) -> mx.array:
    """Mean over positions of KL(target || draft)."""
    logprobs = nn.log_softmax(draft(inputs), axis=-1)
    return (mx.exp(teacher_logprobs) * (teacher_logprobs - logprobs)).sum(-1).mean()


def agreement(draft: nn.Module, target: nn.Module, windows: np.ndarray, batch: int) -> dict:
    """Top-1 agreement with the target (what greedy acceptance is per token) and KL, held out."""
    agree = total = 0
    kl = 0.0
    for i in range(0, len(windows), batch):
        x = mx.array(windows[i : i + batch, :-1])
        t = nn.log_softmax(target(x), axis=-1)
        d = nn.log_softmax(draft(x), axis=-1)
        agree += int((t.argmax(-1) == d.argmax(-1)).sum().item())
        kl += float((mx.exp(t) * (t - d)).sum(-1).sum().item())
        total += x.size
    return {"top1_agreement": agree / total, "kl": kl / total, "tokens": total}


# --- saving --------------------------------------------------------------------------------------

def save_draft(draft: nn.Module, target_dir: Path, out: Path, *, bits: int, card: dict) -> None:
    model = llama.Model(draft.args)
    model.load_weights(list(tree_flatten(draft.parameters())))
    nn.quantize(model, group_size=GROUP_SIZE, bits=bits)
    model.set_dtype(mx.float16)  # scales, biases and norms: half the bytes, loaded as float32
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    config = json.loads((target_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config.update(num_hidden_layers=draft.args.num_hidden_layers, tie_word_embeddings=True,
                  quantization={"group_size": GROUP_SIZE, "bits": bits})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copyfile(target_dir / name, out / name)
    (out / "training.json").write_text(json.dumps(card, indent=2))


# --- the run -------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server.model_files.training.distill",
                                description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None,
                   help="Target mlx_lm folder or .gguf (default: the default target, fetched).")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--layers", default=",".join(map(str, DEFAULT_LAYERS)),
                   help="Target layers the draft starts from, by index (e.g. 0,1,2,29).")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="Stop training after this many minutes (default: run every step).")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--bits", type=int, default=DEFAULT_BITS, choices=[4, 8])
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--val-windows", type=int, default=16)
    p.add_argument("--save-every", type=int, default=10)
    return p.parse_args(argv)


def target_folder(ref: str | None) -> Path:
    if ref is None:
        from server.model_files.default_model import ensure_default_target
        ref = ensure_default_target()
    from server.model_files.gguf import resolve_model_path
    return Path(resolve_model_path(ref))


def main(argv=None) -> None:
    from tqdm import tqdm

    args = parse_args(argv)
    mx.random.seed(args.seed)
    target_dir = target_folder(args.target)
    target, tokenizer, target_config = mlx_load(str(target_dir), return_config=True)
    target.set_dtype(mx.float32)
    target.freeze()
    layer_ids = [int(i) for i in args.layers.split(",")]

    split = split_files(stdlib_files(), VAL_FRACTION)
    train = token_windows(documents(split.train, tokenizer), tokenizer, args.seq_len, args.seed)
    val = token_windows(documents(split.val, tokenizer), tokenizer, args.seq_len, args.seed)
    val = val[: args.val_windows]
    print(f"data: {len(train)} train windows, {len(val)} held-out windows of {args.seq_len}",
          flush=True)

    draft = build_draft(target, target_config, layer_ids)
    before = agreement(draft, target, val, args.batch)
    print(f"before training: {before}", flush=True)

    warmup = max(1, min(10, args.steps // 10))
    schedule = optim.join_schedules(
        [optim.linear_schedule(args.lr / 10, args.lr, warmup),
         optim.cosine_decay(args.lr, args.steps - warmup, args.lr / 10)], [warmup])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
    loss_and_grad = nn.value_and_grad(draft, kl_loss)
    order = np.random.default_rng(args.seed).permutation(len(train))
    card = {"target": str(target_dir), "layers_from_target": layer_ids, "seed": args.seed,
            "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr, "bits": args.bits,
            "train_windows_available": int(len(train)), "before": before, "losses": []}
    start, losses, step = time.time(), [], 0
    bar = tqdm(range(args.steps), desc="distill", unit="step")
    for step in bar:
        idx = order[(step * args.batch) % len(order):][: args.batch]
        x = mx.array(train[idx, :-1])
        teacher = mx.stop_gradient(nn.log_softmax(target(x), axis=-1))
        loss, grads = loss_and_grad(draft, x, teacher)
        opt.update(draft, grads)
        mx.eval(loss, draft.parameters(), opt.state)
        losses.append(loss.item())
        bar.set_postfix(kl=f"{np.mean(losses[-20:]):.3f}")
        if (step + 1) % args.save_every == 0:
            card["losses"].append([step + 1, float(np.mean(losses[-args.save_every:]))])
            save_draft(draft, target_dir, args.out, bits=args.bits, card=card)
        if args.max_minutes is not None and time.time() - start > args.max_minutes * 60:
            break
    bar.close()
    card.update(steps=step + 1, train_tokens=(step + 1) * args.batch * args.seq_len,
                train_minutes=round((time.time() - start) / 60, 1))
    card["after"] = agreement(draft, target, val, args.batch)
    print(f"after training: {card['after']}", flush=True)
    save_draft(draft, target_dir, args.out, bits=args.bits, card=card)
    print(f"saved {args.out}", flush=True)


if __name__ == "__main__":
    main()
