"""`python -m server.bench.decode_profile [--model DIR] [--steps 40] [--reps 3]`: where one
decoding step of the target alone goes on this machine, and what `mx.compile` changes.

In process, greedy, one row, after a `--context`-token prompt. It prints:
- **weights**: the bytes one step reads (every parameter but the embedding rows it does not
  look up) and the time of the step's matrix-vector products alone, over the model's own
  weights: the floor a step cannot go below without reading fewer bytes;
- **ops per layer**: the primitives in one layer's decode graph (`mx.export_to_dot`), with and
  without the fused projections (`server.engine.fused`);
- **one step**, median ms and tok/s of each way to run it, taking turns rep by rep: `mlx_lm`'s
  model as it loads (what the engine runs by default), with fused projections
  (`engine.fuse_projections`), with each MLP `mx.compile`d, the whole step `mx.compile`d over a
  fixed-size cache (`StaticCache`, so that every step has the same shapes), and `mlx_lm`'s
  `generate_step`, which overlaps building the next step's graph with computing this one
  (`mx.async_eval`); with the ratio to the first and whether each gave its tokens;
- **syncs per round**: the engine's `mx.eval` calls and draft tokens proposed per decoding
  round, plain, by prompt lookup and by the draft model at k = 4 (a `.item()` or `.tolist()`
  after an `mx.eval` reads an evaluated array and waits for nothing);
- **fewer syncs**: a draft-model round (`--draft-model`, k = 4) with its draft tokens read
  back before the target verifies them, as the engine does, against the same round verifying
  them straight from the arrays, one sync instead of two (`DraftRound`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from server.bench.tokens import random_tokens
from server.engine.model_kit import ModelKit, load_model
from server.engine.params import GenerationParams, SpeculationParams
from server.engine.policy import SpeculationPolicy
from server.engine.scheduler import Scheduler, SchedulerConfig
from server.engine.sequence import Phase
from server.model_files.default_model import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR

WARMUP = 3


class StaticCache:
    """A KV cache of fixed capacity whose offset is an array: a decode step's graph has the same
    shapes at every position, so `mx.compile` traces it once. Attention reads the whole buffer;
    the mask hides the positions not yet written."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = self.offset[None]
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, **_) -> mx.array:
        queries = self.offset + mx.arange(n)
        return mx.arange(self.keys.shape[2])[None] <= queries[:, None]


class CompiledMLP(nn.Module):
    """Stands in for a layer's MLP: the same module, its call `mx.compile`d (elementwise ops
    fused into one kernel)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.inner = mlp
        self._call = mx.compile(mlp.__call__)

    def __call__(self, x: mx.array) -> mx.array:
        return self._call(x)


# ---------------------------------------------------------------- step runners


def plain_steps(model: nn.Module, prompt: mx.array, steps: int) -> tuple[list[int], float]:
    """Greedy decode `steps` tokens after `prompt`, one `mx.eval` per step; (tokens, s/step)
    over the steps after the warm-up."""
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)
    token = mx.argmax(logits[:, -1:], axis=-1)
    return _timed(lambda t: mx.argmax(model(t, cache=cache)[:, -1:], axis=-1), token, steps)


def _timed(step: Callable[[mx.array], mx.array], token: mx.array,
           steps: int) -> tuple[list[int], float]:
    tokens, start = [], 0.0
    for i in range(WARMUP + steps):
        if i == WARMUP:
            start = time.perf_counter()
        token = step(token)
        mx.eval(token)
        tokens.append(token.item())
    return tokens, (time.perf_counter() - start) / steps


def compiled_mlp_steps(model: nn.Module, prompt: mx.array, steps: int):
    layers = model.layers
    originals = [layer.mlp for layer in layers]
    for layer in layers:
        layer.mlp = CompiledMLP(layer.mlp)
    try:
        return plain_steps(model, prompt, steps)
    finally:
        for layer, mlp in zip(layers, originals, strict=True):
            layer.mlp = mlp


def static_compiled_steps(model: nn.Module, prompt: mx.array, steps: int):
    """The whole step (embedding to argmax) as one `mx.compile`d function of the token and the
    cache buffers, which it returns updated. The caller drops its references before each
    evaluation, so the buffers are updated in place rather than copied."""
    capacity = prompt.shape[1] + WARMUP + steps
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)
    keys, values = _static_buffers(cache, capacity)

    @mx.compile
    def step(token, keys, values, offset):
        static = [StaticCache(k, v, offset) for k, v in zip(keys, values, strict=True)]
        out = mx.argmax(model(token, cache=static)[:, -1:], axis=-1)
        return out, [c.keys for c in static], [c.values for c in static], offset + 1

    token = mx.argmax(logits[:, -1:], axis=-1)
    buffers = [keys, values, mx.array(prompt.shape[1], dtype=mx.int32)]
    del cache, keys, values, logits

    def advance(token: mx.array) -> mx.array:
        nonlocal buffers
        args, buffers = buffers, None
        token, *buffers = step(token, *args)  # the old buffers: referenced by the graph only
        del args
        return token

    return _timed(advance, token, steps)


def _static_buffers(cache, capacity: int) -> tuple[list[mx.array], list[mx.array]]:
    zero = mx.array([0])
    keys, values = [], []
    for c in cache:
        shape = (*c.keys.shape[:2], capacity, c.keys.shape[3])
        keys.append(mx.slice_update(mx.zeros(shape, c.keys.dtype), c.keys[..., :c.offset, :],
                                    zero, axes=(2,)))
        values.append(mx.slice_update(mx.zeros(shape, c.values.dtype),
                                      c.values[..., :c.offset, :], zero, axes=(2,)))
    mx.eval(keys, values)
    return keys, values


def pipelined_steps(model: nn.Module, prompt: mx.array, steps: int):
    """`mlx_lm`'s `generate_step`: it queues step n+1 (`mx.async_eval`) before reading step n.
    Its first token comes from the prompt's forward, which the other runners do not count."""
    tokens, start = [], 0.0
    for i, (token, _) in enumerate(generate_step(prompt[0], model,
                                                 max_tokens=1 + WARMUP + steps)):
        tokens.append(int(token))
        if i == WARMUP:
            start = time.perf_counter()
    return tokens[1:], (time.perf_counter() - start) / steps


# ---------------------------------------------------------------- weights and ops


def _output_head(model: nn.Module) -> nn.Module:
    """The untied `lm_head`, or the embedding when the model ties them."""
    head = getattr(model, "lm_head", None)
    return head if head is not None else model.model.embed_tokens


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters one decode step reads: all of them, but only one embedding row when
    the embedding is not also the output head."""
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    embed = model.model.embed_tokens
    return total if _output_head(model) is embed else total - embed.weight.nbytes


def step_matrices(model: nn.Module) -> list[mx.array]:
    """Each float matrix one decode step multiplies a vector by, once: the linear layers'
    weights (an untied `lm_head` among them) and the embedding when it is also the head."""
    weights = [m.weight for _, m in model.named_modules() if type(m) is nn.Linear]
    embed = model.model.embed_tokens
    if _output_head(model) is embed:
        weights.append(embed.weight)
    return weights


def matvec_ms(model: nn.Module, reps: int) -> float:
    """Median time of one product of a vector with each of `step_matrices(model)`, evaluated
    together as one graph."""
    weights = step_matrices(model)
    inputs = {w.shape[1]: mx.random.normal((1, w.shape[1])) for w in weights}
    mx.eval(list(inputs.values()))
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        mx.eval([inputs[w.shape[1]] @ w.T for w in weights])
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def layer_ops(model: nn.Module, prompt: mx.array) -> Counter:
    """The primitives of one layer's decode forward (one token after `prompt`)."""
    cache = make_prompt_cache(model)
    mx.eval(model(prompt, cache=cache))
    x = model.model.embed_tokens(prompt[:, -1:])
    mx.eval(x)
    out = model.layers[0](x, None, cache[0])
    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "layer.dot"
        mx.export_to_dot(str(dot), out)
        labels = [line.split('label ="')[1].split('"')[0]
                  for line in dot.read_text().splitlines() if "shape=rectangle" in line]
    return Counter(labels)


# ---------------------------------------------------------------- engine syncs


SYNC_TOKENS = 48  # one request's tokens while its syncs are counted
SYNC_CASES = {"none": "plain", "prompt_lookup": "prompt lookup, k = 4",
              "model": "the draft model, k = 4"}


def evals_per_round(kit: ModelKit, source: str, context: int,
                    tokens: int) -> tuple[float, float]:
    """(`mx.eval` calls, draft tokens proposed) per decoding round of one request, drafting by
    `source` ("none", or "prompt_lookup" / "model" at a fixed k = 4; "model" needs the kit's
    draft)."""
    scheduler = Scheduler(kit, SchedulerConfig(), SpeculationPolicy())  # one row: speculates
    prompt = tuple(random_tokens(kit.target.model, (1, context))[0].tolist())
    speculation = (SpeculationParams() if source == "none" else
                   SpeculationParams(4, source=source, adaptive=False))
    seq = scheduler.submit(GenerationParams(prompt, tokens, speculation=speculation,
                                            ignore_eos=True), lambda event: None)
    while seq.phase not in (Phase.DECODE, Phase.DONE):  # a step may prefill and decode
        scheduler.step()
    proposed_before = seq.counters.proposed
    original, calls = mx.eval, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    rounds = 0
    mx.eval = counting
    try:
        while seq.phase is not Phase.DONE:
            scheduler.step()
            rounds += 1
    finally:
        mx.eval = original
    if not rounds:
        raise ValueError(f"{tokens} tokens ended before a decoding round could be counted")
    return calls[0] / rounds, (seq.counters.proposed - proposed_before) / rounds


class DraftRound:
    """A draft-model round outside the engine (k draft steps, then the target verifies the
    k + 1 tokens), its caches trimmed back after each so every round sees the same context:
    with the draft tokens read back before the verification (two syncs, as the engine does) or
    fed to it as arrays (one sync)."""

    def __init__(self, target: nn.Module, draft: nn.Module, prompt: mx.array, k: int = 4):
        self.target, self.draft, self.k = target, draft, k
        self.target_cache, self.draft_cache = make_prompt_cache(target), make_prompt_cache(draft)
        context = prompt[:, :-1]  # the last token is the round's input, as a sampled one is
        mx.eval(target(context, cache=self.target_cache), draft(context, cache=self.draft_cache))
        self.token = prompt[0, -1:]

    def _drafted(self) -> list[mx.array]:
        token, out = self.token, []
        for _ in range(self.k):
            token = mx.argmax(self.draft(token[None], cache=self.draft_cache)[:, -1], axis=-1)
            out.append(token)
        return out

    def _verify(self, inputs: mx.array) -> list[int]:
        verified = mx.argmax(self.target(inputs, cache=self.target_cache), axis=-1)
        mx.eval(verified)
        for c in self.target_cache:
            c.trim(self.k + 1)
        for c in self.draft_cache:
            c.trim(self.k)
        return verified[0].tolist()

    def two_syncs(self) -> list[int]:
        drafted = self._drafted()
        mx.eval(drafted)
        ids = self.token.tolist() + [t.item() for t in drafted]
        return self._verify(mx.array([ids], dtype=self.token.dtype))

    def one_sync(self) -> list[int]:
        drafted = [t.astype(self.token.dtype) for t in self._drafted()]
        return self._verify(mx.concatenate([self.token, *drafted])[None])


def round_syncs_ms(round_: DraftRound, rounds: int) -> dict[str, float]:
    """Median ms of a draft-model round with two syncs and with one, taking turns."""
    times: dict[str, list[float]] = {"two_syncs": [], "one_sync": []}
    for i in range(WARMUP + rounds):
        order = ("two_syncs", "one_sync") if i % 2 else ("one_sync", "two_syncs")
        for name in order:
            start = time.perf_counter()
            getattr(round_, name)()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


# ---------------------------------------------------------------- report

RUNNERS = {
    "mlx_lm's model (the engine's default)": ("unfused", plain_steps),
    "fused projections": ("fused", plain_steps),
    "mx.compile of each MLP": ("unfused", compiled_mlp_steps),
    "mx.compile of the whole step": ("unfused", static_compiled_steps),
    "generate_step (async_eval)": ("unfused", pipelined_steps),
}


def time_steps(models: dict[str, nn.Module], prompt: mx.array, steps: int, reps: int):
    """{runner: (median s/step, tokens of its first rep)}, the runners taking turns each rep."""
    times: dict[str, list[float]] = {name: [] for name in RUNNERS}
    tokens: dict[str, list[int]] = {}
    for _ in range(reps):
        for name, (which, runner) in RUNNERS.items():
            out, seconds = runner(models[which], prompt, steps)
            tokens.setdefault(name, out)
            times[name].append(seconds)
    return {name: (statistics.median(times[name]), tokens[name]) for name in RUNNERS}


def print_steps(results, steps: int, reps: int) -> None:
    base_s, base_tokens = results[next(iter(RUNNERS))]
    print(f"\none decoding step, median of {reps} interleaved runs of {steps} steps")
    print(f"{'':38}{'ms/step':>8}{'tok/s':>7}{'vs first':>10}  same tokens")
    for name, (seconds, tokens) in results.items():
        n = min(len(tokens), len(base_tokens))
        same = "yes" if tokens[:n] == base_tokens[:n] else "no"
        print(f"{name:38}{seconds * 1e3:>8.1f}{1 / seconds:>7.1f}"
              f"{seconds / base_s:>9.2f}x  {same}")


def print_ops(models: dict[str, nn.Module], prompt: mx.array) -> None:
    print("\nops per layer (one decode token; mx.export_to_dot)")
    for which, model in models.items():
        ops = layer_ops(model, prompt)
        listing = ", ".join(f"{name} {n}" for name, n in sorted(ops.items()))
        print(f"{which:>8}: {sum(ops.values())} ({listing})")


def print_round_syncs(target: nn.Module, draft_path: str, prompt: mx.array, rounds: int) -> None:
    draft = load_model(draft_path, dequantize=True).model  # as the engine loads a draft
    ms = round_syncs_ms(DraftRound(target, draft, prompt), rounds)
    print(f"\na draft-model round (k = 4), median of {rounds}: draft tokens read back, then "
          f"verified (2 syncs, the engine's) {ms['two_syncs']:.1f} ms; verified from the arrays "
          f"(1 sync) {ms['one_sync']:.1f} ms; {ms['one_sync'] / ms['two_syncs']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.bench.decode_profile",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_TARGET_DIR),
                   help="Target folder (default: %(default)s).")
    p.add_argument("--draft-model", default=str(DEFAULT_DRAFT_DIR),
                   help="Draft for the syncs of a draft-model round ('' to skip; default:"
                   " %(default)s).")
    p.add_argument("--context", type=int, default=128, help="Prompt tokens before decoding.")
    p.add_argument("--steps", type=int, default=40, help="Timed steps per run.")
    p.add_argument("--reps", type=int, default=3, help="Interleaved runs per way.")
    args = p.parse_args(argv)
    mx.random.seed(0)
    models = {"unfused": load_model(args.model).model,
              "fused": load_model(args.model, fuse=True).model}
    prompt = random_tokens(models["unfused"], (1, args.context))
    model = models["unfused"]
    nbytes, floor = weight_bytes(model), matvec_ms(model, args.reps * 3)
    print(f"{args.model}: {len(model.layers)} layers, dtype "
          f"{model.model.norm.weight.dtype}, {args.context}-token context")
    print(f"weights read per step {nbytes / 1e6:.0f} MB; their matrix-vector products alone "
          f"{floor:.1f} ms ({nbytes / floor / 1e6:.1f} GB/s)")
    print_ops(models, prompt)
    results = time_steps(models, prompt, args.steps, args.reps)
    print_steps(results, args.steps, args.reps)
    step_ms = results[next(iter(RUNNERS))][0] * 1e3
    print(f"matrix-vector products alone / the engine's step: {floor / step_ms:.2f}")
    if args.draft_model:
        print_round_syncs(model, args.draft_model, prompt, args.steps)
    del models, model
    print_evals_per_round(args.model, args.draft_model, args.context)


def print_evals_per_round(target: str, draft: str, context: int) -> None:
    kit = ModelKit(load_model(target))  # as the engine loads its models, once for every case
    if draft:
        kit.load_draft(draft)
    print("\nthe engine's mx.eval calls per decoding round (one request)")
    print(f"  {'':24}{'mx.eval':>8}{'proposed':>9}")
    for source, name in SYNC_CASES.items():
        if source == "model" and kit.draft is None:
            continue
        evals, proposed = evals_per_round(kit, source, context, SYNC_TOKENS)
        print(f"  {name:24}{evals:>8.2f}{proposed:>9.2f}")


if __name__ == "__main__":
    main()
