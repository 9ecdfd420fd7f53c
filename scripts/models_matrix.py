"""docs/models.md: which `mlx_lm` architectures this server serves, and with what.

Every architecture module of the installed `mlx_lm` is tried as a tiny random model
(`server.model_files.architectures`: a 4-layer target and a draft of its first 2 layers),
each in a process of its own (a model that aborts takes only its process down), and checked
against `mlx_lm` itself:

- load: `load_model` accepts it (else the one-line reason it gives);
- batch: 3 prompts decoded together give `mlx_lm.generate_step`'s greedy tokens;
- speculate: the same with its draft proposing 3 tokens a round;
- prefix cache / disk cache: a prompt extending an earlier one starts from its state (in
  memory; after a restart, from disk) and still gives `mlx_lm`'s tokens;
- structured: a JSON-object grammar holds every token;
- distributed: by rule, not run: `mlx_lm` can shard it (`shard()` or `PipelineMixin`) and its
  caches are plain KV caches (what the ranks can mirror).

Greedy tokens may part from `mlx_lm`'s only at a near-tie of the logits (`NEAR_TIE`: Mamba-2
layers round a block of tokens differently from one token).

    python scripts/models_matrix.py --write      # rewrite docs/models.md (minutes)
    python scripts/models_matrix.py --one qwen3_5 # one architecture's row, as JSON
    python scripts/models_matrix.py --update gemma2 gpt2  # make these rows again, in place
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "models.md"
NEAR_TIE = 1e-2
MAX_TOKENS = 12
TEXTS = ["def hello(world):\n    return", "import os\nclass Foo:", "Once upon a time"]
COLUMNS = ["load", "batch", "speculate", "prefix cache", "disk cache", "structured",
           "distributed"]
# Modules of mlx_lm.models that are not architectures.
NOT_ARCHITECTURES = {"base", "cache", "activations", "rope_utils", "switch_layers", "pipeline",
                     "bitlinear_layers", "gated_delta", "ssm", "mla"}


def architectures() -> list[str]:
    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)
                  if m.name not in NOT_ARCHITECTURES and not m.name.startswith("_"))


# -- one architecture (in its own process) ------------------------------------------------------

def row(arch: str, folder: Path) -> dict:
    """The checks of one architecture: {column: "yes" | "no: why"}, or {"built": why}."""
    from server.model_files.architectures import build

    try:
        target, draft = build(folder, arch)
    except Exception as e:  # noqa: BLE001 - no small config builds this architecture
        return {"arch": arch, "built": _reason(e)}
    out = {"arch": arch, "built": "yes"}
    try:
        kit = _kit(target)
    except Exception as e:  # noqa: BLE001 - the server refuses it: the reason it gives
        out.update({c: "no" for c in COLUMNS}, load=f"no: {_reason(e)}")
        return out
    out["caches"] = _caches(kit.target.model)
    out["load"] = "yes"
    out["batch"] = _check(lambda: _batched(kit, 0))
    out["speculate"] = _check(lambda: _speculated(kit, arch, draft, folder))
    out["prefix cache"] = _check(lambda: _prefix(kit, None))
    out["disk cache"] = _check(lambda: _prefix(kit, folder / "disk"))
    out["structured"] = _check(lambda: _structured(kit))
    out["distributed"] = _distributed(arch, kit.target.model)
    return out


def _kit(target):
    from server.engine.models.model_kit import ModelKit, load_model

    return ModelKit(load_model(str(target)))


def _caches(model) -> str:
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    kinds = []
    for c in make_prompt_cache(model):
        name = (" + ".join(type(s).__name__ for s in c.caches) if isinstance(c, CacheList)
                else type(c).__name__)
        if name not in kinds:
            kinds.append(name)
    return ", ".join(kinds)


def _check(run) -> str:
    try:
        problem = run()
    except Exception as e:  # noqa: BLE001 - a failure of the feature: its reason
        return f"no: {_reason(e)}"
    return "yes" if problem is None else f"no: {problem}"


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:120]


def _expected(kit, prompt: list[int]) -> list[int]:
    """`mlx_lm`'s greedy tokens, up to the first end-of-sequence token (the server stops
    there; `generate_step` does not)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt), kit.target.model, max_tokens=MAX_TOKENS):
        out.append(int(token))
        if int(token) in kit.target.tokenizer.eos_token_ids:
            break
    return out


def _differs(kit, prompt: list[int], got: list[int]) -> str | None:
    """None when `got` is mlx_lm's greedy text (or parts from it at a near-tie)."""
    import mlx.core as mx

    expected = _expected(kit, prompt)
    if got == expected:
        return None
    j = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
             min(len(got), len(expected)))
    if j >= min(len(got), len(expected)):
        return f"{len(got)} tokens, mlx_lm {len(expected)}"
    logits = kit.target.model(mx.array(prompt + expected[:j])[None])[0, -1]
    gap = abs((logits[expected[j]] - logits[got[j]]).item())
    return None if gap < NEAR_TIE else f"token {j} differs from mlx_lm's (logit gap {gap:.3g})"


def _run(scheduler, requests) -> list[list[int]]:
    return [tokens for tokens, _ in _run_stats(scheduler, requests)]


def _run_stats(scheduler, requests) -> list[tuple[list[int], object]]:
    """Each request's tokens and stats, run together on `scheduler`."""
    from server.engine.events import TokenEvent
    from server.engine.scheduling.sequence import Phase

    events = [[] for _ in requests]
    seqs = [scheduler.submit(p, events[i].append) for i, p in enumerate(requests)]
    while any(s.phase is not Phase.DONE for s in seqs):
        scheduler.step()
    for seq in seqs:
        if seq.error is not None:
            raise seq.error
    return [([e.token for e in ev if isinstance(e, TokenEvent)], ev[-1].stats)
            for ev in events]


def _params(kit, text: str, k: int = 0, **extra):
    from server.engine.params import GenerationParams, SpeculationParams

    return GenerationParams(tuple(kit.target.tokenizer.encode(text)), MAX_TOKENS,
                            speculation=SpeculationParams(num_draft_tokens=k), **extra)


def _scheduler(kit):
    from server.engine.scheduling.scheduler import Scheduler, SchedulerConfig
    from server.engine.speculation.policy import SpeculationPolicy

    return Scheduler(kit, SchedulerConfig(prefill_chunk=8), SpeculationPolicy(3, 8, 3))


def _batched(kit, k: int) -> str | None:
    requests = [_params(kit, text, k) for text in TEXTS]
    for p, got in zip(requests, _run(_scheduler(kit), requests), strict=True):
        problem = _differs(kit, list(p.prompt_tokens), got)
        if problem:
            return problem
    return None


def _speculated(kit, arch: str, draft: Path, folder: Path) -> str | None:
    """The batch's text with a draft of the model's first layers proposing; where 2 layers
    do not make a model (its layer pattern is longer), an 8-layer target's first 4."""
    from server.model_files.architectures import build

    try:
        kit.load_draft(str(draft))
        return _batched(kit, 3)
    except Exception:  # noqa: BLE001 - tried again with the deeper pair below
        target, draft = build(folder / "deeper", arch, layers=8, draft_layers=4)
        deeper = _kit(target)
        deeper.load_draft(str(draft))
        return _batched(deeper, 3)


def _prefix(kit, disk_dir: Path | None) -> str | None:
    from server.engine.kv.disk_cache import DiskPromptCache
    from server.engine.kv.prefix_cache import PrefixCache

    def scheduler():
        s = _scheduler(kit)
        disk = DiskPromptCache(disk_dir, 1 << 30) if disk_dir is not None else None
        if disk is not None:
            disk.register_model(kit.target.path, kit.target.fingerprint)
        s.prefix_cache = PrefixCache(1 << 30, disk)
        return s

    first = scheduler()
    base = " ".join(f"word{i}" for i in range(40))
    _run(first, [_params(kit, base)])
    if disk_dir is not None:
        first.prefix_cache.disk.flush()
        first = scheduler()  # a restart: memory empty, the disk as it was
    p = _params(kit, base + " and then")
    [(got, stats)] = _run_stats(first, [p])
    if stats.cached_tokens == 0:
        return "the longer prompt did not start from the earlier one's state"
    return _differs(kit, list(p.prompt_tokens), got)


def _structured(kit) -> str | None:
    from server.engine.structured.grammar import grammars_for

    grammar = grammars_for(kit.target.tokenizer).json_object()
    [got] = _run(_scheduler(kit), [_params(kit, "Answer in JSON:", constraint=grammar)])
    check = grammar()
    if check.consume(got) != len(got):
        return "a token broke the grammar"
    return None


def _distributed(arch: str, model) -> str:
    import importlib

    from mlx_lm.models.cache import KVCache, make_prompt_cache

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    source = Path(module.__file__).read_text()
    modes = [m for m, marker in (("tensor", "def shard("), ("pipeline", "PipelineMixin"))
             if marker in source]
    if not modes:
        return "no: mlx_lm cannot shard it"
    if not all(isinstance(c, KVCache) for c in make_prompt_cache(model)):
        return "no: windows or recurrent states are not mirrored across ranks"
    return "yes (" + ", ".join(modes) + ")"


# -- the page ------------------------------------------------------------------------------------

def collect(archs: list[str], workers: int = 2) -> list[dict]:
    """Each architecture's row, each from a process of its own."""
    def one(arch: str) -> dict:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        try:
            done = subprocess.run([sys.executable, __file__, "--one", arch], env=env,
                                  capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return {"arch": arch, "built": "no: timed out"}
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            return {"arch": arch, "built": f"no: the process ended with {done.returncode}"}
        return json.loads(lines[-1])

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, archs))


def render(rows: list[dict]) -> str:
    import mlx_lm

    served = [r for r in rows if r.get("built") == "yes"]
    unbuilt = [r for r in rows if r.get("built") != "yes"]
    lines = [
        "# Supported models",
        "",
        "<!-- generated by scripts/models_matrix.py --write; do not edit -->",
        f"Every architecture of `mlx_lm` {mlx_lm.__version__}, tried as a tiny random model "
        "(a 4-layer target, a draft of its first 2 layers) and checked against `mlx_lm` "
        "itself: greedy text batched (3 prompts), with its draft proposing 3 tokens a round, "
        "from a prefix-cache entry in memory and on disk after a restart, under a JSON "
        "grammar. *Distributed* is by rule: `mlx_lm` can shard it and its caches are plain "
        "KV caches. `python scripts/models_matrix.py --write` makes this page.",
        "",
        "| architecture | caches | " + " | ".join(COLUMNS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    lines += [_line(r) for r in served]
    lines += ["", "Not tried (no small config of theirs builds a model; most are vision or "
              "multimodal wrappers): " +
              ", ".join(f"`{r['arch']}`" for r in unbuilt) + ".", ""]
    return "\n".join(lines)


def _cell(value: str) -> str:
    if value.startswith("yes"):
        return ("✓ " + value[3:].strip()).strip()
    return ("✗ " + value.removeprefix("no").removeprefix(": ").replace("|", "/")).strip()


def parse_rows(text: str) -> dict[str, list[str]]:
    """The page's table: architecture -> its cells."""
    out = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0].strip("`")] = cells[1:]
    return out


def table_row(r: dict) -> list[str]:
    return [r.get("caches", "")] + [_cell(r.get(c, "no")) for c in COLUMNS]


def _line(r: dict) -> str:
    return f"| `{r['arch']}` | " + " | ".join(table_row(r)) + " |"


def updated(text: str, rows: list[dict]) -> str:
    """The page with the table lines of `rows` (tried ones already on it) made again."""
    new = {r["arch"]: _line(r) for r in rows if r.get("built") == "yes"}
    lines = [new.get(line.split("`")[1], line) if line.startswith("| `") else line
             for line in text.splitlines()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help="rewrite docs/models.md")
    group.add_argument("--one", metavar="ARCH", help="print one architecture's row as JSON")
    group.add_argument("--update", nargs="+", metavar="ARCH",
                       help="make these architectures' rows of docs/models.md again")
    parser.add_argument("--only", nargs="*", help="with --write: only these (for a look)")
    args = parser.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(row(args.one, Path(folder))))
        return 0
    if args.update:
        rows = collect(args.update)
        DOC.write_text(updated(DOC.read_text(), rows))
        done = [r["arch"] if r.get("built") == "yes" else f"{r['arch']} ({r.get('built')})"
                for r in rows]
        print(f"{DOC}: made again: {', '.join(done)}")
        return 0
    start = time.time()
    rows = collect(args.only or architectures())
    DOC.write_text(render(rows))
    print(f"{DOC}: {sum(r.get('built') == 'yes' for r in rows)} architectures tried, "
          f"{time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
