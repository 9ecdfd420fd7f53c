"""Import a llama-family GGUF file as an `mlx_lm` folder.

`mlx.core.load` reads the tensors (Q4_0, Q4_1 and Q8_0 blocks arrive as MLX affine-quantized
weights with group size 32) and the metadata; this module renames the tensors to `mlx_lm`'s llama
names, undoes llama.cpp's q/k row permutation (so the folder uses the Hugging Face rotary layout
like every other `mlx_lm` llama), and rebuilds the tokenizer from the metadata's BPE vocabulary
and merges with the `tokenizers` package.

    python -m server.convert FILE.gguf OUT_DIR [--dtype float32]
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from collections import Counter
from pathlib import Path

import mlx.core as mx

log = logging.getLogger(__name__)

GROUP_SIZE = 32  # every GGUF block type that MLX reads quantized has 32 weights per block
CACHE_DIR = Path(os.environ.get("MLX_SPEC_GGUF_CACHE", "models/generated/gguf"))

# ggml tensor types, by id (ggml.h); MLX reads the first six, the rest are named in errors.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}
SUPPORTED_ARCHITECTURES = {"llama"}

LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}

# llama.cpp's pre-tokenizer names -> the `tokenizers` pre-tokenizer that splits text the same way.
GPT2_PRETOKENIZERS = {"default", "gpt2", "gpt-2"}
DIGIT_SPLIT_PRETOKENIZERS = {"smollm", "starcoder", "refact"}

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


class UnsupportedGGUF(ValueError):
    """The file is valid GGUF but uses something this importer cannot convert."""


# --- the header: tensor names and ggml types (mx.load does not report the types) ---------------

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(f, fmt: str):
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _skip_value(f, value_type: int) -> None:
    if value_type == _STRING:
        f.seek(_read(f, "<Q"), 1)
    elif value_type == _ARRAY:
        item_type, count = _read(f, "<I"), _read(f, "<Q")
        if item_type in _SCALAR_FORMATS:
            f.seek(count * struct.calcsize(_SCALAR_FORMATS[item_type]), 1)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    elif value_type in _SCALAR_FORMATS:
        f.seek(struct.calcsize(_SCALAR_FORMATS[value_type]), 1)
    else:
        raise UnsupportedGGUF(f"unknown GGUF metadata value type {value_type}")


def tensor_types(path: str | Path) -> dict[str, str]:
    """{tensor name: ggml type name} read from the file's header."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UnsupportedGGUF(f"{path} is not a GGUF file (bad magic)")
        version = _read(f, "<I")
        if version < 2:
            raise UnsupportedGGUF(f"{path}: GGUF version {version} is too old (need >= 2)")
        n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
        for _ in range(n_kv):
            f.seek(_read(f, "<Q"), 1)
            _skip_value(f, _read(f, "<I"))
        types = {}
        for _ in range(n_tensors):
            name = f.read(_read(f, "<Q")).decode()
            f.seek(8 * _read(f, "<I"), 1)
            ggml_type = _read(f, "<I")
            f.seek(8, 1)
            types[name] = GGML_TYPES.get(ggml_type, f"ggml type {ggml_type}")
        return types


def check_tensor_types(path: str | Path) -> None:
    bad = {n: t for n, t in tensor_types(path).items() if t not in SUPPORTED_TYPES}
    if bad:
        kinds = ", ".join(sorted(set(bad.values())))
        example = next(iter(bad))
        raise UnsupportedGGUF(
            f"{path}: tensor type {kinds} is not supported (e.g. {example}: {bad[example]}); "
            f"supported: {', '.join(sorted(SUPPORTED_TYPES))}. Re-quantize the model to Q4_0, "
            "Q4_1, Q8_0 or F16 (llama.cpp's llama-quantize) and convert that file."
        )


# --- metadata -> config.json --------------------------------------------------------------------

def _scalar(value):
    if isinstance(value, mx.array):
        return value.item()
    return value


def model_config(meta: dict) -> dict:
    arch = _scalar(meta.get("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUF(f"architecture {arch!r} is not supported (only llama-family)")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        return _scalar(value) if value is not None else None

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": int(get("vocab_size") or len(tokens)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_traditional": False,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if (factor := get("rope.scaling.factor")) and get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(factor)}
    for name in ("bos", "eos"):
        if (token_id := meta.get(f"tokenizer.ggml.{name}_token_id")) is not None:
            config[f"{name}_token_id"] = int(_scalar(token_id))
    return config


# --- tensors -------------------------------------------------------------------------------------

def _mlx_name(gguf_name: str) -> str:
    stem, _, suffix = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in LAYER_TENSORS:
            raise UnsupportedGGUF(f"unexpected tensor {gguf_name} (not a llama layer tensor)")
        return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{suffix}"
    if stem not in GLOBAL_TENSORS:
        raise UnsupportedGGUF(f"unexpected tensor {gguf_name} (not a llama tensor)")
    return f"{GLOBAL_TENSORS[stem]}.{suffix}"


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k permutation: its rope pairs adjacent rows, Hugging Face's halves."""
    rows = w.shape[0]
    return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def permute_rows_like_llama_cpp(w: mx.array, n_heads: int) -> mx.array:
    """What llama.cpp's convert script does to q/k (used by tests to write a faithful GGUF)."""
    rows = w.shape[0]
    return (w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def convert_weights(weights: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    out = {}
    for name, w in weights.items():
        target = _mlx_name(name)
        if ".self_attn.q_proj." in target:
            w = _unpermute_rows(w, config["num_attention_heads"])
        elif ".self_attn.k_proj." in target:
            w = _unpermute_rows(w, config["num_key_value_heads"])
        out[target] = w
    if "lm_head.weight" in out:
        config["tie_word_embeddings"] = False
    return out


def quantization_config(weights: dict[str, mx.array]) -> dict | None:
    """Bits per quantized matrix, inferred from shapes: packed uint32 columns per group."""
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            packed_cols = weights[f"{module}.weight"].shape[-1]
            bits[module] = packed_cols * 32 // (scales.shape[-1] * GROUP_SIZE)
    if not bits:
        return None
    common = Counter(bits.values()).most_common(1)[0][0]
    config = {"group_size": GROUP_SIZE, "bits": common}
    for module, b in sorted(bits.items()):
        if b != common:
            config[module] = {"group_size": GROUP_SIZE, "bits": b}
    return config


def dequantize_all(weights: dict[str, mx.array], quant: dict | None,
                   dtype: mx.Dtype) -> dict[str, mx.array]:
    out = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name[: -len(".weight")]
        if f"{module}.scales" in weights:
            bits = quant.get(module, quant)["bits"]
            w = mx.dequantize(w, weights[f"{module}.scales"], weights[f"{module}.biases"],
                              group_size=GROUP_SIZE, bits=bits)
        out[name] = w.astype(dtype)
    return out


# --- tokenizer -----------------------------------------------------------------------------------

def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` equal to the one the GGUF was made from (GPT-2-style BPE)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _scalar(meta.get("tokenizer.ggml.model"))
    if kind != "gpt2":
        raise UnsupportedGGUF(f"tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = _token_types(meta, len(tokens))
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                     fuse_unk=False, byte_fallback=False))
    pre = _scalar(meta.get("tokenizer.ggml.pre", "default"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGIT_SPLIT_PRETOKENIZERS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in GPT2_PRETOKENIZERS:
        tokenizer.pre_tokenizer = byte_level
    else:
        known = ", ".join(sorted(GPT2_PRETOKENIZERS | DIGIT_SPLIT_PRETOKENIZERS))
        raise UnsupportedGGUF(f"pre-tokenizer {pre!r} is not supported (known: {known})")
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    tokenizer.add_special_tokens(special)
    if _flag(meta, "tokenizer.ggml.add_bos_token") and "tokenizer.ggml.bos_token_id" in meta:
        bos_id = int(_scalar(meta["tokenizer.ggml.bos_token_id"]))
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    return tokenizer


def _token_types(meta: dict, n: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [TOKEN_NORMAL] * n
    return types.tolist() if isinstance(types, mx.array) else list(types)


def _flag(meta: dict, key: str) -> bool:
    return bool(_scalar(meta.get(key, False)))


def tokenizer_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(name):
        key = f"tokenizer.ggml.{name}_token_id"
        return tokens[int(_scalar(meta[key]))] if key in meta else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": _flag(meta, "tokenizer.ggml.add_bos_token"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_scalar(meta.get(
            f"{_scalar(meta.get('general.architecture'))}.context_length", 4096))),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = _scalar(meta["tokenizer.chat_template"])
    return config


# --- the whole conversion ----------------------------------------------------------------------

def convert(gguf_path: str | Path, out_dir: str | Path, *, dtype: str | None = None) -> Path:
    """Write an `mlx_lm` folder for `gguf_path`; `dtype` (e.g. "float32") dequantizes."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    check_tensor_types(gguf_path)
    raw, meta = mx.load(str(gguf_path), return_metadata=True)
    config = model_config(meta)
    tokenizer = build_tokenizer(meta)
    weights = convert_weights(raw, config)
    quant = quantization_config(weights)
    if dtype is not None:
        weights = dequantize_all(weights, quant, getattr(mx, dtype))
        quant = None
    if quant is not None:
        config["quantization"] = quant
        config["quantization_config"] = quant
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(
        {k: v for k, v in tokenizer_config(meta).items()
         if k.endswith("_token") and v is not None}, indent=2))
    return out_dir


def _file_key(path: Path, dtype: str | None) -> str:
    """Names the cache folder: the file's stem, a hash of its path, size and mtime, the dtype."""
    st = path.stat()
    digest = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return f"{path.stem}-{digest.hexdigest()[:12]}-{dtype or 'quantized'}"


def cache_dtype() -> str | None:
    """float32 on the CPU (MLX's quantized matmuls are slower there than fp32 GEMV), else as is."""
    return "float32" if mx.default_device() == mx.cpu else None


def resolve_model_path(path: str, *, cache_dir: str | Path | None = None) -> str:
    """A `.gguf` file -> its converted folder (converted once, then reused); anything else as is."""
    if not str(path).lower().endswith(".gguf"):
        return path
    source = Path(path).expanduser()
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    dtype = cache_dtype()
    out = Path(cache_dir or CACHE_DIR) / _file_key(source, dtype)
    if (out / "config.json").exists():
        return str(out)
    log.info("converting %s to an mlx_lm folder in %s (first use only)", source, out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    convert(source, partial, dtype=dtype)
    shutil.rmtree(out, ignore_errors=True)
    partial.replace(out)
    return str(out)
