"""`python -m server.convert FILE.gguf OUT_DIR [--dtype float32]`: llama GGUF -> mlx_lm folder."""

from __future__ import annotations

import argparse
import sys

from server.model_files.gguf import UnsupportedGGUF, convert


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m server.convert", description=__doc__)
    p.add_argument("gguf", help="Path to a llama-family .gguf file.")
    p.add_argument("out_dir", help="Folder to write (config.json, weights, tokenizer).")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="Dequantize the weights to this dtype (default: keep them quantized).")
    args = p.parse_args(argv)
    try:
        out = convert(args.gguf, args.out_dir, dtype=args.dtype)
    except (UnsupportedGGUF, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
