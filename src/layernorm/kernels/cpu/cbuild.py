"""Compile C source files into a cached shared library: the build step of every fused CPU kernel.

Sources (``.c``/``.h`` files shipped in the package's ``csrc`` folders) include no PyTorch
headers, so a build takes about a second with the system C compiler. The one C++ library, the
norms' operators and the recurrent training node (:func:`build_torch_library`, ``csrc_torch``),
is built against PyTorch's headers and libraries with the system C++ compiler (some 40 s),
PyTorch's version in its key, and kept only once an error raised in it reaches Python in a child
process.
Headers are found next to the sources (``-I`` each source's folder). Libraries are cached under
``$LAYERNORM_CACHE_DIR`` (default ``~/.cache/layernorm``; which folders are trusted, and which
libraries are loaded, is :mod:`.cache`'s business), keyed by a hash of the content of every
source and header in those folders, the flags, the compiler and the CPU's instruction sets (the
default target is ``-march=native``), so a changed kernel or another machine never loads a stale
binary. They link
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
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
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


#: The suffixes of the files a build may read: C and C++ sources and headers.
SOURCE_SUFFIXES = (".c", ".h", ".cpp")


def source_files(sources: Sequence[Path], include_dirs: Sequence[Path] = ()) -> list[Path]:
    """Every source and header a build of ``sources`` may read: the sources and the
    :data:`SOURCE_SUFFIXES` files of their folders and of ``include_dirs`` (headers are found
    there), sorted, each once."""
    found = {Path(s).resolve() for s in sources}
    for folder in {p.parent for p in found} | {Path(d).resolve() for d in include_dirs}:
        found.update(p.resolve() for p in folder.iterdir() if p.suffix in SOURCE_SUFFIXES)
    return sorted(found)


def _digest(head: Sequence[str], srcs: Sequence[Path], include_dirs: Sequence[Path] = ()) -> str:
    """The cache key of a build: ``head`` (flags, compiler, what the binary links) and the
    content of every file it may read (:func:`source_files`)."""
    digest = hashlib.sha256("\n".join(head).encode())
    for path in source_files(srcs, include_dirs):
        # the name too: the same text as another file must not collide; folders may move
        digest.update(f"\0{path.name}\0".encode())
        digest.update(path.read_bytes())
    digest.update("\0".join(p.name for p in srcs).encode())
    return digest.hexdigest()[:16]


def _compile(
    cmd: list[str], out: Path, stem: str, check: Callable[[Path], str | None] | None = None
) -> None:
    """Run the compiler command ``cmd`` (its last output argument is added here) into a
    temporary file beside ``out``; if ``check`` finds no fault in that file (it returns why it
    is unfit, or ``None``), move the sealed result to ``out``."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        full = [*cmd, "-o", str(tmp_so)]
        proc = subprocess.run(full, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(full)} failed:\n{proc.stderr[-2000:]}")
        if proc.stderr.strip():
            warnings.warn(
                f"layernorm: compiler warnings building {stem}:\n{proc.stderr[-4000:]}",
                RuntimeWarning,
                stacklevel=3,
            )
        reason = check(tmp_so) if check is not None else None
        if reason is not None:
            raise RuntimeError(f"{cmd[0]} built {stem}, but {reason}")
        cache.seal(tmp_so)
        os.replace(tmp_so, out)  # atomic: concurrent builders never see a half-written library


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
    key = _digest([" ".join(flags), cc, gomp or "", cpu_flags()], srcs)
    out = cache_dir() / f"{stem}_{key}.so"
    if out.exists():
        return out
    # Link PyTorch's own libgomp when it has one (same soname, so the loader maps it once).
    link = [gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"] if gomp else []
    _compile([cc, *flags, *includes, *map(str, srcs), *link, "-lm"], out, stem)
    return out


def cxx_compilers() -> list[str]:
    """The C++ compilers to try, in order: ``$CXX``, then every ``c++`` and every ``g++`` on
    ``PATH``, each file once. More than one, because a compiler can build a library that loads and
    runs but whose C++ exceptions kill the process instead of reaching Python: seen on an Intel
    Xeon host whose first ``g++`` was a wrapper of GCC 13 with start files of its own, where the
    system's ``g++`` beside it built working libraries (:func:`build_torch_library` tries the
    next)."""
    folders = os.environ.get("PATH", os.defpath).split(os.pathsep)
    found = [shutil.which(os.environ["CXX"])] if os.environ.get("CXX") else []
    found += [shutil.which(name, path=folder) for name in ("c++", "g++") for folder in folders]
    seen: set[str] = set()
    compilers = []
    for path in filter(None, found):
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            compilers.append(path)
    return compilers


def cxx_compiler() -> str | None:
    """The first of :func:`cxx_compilers`; ``None`` when there is none."""
    return next(iter(cxx_compilers()), None)


#: The flags of a C++ library built against PyTorch's headers (on top of the ABI define and the
#: include folders). vptr checks are left out of a sanitized build: they need the run-time type
#: information of PyTorch's own classes, which its libraries were not built to give.
TORCH_CXX_FLAGS = ("-O2", "-std=c++20", "-fPIC", "-shared", "-Wall", "-Wextra")
TORCH_SANITIZE_FLAGS = (*SANITIZE_FLAGS, "-fno-sanitize=vptr")


def torch_cxx_flags() -> tuple[str, ...]:
    """The compiler flags of a C++ library that uses PyTorch's C++ API (all in the cache key):
    :data:`TORCH_CXX_FLAGS`, PyTorch's C++ ABI, its headers as system headers (their warnings are
    not this project's) and, with ``LAYERNORM_CPU_SANITIZE=1``, the sanitizers."""
    import torch  # here, not at import: the C kernels' builds do not need it

    root = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    sanitize = TORCH_SANITIZE_FLAGS if sanitizing() else ()
    return (
        *TORCH_CXX_FLAGS,
        *sanitize,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-isystem",
        str(root / "include"),
    )


def torch_link_flags() -> tuple[str, ...]:
    """Linking against this process's PyTorch (its ``lib`` folder, found at run time too)."""
    import torch

    lib = Path(torch.__file__).resolve().parent / "lib"
    return (f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10")


def build_torch_library(
    sources: Sequence[Path],
    stem: str,
    include_dirs: Sequence[Path] = (),
    *,
    error_probe: str | None = None,
) -> Path:
    """Compile the C++ files ``sources``, which use PyTorch's C++ API (operators, autograd
    nodes), into one library against this process's PyTorch, unless a matching cached build
    exists; return the library's path. ``include_dirs``: more folders to find headers in (their
    files are part of the cache key, as are PyTorch's version and folder, and the compilers).

    ``error_probe``: a Python statement that makes the library raise a C++ error (e.g. an
    operator called with a bad argument). A fresh build is loaded in a child process, which runs
    it and must see a ``RuntimeError``; a build whose error kills that process instead is thrown
    away and the next of :func:`cxx_compilers` tried.

    Raises ``RuntimeError`` naming the cause (not Linux, no compiler, each compiler's failure).
    """
    import torch

    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"the C++ operators are built on Linux only, not {sys.platform}")
    compilers = cxx_compilers()
    if not compilers:
        raise RuntimeError("no C++ compiler found (tried $CXX, and c++ and g++ on PATH)")
    srcs = [Path(s).resolve() for s in sources]
    folders = [*dict.fromkeys(p.parent for p in srcs), *(Path(d).resolve() for d in include_dirs)]
    includes = [f"-I{d}" for d in folders]
    flags = torch_cxx_flags()
    link = torch_link_flags()
    head = [" ".join(flags), " ".join(link), *compilers, torch.__version__]
    key = _digest(head, srcs, include_dirs)
    out = cache_dir() / f"{stem}_{key}.so"
    if out.exists():
        return out
    check = functools.partial(errors_reach_python, error_probe) if error_probe else None
    failures = []
    for cxx in compilers:
        try:
            _compile([cxx, *flags, *includes, *map(str, srcs), *link], out, stem, check)
            return out
        except RuntimeError as err:
            failures.append(str(err))
    raise RuntimeError("no C++ compiler built a working library:\n" + "\n".join(failures))


def errors_reach_python(probe: str, library: Path) -> str | None:
    """Why ``library``'s errors do not reach Python, or ``None`` when they do: a child process
    loads it into PyTorch and runs ``probe``, which must raise ``RuntimeError``. A child, because
    where the library's C++ exception cannot unwind through PyTorch's frames the process dies."""
    code = (
        "import sys, torch\n"
        "torch.ops.load_library(sys.argv[1])\n"
        "try:\n"
        f"    {probe}\n"
        "except RuntimeError:\n"
        "    sys.exit(0)\n"
        "sys.exit('the probe raised no RuntimeError')\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(library)], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return "raising an error in it did not return within 300 s"
    except OSError as err:  # no Python to run the check with (an embedded interpreter)
        return f"its errors could not be checked: no child Python ({sys.executable!r}: {err})"
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:  # a signal without a name (a real-time one)
            name = f"signal {-proc.returncode}"
        return (
            f"an error raised in it killed the process ({name}) instead of reaching Python: "
            "its C++ exceptions do not unwind through PyTorch's libraries"
        )
    return f"raising an error in it failed:\n{proc.stderr.strip()[-1500:]}"
