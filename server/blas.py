"""Fast BLAS for MLX on a Linux CPU, with nothing for the user to do.

MLX's Linux CPU wheel links a reference BLAS (`mlx_cpu.libs/libblas-*.so`): fp32 matmuls run
several times slower than with OpenBLAS, which exports the same symbols. The dynamic linker
takes a symbol from the first library that defines it, so preloading Debian's OpenBLAS makes
MLX use it. `LD_PRELOAD` is read only when a process starts: `ensure_fast_blas()`, called first
thing by a command-line `main`, re-executes the process once with it set (the same interpreter
and argv, `python -m module` included). `MLX_SPEC_NO_BLAS_REEXEC=1` opts out.

Elsewhere (macOS: Accelerate; a GPU build: the GPU's own BLAS) it does nothing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

OPT_OUT_ENV = "MLX_SPEC_NO_BLAS_REEXEC"
REEXEC_MARKER_ENV = "MLX_SPEC_BLAS_REEXECED"  # set in the re-executed process: never twice
DEBIAN_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")
INSTALL_HINT = "apt-get install libopenblas0-pthread"


def ensure_fast_blas() -> None:
    """Re-exec this process with OpenBLAS preloaded when MLX would run on a slow CPU BLAS.

    Returns (doing nothing) when: not Linux, opted out, already re-executed, OpenBLAS already
    mapped, no OpenBLAS on the system, or MLX does not run on the CPU. Never returns otherwise.
    """
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT_ENV) == "1":
        return
    if os.environ.get(REEXEC_MARKER_ENV) or openblas_mapped():
        return
    library = find_openblas()
    if library is None or not mlx_on_cpu():
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (str(library), env.get("LD_PRELOAD")) if p)
    env[REEXEC_MARKER_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, reexec_argv(), env)


def reexec_argv() -> list[str]:
    """This process's command line, run by this interpreter: `sys.orig_argv` keeps
    `-m module` (and interpreter flags) where `sys.argv` has the module's file."""
    return [sys.executable, *sys.orig_argv[1:]]


def find_openblas() -> Path | None:
    """Debian's OpenBLAS, else the one `ldconfig` knows; None when there is none."""
    if DEBIAN_OPENBLAS.exists():
        return DEBIAN_OPENBLAS
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libopenblas.so") and Path(path).exists():
            return Path(path)
    return None


def mlx_on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def mapped_libraries() -> list[str]:
    """Paths of the shared libraries mapped into this process (Linux; [] elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in lines if ".so" in line and "/" in line}
    return sorted(paths)


def openblas_mapped() -> bool:
    return any("libopenblas" in Path(p).name for p in mapped_libraries())


def blas_in_use() -> str | None:
    """The BLAS library MLX's CPU matmuls use: OpenBLAS when it is mapped (it wins symbol
    lookup when preloaded), else the first BLAS mapped; None when none is (MLX not loaded)."""
    libraries = mapped_libraries()
    for path in libraries:
        if "libopenblas" in Path(path).name:
            return path
    return next((p for p in libraries if "blas" in Path(p).name.lower()), None)


def blas_report() -> tuple[int, str] | None:
    """(logging level, one line naming the BLAS; a warning with the fix when it is the slow
    one), or None where MLX does not run on a Linux CPU."""
    if not sys.platform.startswith("linux") or not mlx_on_cpu():
        return None
    blas = blas_in_use()
    if blas is not None and "libopenblas" in Path(blas).name:
        return logging.INFO, f"BLAS: OpenBLAS ({blas})"
    why = ("OpenBLAS is not installed; install it with: " + INSTALL_HINT
           if find_openblas() is None else
           f"OpenBLAS is installed but not loaded ({OPT_OUT_ENV}=1 or a failed preload)")
    return logging.WARNING, (f"BLAS: {blas or 'unknown'} (MLX's reference BLAS): CPU matmuls "
                             f"run several times slower. {why}")


def log_blas() -> None:
    """The start-up log line of `blas_report`."""
    report = blas_report()
    if report is not None:
        log.log(*report)
