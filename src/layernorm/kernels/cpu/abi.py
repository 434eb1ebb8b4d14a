"""One typed description of every fused CPU kernel's arguments, and what follows from it.

Each kernel takes a single pointer to an argument struct. :data:`KERNELS` lists, per kernel, every
field: its name, C type, role (input / output / scalar), dtype rule and shape rule, and whether it
may be ``NULL``. From that one list come

* the C header ``csrc/layernorm_cpu_abi.h`` (typedefs of the structs and the prototypes, with
  ``_Static_assert`` s on every field offset, so the compiler checks the layout ctypes assumes);
  :func:`c_header` generates it and a test checks the checked-in file equals it;
* the :class:`ctypes.Structure` of each kernel and dtype (:func:`structure`);
* the checks run before C sees a pointer (:func:`check_call`): dtype, device, contiguity and
  shape of every tensor, finiteness and range of every scalar.

The kernels exist for ``float`` (symbol suffix ``f32``), ``double`` (``f64``), bfloat16 (``bf16``)
and float16 (``f16``); :data:`INSTANCES` gives each one's storage type (``scalar_t``: the type of
``x`` and of every tensor of its shape) and compute type (``compute_t``: the arithmetic, the
statistics and the parameters, float32 for the half types, whose kernels also take gains and
biases in their own type: ``half_params``). Run
``python -m layernorm.kernels.cpu.abi`` to rewrite the header after changing :data:`KERNELS`.
"""

from __future__ import annotations

import ctypes
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
HEADER_NAME = "layernorm_cpu_abi.h"


class Instance(NamedTuple):
    """One instantiation of the kernels: what ``scalar_t`` and ``compute_t`` are in C."""

    c_type: str  # storage type of x (and of every (M, N) tensor)
    suffix: str  # symbol suffix: ln_fwd_<suffix>
    compute: str  # C type of the arithmetic, the statistics and (by default) the parameters
    compute_dtype: torch.dtype  # the same, as a torch dtype


#: torch dtype -> its instance. The half types are 16-bit patterns in C (``ln_bf16_t``,
#: ``ln_f16_t``: typedefs of ``uint16_t``), converted to float32 on load and back with
#: round-to-nearest-even on store.
INSTANCES: dict[torch.dtype, Instance] = {
    torch.float32: Instance("float", "f32", "float", torch.float32),
    torch.float64: Instance("double", "f64", "double", torch.float64),
    torch.bfloat16: Instance("ln_bf16_t", "bf16", "float", torch.float32),
    torch.float16: Instance("ln_f16_t", "f16", "float", torch.float32),
}
#: The C typedefs the half instances' storage types name.
_HALF_TYPEDEFS = (
    ("ln_bf16_t", "bfloat16: the upper 16 bits of a float"),
    ("ln_f16_t", "IEEE 754 binary16"),
)


class Role(enum.Enum):
    INPUT = "input"  # a tensor the kernel reads
    OUTPUT = "output"  # a tensor the kernel writes (allocated by the caller)
    SCALAR = "scalar"  # a number passed by value


class DType(enum.Enum):
    SAME = "same as x"  # the instantiated scalar_t: x's dtype
    STATS = "statistics"  # per-row mean/rstd: compute_t (float32 for half x, see stats_dtype)
    COMPUTE = "compute type"  # compute_t, as STATS (dbias, whatever the bias's dtype)
    # gains, biases and the gain's gradient: compute_t, or x's own half type where the kernel's
    # half_params flag is 1 (converted in C, not by a torch op per call); void* in C
    PARAM = "compute type, or x's with half_params"
    INDEX = "index"  # int64_t size, taken from x's shape
    FLOAT = "float"  # double scalar
    FLAG = "flag"  # int32_t, 0 or 1
    COUNT = "count"  # int32_t, >= 1


#: C type of each non-pointer field; pointers are ``scalar_t*`` or ``compute_t*`` (const for
#: inputs).
_SCALAR_CTYPES = {DType.INDEX: "int64_t", DType.FLOAT: "double", DType.FLAG: "int32_t",
                  DType.COUNT: "int32_t"}  # fmt: skip
_CTYPES_OF = {"int64_t": ctypes.c_int64, "double": ctypes.c_double, "int32_t": ctypes.c_int32}


@dataclass(frozen=True)
class Arg:
    """One field of a kernel's argument struct.

    ``shape`` names each dimension by a size symbol (``"M"`` rows, ``"N"`` columns), bound from
    ``x``; ``minimum`` is the smallest value a scalar may take (always finite).
    """

    name: str
    role: Role
    dtype: DType
    shape: tuple[str, ...] = ()
    optional: bool = False
    minimum: float | None = None
    doc: str = ""

    def c_type(self, scalar: str = "scalar_t", compute: str = "compute_t") -> str:
        if self.role is Role.SCALAR:
            return _SCALAR_CTYPES[self.dtype]
        t = {DType.SAME: scalar, DType.PARAM: "void"}.get(self.dtype, compute)
        return f"const {t}*" if self.role is Role.INPUT else f"{t}*"


@dataclass(frozen=True)
class Kernel:
    """A kernel ``int <name>_<suffix>(const <name>_args_<suffix>* a)``: 0 on success, else the
    number of an allocation that failed."""

    name: str
    doc: str
    args: tuple[Arg, ...]

    def arg(self, name: str) -> Arg:
        return next(a for a in self.args if a.name == name)

    def fields(self) -> tuple[Arg, ...]:
        """Struct order: pointers, then 8-byte scalars, then 4-byte ones (no inner padding)."""
        return tuple(sorted(self.args, key=_field_rank))


def _field_rank(a: Arg) -> int:
    if a.role is not Role.SCALAR:
        return 0
    return 1 if a.dtype in (DType.INDEX, DType.FLOAT) else 2


def _tensor(
    name: str,
    role: Role,
    shape: tuple[str, ...],
    dtype: DType = DType.SAME,
    optional: bool = False,
    doc: str = "",
) -> Arg:
    return Arg(name, role, dtype, shape, optional, None, doc)


_IN, _OUT, _SC = Role.INPUT, Role.OUTPUT, Role.SCALAR
_MN, _M, _N = ("M", "N"), ("M",), ("N",)
_SIZES = (
    Arg("M", _SC, DType.INDEX, minimum=0, doc="rows"),
    Arg("N", _SC, DType.INDEX, minimum=1, doc="elements per row"),
)
_THREADS = Arg("threads", _SC, DType.COUNT, minimum=1, doc="OpenMP threads to split rows over")
_STREAM = Arg(
    "stream", _SC, DType.FLAG, minimum=0,
    doc="1: the (M, N) output bypasses the caches (non-temporal stores of whole cache lines, "
    "not of a run under 768 bytes that is not whole lines; not in the half kernels' forwards "
    "of rows of 65 elements or more)",
)  # fmt: skip
_EPS = Arg("eps", _SC, DType.FLOAT, minimum=0.0, doc="added to the variance")
#: The flag that says which dtype the PARAM tensors have; read before them by every check.
HALF_PARAMS = "half_params"
_HALF_PARAMS = Arg(
    HALF_PARAMS, _SC, DType.FLAG, minimum=0,
    doc="1: weight, bias and dweight in x's half type (converted in C), 0: in the compute type "
    "(for float32 and float64 x the two are one)",
)  # fmt: skip
_K = Arg("k", _SC, DType.FLOAT, doc="AdaNorm's k in φ(y) = C·(1 − k·y)")
_SCALE = Arg("scale", _SC, DType.FLOAT, doc="AdaNorm's C")

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "ln_fwd",
        "Layer norm of each row: y = (x − μ)·rstd ⊙ w + b, rstd = 1/sqrt(var + eps).",
        (
            _tensor("x", _IN, _MN),
            _tensor("weight", _IN, _N, DType.PARAM, optional=True, doc="w = 1"),
            _tensor("bias", _IN, _N, DType.PARAM, optional=True, doc="b = 0"),
            _tensor("y", _OUT, _MN),
            _tensor("mean", _OUT, _M, DType.STATS),
            _tensor("rstd", _OUT, _M, DType.STATS),
            *_SIZES, _EPS, _THREADS, _STREAM, _HALF_PARAMS,
        ),
    ),
    Kernel(
        "ln_bwd",
        "Layer-norm (DetachNorm) gradients; an output left NULL is not computed.",
        (
            _tensor("dy", _IN, _MN),
            _tensor("x", _IN, _MN),
            _tensor("mean", _IN, _M, DType.STATS),
            _tensor("rstd", _IN, _M, DType.STATS),
            _tensor("weight", _IN, _N, DType.PARAM, optional=True, doc="w = 1"),
            _tensor("dx", _OUT, _MN, optional=True),
            _tensor("dweight", _OUT, _N, DType.PARAM, optional=True),
            _tensor("dbias", _OUT, _N, DType.COMPUTE, optional=True),
            *_SIZES,
            Arg("detach_mean", _SC, DType.FLAG, minimum=0, doc="1: μ is a constant in backward"),
            Arg("detach_std", _SC, DType.FLAG, minimum=0, doc="1: σ is a constant in backward"),
            _THREADS, _STREAM, _HALF_PARAMS,
        ),
    ),
    Kernel(
        "rms_fwd",
        "RMSNorm of each row: y = x·rstd ⊙ w, rstd = 1/sqrt(mean(x²) + eps).",
        (
            _tensor("x", _IN, _MN),
            _tensor("weight", _IN, _N, DType.PARAM, optional=True, doc="w = 1"),
            _tensor("y", _OUT, _MN),
            _tensor("rstd", _OUT, _M, DType.STATS),
            *_SIZES, _EPS, _THREADS, _STREAM, _HALF_PARAMS,
        ),
    ),
    Kernel(
        "rms_bwd",
        "RMSNorm gradients; an output left NULL is not computed.",
        (
            _tensor("dy", _IN, _MN),
            _tensor("x", _IN, _MN),
            _tensor("rstd", _IN, _M, DType.STATS),
            _tensor("weight", _IN, _N, DType.PARAM, optional=True, doc="w = 1"),
            _tensor("dx", _OUT, _MN, optional=True),
            _tensor("dweight", _OUT, _N, DType.PARAM, optional=True),
            *_SIZES, _THREADS, _STREAM, _HALF_PARAMS,
        ),
    ),
    Kernel(
        "ada_fwd",
        "AdaNorm of each row: z = C·(1 − k·ŷ)·ŷ, ŷ = (x − μ)·rstd.",
        (
            _tensor("x", _IN, _MN),
            _tensor("z", _OUT, _MN),
            _tensor("mean", _OUT, _M, DType.STATS),
            _tensor("rstd", _OUT, _M, DType.STATS),
            *_SIZES, _EPS, _K, _SCALE, _THREADS, _STREAM,
        ),
    ),
    Kernel(
        "ada_bwd",
        "AdaNorm input gradient, φ(ŷ) held constant (Xu et al. 2019, Eq. 10).",
        (
            _tensor("dz", _IN, _MN),
            _tensor("x", _IN, _MN),
            _tensor("mean", _IN, _M, DType.STATS),
            _tensor("rstd", _IN, _M, DType.STATS),
            _tensor("dx", _OUT, _MN),
            *_SIZES, _K, _SCALE, _THREADS, _STREAM,
        ),
    ),
    Kernel(
        "cvt",
        "The conversions every kernel makes: xf = x in compute_t; y = yf rounded to scalar_t "
        "(nearest even, NaN kept).",
        (
            _tensor("x", _IN, _MN),
            _tensor("xf", _OUT, _MN, DType.COMPUTE),
            _tensor("yf", _IN, _MN, DType.COMPUTE),
            _tensor("y", _OUT, _MN),
            *_SIZES,
        ),
    ),
)  # fmt: skip

BY_NAME: dict[str, Kernel] = {k.name: k for k in KERNELS}


# ------------------------------------------------------------------------------ ctypes side


def _ctype(arg: Arg) -> type:
    return ctypes.c_void_p if arg.role is not Role.SCALAR else _CTYPES_OF[arg.c_type()]


_STRUCTS: dict[tuple[str, torch.dtype], type[ctypes.Structure]] = {}


def structure(kernel: Kernel, dtype: torch.dtype) -> type[ctypes.Structure]:
    """The ctypes mirror of ``<kernel>_args_<suffix>`` (tensor fields are ``void*``)."""
    key = (kernel.name, dtype)
    if key not in _STRUCTS:
        suffix = INSTANCES[dtype].suffix
        fields = [(a.name, _ctype(a)) for a in kernel.fields()]
        _STRUCTS[key] = type(f"{kernel.name}_args_{suffix}", (ctypes.Structure,),
                             {"_fields_": fields})  # fmt: skip
    return _STRUCTS[key]


# ------------------------------------------------------------------------------ checks


def expected_dtype(rule: DType, x_dtype: torch.dtype, half_params: int = 0) -> torch.dtype:
    """The dtype a tensor argument must have under ``rule`` for ``x`` of ``x_dtype``: x's own for
    SAME, and for PARAM where the kernel's ``half_params`` flag is 1; else the instance's compute
    dtype (float32 for half x)."""
    if rule is DType.SAME or (rule is DType.PARAM and half_params):
        return x_dtype
    return INSTANCES[x_dtype].compute_dtype


def _has_half_params(kernel: Kernel) -> bool:
    return any(a.name == HALF_PARAMS for a in kernel.args)


def check_call(kernel: Kernel, values: Mapping[str, object]) -> dict[str, int]:
    """Check every argument of ``kernel`` against its description; return the bound sizes.

    ``values`` holds a tensor (or ``None`` where optional) for every tensor field and a number for
    every scalar field except the sizes, which are bound from ``x``. Raises ``TypeError`` for a
    wrong kind or dtype, ``ValueError`` for a wrong shape, device, layout or value, each naming
    the kernel, the argument, what was expected and what came.
    """
    op = f"layernorm CPU kernel {kernel.name}"
    x = values.get("x")
    if not isinstance(x, Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INSTANCES:
        names = ", ".join(str(d).removeprefix("torch.") for d in INSTANCES)
        raise TypeError(f"{op}: x must be one of {names}, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (M, N), got shape {tuple(x.shape)}")
    sizes = {"M": int(x.shape[0]), "N": int(x.shape[1])}
    if sizes["N"] < 1:
        raise ValueError(f"{op}: x must have at least one column, got shape {tuple(x.shape)}")
    half_params = 0
    if _has_half_params(kernel):  # first: the PARAM tensors' dtype depends on it
        half_params = values.get(HALF_PARAMS)  # type: ignore[assignment]
        _check_scalar(op, kernel.arg(HALF_PARAMS), half_params)
    for arg in kernel.args:
        if arg.dtype is DType.INDEX:
            continue
        v = values.get(arg.name)
        if arg.role is Role.SCALAR:
            _check_scalar(op, arg, v)
            continue
        if v is None:
            if arg.optional:
                continue
            raise TypeError(f"{op}: {arg.name} is required, got None")
        if not isinstance(v, Tensor):
            raise TypeError(f"{op}: {arg.name} must be a torch.Tensor, got {type(v).__name__}")
        want = expected_dtype(arg.dtype, x.dtype, half_params)
        if v.dtype != want:
            if arg.dtype is DType.SAME:
                whose = "x's"
            elif arg.dtype is DType.PARAM and half_params:
                whose = f"x's, as {HALF_PARAMS} is 1"
            else:
                whose = f"the compute type for x of {x.dtype}"
            raise TypeError(f"{op}: {arg.name} must have dtype {want} ({whose}), got {v.dtype}")
        if v.device.type != "cpu":
            raise ValueError(f"{op}: {arg.name} must be on the CPU, got {v.device}")
        shape = tuple(sizes[s] for s in arg.shape)
        if tuple(v.shape) != shape:
            dims = ", ".join(arg.shape)
            raise ValueError(f"{op}: {arg.name} must have shape ({dims}) = {shape}, "
                             f"got {tuple(v.shape)}")  # fmt: skip
        if not v.is_contiguous():
            raise ValueError(f"{op}: {arg.name} must be contiguous, got strides {v.stride()}")
    return sizes


def _check_scalar(op: str, arg: Arg, v: object) -> None:
    if arg.dtype is DType.FLOAT:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise TypeError(f"{op}: {arg.name} must be a float, got {type(v).__name__}")
        ok = -math.inf < v < math.inf and (arg.minimum is None or v >= arg.minimum)
        rule = "finite" if arg.minimum is None else f"finite and >= {arg.minimum}"
    else:
        if not isinstance(v, int):  # bool is an int: flags take True/False
            raise TypeError(f"{op}: {arg.name} must be an int, got {type(v).__name__}")
        if arg.dtype is DType.FLAG:
            ok, rule = v in (0, 1), "0 or 1"
        else:
            ok, rule = v >= (arg.minimum or 0), f">= {arg.minimum}"
    if not ok:
        raise ValueError(f"{op}: {arg.name} must be {rule}, got {v!r}")


def pack(kernel: Kernel, values: Mapping[str, object], sizes: Mapping[str, int]) -> object:
    """The argument struct for checked ``values`` (see :func:`check_call`)."""
    x = values["x"]
    assert isinstance(x, Tensor)
    struct = structure(kernel, x.dtype)()
    for arg in kernel.args:
        if arg.dtype is DType.INDEX:
            setattr(struct, arg.name, sizes[arg.name])
        elif arg.role is Role.SCALAR:
            setattr(struct, arg.name, values[arg.name])
        else:
            t = values.get(arg.name)
            setattr(struct, arg.name, None if t is None else t.data_ptr())  # type: ignore[union-attr]
    return struct


_SHAPE_CODES = {("M", "N"): 0, ("M",): 1, ("N",): 2}


class Binder:
    """:func:`check_call` then :func:`pack` for one kernel, on every call of an op.

    The same rules, precompiled into tuples so that well-formed arguments cost a few attribute
    reads each (a kernel call on a small tensor takes microseconds); anything that fails the fast
    test is handed to :func:`check_call`, which raises the error naming what is wrong.

    ``outputs_made=True`` says the output tensors were allocated by the caller itself to the
    kernel's shapes and dtypes from ``x`` (as :mod:`._native` allocates them), so only their
    addresses are taken: the inputs and scalars, which come from outside, are checked as always.
    """

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        order = kernel.fields()
        # (field name, 0 tensor / 1 size / 2 float scalar / 3 flag / 4 count, shape code, optional);
        # 5, an output made to measure, in the plans below
        plan = []
        for a in order:
            if a.role is not Role.SCALAR:
                plan.append((a.name, 0, _SHAPE_CODES[a.shape], a.optional))
            elif a.dtype is DType.INDEX:
                plan.append((a.name, 1, 0 if a.name == "M" else 1, False))
            elif a.dtype is DType.FLOAT:
                lo = -math.inf if a.minimum is None else a.minimum
                plan.append((a.name, 2, lo, False))
            else:
                plan.append((a.name, 3 if a.dtype is DType.FLAG else 4, 0, False))
        self.structs = {dt: structure(kernel, dt) for dt in INSTANCES}
        self.half_params = _has_half_params(kernel)
        # per instance, outputs_made and half_params flag, each field's plan entry and the dtype
        # it must have (None for scalars); with outputs_made an output tensor is of kind 5, its
        # address taken as is
        self.plans = {
            (dt, made, half): tuple(
                (name, 5 if made and kind == 0 and a.role is Role.OUTPUT else kind, code,
                 optional, None if a.role is Role.SCALAR else expected_dtype(a.dtype, dt, half))
                for (name, kind, code, optional), a in zip(plan, order, strict=True)
            )
            for dt in INSTANCES
            for made in (False, True)
            for half in ((0, 1) if self.half_params else (0,))
        }  # fmt: skip

    def __call__(
        self, values: Mapping[str, object], outputs_made: bool = False
    ) -> ctypes.Structure:
        """The argument struct of ``values``, after checking them (all of them, or all but the
        outputs with ``outputs_made``); raises as check_call."""
        x = values.get("x")
        if type(x) is not Tensor and not isinstance(x, Tensor):
            check_call(self.kernel, values)
        assert isinstance(x, Tensor)
        dt = x.dtype
        struct_cls = self.structs.get(dt)
        if struct_cls is None or x.dim() != 2 or x.shape[1] < 1:
            check_call(self.kernel, values)
            raise AssertionError("unreachable: check_call raises")
        m, n = x.shape
        try:
            # a flag of another value or type finds no plan, or fails its own check in it
            half = values.get(HALF_PARAMS) if self.half_params else 0
            plan = self.plans.get((dt, outputs_made, half))  # type: ignore[call-overload]
            fields = None if plan is None else self._fields(values, m, n, plan)
        except (AttributeError, TypeError):  # not a tensor, or a number of the wrong kind
            fields = None
        if fields is not None:
            return struct_cls(*fields)
        check_call(self.kernel, values)
        raise AssertionError(f"{self.kernel.name}: arguments refused without a reason")

    @staticmethod
    def _fields(values: Mapping[str, object], m: int, n: int, plan: tuple) -> list[object] | None:
        """The struct's fields in order, or ``None`` at the first argument that breaks a rule."""
        shapes = ((m, n), (m,), (n,))
        fields: list[object] = []
        for name, kind, code, optional, want in plan:
            v = values.get(name)
            if v is None and kind in (0, 5):  # a tensor left out: NULL, where it may be
                if not optional:
                    return None
                fields.append(None)
            elif kind == 5:  # an output made to measure (``outputs_made``): its address
                fields.append(v.data_ptr())  # type: ignore[union-attr]
            elif kind == 0:  # a tensor: dtype, device, shape, layout
                if (
                    v.dtype is want  # type: ignore[union-attr]
                    and v.is_cpu  # type: ignore[union-attr]
                    and v.shape == shapes[code]  # type: ignore[union-attr]
                    and v.is_contiguous()  # type: ignore[union-attr]
                ):
                    fields.append(v.data_ptr())  # type: ignore[union-attr]
                else:
                    return None
            elif kind == 1:  # a size, from x
                fields.append(m if code == 0 else n)
            elif kind == 2:  # a float scalar: finite, at least its minimum (NaN fails)
                if type(v) is not float and (isinstance(v, bool) or not isinstance(v, int | float)):
                    return None
                if not code <= v < math.inf:  # type: ignore[operator]
                    return None
                fields.append(float(v))  # type: ignore[arg-type]
            else:  # a flag (0 or 1) or a count (at least 1)
                if not isinstance(v, int) or not (v in (0, 1) if kind == 3 else v >= 1):
                    return None
                fields.append(v)
        return fields


# ------------------------------------------------------------------------------ C side


def c_header() -> str:
    """The C header of every kernel: argument structs, prototypes and layout assertions whose
    offsets come from the ctypes structures (so C and Python agree on every field)."""
    lines = [
        "/* Generated by `python -m layernorm.kernels.cpu.abi` from layernorm/kernels/cpu/abi.py:",
        "   edit that file, not this one (a test checks the two agree). */",
        "#ifndef LAYERNORM_CPU_ABI_H",
        "#define LAYERNORM_CPU_ABI_H",
        "",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        *(f"typedef uint16_t {name}; /* {doc} */" for name, doc in _HALF_TYPEDEFS),
        "",
    ]
    for kernel in KERNELS:
        lines.append(f"/* {kernel.doc} */")
        for dtype, inst in INSTANCES.items():
            tname = f"{kernel.name}_args_{inst.suffix}"
            lines.append("typedef struct {")
            for a in kernel.fields():
                rule = _describe(a)
                lines.append(f"    {a.c_type(inst.c_type, inst.compute)} {a.name}; /* {rule} */")
            lines.append(f"}} {tname};")
            lines.append(f"int {kernel.name}_{inst.suffix}(const {tname}* a);")
            struct = structure(kernel, dtype)
            for a in kernel.fields():
                off = getattr(struct, a.name).offset
                lines.append(f'_Static_assert(offsetof({tname}, {a.name}) == {off}, '
                             f'"{tname}.{a.name}");')  # fmt: skip
            lines.append(f'_Static_assert(sizeof({tname}) == {ctypes.sizeof(struct)}, '
                         f'"{tname} size");')  # fmt: skip
            lines.append("")
    lines.append("#endif")
    return "\n".join(lines) + "\n"


def _describe(a: Arg) -> str:
    if a.role is Role.SCALAR:
        bound = "" if a.minimum is None else f", >= {a.minimum:g}"
        return f"{a.role.value}, {a.dtype.value}{bound}" + (f": {a.doc}" if a.doc else "")
    shape = "(" + ", ".join(a.shape) + ")"
    if a.optional:
        return f"{a.role.value} {shape}, {a.dtype.value}, may be NULL" + (
            f" ({a.doc})" if a.doc else ""
        )
    return f"{a.role.value} {shape}, {a.dtype.value}" + (f": {a.doc}" if a.doc else "")


def header_path() -> Path:
    return CSRC_DIR / HEADER_NAME


if __name__ == "__main__":
    header_path().write_text(c_header())
    print(f"wrote {header_path()}")
