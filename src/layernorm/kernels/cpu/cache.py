"""Where the compiled kernels are cached, and the checks a cached library passes before loading.

Loading a shared library runs its code (its constructors) inside this process, so a cached library
is trusted only as far as whoever could have written it. A cache folder is used only when it is a
real directory (not a symbolic link) owned by this user and writable by no one else; a library is
loaded only when it is a regular file (not a symbolic link) owned by this user and writable by no
one else, inside such a folder. The checks are made on the open file descriptors that are loaded
(``/proc/self/fd``), so nothing can be swapped in between check and load.

Folders tried, in order: ``$LAYERNORM_CACHE_DIR``; ``$XDG_CACHE_HOME/layernorm`` or
``~/.cache/layernorm``; ``<tempdir>/layernorm-<uid>`` (the uid only keeps users apart by name: the
folder is trusted by the checks above, never by its name). When none passes, a private folder made
by :func:`tempfile.mkdtemp` serves this process and is removed at exit, with a warning that says why
(the kernels are then rebuilt by every process).

A cached library that cannot be loaded (truncated by a crash or a full disk) is removed and built
again, once; only if that fails too do the callers fall back to eager PyTorch.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import functools
import os
import shutil
import stat
import struct
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

ENV_CACHE = "LAYERNORM_CACHE_DIR"
_DIR_MODE = 0o700
_FILE_MODE = 0o600
# Descriptors of the loaded libraries stay open for the life of the process: the loader knows each
# library by the name it was opened under (``/proc/self/fd/<n>``), and a reused number would make a
# later load return the earlier library.
_LOADED_FDS: list[int] = []


class UntrustedLibraryError(RuntimeError):
    """A cached library (or its folder) that this user does not control, or that cannot be loaded.

    ``identity`` is the ``(st_dev, st_ino)`` of the file that was refused, when known, so that only
    that file is removed (another process may have put a good build in its place meanwhile).
    ``damaged`` tells a missing or unloadable file (repaired without a word) from one that someone
    placed there (worth a warning).
    """

    def __init__(
        self, message: str, identity: tuple[int, int] | None = None, damaged: bool = False
    ) -> None:
        super().__init__(message)
        self.identity = identity
        self.damaged = damaged


def _uid() -> int:
    return os.geteuid()


def _problem(st: os.stat_result, kind: str) -> str | None:
    """Why a file system object with this ``lstat``/``fstat`` result cannot be trusted, or
    ``None``: it must be a ``kind`` ("directory" or "regular file"), not a symbolic link, owned by
    this user and not writable by group or others."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    is_kind = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if not is_kind(st.st_mode):
        return f"is not a {kind}"
    if st.st_uid != _uid():
        return f"belongs to uid {st.st_uid}, not to this user (uid {_uid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot serve as the cache folder (it is created, mode 0700, when missing), or
    ``None`` when it can: a directory owned by this user, writable by no one else and by us."""
    try:
        path.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as err:
        return f"cannot be created ({err.strerror or err})"
    reason = _problem(st, "directory")
    if reason is None and not os.access(path, os.W_OK | os.X_OK):
        reason = "is not writable"
    return reason


def _candidates() -> list[tuple[Path, bool]]:
    """The folders to try, in order, each with whether it was named by ``$LAYERNORM_CACHE_DIR``
    (then even one that cannot be created is worth a warning)."""
    explicit = os.environ.get(ENV_CACHE)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    shared = Path(tempfile.gettempdir()) / f"layernorm-{_uid()}"
    found: list[tuple[Path, bool]] = [] if not explicit else [(Path(explicit), True)]
    return [*found, (Path(base) / "layernorm", False), (shared, False)]


def cache_dir() -> Path:
    """The first trusted folder of :func:`_candidates`, else this process's private folder.

    A folder skipped because it exists but fails the checks (or was named by
    ``$LAYERNORM_CACHE_DIR``) is named in a warning, and so is the fall-back to a private folder;
    a default folder that cannot be created (HOME=/nonexistent, as for service accounts) is not.
    """
    tried, noteworthy = [], []
    chosen = None
    for path, explicit in _candidates():
        reason = folder_problem(path)
        if reason is None:
            chosen = path
            break
        tried.append(f"{path} {reason}")
        if explicit or not reason.startswith("cannot be created"):
            noteworthy.append(tried[-1])
    if chosen is not None and not noteworthy:
        return chosen
    if chosen is None:
        chosen = _private_dir()
        where = f"building the kernels in {chosen}, a private folder for this process"
    else:
        where = f"using {chosen}"
    warnings.warn(
        "layernorm: not using the kernel cache folder "
        + "; ".join(noteworthy or tried)
        + f" ({where}). A cache folder must be a directory of this user that no one else can "
        "write: `chmod go-w` it, or set LAYERNORM_CACHE_DIR to one.",
        RuntimeWarning,
        stacklevel=2,
    )
    return chosen


@functools.cache
def _private_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="layernorm-"))  # mode 0700, a fresh name: ours alone
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def seal(path: Path) -> None:
    """Give a freshly built library its final mode (read-write for this user only) and write it to
    disk before it is renamed into the cache, so that a crash cannot leave a cut library under the
    final name."""
    os.chmod(path, _FILE_MODE)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_library(path: Path) -> ctypes.CDLL:
    """Load the library at ``path`` if it and its folder pass the checks.

    Raises :class:`UntrustedLibraryError` naming the reason; a library the loader rejects
    (truncated, not an ELF file) raises it too, with the loader's message.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        dir_fd = os.open(path.parent, flags | os.O_DIRECTORY)
    except OSError as err:
        raise UntrustedLibraryError(f"cannot open {path.parent} ({err.strerror})") from err
    try:
        reason = _problem(os.fstat(dir_fd), "directory")
        if reason is not None:
            raise UntrustedLibraryError(f"cache folder {path.parent} {reason}")
        try:
            # O_NONBLOCK: a FIFO under the library's name must not hang the open
            fd = os.open(path.name, flags | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as err:
            identity = _identity(path)
            if err.errno == errno.ELOOP:
                raise UntrustedLibraryError(f"{path} is a symbolic link", identity) from err
            missing = err.errno == errno.ENOENT
            raise UntrustedLibraryError(
                f"cannot open {path} ({err.strerror})", identity, damaged=missing
            ) from err
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        identity = (st.st_dev, st.st_ino)
        reason = _problem(st, "regular file")
        if reason is not None:
            raise UntrustedLibraryError(f"{path} {reason}", identity)
        reason = _elf_problem(fd, st.st_size)
        if reason is not None:
            raise UntrustedLibraryError(f"cannot load {path} ({reason})", identity, damaged=True)
        by_fd = f"/proc/self/fd/{fd}"
        try:
            lib = ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(path))
        except OSError as err:
            raise UntrustedLibraryError(
                f"cannot load {path} ({err})", identity, damaged=True
            ) from err
    except BaseException:
        os.close(fd)
        raise
    _LOADED_FDS.append(fd)
    return lib


# ELF header fields, (format, offset), of e_phoff, e_shoff, e_phentsize, e_phnum, e_shentsize and
# e_shnum; then a program header's p_type, p_offset, p_filesz. Keyed by EI_CLASS (1: 32, 2: 64 bit).
_ELF_HEADER = {
    1: (("I", 0x1C), ("I", 0x20), ("H", 0x2A), ("H", 0x2C), ("H", 0x2E), ("H", 0x30)),
    2: (("Q", 0x20), ("Q", 0x28), ("H", 0x36), ("H", 0x38), ("H", 0x3A), ("H", 0x3C)),
}
_ELF_SEGMENT = {1: (("I", 0), ("I", 4), ("I", 0x10)), 2: (("I", 0), ("Q", 8), ("Q", 0x20))}
_PT_LOAD = 1


def _elf_problem(fd: int, size: int) -> str | None:
    """Why the ELF file open as ``fd`` is not whole, or ``None``. The loader maps segments by the
    sizes the headers state, and touching a page past the end of a truncated file kills the
    process with SIGBUS, so a library cut short by a crash or a full disk is caught here."""
    head = os.pread(fd, 64, 0)
    if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in _ELF_HEADER:
        return "not an ELF shared library"
    order = "<" if head[5] == 1 else ">"

    def field(buf: bytes, spec: tuple[str, int]) -> int:
        return struct.unpack_from(order + spec[0], buf, spec[1])[0]

    phoff, shoff, phentsize, phnum, shentsize, shnum = (
        field(head, f) for f in _ELF_HEADER[head[4]]
    )
    if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size:
        return f"truncated: its headers reach past its {size} bytes"
    table = os.pread(fd, phnum * phentsize, phoff)
    p_type, p_offset, p_filesz = _ELF_SEGMENT[head[4]]
    for i in range(phnum):
        entry = table[i * phentsize : (i + 1) * phentsize]
        if len(entry) < phentsize:
            return "truncated program headers"
        if (
            field(entry, p_type) == _PT_LOAD
            and field(entry, p_offset) + field(entry, p_filesz) > size
        ):
            return f"truncated: a segment reaches past its {size} bytes"
    return None


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _discard(path: Path, identity: tuple[int, int] | None) -> None:
    """Remove ``path`` if it is still the file that was refused (a concurrent builder may already
    have renamed a good library over it, which must stay)."""
    if identity is not None and _identity(path) == identity:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def load_library(build: Callable[[], Path]) -> ctypes.CDLL:
    """``build()`` the library (or find it cached) and load it. A cached library that is refused
    (damaged, or not a regular file of this user) is removed and built again once; the error of
    that second attempt propagates to the caller, which falls back to eager PyTorch."""
    path = build()
    try:
        return open_library(path)
    except UntrustedLibraryError as err:
        if not err.damaged:  # damage is repaired quietly; a file someone placed there is not
            warnings.warn(
                f"layernorm: rebuilding a refused library: {err}", RuntimeWarning, stacklevel=2
            )
        _discard(path, err.identity)
    return open_library(build())
