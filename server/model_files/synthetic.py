"""Build a deterministic random target/draft pair in `mlx_lm` format, offline, in seconds.

Random weights with tied embeddings repeat one token forever, so the head is untied and the
embeddings scaled up, which gives varied greedy output. The draft is the target's first layers;
the target's later layers write to the residual stream through `o_proj`/`down_proj` scaled down,
so the draft predicts the target well but not perfectly: a realistic acceptance rate.

    python -m server.model_files.synthetic OUT_DIR [--preset small|tiny]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from server.model_files.tokenizer_builder import save_tokenizer, special_token_ids, train_tokenizer

EMBEDDING_SCALE = 10.0
LATE_LAYER_RESIDUAL_SCALE = 0.15


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    draft_layers: int
    tokenizer_bytes: int


PRESETS = {
    # Tests: loads and generates in milliseconds.
    "tiny": Preset(512, 64, 4, 4, 2, 128, 2, 400_000),
    # `make serve` and benchmarks until the trained demo pair exists: ~80M parameters, so a
    # 2-layer draft is several times cheaper than the target, as in real pairs.
    "small": Preset(4096, 768, 12, 12, 4, 2048, 2, 2_000_000),
}


def model_config(preset: Preset, *, num_layers: int, vocab_size: int, eos_id: int) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": preset.hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": preset.intermediate_size,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def random_target(config: dict, seed: int, draft_layers: int) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * EMBEDDING_SCALE
    for layer in model.model.layers[draft_layers:]:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * LATE_LAYER_RESIDUAL_SCALE
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * LATE_LAYER_RESIDUAL_SCALE
    mx.eval(model.parameters())
    return model


def draft_from_target(target: llama.Model, config: dict) -> llama.Model:
    """The target's embeddings, first layers, final norm and head, sliced to `config`'s vocab."""
    draft = llama.Model(llama.ModelArgs.from_dict(config))
    n_layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    weights = {}
    for name, value in tree_flatten(target.parameters()):
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= n_layers:
            continue
        weights[name] = value
    weights = {k: _resize_vocab(k, v, vocab) for k, v in weights.items()}
    draft.load_weights(list(weights.items()))
    mx.eval(draft.parameters())
    return draft


def _resize_vocab(name: str, value: mx.array, vocab: int) -> mx.array:
    """Pad (with small random rows) or cut the vocab axis of embedding and head matrices."""
    if name not in ("model.embed_tokens.weight", "lm_head.weight"):
        return value
    if value.shape[0] >= vocab:
        return value[:vocab]
    extra = mx.random.normal((vocab - value.shape[0], value.shape[1])) * 0.01
    return mx.concatenate([value, extra.astype(value.dtype)])


def save_model(model: llama.Model, config: dict, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"}
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(tokenizer, path)
    return path


def build_pair(
    out_dir: Path, preset: str = "tiny", *, seed: int = 0, draft_vocab_pad: int = 0
) -> tuple[Path, Path]:
    """Write `out_dir/target` and `out_dir/draft`; returns both paths.

    `draft_vocab_pad` gives the draft a larger embedding than the tokenizer (as Qwen2.5-0.5B
    vs 7B); the tokenizer, and so compatibility, stays the same.
    """
    p = PRESETS[preset]
    tokenizer = train_tokenizer(p.vocab_size, max_bytes=p.tokenizer_bytes)
    vocab = tokenizer.get_vocab_size()
    eos = special_token_ids(tokenizer)["<|im_end|>"]
    target_cfg = model_config(p, num_layers=p.num_layers, vocab_size=vocab, eos_id=eos)
    draft_cfg = model_config(
        p, num_layers=p.draft_layers, vocab_size=vocab + draft_vocab_pad, eos_id=eos
    )
    target = random_target(target_cfg, seed, p.draft_layers)
    draft = draft_from_target(target, draft_cfg)
    out_dir = Path(out_dir)
    return (
        save_model(target, target_cfg, tokenizer, out_dir / "target"),
        save_model(draft, draft_cfg, tokenizer, out_dir / "draft"),
    )


def build_foreign_vocab_model(path: Path, preset: str = "tiny", *, seed: int = 1) -> Path:
    """A model whose tokenizer maps strings to other ids: an incompatible draft."""
    p = PRESETS[preset]
    texts = (chr(c) * 3 + " word" + str(c) for c in range(32, 800))
    tokenizer = train_tokenizer(p.vocab_size // 2, texts=texts)
    vocab = tokenizer.get_vocab_size()
    eos = special_token_ids(tokenizer)["<|im_end|>"]
    cfg = model_config(p, num_layers=1, vocab_size=vocab, eos_id=eos)
    return save_model(random_target(cfg, seed, 1), cfg, tokenizer, Path(path))


def ensure_pair(out_dir: Path, preset: str = "small") -> tuple[Path, Path]:
    """Build the pair once; later calls reuse what is on disk."""
    out_dir = Path(out_dir)
    target, draft = out_dir / "target", out_dir / "draft"
    if not (target / "model.safetensors").exists() or not (draft / "model.safetensors").exists():
        return build_pair(out_dir, preset)
    return target, draft


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    target, draft = build_pair(args.out_dir, args.preset, seed=args.seed)
    print(f"target: {target}\ndraft: {draft}")


if __name__ == "__main__":
    main()
