"""One entry of the disk prefix cache as a file: `mlx_lm`'s prompt-cache format.

What `save_prompt_cache(caches, metadata)` writes (safetensors: the caches' states flattened,
with their classes, scalars and our metadata in the header), built here from numpy copies so
that a thread which never touches MLX can write it; read back with `load_prompt_cache`. The
name is `<hash of key and token ids>-<CRC-32 of the whole file>.safetensors`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
)

from server.engine.kv.layers import arrays_of, leaves

FORMAT = "mlx-spec-server/prefix-cache/1"
NAME = re.compile(r"^([0-9a-f]{32})-([0-9a-f]{8})\.safetensors$")
_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int32: "I32",
           mx.int64: "I64", mx.uint32: "U32", mx.uint8: "U8", mx.int8: "I8"}  # ids, counts


@dataclass
class DiskEntry:
    path: Path
    key: str
    tokens: np.ndarray
    nbytes: int
    used: float  # last written or read (the file's modification time)
    paths: dict[str, str] = field(default_factory=dict)  # fingerprint -> model path
    # Whether its caches can be cut to a shorter prefix (not a recurrent state, nor a window
    # once full): only then may a prompt that shares part of its tokens use it.
    trimmable: bool = True


def entry_name(key: str, tokens: np.ndarray) -> str:
    h = hashlib.sha256(key.encode())
    h.update(tokens.astype("<i8").tobytes())
    return h.hexdigest()[:32]


def prompt_cache_layout(caches: list, meta: dict[str, str]):
    """What `save_prompt_cache(caches, meta)` would write - its tensors (as host copies) and
    its header metadata - for caches cut to what they hold (their buffers run longer)."""
    caches = [_held(c) for c in caches]
    scalars: list = [""]
    arrays = []
    for path, value in tree_flatten([c.state for c in caches]):
        if not isinstance(value, mx.array):  # as save_prompt_cache's map_data stores them
            value, kind = _scalar(value)
            scalars.append((path, kind))
        arrays.append((path, *_host_copy(value)))
    classes = [type(c).__name__ for c in caches]
    meta = {**meta, "trimmable": "1" if can_trim_prompt_cache(caches) else "0"}
    return arrays, dict(tree_flatten([meta, classes, scalars]))


def _held(cache):
    """A request's cache with its buffers cut to the tokens it holds, in order."""
    if isinstance(cache, KVCache):
        held = KVCache()
        held.keys, held.values = (a[..., : cache.offset, :] for a in (cache.keys, cache.values))
        held.offset = cache.offset
        return held
    if isinstance(cache, RotatingKVCache):
        held = RotatingKVCache(cache.max_size, cache.keep)
        count = min(cache.offset, cache.keys.shape[2])
        held.keys, held.values = (cache._temporal_order(a)[..., -count:, :]
                                  for a in (cache.keys, cache.values))
        held.offset, held._idx = cache.offset, count
        return held
    if isinstance(cache, CacheList):
        return CacheList(*(_held(c) for c in cache.caches))
    return cache  # a recurrent state: its arrays are what it holds


def _scalar(value) -> tuple[mx.array, str]:
    if isinstance(value, str):
        return mx.array([ord(c) for c in value]), "string"
    if value is None:
        return mx.array([]), "none"
    return mx.array(value), "scalar"


def _host_copy(array: mx.array) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(safetensors dtype, shape, a numpy copy of the bytes): numpy has no bfloat16, so 16-bit
    floats travel as their bits."""
    dtype = _DTYPES.get(array.dtype)
    if dtype is None:
        raise ValueError(f"cannot store a {array.dtype} cache")
    bits = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
    return dtype, tuple(array.shape), np.array(bits, copy=True)


def write_temp_file(directory: Path, name: str, arrays: list,
                    metadata: dict[str, str]) -> tuple[Path, Path]:
    """Write a safetensors file of `arrays` ((path, dtype, shape, numpy data)) and `metadata`
    under a temporary name: (that path, the final path, named by its CRC-32). No MLX here."""
    header, offset = {}, 0
    for path, dtype, shape, data in arrays:
        header[path] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    prefix = struct.pack("<Q", len(head)) + head
    crc = zlib.crc32(prefix)
    for *_, data in arrays:
        crc = zlib.crc32(memoryview(data).cast("B"), crc)
    final = directory / f"{name}-{crc:08x}.safetensors"
    tmp = directory / f".tmp-{name}-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(prefix)
            for *_, data in arrays:
                f.write(memoryview(data).cast("B"))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, final


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors header of `path` and the file size it implies."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 64 * 2**20:
            raise ValueError("header length out of range")
        header = json.loads(f.read(length))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    return header, 8 + length + end


def read_entry(path: Path) -> DiskEntry | None:
    """The index entry of one file; None for a file of another format (left alone)."""
    header, size = read_header(path)
    meta = header.get("__metadata__", {})
    if meta.get("0.format") != FORMAT:
        return None
    st = path.stat()
    if st.st_size != size:
        raise ValueError(f"{st.st_size} bytes, its header says {size}")
    tokens = np.array([int(t) for t in meta["0.tokens"].split(",")], dtype=np.int64)
    paths = json.loads(meta.get("0.paths", "{}"))
    return DiskEntry(path, meta["0.key"], tokens, st.st_size, st.st_mtime, paths,
                     meta.get("0.trimmable", "1") == "1")


def load_checked(entry: DiskEntry) -> list[KVCache]:
    crc = 0
    with open(entry.path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            crc = zlib.crc32(chunk, crc)
    if f"{crc:08x}" != NAME.match(entry.path.name).group(2):
        raise ValueError("checksum mismatch")
    cache, meta = load_prompt_cache(str(entry.path), return_metadata=True)
    tokens = np.array([int(t) for t in meta["tokens"].split(",")], dtype=np.int64)
    if meta.get("key") != entry.key or not np.array_equal(tokens, entry.tokens):
        raise ValueError("key or tokens differ from the index")
    if any(getattr(c, "offset", len(tokens)) != len(tokens) for c in leaves(cache)):
        raise ValueError("caches do not cover the entry's tokens")
    mx.eval(arrays_of(cache))
    return cache
