"""The kernels' argument description (:mod:`layernorm.kernels.cpu.abi`) and what follows from it:
the checked-in C header, the ctypes structs, the checks before C sees a pointer."""

from __future__ import annotations

import ctypes

import pytest
import torch

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


def test_instances_cover_every_float_dtype():
    """float32/float64 compute in their own type, the half types in float32; the C header names
    each instance's storage and compute types in its structs."""
    header = abi.c_header()
    for dtype, inst in abi.INSTANCES.items():
        assert inst.compute_dtype == (dtype if dtype in (torch.float32, torch.float64)
                                      else torch.float32)  # fmt: skip
        assert f"const {inst.c_type}* x;" in header
        assert f"int ln_fwd_{inst.suffix}(const ln_fwd_args_{inst.suffix}* a);" in header
        ln_fwd = abi.BY_NAME["ln_fwd"]
        assert abi.expected_dtype(ln_fwd.arg("weight").dtype, dtype) == inst.compute_dtype
        assert abi.expected_dtype(ln_fwd.arg("weight").dtype, dtype, 1) == dtype
        assert abi.expected_dtype(ln_fwd.arg("mean").dtype, dtype, 1) == inst.compute_dtype
        assert abi.expected_dtype(ln_fwd.arg("mean").dtype, dtype) == inst.compute_dtype
        assert abi.expected_dtype(ln_fwd.arg("y").dtype, dtype) == dtype
    assert set(abi.INSTANCES) == {torch.float32, torch.float64, torch.bfloat16, torch.float16}


@pytest.mark.parametrize("dtype", list(abi.INSTANCES))
def test_struct_fields_follow_the_description(dtype):
    for kernel in abi.KERNELS:
        struct = abi.structure(kernel, dtype)
        assert [f[0] for f in struct._fields_] == [a.name for a in kernel.fields()]
        for a in kernel.args:
            want = ctypes.c_void_p if a.role is not abi.Role.SCALAR else None
            if want is not None:
                assert dict(struct._fields_)[a.name] is want


def test_kernel_sources_ship_as_package_data():
    """Every C file next to the kernels matches a package-data pattern (built on first use)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["layernorm"]
    package = abi.CSRC_DIR.parents[2]  # src/layernorm
    files = [p for p in abi.CSRC_DIR.iterdir() if p.suffix in (".c", ".h")]
    assert files
    for path in files:
        rel = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), rel


def _valid(
    kernel: abi.Kernel, dtype: torch.dtype, half_params: int = 1, m: int = 3, n: int = 5
) -> dict:
    sizes = {"M": m, "N": n}
    values: dict = {}
    for a in kernel.args:
        if a.role is not abi.Role.SCALAR:
            want = abi.expected_dtype(a.dtype, dtype, half_params)
            values[a.name] = torch.ones(tuple(sizes[s] for s in a.shape), dtype=want)
        elif a.dtype is abi.DType.FLOAT:
            values[a.name] = 0.5
        elif a.name == abi.HALF_PARAMS:
            values[a.name] = half_params
        elif a.dtype is abi.DType.FLAG:
            values[a.name] = 1
        elif a.dtype is abi.DType.COUNT:
            values[a.name] = 2
    return values


def _perturbations(kernel: abi.Kernel, values: dict):
    """(what, values with one argument broken) for every argument and every way to break it."""
    for a in kernel.args:
        if a.dtype is abi.DType.INDEX:
            continue
        v = values[a.name]
        if a.role is not abi.Role.SCALAR:
            other = torch.float64 if v.dtype == torch.float32 else torch.float32
            yield f"{a.name} dtype", {**values, a.name: v.to(other)}
            if v.dtype != values["x"].dtype:  # a compute-type tensor given in x's (half) dtype
                yield f"{a.name} in x's dtype", {**values, a.name: v.to(values["x"].dtype)}
            yield f"{a.name} short", {**values, a.name: v.reshape(-1)[:-1].clone()}
            yield f"{a.name} 3-D", {**values, a.name: v.reshape(1, *v.shape)}
            yield f"{a.name} meta", {**values, a.name: v.to("meta")}
            yield f"{a.name} list", {**values, a.name: v.tolist()}
            if v.dim() == 2 and v.shape[0] > 1 and v.shape[1] > 1:
                yield f"{a.name} strided", {**values, a.name: v.t().contiguous().t()}
            if not a.optional:
                yield f"{a.name} None", {**values, a.name: None}
        elif a.dtype is abi.DType.FLOAT:
            for bad in (float("nan"), float("inf"), "1", None, True):
                yield f"{a.name}={bad!r}", {**values, a.name: bad}
            if a.minimum is not None:
                yield f"{a.name} below", {**values, a.name: a.minimum - 1.0}
        else:
            for bad in (-1, 2 if a.dtype is abi.DType.FLAG else 0, 1.0, None):
                yield f"{a.name}={bad!r}", {**values, a.name: bad}


@pytest.mark.parametrize("half_params", [0, 1], ids=["params in compute type", "half_params"])
@pytest.mark.parametrize("outputs_made", [False, True], ids=["all", "outputs_made"])
@pytest.mark.parametrize("dtype", list(abi.INSTANCES))
@pytest.mark.parametrize("kernel", abi.KERNELS, ids=lambda k: k.name)
def test_fast_binder_agrees_with_the_described_checks(kernel, dtype, outputs_made, half_params):
    """The precompiled checks of every call refuse exactly what check_call refuses, with its
    error, and pack the same struct as pack() where both accept. With ``outputs_made`` (outputs
    allocated by the caller to measure) the same holds for every input and scalar, and a
    required output left out is still refused. ``half_params`` (the kernels that have the flag)
    decides the dtype of every PARAM tensor."""
    binder = abi.Binder(kernel)
    values = _valid(kernel, dtype, half_params)
    sizes = abi.check_call(kernel, values)
    fast, slow = binder(values, outputs_made), abi.pack(kernel, values, sizes)
    assert bytes(fast) == bytes(slow)
    outputs = {a.name for a in kernel.args if a.role is abi.Role.OUTPUT}
    count = 0
    for what, bad in _perturbations(kernel, values):
        if outputs_made and what.split()[0] in outputs and not what.endswith(" None"):
            continue  # taken as made: only its address
        if outputs_made and what == "x dtype":
            continue  # outputs made from an x of another dtype would be of that dtype
        with pytest.raises((TypeError, ValueError)) as slow_err:
            abi.check_call(kernel, bad)
        with pytest.raises(slow_err.type) as fast_err:
            binder(bad, outputs_made)
        assert str(fast_err.value) == str(slow_err.value), what
        count += 1
    assert count >= 3 * len(kernel.args) - (7 * len(outputs) if outputs_made else 0)
