"""The compiled-kernel cache: which folders and libraries are trusted, and damaged builds.

Loading a shared library runs its constructors, so a library that another user could have written
must never be loaded. Each attack plants a library whose constructor writes a marker file, under
the names the kernels are cached by, then runs a fresh "victim" process: the marker must stay
absent and the fused kernels must still load (built afresh) and give correct results. Each test
first checks that loading the planted library does write the marker, so it can fail.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import layernorm
from layernorm.kernels.cpu import _native, cache, cbuild, rnn, torch_ops

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or cbuild.compiler() is None,
    reason="the fused kernels are built on Linux with a C compiler only",
)
needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to act as a second user"
)

SRC = Path(layernorm.__file__).resolve().parents[1]
OTHER_UID = 65534  # nobody

# Runs in a fresh process: the norm and recurrent kernels against torch and the step-by-step loop.
VICTIM = r"""
import json, warnings
import torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import layernorm
    from layernorm.kernels.cpu import _native, cbuild
    from layernorm.kernels.cpu import rnn
    torch.manual_seed(0)
    x = torch.randn(6, 40, dtype=torch.float64) * 3 + 2
    y = layernorm.functional.layer_norm(x, 40)
    ln_err = (y - torch.nn.functional.layer_norm(x, (40,))).abs().max().item()
    lstm = layernorm.LayerNormLSTM(3, 5, dtype=torch.float64)
    seq = torch.randn(7, 2, 3, dtype=torch.float64)
    fused = lstm(seq)[0]
    lstm.impl = "loop"
    rnn_err = (fused - lstm(seq)[0]).abs().max().item()
    native, steps = _native.enabled(), rnn.available(seq)
    from layernorm.kernels.cpu import torch_ops
    cxx_ops = torch_ops.enabled()
print(json.dumps({
    "native": native, "steps": steps, "ln_err": ln_err, "rnn_err": rnn_err, "cxx_ops": cxx_ops,
    "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
}))
"""


def _library_names() -> list[str]:
    """The file names the kernels are cached under (the same for every user of this machine)."""
    return [_native._build().name, rnn._build().name]


def _plant(folder: Path, marker: Path) -> Path:
    """Compile a library whose constructor creates ``marker``; return its path."""
    src = folder / "planted.c"
    src.write_text(
        "#include <fcntl.h>\n#include <unistd.h>\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        f"    int fd = open({json.dumps(str(marker))}, O_WRONLY | O_CREAT, 0666);\n"
        "    if (fd >= 0) close(fd);\n}\n"
    )
    lib = folder / "planted.so"
    subprocess.run(
        [cbuild.compiler() or "cc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True
    )
    lib.chmod(0o755)
    return lib


def _env(**extra: str) -> dict[str, str]:
    """The victims' environment: no C++ operators (a C++ build against PyTorch's headers takes
    about 12 s in every fresh cache) unless ``extra`` switches them on; the same cache checks load
    them (test_truncated_library_is_rebuilt builds them)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", cache.ENV_CACHE)}
    env.update(PYTHONPATH=str(SRC), PYTHONDONTWRITEBYTECODE="1", LAYERNORM_CPU_TORCH_OPS="0")
    env.update(extra)
    return env


def _run(env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", VICTIM], env=env, capture_output=True, text=True,
        timeout=600, cwd="/",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_correct(result: dict) -> None:
    assert result["native"] and result["steps"], result  # the kernels were built afresh and load
    assert result["ln_err"] < 1e-12 and result["rnn_err"] < 1e-12, result


def _assert_loads_marker(lib: Path, marker: Path) -> None:
    """The planted library does run when loaded: the attack tests below can fail."""
    load = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    subprocess.run([sys.executable, "-c", load, str(lib)], check=True)
    assert marker.exists()
    marker.unlink()


@needs_root
def test_fallback_folder_planted_by_another_user(tmp_path):
    # The victim's home cannot hold a cache, so it falls back to <tmp>/layernorm-<uid>, which
    # another user made first (closed to others, mode 0755, so only its owner is wrong), with a
    # library of theirs under the kernels' names.
    marker = tmp_path / "marker"
    lib = _plant(tmp_path, marker)
    _assert_loads_marker(lib, marker)
    (tmp_path / "not-a-folder").write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    trap = tmp / f"layernorm-{os.geteuid()}"
    trap.mkdir(mode=0o755)
    for name in _library_names():
        shutil.copy(lib, trap / name)
        os.chown(trap / name, OTHER_UID, OTHER_UID)
    os.chown(trap, OTHER_UID, OTHER_UID)
    # a home under a regular file cannot be created, not even by root
    result = _run(_env(HOME=str(tmp_path / "not-a-folder" / "home"), TMPDIR=str(tmp)))
    assert not marker.exists()
    _assert_correct(result)
    assert any(f"belongs to uid {OTHER_UID}" in w for w in result["warnings"]), result["warnings"]
    assert sorted(p.name for p in trap.iterdir()) == sorted(_library_names())  # left alone


def test_world_writable_fallback_folder_is_not_used(tmp_path):
    # The folder is this user's own but anyone can write to it (mode 0777): a library in it may
    # be anyone's, so the kernels are built into a private folder for the process instead.
    marker = tmp_path / "marker"
    lib = _plant(tmp_path, marker)
    _assert_loads_marker(lib, marker)
    (tmp_path / "not-a-folder").write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    trap = tmp / f"layernorm-{os.geteuid()}"
    trap.mkdir()
    trap.chmod(0o777)
    for name in _library_names():
        shutil.copy(lib, trap / name)
    # a home under a regular file cannot be created, not even by root
    result = _run(_env(HOME=str(tmp_path / "not-a-folder" / "home"), TMPDIR=str(tmp)))
    assert not marker.exists()
    _assert_correct(result)
    assert any("writable by other users (mode 0777)" in w for w in result["warnings"])
    # the private folder was removed at exit; the trap folder was not written to
    assert sorted(p.name for p in tmp.iterdir()) == [trap.name]
    assert sorted(p.name for p in trap.iterdir()) == sorted(_library_names())


def _chown_other(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    os.chown(path, OTHER_UID, OTHER_UID)


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("symlink", "is a symbolic link"),
        ("group_writable", "is writable by other users"),
        ("other_owner", f"belongs to uid {OTHER_UID}"),
    ],
)
def test_refused_library_in_the_cache_is_replaced(tmp_path, how, reason):
    # A trusted cache folder holding, under a kernel library's name, a link to another file, a
    # file others can write or a file of another user: it is not loaded but rebuilt in place.
    marker = tmp_path / "marker"
    lib = _plant(tmp_path, marker)
    _assert_loads_marker(lib, marker)
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    for name in _library_names():
        if how == "symlink":
            (folder / name).symlink_to(lib)
            continue
        shutil.copy(lib, folder / name)
        if how == "group_writable":
            (folder / name).chmod(0o666)
        else:
            _chown_other(folder / name)
    result = _run(_env(**{cache.ENV_CACHE: str(folder)}))
    assert not marker.exists()
    _assert_correct(result)
    assert any(reason in w for w in result["warnings"]), result["warnings"]
    for name in _library_names():
        st = os.lstat(folder / name)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
        assert stat.S_IMODE(st.st_mode) == 0o600


def test_truncated_library_is_rebuilt(tmp_path):
    # A build cut short (crash, full disk) left truncated libraries in the cache: the next
    # processes (two at once here) rebuild them without a warning instead of running eager.
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    sizes = {}
    builds = [_native._build(), rnn._build()]
    cxx_ops = cbuild.cxx_compiler() is not None
    if cxx_ops:  # the C++ operators' library too
        builds.append(torch_ops.build())
    for built in builds:
        sizes[built.name] = built.stat().st_size
        (folder / built.name).write_bytes(built.read_bytes()[:4096])
        (folder / built.name).chmod(0o600)
    env = _env(**{cache.ENV_CACHE: str(folder), torch_ops.ENV_SWITCH: "1"})
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", VICTIM], env=env, stdout=subprocess.PIPE, text=True, cwd="/"
        )
        for _ in range(2)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0
        result = json.loads(out.strip().splitlines()[-1])
        _assert_correct(result)
        assert result["cxx_ops"] == cxx_ops
        assert result["warnings"] == []
    for name, size in sizes.items():
        assert (folder / name).stat().st_size == size
    assert sorted(p.name for p in folder.iterdir()) == sorted(sizes)  # no temporary left over


# The checks themselves, in this process.


def test_folder_checks(tmp_path):
    ok = tmp_path / "new" / "cache"
    assert cache.folder_problem(ok) is None
    assert stat.S_IMODE(ok.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o775)
    assert cache.folder_problem(loose) == "is writable by other users (mode 0775)"
    link = tmp_path / "link"
    link.symlink_to(ok)
    assert cache.folder_problem(link) == "is a symbolic link"
    (tmp_path / "file").write_text("")
    assert cache.folder_problem(tmp_path / "file").startswith("cannot be created")
    assert cache.folder_problem(tmp_path / "file" / "sub").startswith("cannot be created")


@needs_root
def test_folder_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    assert cache.folder_problem(theirs) == f"belongs to uid {OTHER_UID}, not to this user (uid 0)"


def test_untrusted_default_folders_fall_back_to_a_private_one(tmp_path, monkeypatch):
    # an explicit folder that others can write: a warning names it, and a private folder is used
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    tmp = tmp_path / "tmp"
    (tmp / f"layernorm-{os.geteuid()}").mkdir(parents=True)
    (tmp / f"layernorm-{os.geteuid()}").chmod(0o777)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(cache.ENV_CACHE, str(loose))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with pytest.warns(RuntimeWarning, match=r"loose is writable by other users.*layernorm-\d+ is"):
        got = cache.cache_dir()
    assert got == cache._private_dir()
    st = os.lstat(got)
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_refused_explicit_folder_is_named(tmp_path, monkeypatch):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o757)
    monkeypatch.setenv(cache.ENV_CACHE, str(loose))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.warns(RuntimeWarning, match=r"loose is writable by other users \(mode 0757\) "):
        got = cache.cache_dir()
    assert got == tmp_path / "xdg" / "layernorm"


def test_no_folder_at_all_is_said(tmp_path, monkeypatch):
    # nothing can be created: the private folder is used, with a warning that says why
    (tmp_path / "file").write_text("")
    (tmp_path / f"layernorm-{os.geteuid()}").write_text("")  # a file where the folder would be
    monkeypatch.delenv(cache.ENV_CACHE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"cannot be created.*private folder"):
        got = cache.cache_dir()
    assert got == cache._private_dir()


def _source(folder: Path, answer: int) -> Path:
    """A one-function C file in a folder of its own (a build hashes every C file beside it)."""
    src = folder / "src"
    src.mkdir()
    path = src / "probe.c"
    path.write_text(f"int answer(void);\nint answer(void) {{ return {answer}; }}\n")
    return path


def test_built_library_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "cache"))
    path = cbuild.build_shared_library([_source(tmp_path, 42)], "probe")
    assert path.parent == tmp_path / "cache"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert cache.open_library(path).answer() == 42
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left over


def test_open_library_refuses_a_link_and_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "cache"))
    real = cbuild.build_shared_library([_source(tmp_path, 7)], "probe")
    link = real.with_name("link.so")
    link.symlink_to(real)
    with pytest.raises(cache.UntrustedLibraryError, match=r"link\.so is a symbolic link"):
        cache.open_library(link)


@pytest.mark.parametrize("keep", [0, 40, 64, 4096, 0.5, -1])
def test_cut_library_is_refused_before_the_loader_sees_it(tmp_path, monkeypatch, keep):
    # the loader maps segments by the sizes the headers state: a cut file would kill the process
    # with SIGBUS instead of failing to load
    monkeypatch.setenv(cache.ENV_CACHE, str(tmp_path / "cache"))
    whole = _native._build().read_bytes()
    n = int(len(whole) * keep) if isinstance(keep, float) else keep % len(whole)
    cut = cbuild.cache_dir() / "cut.so"
    cut.write_bytes(whole[:n])
    cut.chmod(0o600)
    with pytest.raises(cache.UntrustedLibraryError, match=r"cut\.so .*(truncated|not an ELF)") as e:
        cache.open_library(cut)
    assert e.value.damaged
