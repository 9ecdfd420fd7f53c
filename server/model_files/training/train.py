"""Train one `mlx_lm` model on the stdlib corpus with MLX and save it in `mlx_lm` format.

Everything is seeded (model init, document order, batch order), so one config on one machine
rebuilds the same weights. The train step is `mx.compile`d with the model, optimizer and random
state as implicit inputs/outputs: on CPU that fuses the elementwise work between matmuls and is
what makes a 6M-parameter model trainable in minutes.
"""

from __future__ import annotations

import importlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from server.model_files.tokenizer_builder import save_tokenizer


@dataclass(frozen=True)
class TrainConfig:
    """One model's optimisation settings (the `train:` block of a model in the YAML)."""

    steps: int
    batch_size: int
    learning_rate: float
    min_learning_rate: float
    warmup_steps: int
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 8  # validation batches per intermediate evaluation

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown train settings: {sorted(unknown)}")
        return cls(**d)


def model_config(arch: dict, vocab_size: int, eos_token_id: int, bos_token_id: int) -> dict:
    """config.json: the architecture from the YAML plus what `mlx_lm.load` and servers need.

    eos is <|im_end|> so generation stops at the end of an assistant turn.
    """
    return {
        **arch,
        "vocab_size": vocab_size,
        "eos_token_id": eos_token_id,
        "bos_token_id": bos_token_id,
        "torch_dtype": "float16",
    }


def build_model(config: dict, seed: int) -> nn.Module:
    """A freshly initialised `mlx_lm.models.<model_type>.Model`, seeded."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def warmup_cosine(peak: float, steps: int, warmup: int, end: float):
    """Linear warmup from 0 over `warmup` steps to `peak`, then cosine decay to `end` at the
    last step; without warmup, the cosine decay alone."""
    decay = optim.cosine_decay(peak, max(steps - warmup, 1), end=end)
    if warmup <= 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(0.0, peak, warmup), decay], [warmup])


def lr_schedule(tc: TrainConfig):
    """`warmup_cosine` with the config's peak, steps, warmup (at least one step) and end."""
    return warmup_cosine(tc.learning_rate, tc.steps, max(tc.warmup_steps, 1),
                         tc.min_learning_rate)


def windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping (seq_len + 1)-token windows: inputs and their shifted targets."""
    n = (len(tokens) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return tokens[idx]


def batches(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless batches; each epoch visits every window once, in a seeded random order."""
    data = windows(tokens, seq_len)
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(data))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield data[order[i : i + batch_size]]


def loss_fn(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def make_train_step(model: nn.Module, optimizer: optim.Optimizer, grad_clip: float):
    """The compiled step: forward, backward, clip, AdamW update, all in one graph."""
    state = [model.state, optimizer.state, mx.random.state]
    loss_and_grad = nn.value_and_grad(model, loss_fn)

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x: mx.array, y: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, x, y)
        if grad_clip > 0:
            grads, _ = optim.clip_grad_norm(grads, grad_clip)
        optimizer.update(model, grads)
        return loss

    return step, state


def validation_loss(
    model: nn.Module,
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int = 16,
    max_batches: int | None = None,
) -> float:
    """Mean cross-entropy in nats/token over the validation stream's windows, in order."""
    data = windows(tokens, seq_len)
    if max_batches is not None:
        data = data[: max_batches * batch_size]
    total, count = 0.0, 0
    for i in range(0, len(data), batch_size):
        chunk = mx.array(data[i : i + batch_size].astype(np.int32))
        logits = model(chunk[:, :-1])
        loss = nn.losses.cross_entropy(logits, chunk[:, 1:], reduction="sum")
        total += loss.item()
        count += chunk[:, 1:].size
    return total / max(count, 1)


@dataclass
class TrainResult:
    model: nn.Module
    parameters: int
    steps: int
    tokens_seen: int
    train_seconds: float
    final_train_loss: float
    history: list[dict]


def train(
    model: nn.Module,
    tc: TrainConfig,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    seq_len: int,
    seed: int,
    desc: str = "train",
) -> TrainResult:
    """AdamW with warmup + cosine for `tc.steps` steps; a tqdm bar shows loss and tokens/s."""
    optimizer = optim.AdamW(learning_rate=lr_schedule(tc), weight_decay=tc.weight_decay)
    step, state = make_train_step(model, optimizer, tc.grad_clip)
    data = batches(train_tokens, seq_len, tc.batch_size, seed)
    tokens_per_step = tc.batch_size * seq_len
    history: list[dict] = []
    smoothed = math.nan
    start = time.perf_counter()
    bar = tqdm(range(1, tc.steps + 1), desc=desc, mininterval=2.0, dynamic_ncols=True)
    for i in bar:
        batch = mx.array(next(data).astype(np.int32))
        loss = step(batch[:, :-1], batch[:, 1:])
        mx.eval(state, loss)
        value = loss.item()
        smoothed = value if math.isnan(smoothed) else 0.95 * smoothed + 0.05 * value
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{smoothed:.3f}", tok_s=f"{i * tokens_per_step / elapsed:.0f}")
        if tc.eval_every and i % tc.eval_every == 0 and i < tc.steps:
            val = validation_loss(model, val_tokens, seq_len, max_batches=tc.eval_batches)
            history.append({"step": i, "train_loss": smoothed, "val_loss": val})
            bar.write(f"[{desc}] step {i}: train {smoothed:.3f}  val {val:.3f} nats/token")
    seconds = time.perf_counter() - start
    return TrainResult(
        model=model,
        parameters=count_parameters(model),
        steps=tc.steps,
        tokens_seen=tc.steps * tokens_per_step,
        train_seconds=seconds,
        final_train_loss=smoothed,
        history=history,
    )


def save_model(model: nn.Module, config: dict, tokenizer, path: Path) -> Path:
    """`mlx_lm` layout: config.json, float16 model.safetensors, tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(tokenizer, path)
    return path
