"""Building the C++ library against PyTorch: which compilers are tried, and a build whose errors
would kill the process is thrown away.

On one host (an Intel Xeon beside a GPU) the first ``g++`` on PATH was a wrapper of GCC 13 with
start files of its own: the operators it built loaded and ran, but any error raised in them (an
operator called with a bad argument) killed the process with SIGSEGV, while the system's ``g++``
beside it built libraries whose errors reached Python. The wrapper here reproduces the effect on
any machine (its builds abort where the error would be raised).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from layernorm.kernels.cpu import _native, cache, cbuild

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or cbuild.cxx_compiler() is None,
    reason="the C++ library is built on Linux with a C++ compiler only",
)

SOURCE = """\
#include <cstdlib>
#include <torch/library.h>

void fail(int64_t code) {
#ifdef BUILD_TEST_ABORTS
  std::abort();  // what a build whose exceptions cannot unwind through PyTorch amounts to
#endif
  TORCH_CHECK(false, "fail: called with ", code);
}

TORCH_LIBRARY(layernorm_build_test, m) { m.def("fail(int code) -> ()", fail); }
"""
PROBE = "torch.ops.layernorm_build_test.fail(3)"


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def source(tmp_path, monkeypatch):
    """The test library's source, and an empty cache folder of this test's own."""
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(cache.ENV_CACHE, str(folder))
    src = tmp_path / "src" / "fail.cpp"
    src.parent.mkdir()
    src.write_text(SOURCE)
    return src


@pytest.fixture
def crashing_compiler(tmp_path):
    """A compiler whose libraries die where they should raise: the real one plus a define."""
    real = cbuild.cxx_compiler()
    folder = tmp_path / "wrapper"
    folder.mkdir()
    return str(_executable(folder / "g++", f'#!/bin/sh\nexec {real} -DBUILD_TEST_ABORTS "$@"\n'))


def test_compilers_are_cxx_then_each_on_path_once(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    gxx_a = _executable(first / "g++", "#!/bin/sh\n")
    gxx_b = _executable(second / "g++", "#!/bin/sh\n")
    (second / "c++").symlink_to(gxx_a)  # the same compiler as a/g++ by another name
    monkeypatch.setenv("PATH", f"{first}{os.pathsep}{second}")
    monkeypatch.delenv("CXX", raising=False)
    assert cbuild.cxx_compilers() == [str(second / "c++"), str(gxx_b)]
    monkeypatch.setenv("CXX", str(gxx_b))
    assert cbuild.cxx_compilers() == [str(gxx_b), str(second / "c++")]
    assert cbuild.cxx_compiler() == str(gxx_b)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    monkeypatch.delenv("CXX")
    assert cbuild.cxx_compilers() == [] and cbuild.cxx_compiler() is None


def test_errors_reach_python_tells_a_raise_from_a_crash():
    library = _native._build()  # any library loads; the probes stand in for its errors
    assert cbuild.errors_reach_python("raise RuntimeError('fine')", library) is None
    crash = cbuild.errors_reach_python("import os; os.abort()", library)
    assert crash is not None and "SIGABRT" in crash and "killed the process" in crash
    silent = cbuild.errors_reach_python("pass", library)
    assert silent is not None and "raised no RuntimeError" in silent
    # a signal without a name in the signal module (a real-time one) is named by its number
    unnamed = cbuild.errors_reach_python(
        "import os, signal; os.kill(os.getpid(), signal.SIGRTMIN + 1)", library
    )
    assert unnamed is not None and "killed the process (signal " in unnamed


def test_errors_unchecked_without_a_child_python(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    reason = cbuild.errors_reach_python("pass", tmp_path / "lib.so")
    assert reason is not None and "could not be checked" in reason


def test_a_build_whose_errors_kill_the_process_is_refused(source, crashing_compiler, monkeypatch):
    monkeypatch.setattr(cbuild, "cxx_compilers", lambda: [crashing_compiler])
    with pytest.raises(RuntimeError, match=r"(?s)no C\+\+ compiler built.*SIGABRT"):
        cbuild.build_torch_library([source], "build_test", error_probe=PROBE)
    assert list(cache.cache_dir().iterdir()) == []  # nothing cached, no temporary left


def test_the_next_compiler_builds_when_the_first_ones_library_crashes(
    source, crashing_compiler, monkeypatch
):
    tried = []
    compile_ = cbuild._compile

    def recording(cmd, *args):
        tried.append(cmd[0])
        compile_(cmd, *args)
        tried.append("ok")

    # every compiler of this machine after the wrapper: the first of them may crash too (as on
    # the host described above, where $CXX was the wrapper)
    compilers = [crashing_compiler, *cbuild.cxx_compilers()]
    monkeypatch.setattr(cbuild, "cxx_compilers", lambda: compilers)
    monkeypatch.setattr(cbuild, "_compile", recording)
    built = cbuild.build_torch_library([source], "build_test", error_probe=PROBE)
    assert tried[0] == crashing_compiler and tried[1] != "ok" and tried[-1] == "ok"
    assert built.parent == cache.cache_dir() and [*built.parent.iterdir()] == [built]
    assert cbuild.errors_reach_python(PROBE, built) is None
    # cached: found again without building
    monkeypatch.setattr(cbuild, "_compile", lambda *a, **k: pytest.fail("built again"))
    assert cbuild.build_torch_library([source], "build_test", error_probe=PROBE) == built
