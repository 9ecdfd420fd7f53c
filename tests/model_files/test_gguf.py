"""GGUF import: a tiny llama written the way llama.cpp writes it comes back as the same model.

The GGUF is made here from an `mlx_lm` folder (tensor names, q/k row permutation and tokenizer
metadata as llama.cpp's convert script writes them) with `mx.save_gguf`, then converted with
`server.convert` and loaded with `mlx_lm.load`: the logits must equal the original's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from support.gguf_writer import TEMPLATE, gguf_tensors, model_metadata, tokenizer_metadata
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from server.convert import main as convert_main
from server.model_files import gguf
from server.model_files.tokenizer_builder import SPECIAL_TOKENS, stdlib_files


def logits(model_dir: Path, tokens: list[int]) -> np.ndarray:
    model, _ = load(str(model_dir))
    model.set_dtype(mx.float32)
    return np.array(model(mx.array([tokens])))


TOKENS = [5, 17, 99, 3, 250, 42, 7, 300, 11, 64, 128, 2]


def test_round_trip_logits_equal_the_original(source, tmp_path, capsys):
    folder, _, _, path = source
    convert_main([str(path), str(tmp_path / "out")])
    assert "wrote" in capsys.readouterr().out
    np.testing.assert_allclose(logits(tmp_path / "out", TOKENS), logits(folder, TOKENS),
                               rtol=1e-5, atol=1e-5)


def test_float16_tensors_round_trip(source, tmp_path):
    folder, config, weights, _ = source
    half = {k: v.astype(mx.float16) for k, v in weights.items()}
    path = tmp_path / "half.gguf"
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    mx.save_gguf(str(path), gguf_tensors(half, config),
                 {**model_metadata(config), **tokenizer_metadata(tok)})
    gguf.convert(path, tmp_path / "out", dtype="float32")
    reference = logits(folder, TOKENS)
    got = logits(tmp_path / "out", TOKENS)
    assert np.abs(got - reference).max() < 0.05 * np.abs(reference).max()
    assert (got.argmax(-1) == reference.argmax(-1)).mean() > 0.9


def test_quantized_weights_keep_their_bits_and_match_mlx_quantize(source, tmp_path):
    """What mx.load hands over for Q4_1/Q8_0: affine weights, group size 32, bits per tensor."""
    folder, config, weights, _ = source
    raw = {}
    for name, w in gguf_tensors(weights, config).items():
        bits = 8 if name.startswith("token_embd") else 4
        if w.ndim == 2:
            q, scales, biases = mx.quantize(w, group_size=32, bits=bits)
            stem = name[: -len(".weight")]
            raw.update({name: q, f"{stem}.scales": scales, f"{stem}.biases": biases})
        else:
            raw[name] = w
    cfg = gguf.model_config(model_metadata(config) | tokenizer_metadata(
        Tokenizer.from_file(str(folder / "tokenizer.json"))))
    converted = gguf.convert_weights(raw, cfg)
    quant = gguf.quantization_config(converted)
    assert quant["bits"] == 4 and quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}

    # The reference: the original model quantized by mlx itself with the same bits.
    reference, _ = load(str(folder))
    nn.quantize(reference, group_size=32, bits=4,
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and
                (True if p != "model.embed_tokens" else {"group_size": 32, "bits": 8}))
    expected = dict(tree_flatten(reference.parameters()))
    for name, value in converted.items():
        np.testing.assert_array_equal(np.array(value), np.array(expected[name]), err_msg=name)
    dense = gguf.dequantize_all(converted, quant, mx.float32)
    assert dense["model.layers.0.self_attn.q_proj.weight"].shape == \
        weights["model.layers.0.self_attn.q_proj.weight"].shape


def test_config_and_tokenizer_files(source, tmp_path):
    folder, config, _, path = source
    out = gguf.convert(path, tmp_path / "out")
    got = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "eos_token_id"):
        assert got[key] == config[key], key
    assert got["tie_word_embeddings"] is False  # the tiny model has its own output head
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == TEMPLATE
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["pad_token"] == "<|endoftext|>"
    _, wrapper = load(str(out))
    assert wrapper.eos_token_id == config["eos_token_id"]


def corpus() -> list[str]:
    texts = [p.read_text(encoding="utf-8", errors="replace")[:20_000] for p in stdlib_files()[:40]]
    return texts + [
        "<|im_start|>user\nHi 12345 there<|im_end|>\n",
        "naïve café — 東京 🙂 x=3.14159; y = 10_000\r\n\ttabs  and   spaces",
        "  leading spaces, 2024-01-31, 0xFF, 1e-9",
    ]


def trained(pre_tokenizer) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus()[:10], trainer=trainer)
    return tok


@pytest.mark.parametrize("pre, pre_tokenizer", [
    ("gpt-2", pre_tokenizers.ByteLevel(add_prefix_space=False)),
    ("smollm", pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])),
])
def test_tokenizer_from_metadata_encodes_like_the_original(pre, pre_tokenizer):
    original = trained(pre_tokenizer)
    rebuilt = gguf.build_tokenizer(tokenizer_metadata(original, pre))
    for text in corpus():
        assert rebuilt.encode(text).ids == original.encode(text).ids
        ids = original.encode(text).ids
        assert rebuilt.decode(ids) == original.decode(ids)


def write_header_only_gguf(path: Path, tensors: dict[str, int]) -> None:
    """A GGUF header with no metadata and the given (name -> ggml type id) tensor infos."""
    parts = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), 0)]
    for name, ggml_type in tensors.items():
        parts += [struct.pack("<Q", len(name)), name.encode(), struct.pack("<I", 2),
                  struct.pack("<QQ", 256, 8), struct.pack("<IQ", ggml_type, 0)]
    path.write_bytes(b"".join(parts))


def test_unsupported_tensor_type_is_named(tmp_path):
    path = tmp_path / "k_quant.gguf"
    write_header_only_gguf(path, {"token_embd.weight": 14, "blk.0.attn_q.weight": 12})
    assert gguf.tensor_types(path) == {"token_embd.weight": "Q6_K", "blk.0.attn_q.weight": "Q4_K"}
    with pytest.raises(gguf.UnsupportedGGUF, match="Q4_K, Q6_K"):
        gguf.convert(path, tmp_path / "out")
    with pytest.raises(SystemExit, match="Q4_K"):
        convert_main([str(path), str(tmp_path / "out")])


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(gguf.UnsupportedGGUF, match="not a GGUF"):
        gguf.tensor_types(path)


def test_unsupported_architecture_is_named():
    with pytest.raises(gguf.UnsupportedGGUF, match="'qwen3moe'"):
        gguf.model_config({"general.architecture": "qwen3moe"})


def test_resolve_model_path_converts_once(source, tmp_path, monkeypatch):
    _, _, _, path = source
    assert gguf.resolve_model_path("models/demo/target") == "models/demo/target"
    calls = []
    real = gguf.convert
    monkeypatch.setattr(gguf, "convert", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = gguf.resolve_model_path(str(path), cache_dir=tmp_path)
    second = gguf.resolve_model_path(str(path), cache_dir=tmp_path)
    assert first == second and len(calls) == 1
    assert (Path(first) / "config.json").exists()
    assert not list(tmp_path.glob("*.partial"))
    with pytest.raises(FileNotFoundError):
        gguf.resolve_model_path(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)


@pytest.mark.anyio
async def test_admin_endpoints_accept_a_gguf_draft(source, tiny_pair, model_dir, tmp_path,
                                                   monkeypatch):
    from support.servers import served

    monkeypatch.setattr(gguf, "CACHE_DIR", tmp_path / "cache")
    bad = model_dir / "pair" / "k_quant.gguf"
    write_header_only_gguf(bad, {"token_embd.weight": 12})
    url = "/v1/models/draft"
    async with served(tiny_pair[0], None, model_roots=[model_dir]) as (client, _):
        r = await client.post(f"{url}/compatibility", json={"model": str(source[3])})
        assert r.json() == {"compatible": True, "reason": None}
        r = await client.post(f"{url}/compatibility", json={"model": str(bad)})
        assert r.json()["compatible"] is False and "Q4_K" in r.json()["reason"]
        r = await client.post(url, json={"model": str(bad)})
        assert r.status_code == 400 and "Q4_K" in r.json()["error"]["message"]
        r = await client.post(url, json={"model": str(source[3])})
        assert r.status_code == 200, r.text
        draft = [m for m in (await client.get("/v1/models")).json()["data"]
                 if m["role"] == "draft"]
        assert Path(draft[0]["path"]).parent == tmp_path / "cache"
