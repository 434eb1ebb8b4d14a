"""The kernels' argument description (:mod:`layernorm.kernels.cpu.abi`) and what follows from it:
the checked-in C header, the ctypes structs, the checks before C sees a pointer."""

from __future__ import annotations

import ctypes

import pytest

from layernorm.kernels.cpu import abi


def test_checked_in_header_is_the_generated_one():
    """The compiler and sanitizers read the file on disk; it must be what abi.py describes
    (regenerate with ``python -m layernorm.kernels.cpu.abi``)."""
    assert abi.header_path().read_text() == abi.c_header()


@pytest.mark.parametrize("kernel", abi.KERNELS, ids=lambda k: k.name)
def test_every_field_has_a_rule(kernel):
    names = [a.name for a in kernel.args]
    assert len(set(names)) == len(names)
    assert names.count("x") == 1
    for a in kernel.args:
        if a.role is not abi.Role.SCALAR:
            assert set(a.shape) <= {"M", "N"} and a.shape
        else:
            assert not a.shape and not a.optional


@pytest.mark.parametrize("dtype", list(abi.INSTANCES))
def test_struct_fields_follow_the_description(dtype):
    for kernel in abi.KERNELS:
        struct = abi.structure(kernel, dtype)
        assert [f[0] for f in struct._fields_] == [a.name for a in kernel.fields()]
        for a in kernel.args:
            want = ctypes.c_void_p if a.role is not abi.Role.SCALAR else None
            if want is not None:
                assert dict(struct._fields_)[a.name] is want
