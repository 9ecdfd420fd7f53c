"""A GGUF written from an `mlx_lm` folder the way llama.cpp's converter writes it (tensor
names, q/k row permutation, tokenizer metadata): what the GGUF import is tested against."""

from __future__ import annotations

import json

import mlx.core as mx
from tokenizers import Tokenizer

from server.model_files import gguf

LAYER_NAMES = {v: k for k, v in gguf.LAYER_TENSORS.items()}
GLOBAL_NAMES = {v: k for k, v in gguf.GLOBAL_TENSORS.items()}
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|im_end|>\n{% endfor %}")


def gguf_name(mlx_name: str) -> str:
    stem, _, suffix = mlx_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, part = stem.split(".", 3)
        return f"blk.{layer}.{LAYER_NAMES[part]}.{suffix}"
    return f"{GLOBAL_NAMES[stem]}.{suffix}"


def gguf_tensors(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    """mlx_lm llama weights renamed and q/k permuted the way llama.cpp's converter does."""
    out = {}
    for name, w in weights.items():
        if ".q_proj." in name:
            w = gguf.permute_rows_like_llama_cpp(w, config["num_attention_heads"])
        elif ".k_proj." in name:
            w = gguf.permute_rows_like_llama_cpp(w, config["num_key_value_heads"])
        out[gguf_name(name)] = w
    return out


def tokenizer_metadata(tok: Tokenizer, pre: str = "gpt-2") -> dict:
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    special = {a["content"] for a in data["added_tokens"]}
    types = [gguf.TOKEN_CONTROL if t in special else gguf.TOKEN_NORMAL for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.eos_token_id": mx.array(vocab["<|im_end|>"], dtype=mx.uint32),
        "tokenizer.ggml.padding_token_id": mx.array(vocab["<|endoftext|>"], dtype=mx.uint32),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": TEMPLATE,
    }


def model_metadata(config: dict) -> dict:
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    return {
        "general.architecture": "llama",
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(config["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"]),
        "llama.rope.freq_base": mx.array(config["rope_theta"]),
        "llama.context_length": u32(config["max_position_embeddings"]),
        "llama.vocab_size": u32(config["vocab_size"]),
    }


def write_gguf(folder, path) -> tuple[dict, dict]:
    """The tiny model in `folder` written as a GGUF at `path`: (its config, its weights)."""
    config = json.loads((folder / "config.json").read_text())
    weights = mx.load(str(folder / "model.safetensors"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    mx.save_gguf(str(path), gguf_tensors(weights, config),
                 {**model_metadata(config), **tokenizer_metadata(tok)})
    return config, weights
