"""`python -m server.batch -i requests.jsonl -o results.jsonl`: run a file of requests offline.

The input is OpenAI's Batch API file: one JSON object per line, `{"custom_id", "method": "POST",
"url", "body"}`, `url` one of `/v1/chat/completions`, `/v1/completions`, `/v1/responses`,
`/v1/messages` and `/v1/embeddings` (with `models.embedding_model`). Each line goes to the
server's own app, in process, with as many in flight as the engine batches
(`engine.max_batch_size`), so the file is decoded with continuous batching and speculation as
requests over HTTP would be. Each result is
written as soon as it is done (so not in input order), in the Batch API's output shape:

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"},
     "error": null}

A line that is not a request (bad JSON, an unknown url, `"stream": true`) gets `"response": null`
and an `error`; a request the server refuses gets its 4xx status and error body, as over HTTP.
The model flags and `--config` are `python -m server`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from server.__main__ import parse_args as server_args
from server.__main__ import settings_from_args
from server.blas import ensure_fast_blas
from server.http.jobs.lines import run_line


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m server.batch", description=__doc__.split("\n")[0],
                                epilog="Other flags are python -m server's (--config, --model,"
                                " --draft-model, ...).")
    p.add_argument("-i", "--input", type=Path, required=True, help="Batch API input (JSONL).")
    p.add_argument("-o", "--output", type=Path, required=True, help="Where results go (JSONL).")
    p.add_argument("--concurrency", type=int, default=None,
                   help="Requests in flight (default: engine.max_batch_size).")
    args, rest = p.parse_known_args(argv)
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be at least 1")
    return args, rest


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        ensure_fast_blas()
    args, rest = parse_args(argv)
    settings = settings_from_args(server_args(rest))
    if not args.input.is_file():
        sys.exit(f"error: no such input file: {args.input}")
    lines = args.input.read_text(encoding="utf-8").splitlines()
    done = asyncio.run(run_file(settings, lines, args.output, args.concurrency))
    print(f"{done} results written to {args.output}", file=sys.stderr)


async def run_file(settings, lines: list[str], output: Path,
                   concurrency: int | None = None) -> int:
    """Serve `settings`' models in process and write one result per non-empty line."""
    from server.http.app import build_engine, create_app
    from server.model_files.bundled import ensure_default_models

    settings = ensure_default_models(settings)
    engine = build_engine(settings)
    engine.start()
    try:
        app = create_app(settings, engine)
        limit = asyncio.Semaphore(concurrency or settings.engine.max_batch_size)
        requests = [line for line in lines if line.strip()]
        client = app.state.batch_runner.http()  # the app's own client, with the server's key
        with open(output, "w", encoding="utf-8") as out, _progress(len(requests)) as bar:
            async def one(line: str) -> None:
                async with limit:
                    result = await run_line(client, line)
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                out.flush()
                bar.update(1)

            try:
                await asyncio.gather(*(one(line) for line in requests))
            finally:
                await app.state.batch_runner.close()
        return len(requests)
    finally:
        engine.stop()


def _progress(total: int):
    """A tqdm bar on stderr (tqdm comes with huggingface_hub); a no-op without it."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - mlx_lm's dependencies bring it
        from contextlib import nullcontext

        class _Quiet:
            def update(self, _):
                pass

        return nullcontext(_Quiet())
    return tqdm(total=total, unit="req", desc="batch", file=sys.stderr)


if __name__ == "__main__":
    main()
