"""The first updates of a distillation run, step by step: loss and gradient norm.

    python -m server.model_files.training.first_steps [--steps 40] [distill's options]

Runs `distill`'s setup, schedule and update (`--layers`, `--lr`, `--warmup`, `--clip-norm`,
`--epochs`...: the schedule is the whole run's) for `--steps` batches and prints, per step, the
loss and the gradient's global norm before clipping, then the largest of each and the mean loss
of the last half: whether a setting spikes at the start, and where it stands after. Saves
nothing.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from server.model_files.training import distill

DEFAULT_STEPS = 40


def first_steps(args: argparse.Namespace, n: int) -> list[tuple[float, float]]:
    """(loss, gradient norm) of the first `n` updates of the run `args` describe."""
    mx.random.seed(args.seed)
    s = distill.setup(args)
    opt = distill.optimizer(args, distill.total_steps(args, s))
    loss_and_grad = nn.value_and_grad(s.draft, distill.loss_fn)
    out = []
    rng = np.random.default_rng(args.seed)
    for batch in distill.batches(s.train, s.index, args.batch, rng, s.soft):
        loss, norm = distill.train_step(s.draft, opt, loss_and_grad, batch, args.clip_norm)
        out.append((loss.item(), norm.item()))
        if len(out) == n:
            break
    return out


def summary(steps: list[tuple[float, float]]) -> str:
    losses, norms = zip(*steps, strict=True)
    late = losses[len(losses) // 2:]
    return (f"largest loss {max(losses):.2f} (step {int(np.argmax(losses)) + 1}), largest "
            f"gradient norm {max(norms):.1f} (step {int(np.argmax(norms)) + 1}); mean loss of "
            f"steps {len(losses) - len(late) + 1}-{len(losses)}: {np.mean(late):.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.model_files.training.first_steps",
                                description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ours, rest = p.parse_known_args(argv)
    args = distill.parse_args(rest)
    steps = first_steps(args, ours.steps)
    print(f"layers {args.layers}, lr {args.lr:g}, warmup {args.warmup}, clip-norm "
          f"{args.clip_norm:g}, {args.epochs:g} epochs' schedule")
    for i, (loss, norm) in enumerate(steps, 1):
        print(f"step {i:3d}  loss {loss:7.2f}  gradient norm {norm:7.1f}")
    print(summary(steps), flush=True)


if __name__ == "__main__":
    main()
