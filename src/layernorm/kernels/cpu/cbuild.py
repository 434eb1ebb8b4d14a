"""Compile C source files into a cached shared library: the build step of every fused CPU kernel.

Sources (``.c``/``.h`` files shipped in the package's ``csrc`` folders) include no PyTorch
headers, so a build takes about a second with the system C compiler. Headers are found next to the
sources (``-I`` each source's folder). Libraries are cached under ``$LAYERNORM_CACHE_DIR``
(default ``~/.cache/layernorm``; which folders are trusted, and which libraries are loaded, is
:mod:`.cache`'s business), keyed by a hash of the content of every ``.c``/``.h`` file in
those folders, the flags, the compiler and the CPU's instruction sets (the default target is
``-march=native``), so a changed kernel or another machine never loads a stale binary. They link
the ``libgomp`` that PyTorch has already loaded, so both share one OpenMP thread pool.

Builds use ``-Wall -Wextra``; the compiler's warnings are shown as a ``RuntimeWarning``.
``LAYERNORM_CPU_SANITIZE=1`` adds AddressSanitizer and UndefinedBehaviorSanitizer (a separate
cache entry; the process must preload their runtimes, see the Makefile's ``sanitize`` target).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

from . import cache

ENV_CACHE = cache.ENV_CACHE
ENV_SANITIZE = "LAYERNORM_CPU_SANITIZE"
BASE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-Wall", "-Wextra")
#: The instruction-set target when the caller names none.
NATIVE_ISA = ("-march=native",)
SANITIZE_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-omit-frame-pointer",
    "-fno-sanitize-recover=undefined",
)


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


@functools.cache
def accepts_flags(flags: tuple[str, ...]) -> bool:
    """Whether the C compiler accepts ``flags``: an older one may not know an instruction-set
    extension (GCC before 10 has no ``-mavx512bf16``), and a target it cannot build must not be
    chosen (its build would fail and leave the eager fallback). True without a compiler (nothing
    is built then) or flags."""
    cc = compiler()
    if cc is None or not flags:
        return True
    try:
        done = subprocess.run(
            [cc, *flags, "-x", "c", "-fsyntax-only", "-"],
            input=b"int layernorm_probe;\n",
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def sanitizing() -> bool:
    """True when ``LAYERNORM_CPU_SANITIZE=1``: build with ASan + UBSan."""
    return os.environ.get(ENV_SANITIZE, "0") == "1"


def build_flags(
    extra_flags: Sequence[str] = (), isa_flags: Sequence[str] = NATIVE_ISA
) -> tuple[str, ...]:
    """The compiler flags of a build (all part of the cache key)."""
    sanitize = SANITIZE_FLAGS if sanitizing() else ()
    return (*BASE_FLAGS, *isa_flags, *sanitize, *extra_flags)


def source_files(sources: Sequence[Path]) -> list[Path]:
    """Every ``.c``/``.h`` file a build of ``sources`` may read: the sources and their folders'
    C files (headers are found there), sorted, each once."""
    found = {Path(s).resolve() for s in sources}
    for folder in {p.parent for p in found}:
        found.update(p.resolve() for p in folder.iterdir() if p.suffix in (".c", ".h"))
    return sorted(found)


def build_shared_library(
    sources: Sequence[Path],
    stem: str,
    extra_flags: Sequence[str] = (),
    *,
    isa_flags: Sequence[str] = NATIVE_ISA,
) -> Path:
    """Compile the C files ``sources`` into one library unless a matching cached build exists;
    return the library's path. ``isa_flags`` picks the instruction-set target.

    Raises ``RuntimeError`` naming the cause (not Linux, no compiler, compiler error); callers
    fall back to their eager PyTorch paths.
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"the fused CPU kernels are built on Linux only, not {sys.platform}")
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (tried $CC, cc, gcc)")
    gomp = loaded_libgomp()
    srcs = [Path(s).resolve() for s in sources]
    includes = [f"-I{d}" for d in dict.fromkeys(p.parent for p in srcs)]
    flags = build_flags(extra_flags, isa_flags)
    digest = hashlib.sha256("\n".join([" ".join(flags), cc, gomp or "", cpu_flags()]).encode())
    for path in source_files(srcs):
        # the name too: the same text as another file must not collide; folders may move
        digest.update(f"\0{path.name}\0".encode())
        digest.update(path.read_bytes())
    digest.update("\0".join(p.name for p in srcs).encode())
    key = digest.hexdigest()[:16]
    out = cache_dir() / f"{stem}_{key}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        # Link PyTorch's own libgomp when it has one (same soname, so the loader maps it once).
        link = [gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"] if gomp else []
        cmd = [cc, *flags, *includes, *map(str, srcs), "-o", str(tmp_so), *link, "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        if proc.stderr.strip():
            warnings.warn(
                f"layernorm: compiler warnings building {stem}:\n{proc.stderr[-4000:]}",
                RuntimeWarning,
                stacklevel=2,
            )
        cache.seal(tmp_so)
        os.replace(tmp_so, out)  # atomic: concurrent builders never see a half-written library
    return out
