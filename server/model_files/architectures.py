"""Tiny random models of `mlx_lm`'s own architectures, built offline from their `ModelArgs`.

The tests and the support matrix (`docs/models.md`) serve the model families people run: hybrid
(Gated DeltaNet, Mamba, short convolutions + attention) and sliding-window ones. Each is built
at a test's size from a small config: `SMALL` for every architecture, plus what an architecture
needs of its own (`SPECIFIC`: its recurrent heads, layer pattern, window of a few tokens so
that short prompts cross it). As in `synthetic`, the head is untied and the embeddings scaled
up so that greedy output varies, and a draft is the target's first layers while the target's
later layers write to the residual stream scaled down: a draft with a realistic acceptance.

    python -m server.model_files.architectures OUT_DIR --arch qwen3_5 [--layers 4 --draft-layers 2]
    python -m server.model_files.architectures models/generated/hybrid --arch qwen3_5 \
        --preset small --layers 12   # the benchmarks' hybrid pair (a 2-layer draft)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from server.model_files.synthetic import EMBEDDING_SCALE, LATE_LAYER_RESIDUAL_SCALE
from server.model_files.tokenizer_builder import save_tokenizer, special_token_ids, train_tokenizer

TOKENIZER_VOCAB = 512
MAX_PARAMETERS = 50_000_000
TOKENIZER_BYTES = 400_000

# Every architecture starts from these; fields its ModelArgs does not have are ignored.
SMALL = {
    "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
# What an architecture needs beyond `SMALL`. Windows are a few tokens long, so that test
# prompts cross them; layer patterns mix both kinds within the first two layers (the draft).
SPECIFIC: dict[str, dict] = {
    "llama": {},
    "qwen3": {},
    "qwen3_5": {"linear_num_value_heads": 4, "linear_num_key_heads": 2,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4, "full_attention_interval": 2},
    "qwen3_next": {"linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                   "linear_conv_kernel_dim": 4, "full_attention_interval": 2,
                   "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                   "shared_expert_intermediate_size": 64, "mlp_only_layers": [],
                   "moe_intermediate_size": 32, "partial_rotary_factor": 0.25},
    "gemma3_text": {"sliding_window": 8, "sliding_window_pattern": 2,
                    "query_pre_attn_scalar": 16, "rope_local_base_freq": 10000.0},
    "gpt_oss": {"sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "lfm2": {"norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_dim": 64,
             "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "block_ff_dim": 128,
             "layer_types": ["conv", "full_attention"] * 2},
    "nemotron_h": {"hybrid_override_pattern": "M*M-", "mamba_num_heads": 4,
                   "mamba_head_dim": 16, "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1,
                   "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2",
                   "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
                   "chunk_size": 16, "mamba_proj_bias": False, "attention_bias": False,
                   "mlp_bias": False},
    "granitemoehybrid": {"attention_bias": False, "embedding_multiplier": 1.0,
                         "attention_multiplier": 0.25, "logits_scaling": 1.0,
                         "residual_multiplier": 1.0,
                         "layer_types": ["mamba", "attention"] * 2, "mamba_n_heads": 4,
                         "mamba_d_head": 32, "mamba_proj_bias": False, "mamba_d_state": 16,
                         "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
                         "shared_intermediate_size": 128},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 16,
              "mamba_expand": 2, "num_experts": 4, "num_experts_per_tok": 2,
              "tie_word_embeddings": False},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1, 3], "num_heads": 4,
                                           "head_dim": 16, "short_conv_kernel_size": 4},
                    "model_max_length": 4096, "num_experts": 4, "moe_intermediate_size": 32,
                    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                    "v_head_dim": 16, "num_experts_per_token": 2, "first_k_dense_replace": 1},
    "mamba2": {"time_step_limit": [0.001, 100.0], "num_heads": 8},
    # learned position embeddings: as many positions as the others' context
    "gpt2": {"n_positions": 4096, "n_ctx": 4096},
    "gpt_bigcode": {"n_positions": 4096},
    "minimax": {"rotary_dim": 16},  # within the head (16 wide)
    "qwen": {"kv_channels": 16},  # the head's width
    "plamo": {"n_shared_head": 2},  # query heads per key/value head
    # LongCat's attention keeps its LoRA scales only when these are on (as in its configs)
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True,
                      "zero_expert_type": "identity"},
    "longcat_flash_ngram": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "mistral4": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                     "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 4096}},
    "llama4_text": {"intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0],
                    "use_qk_norm": True, "attention_chunk_size": 8,
                    "num_local_experts": 4, "num_experts_per_tok": 1,
                    "interleave_moe_layer_step": 2},
}
# The benchmarks' size (`--preset small`), like `synthetic`'s generated pair: ~80M parameters,
# so that a 2-layer draft is several times cheaper than the target.
SMALL_PRESET = {"hidden_size": 768, "intermediate_size": 2048, "num_attention_heads": 12,
                "num_key_value_heads": 4, "head_dim": 64}
# Qwen3.5's layers alternate Gated DeltaNet and attention here (it has three of the first to
# one of the second): so the 2-layer draft, like the generated pair's, holds one of each.
PRESET_SPECIFIC = {"qwen3_5": {"linear_num_value_heads": 8, "linear_num_key_heads": 4,
                               "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                               "full_attention_interval": 2},
                   "gemma3_text": {"sliding_window": 512, "sliding_window_pattern": 6,
                                   "query_pre_attn_scalar": 64}}
PRESET_TOKENIZER = (4096, 2_000_000)

# Config fields that list one entry per layer: cut with the layers for a draft.
PER_LAYER_FIELDS = ("layer_types", "block_types", "no_rope_layers")
PER_LAYER_STRINGS = ("hybrid_override_pattern",)
# The matrices through which a later layer writes to the residual stream (scaled down).
RESIDUAL_WRITES = ("o_proj", "down_proj", "out_proj", "dense", "c_proj", "wo", "w2")


def model_class(model_type: str):
    """`mlx_lm`'s (Model, ModelArgs) for `model_type`."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return module.Model, module.ModelArgs


def tiny_config(model_type: str, *, layers: int = 4, vocab_size: int = TOKENIZER_VOCAB,
                eos_id: int = 0, **extra) -> dict:
    """A small config of `model_type`: `SMALL`, its `SPECIFIC` fields, `layers` layers, and a
    guess for every other field its `ModelArgs` requires (`guess`)."""
    config = {"model_type": model_type, **SMALL, **SPECIFIC.get(model_type, {}), **extra,
              "num_hidden_layers": layers, "vocab_size": vocab_size, "eos_token_id": eos_id}
    _, args_cls = model_class(model_type)
    for f in dataclasses.fields(args_cls):
        if f.name not in config and f.default is dataclasses.MISSING and \
                f.default_factory is dataclasses.MISSING and not f.name.endswith("_config"):
            config[f.name] = guess(f.name, str(f.type))
    return cut_layers(config, layers)


def guess(name: str, kind: str):
    """A small value for a required config field no preset names, from its name and type."""
    if "List" in kind or "list" in kind or "Tuple" in kind:
        return []
    if "bool" in kind:
        return False
    if "str" in kind and "act" in name:
        return "silu"
    if "float" in kind:
        return 1e-5 if "eps" in name else 10000.0 if "theta" in name else 1.0
    if "int" in kind:
        for words, value in (("experts_per_tok", 2), ("top_k", 2), ("topk", 2),
                             ("expert", 4), ("layer", 4), ("kv_head", 2), ("head_dim", 16),
                             ("heads", 4), ("window", 8), ("group", 1), ("kernel", 4),
                             ("rank", 16), ("state", 16)):
            if words in name:
                return value
        return 64 if ("size" in name or "dim" in name) else 2
    if "Dict" in kind or "dict" in kind:
        return {}
    return None


def cut_layers(config: dict, layers: int) -> dict:
    """`config` with its per-layer fields cut (or cycled) to `layers` layers."""
    out = dict(config, num_hidden_layers=layers)
    _, args_cls = model_class(config["model_type"])
    for name in ("n_layer", "n_layers", "num_layers"):  # GPT-2-like names of the count
        if name in {f.name for f in dataclasses.fields(args_cls)}:
            out[name] = layers
    for key in PER_LAYER_FIELDS:
        if isinstance(out.get(key), list):
            pattern = out[key]
            out[key] = [pattern[i % len(pattern)] for i in range(layers)]
    for key in PER_LAYER_STRINGS:
        if isinstance(out.get(key), str):
            pattern = out[key]
            out[key] = "".join(pattern[i % len(pattern)] for i in range(layers))
    return out


def random_model(config: dict, *, seed: int, draft_layers: int,
                 max_parameters: int | None = MAX_PARAMETERS):
    """`config`'s model with random weights: embeddings scaled up, layers from `draft_layers`
    on writing to the residual stream scaled down."""
    mx.random.seed(seed)
    model_cls, args_cls = model_class(config["model_type"])
    model = model_cls(args_cls.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    size = sum(v.size for v in weights.values())
    if max_parameters and size > max_parameters:  # a default left at full size
        raise ValueError(f"the small config builds {size / 1e6:.0f}M parameters")
    for name, value in weights.items():
        if "embed" in name and name.endswith("weight") and value.ndim == 2:
            weights[name] = value * EMBEDDING_SCALE
        layer = _layer_index(name)
        if layer is None and "norm" in name and value.ndim == 1:
            # A model that ties its head to its embeddings (LFM2 always does) would predict
            # its input token forever: a random final norm turns the hidden state away.
            weights[name] = value * mx.random.normal(value.shape)
        if layer is not None and layer >= draft_layers and \
                any(f".{w}." in name for w in RESIDUAL_WRITES):
            weights[name] = value * LATE_LAYER_RESIDUAL_SCALE
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    return model


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "h", "blocks") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def first_layers(model: nn.Module, config: dict, layers: int):
    """A model of `config` cut to `layers` layers, with `model`'s weights for them."""
    model_cls, args_cls = model_class(config["model_type"])
    draft = model_cls(args_cls.from_dict(config))
    weights = [(k, v) for k, v in tree_flatten(model.parameters())
               if (_layer_index(k) is None or _layer_index(k) < layers)]
    draft.load_weights(weights)
    mx.eval(draft.parameters())
    return draft


def save(model: nn.Module, config: dict, tokenizer, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"),
                        dict(tree_flatten(model.parameters())), {"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_tokenizer(tokenizer, path)
    return path


def build(out_dir: Path, model_type: str, *, layers: int = 4, draft_layers: int = 2,
          seed: int = 0, tokenizer=None, preset: str = "tiny", **extra) -> tuple[Path, Path]:
    """Write `out_dir/target` (`layers` layers) and `out_dir/draft` (its first
    `draft_layers`); returns both paths. `preset` "small": the benchmarks' size."""
    if preset == "small":
        extra = {**SMALL_PRESET, **PRESET_SPECIFIC.get(model_type, {}), **extra}
        vocab, text_bytes = PRESET_TOKENIZER
    else:
        vocab, text_bytes = TOKENIZER_VOCAB, TOKENIZER_BYTES
    tokenizer = tokenizer or train_tokenizer(vocab, max_bytes=text_bytes)
    eos = special_token_ids(tokenizer)["<|im_end|>"]
    config = tiny_config(model_type, layers=layers, vocab_size=tokenizer.get_vocab_size(),
                         eos_id=eos, **extra)
    target = random_model(config, seed=seed, draft_layers=draft_layers,
                          max_parameters=None if preset == "small" else MAX_PARAMETERS)
    draft_config = cut_layers(config, draft_layers)
    draft = first_layers(target, draft_config, draft_layers)
    out_dir = Path(out_dir)
    return (save(target, config, tokenizer, out_dir / "target"),
            save(draft, draft_config, tokenizer, out_dir / "draft"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", default="qwen3_5", help="an mlx_lm model_type")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=["tiny", "small"], default="tiny",
                        help="small: the benchmarks' ~80M-parameter size (with --layers 12)")
    args = parser.parse_args(argv)
    target, draft = build(args.out_dir, args.arch, layers=args.layers,
                          draft_layers=args.draft_layers, seed=args.seed, preset=args.preset)
    print(f"target: {target}\ndraft: {draft}")


if __name__ == "__main__":
    main()
