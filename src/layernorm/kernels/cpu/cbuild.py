"""Compile a C source into a cached shared library: the build step of every fused CPU kernel.

Sources include no PyTorch headers, so a build takes about a second with the system C compiler.
Libraries are cached under ``$LAYERNORM_CACHE_DIR`` (default ``~/.cache/layernorm``; which folders
are trusted, and which libraries are loaded, is :mod:`.cache`'s business), keyed by a
hash of the source, the flags, the compiler and the CPU's instruction sets (the build uses
``-march=native``), so a changed kernel or another machine never loads a stale binary. They link
the ``libgomp`` that PyTorch has already loaded, so both share one OpenMP thread pool.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from . import cache

ENV_CACHE = cache.ENV_CACHE
BASE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")


def cpu_flags() -> str:
    """The CPU's feature flags: part of the cache key because the build uses -march=native."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loaded_libgomp() -> str | None:
    """Path of the libgomp PyTorch already mapped into this process (Linux), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if os.path.basename(path).startswith("libgomp") and ".so" in path:
                    return path
    except OSError:
        pass
    return None


def cache_dir() -> Path:
    """The cache folder: one this user owns and no one else can write (see :mod:`.cache`)."""
    return cache.cache_dir()


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else ``cc``, else ``gcc``; ``None`` when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def build_shared_library(source: str, stem: str, extra_flags: Sequence[str] = ()) -> Path:
    """Compile ``source`` unless a matching cached build exists; return the library's path.

    Raises ``RuntimeError`` naming the cause (not Linux, no compiler, compiler error); callers
    fall back to their eager PyTorch paths.
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"the fused CPU kernels are built on Linux only, not {sys.platform}")
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (tried $CC, cc, gcc)")
    gomp = loaded_libgomp()
    flags = (*BASE_FLAGS, *extra_flags)
    key = hashlib.sha256(
        "\n".join([source, " ".join(flags), cc, gomp or "", cpu_flags()]).encode()
    ).hexdigest()[:16]
    out = cache_dir() / f"{stem}_{key}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        c_file = Path(tmp) / f"{stem}.c"
        c_file.write_text(source)
        tmp_so = Path(tmp) / out.name
        # Link PyTorch's own libgomp when it has one (same soname, so the loader maps it once).
        link = [gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"] if gomp else []
        cmd = [cc, *flags, str(c_file), "-o", str(tmp_so), *link, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        cache.seal(tmp_so)
        os.replace(tmp_so, out)  # atomic: concurrent builders never see a half-written library
    return out
