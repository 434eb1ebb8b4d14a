"""Load and call the recurrent layers' C kernels (``csrc/rnn_step.c``, ``csrc/rnn_seq.c``).

The library is compiled with the system C compiler (about a second, no PyTorch headers) by
:mod:`.cbuild`, once per instruction-set target of :mod:`.targets`, only for the one selected.
Every kernel takes pointers to argument structs of named fields that :mod:`.rnn_abi` describes;
:func:`prepare` checks each tensor's dtype, device, layout and shape and each number's range
against that description before packing a struct, so C never sees a pointer to too little memory.
A struct is prepared once per sequence and direction; a step call then sets only the step's rows
and threads (which C checks against the buffers' rows again).

``LAYERNORM_CPU_COMPILE=0`` or a failed build makes :func:`available` false: the recurrent layers
then use their eager step functions (a warning says why, once).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import buffers, cache, cbuild, rnn_abi, targets
from ._env import COMPILE_SWITCH, compile_switched_off

ENV_SWITCH = COMPILE_SWITCH
#: The translation units (headers are found next to them).
SOURCES = (rnn_abi.CSRC_DIR / "rnn_step.c", rnn_abi.CSRC_DIR / "rnn_seq.c")
# On top of the shared flags: no errno and no FP traps, which changes no result but lets the gate
# loops (exp, tanh) vectorize; there is no -ffast-math, so NaN and rounding behave as written.
EXTRA_FLAGS = ("-fno-math-errno", "-fno-trapping-math")

KernelTable = dict[tuple[str, torch.dtype], Any]

#: The sequence kernels' float32 recurrent GEMMs: ``"mkl"`` (the running PyTorch's MKL packed
#: GEMM, W packed once per call, where each GEMM runs on one thread), ``"tile"`` (the library's
#: own packed tile), or ``None``: by processor (:func:`mkl_by_default`). Set by :func:`use_gemm`.
GEMM_CHOICES = ("mkl", "tile")
_PACKED_GEMM_SYMBOLS = ("cblas_sgemm_pack_get_size", "cblas_sgemm_pack", "cblas_sgemm_compute")
_SGEMM_SYMBOL = "sgemm_"
_HALF_GEMM_SYMBOL = "gemm_bf16bf16f32_"
#: The GEMMs of a float32 forward call of one step of more than :func:`direct_rows` rows:
#: ``"mkl"`` (MKL's sgemm, the weights read as stored, :func:`torch_sgemm`), ``"packed"`` (as
#: every other call: packed for the tile or MKL's packed GEMM, :data:`GEMM_CHOICES`), or ``None``:
#: by processor (:func:`one_step_sgemm_by_default`). Set by :func:`use_one_step_gemm`. The same
#: choice gives a call on a bfloat16 layer's weights as stored (a bfloat16 layer's one step, the
#: sequence struct's ``w_half``) MKL's ``gemm_bf16bf16f32`` (:func:`torch_half_gemm`) or, with
#: ``"packed"``, those weights widened to float32 for the call.
ONE_STEP_GEMM_CHOICES = ("mkl", "packed")
#: The LN-LSTM forward step's rows a group, the C kernels' range.
FORWARD_GROUPS = range(1, rnn_abi.FORWARD_GROUP_MAX + 1)


class _OneStepSetters(NamedTuple):
    """A loaded library's setters of its one-step GEMMs' entry points."""

    sgemm: Any  # rnn_set_one_step_sgemm
    half: Any  # rnn_set_one_step_half_gemm


class _LibrarySetting:
    """A setting of every recurrent library loaded: each library's C setter, by (target, build
    variant), given the setting's value when the library loads and whenever the choice changes.
    ``apply(isa, setter, choice)`` hands it over, ``choice`` ``None`` meaning the processor's
    default for target ``isa``. Changed between calls, never while a kernel runs."""

    def __init__(self, apply: Callable[[str, Any, Any], None]) -> None:
        self.apply = apply
        self.choice: Any = None
        self.setters: dict[tuple[str, tuple[str, ...]], Any] = {}

    def bind(self, isa: str, variant: tuple[str, ...], setter: Any) -> None:
        """A library of target ``isa`` loaded: its setter takes the setting now and later."""
        self.apply(isa, setter, self.choice)
        self.setters[isa, variant] = setter

    def choose(self, choice: Any) -> None:
        """Every library loaded, and every one loaded later, takes ``choice`` (checked by the
        caller)."""
        self.choice = choice
        for (isa, _), setter in self.setters.items():
            self.apply(isa, setter, choice)


def _torch_cpu_symbols(names: tuple[str, ...]) -> tuple[int, ...] | None:
    """The addresses of ``names`` in the running PyTorch's CPU library (its MKL is linked into
    ``libtorch_cpu``, which is already loaded: ``RTLD_NOLOAD`` opens nothing new), or ``None``
    where there is no such library or one of them is missing."""
    if not torch.backends.mkl.is_available():
        return None
    path = Path(torch.__file__).resolve().parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        addresses = tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names)
    except (OSError, AttributeError):
        return None
    return addresses if all(addresses) else None  # type: ignore[return-value]


@functools.cache
def torch_packed_gemm() -> tuple[int, int, int] | None:
    """The addresses of MKL's ``cblas_sgemm_pack_get_size``, ``cblas_sgemm_pack`` and
    ``cblas_sgemm_compute`` in the running PyTorch's CPU library (:func:`_torch_cpu_symbols`), or
    ``None`` where there are none or they do not give ``torch.mm``'s product on a small case (the
    C side calls them with 32-bit sizes, MKL's LP64 interface, as PyTorch's builds link it)."""
    addresses = _torch_cpu_symbols(_PACKED_GEMM_SYMBOLS)
    if addresses is None or not _packed_gemm_multiplies(*addresses):
        return None
    return addresses  # type: ignore[return-value]


@functools.cache
def torch_sgemm() -> int | None:
    """The address of MKL's ``sgemm_`` (the Fortran interface: sizes and scalars by address,
    column-major) in the running PyTorch's CPU library, the GEMM ``torch.mm`` runs on float32
    there, or ``None`` where there is none or it does not give ``torch.mm``'s product on a small
    case called as the sequence kernels call it (32-bit sizes: LP64)."""
    addresses = _torch_cpu_symbols((_SGEMM_SYMBOL,))
    if addresses is None or not _sgemm_multiplies(addresses[0]):
        return None
    return addresses[0]


@functools.cache
def torch_half_gemm() -> int | None:
    """The address of MKL's ``gemm_bf16bf16f32_`` (the Fortran interface as ``sgemm_``'s, A and
    B bfloat16, C float32) in the running PyTorch's CPU library, or ``None`` where there is none
    or it does not give the float32 product of the same values on a small case called as the
    sequence kernels call it (:func:`_sgemm_multiplies`)."""
    addresses = _torch_cpu_symbols((_HALF_GEMM_SYMBOL,))
    if addresses is None or not _sgemm_multiplies(addresses[0], torch.bfloat16):
        return None
    return addresses[0]


def _sgemm_multiplies(sgemm: int, operands: torch.dtype = torch.float32) -> bool:
    """Whether the Fortran-interface GEMM at this address, of A and W in ``operands`` into a
    float32 C, computes ``A · Wᵀ`` as the sequence kernels call it (``Cᵀ = W · Aᵀ`` column-major:
    W [N, K] transposed, A [M, K] as is, beta 0, C's leading dimension wider than N) on a 3 × 5
    by 5 × 4 case. Each size is a 4-byte int followed by the bytes of -1: an ILP64 sgemm, which
    would read 8-byte sizes where the kernels pass 4, reads negative ones and computes nothing
    (BLAS refuses them), so it is not taken."""
    i, f = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_float)
    s, p = ctypes.c_char_p, ctypes.c_void_p
    call = ctypes.CFUNCTYPE(None, s, s, i, i, i, f, p, i, p, i, f, p, i)(sgemm)
    cpu = {"device": "cpu", "dtype": torch.float32}  # whatever the defaults are set to
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(3, 5, generator=gen, **cpu), torch.randn(4, 5, generator=gen, **cpu)
    a, w = a.to(operands), w.to(operands)
    c = torch.full((3, 6), math.nan, **cpu)
    kept = []

    def ref(v: int) -> Any:
        pair = (ctypes.c_int32 * 2)(v, -1)  # little-endian: v, then the high word of -2^32 + v
        kept.append(pair)
        return ctypes.cast(pair, i)

    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    call(b"T", b"N", ref(4), ref(3), ref(5), ctypes.byref(one), w.data_ptr(), ref(5),
         a.data_ptr(), ref(5), ctypes.byref(zero), c.data_ptr(), ref(6))  # fmt: skip
    want = a.float() @ w.float().t()  # bfloat16 operands' products are exact in float32
    return bool(torch.allclose(c[:, :4], want, rtol=1e-5, atol=1e-6)) and bool(
        c[:, 4:].isnan().all()
    )


def _packed_gemm_multiplies(pack_size: int, pack: int, compute: int) -> bool:
    """Whether MKL's packed GEMM at these addresses computes ``A · Wᵀ`` as the sequence kernels
    call it (row-major, W [N, K] packed transposed as B, beta 0) on a 3 × 5 by 5 × 4 case."""
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    get_size = ctypes.CFUNCTYPE(ctypes.c_size_t, i, i, i, i)(pack_size)
    do_pack = ctypes.CFUNCTYPE(None, i, i, i, i, i, i, f, p, i, p)(pack)
    do_compute = ctypes.CFUNCTYPE(None, i, i, i, i, i, i, p, i, p, i, f, p, i)(compute)
    row_major, no_trans, trans, packed, b_matrix = 101, 111, 112, 151, 162
    cpu = {"device": "cpu", "dtype": torch.float32}  # whatever the defaults are set to
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(3, 5, generator=gen, **cpu), torch.randn(4, 5, generator=gen, **cpu)
    c = torch.full((3, 4), math.nan, **cpu)
    buf = torch.empty(get_size(b_matrix, 3, 4, 5) // 4 + 16, **cpu)
    do_pack(row_major, b_matrix, trans, 3, 4, 5, 1.0, w.data_ptr(), 5, buf.data_ptr())
    do_compute(row_major, no_trans, packed, 3, 4, 5, a.data_ptr(), 5, buf.data_ptr(), 4, 0.0,
               c.data_ptr(), 4)  # fmt: skip
    return bool(torch.allclose(c, a @ w.t(), rtol=1e-5, atol=1e-6))


def mkl_by_default(isa: str) -> bool:
    """Whether the sequence kernels built for target ``isa`` multiply by MKL's packed GEMM unless
    told (:func:`use_gemm`): on an Intel processor with AVX-512 when the target has none (the AVX2
    build, chosen by ``LAYERNORM_CPU_ISA`` or by a compiler without AVX-512 flags), since MKL
    picks its own instruction set. There the LN-LSTM took 0.91-1.49x torch.nn.LSTM's time in
    inference against 1.43-2.04x with the tile, 0.96-1.33x in training against 1.16-1.54x (Intel
    Xeon, one thread). Not with the AVX-512 targets there (1.05-1.46x against 1.07-1.31x, the tile
    level or faster at five of six shapes, MKL's fixed cost per call at few rows), nor on AMD
    (1.33-2.04x against 1.02-1.25x, AMD EPYC with AVX-512), nor on AVX2-only processors (MKL's
    packed GEMM at 0.5-0.8x the tile's rate on an AMD EPYC; Intel's unmeasured)."""
    (features,) = {t.features for t in targets.TARGETS if t.name == isa}
    return (
        targets.cpu_vendor() == "GenuineIntel"
        and "avx512f" in targets.cpu_features()
        and "avx512f" not in features
    )


# From this x86 family on AMD's AVX-512 units are 512 bits wide (Zen 5; Zen 4, family 25, splits
# a 512-bit operation into two 256-bit halves, the rate of AVX2 code).
_AMD_FULL_WIDTH_AVX512_FAMILY = 26


def _avx512_target(isa: str) -> bool:
    """Whether target ``isa`` has AVX-512."""
    return any("avx512f" in t.features for t in targets.TARGETS if t.name == isa)


def _amd_full_width_avx512(isa: str) -> bool:
    """An AMD processor from family 26 (see :func:`tile_outpaces_torch_gemm`) and a target with
    AVX-512."""
    return (
        targets.cpu_vendor() == "AuthenticAMD"
        and targets.cpu_family() >= _AMD_FULL_WIDTH_AVX512_FAMILY
        and _avx512_target(isa)
    )


# AMD's x86 family 25 (Zen 3 and Zen 4; with AVX-512 only Zen 4).
_AMD_ZEN4_FAMILY = 25
#: The batch-row split's limit on an AMD Zen 4 with an AVX-512 target (see
#: :func:`batch_split_bytes_by_default`).
ZEN4_BATCH_SPLIT_BYTES = 16 << 20


def batch_split_bytes_by_default(isa: str) -> int:
    """The most bytes of packed weights for which a sequence call of target ``isa`` on this
    processor splits the batch's rows among its threads (each carrying its rows through every
    step, reading all the weights each step) instead of sharing every step's GEMM by panels and
    meeting twice a step (``csrc/rnn_common.h``: ``batch_split``): the same outputs either way.
    16 MiB on an AMD Zen 4 (family 25) with an AVX-512 target, 4 MiB elsewhere (the limit the
    shared steps won past on this processor when the split came, 2026-11-25). Two threads, ours
    / torch.nn.LSTM (GRU), 4 / 16 MiB (``ab_rnn.py --cflags``, AMD EPYC Zen 4, 2026-11-30):
    LN-LSTM inference (T, B, I, H) = (50, 128, 256, 512) 1.14 / 1.04, (100, 64, 256, 512)
    1.02 / 0.97, (35, 20, 650, 650) 1.07 / 1.05; training 0.93 / 0.90, 0.89 / 0.81-0.84,
    1.08 / 1.06; LN-GRU inference (100, 64, 256, 512) 0.57 / 0.54, (35, 20, 650, 650) 0.86 /
    0.81, training level; (30, 32, 512, 1024) (25 MiB) 1.06 with the split forced, 1.07 without;
    the AVX2 build level at three shapes (0.92 / 0.92, 0.92 / 0.94, 0.95 / 0.95). Other
    processors unmeasured at the new limit."""
    if (
        targets.cpu_vendor() == "AuthenticAMD"
        and targets.cpu_family() == _AMD_ZEN4_FAMILY
        and _avx512_target(isa)
    ):
        return ZEN4_BATCH_SPLIT_BYTES
    return rnn_abi.BATCH_SPLIT_BYTES_DEFAULT


def _apply_batch_split(isa: str, set_batch_split_bytes: Any, limit: int | None) -> None:
    if limit is None:
        limit = batch_split_bytes_by_default(isa)
    if set_batch_split_bytes(limit) != 0:
        raise RuntimeError(f"layernorm: rnn_set_batch_split_bytes refused {limit} bytes")


_BATCH_SPLIT = _LibrarySetting(_apply_batch_split)  # rnn_set_batch_split_bytes


def use_batch_split_bytes(limit: int | None) -> None:
    """Set the batch-row split's limit (packed weights' bytes, an int >= 0) for every library
    loaded or loaded later, or ``None`` for the processor's default
    (:func:`batch_split_bytes_by_default`). Not while a kernel runs (tests and benchmarks switch
    between calls)."""
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"use_batch_split_bytes: limit must be an int >= 0 or None, got {limit!r}")
    _BATCH_SPLIT.choose(limit)


def forward_group_by_default(isa: str) -> int:
    """The LN-LSTM forward step's rows a group (their statistics' dependency chains overlap;
    ``csrc/rnn_step_impl.h``) for target ``isa`` on this processor: eight on Intel processors and
    on AMD processors from family 26 with an AVX-512 target, four elsewhere. The same results at
    any size. LN-LSTM, one thread, four / eight rows a group (``ab_rnn.py --group``, both
    orders), x torch.nn.LSTM's time, inference: AMD EPYC family 26, (T, B, I, H) =
    (20, 256, 32, 32) 1.64 / 1.51 and 1.70 / 1.56, (50, 64, 32, 32) 1.51 / 1.42 and 1.64 / 1.49,
    (100, 128, 64, 64) 1.27 / 1.24 and 1.27 / 1.22, level at (100, 32, 128, 256); Intel Xeon
    (family 6, model 207), the AVX-512 target: (20, 256, 32, 32) 1.46 / 1.33, (50, 64, 32, 32)
    1.33 / 1.26, (100, 64, 32, 32) 1.51 / 1.39 and 1.29 / 1.23, (100, 32, 64, 64) 1.14 / 1.11
    and 1.20 / 1.15, level at four shapes of H = 128 and 256; the AVX2 target against torch held
    to AVX2 (100, 64, 32, 32) 1.03 / 0.96, (100, 32, 64, 64) 0.95 / 0.93. Training level (either
    setting ahead by up to 0.13, as the order of the two went). On the AMD Zen 4 (family 25) a
    step's rows in cache at H = 64 took 320 ns a row in groups of four, 338 in groups of eight."""
    if targets.cpu_vendor() == "GenuineIntel" or _amd_full_width_avx512(isa):
        return 8
    return rnn_abi.FORWARD_GROUP_DEFAULT


def _apply_forward_group(isa: str, set_forward_group: Any, rows: int | None) -> None:
    rows = rows or forward_group_by_default(isa)
    if set_forward_group(rows) != 0:
        raise RuntimeError(f"layernorm: rnn_set_forward_group refused {rows} rows")


_FORWARD_GROUP = _LibrarySetting(_apply_forward_group)  # rnn_set_forward_group


def use_forward_group(rows: int | None) -> None:
    """Set the LN-LSTM forward step's rows a group for every library loaded or loaded later: one
    of :data:`FORWARD_GROUPS`, or ``None`` for the processor's default
    (:func:`forward_group_by_default`). Not while a kernel runs (tests and benchmarks switch
    between calls)."""
    if rows is not None and (type(rows) is not int or rows not in FORWARD_GROUPS):
        raise ValueError(
            f"use_forward_group: rows must be an int in 1-{FORWARD_GROUPS[-1]} or None, got "
            f"{rows!r}"
        )
    _FORWARD_GROUP.choose(rows)


def tile_outpaces_torch_gemm(isa: str) -> bool:
    """Whether the C GEMM of target ``isa`` multiplies at about twice ``torch.mm``'s float32 rate
    on this processor, so that the recurrent layers give it the products they would otherwise
    leave to ``torch.mm`` (the weights' gradients at every size, the input projection inside the
    time loop for a larger W_ih: :mod:`layernorm.recurrent._cstep`, :mod:`._fused`).

    True on AMD processors from family 26 (Zen 5), whose AVX-512 units are 512 bits wide, for a
    target with AVX-512: PyTorch's MKL runs its AVX2 code on every AMD processor (it takes its
    AVX-512 code on Intel's only), at half of what the AVX-512 tile reaches there. One thread, AMD
    EPYC family 26 (AVX-512): ``benchmarks/bench_rnn_gemm.py`` 242-269 GFLOP/s against torch.mm's
    47-107; a weight's gradient (N, G, H) = (3200, 512, 128), (700, 2600, 650), (6400, 2048, 512)
    in 0.44, 0.51, 0.51x torch.mm's time (two threads 0.46, 0.45, 0.52). On Zen 4 both run at the
    rate of 256-bit units, where the thresholds of those modules were measured. An AMD Zen 5
    with 256-bit AVX-512 units (some laptop parts) is taken for a wide one: there the C GEMM
    is at about torch.mm's rate, as on Zen 4, and the larger limits cost what they cost there."""
    return _amd_full_width_avx512(isa)


def _packed_gemm_wanted(isa: str, choice: str | None) -> bool:
    return choice == "mkl" if choice else mkl_by_default(isa)


def _apply_gemm(isa: str, set_packed_gemm: Any, choice: str | None) -> None:
    """Give a loaded library of target ``isa`` the MKL entry points (or none) the choice says."""
    packed = torch_packed_gemm() if _packed_gemm_wanted(isa, choice) else None
    if set_packed_gemm(*(packed or (None, None, None))) != 0:
        raise RuntimeError("layernorm: rnn_set_packed_gemm refused its entry points")


_GEMM = _LibrarySetting(_apply_gemm)  # rnn_set_packed_gemm


def use_gemm(choice: str | None) -> None:
    """Choose the sequence kernels' float32 recurrent GEMM for every library loaded or loaded
    later: one of :data:`GEMM_CHOICES`, or ``None`` for the processor's default
    (:func:`mkl_by_default`); ``"mkl"`` where PyTorch has no MKL runs the tile. Not while a
    kernel runs (benchmarks and tests switch between calls)."""
    if choice is not None and choice not in GEMM_CHOICES:
        raise ValueError(f"use_gemm: choice must be one of {GEMM_CHOICES} or None, got {choice!r}")
    _GEMM.choose(choice)


def one_step_sgemm_by_default(isa: str) -> bool:
    """Whether a float32 forward call of one step of more than :func:`direct_rows` rows (a
    decoder's token for a batch) multiplies by MKL's sgemm, the weights read as stored, with the
    kernels of target ``isa``: wherever PyTorch has it, except where the C GEMM outpaces
    ``torch.mm`` (:func:`tile_outpaces_torch_gemm`: there packing costs less than the tile saves).
    Packing W_ih and W_hh for one GEMM each is a pass over each and another over the copy: at
    (T, B, I, H) = (1, 32, 256, 256) an LN-GRU call spent 23% of its time packing and 33% in the
    tile. LN-GRU inference, Intel Xeon (family 6, model 207), x torch.nn.GRU's time, packed /
    sgemm, one | two threads: (B, I, H) = (16, 256, 256) 1.26 / 1.05 | 1.34 / 0.92,
    (32, 256, 256) 1.11 / 1.00 | 1.23 / 0.91, (128, 256, 256) 1.07 / 1.01 | 1.03 / 0.93,
    (16, 1024, 1024) 1.05 / 1.00 | 1.09 / 0.96 (benchmarks/RESULTS.md, 2026-11-29)."""
    return not tile_outpaces_torch_gemm(isa)


def _one_step_sgemm_wanted(isa: str, choice: str | None) -> bool:
    return choice == "mkl" if choice else one_step_sgemm_by_default(isa)


def _apply_one_step_gemm(isa: str, setters: _OneStepSetters, choice: str | None) -> None:
    """Give a loaded library of target ``isa`` MKL's sgemm and gemm_bf16bf16f32 (or neither)
    as the choice says."""
    wanted = _one_step_sgemm_wanted(isa, choice)
    if setters.sgemm(torch_sgemm() if wanted else None) != 0:
        raise RuntimeError("layernorm: rnn_set_one_step_sgemm refused its entry point")
    if setters.half(torch_half_gemm() if wanted else None) != 0:
        raise RuntimeError("layernorm: rnn_set_one_step_half_gemm refused its entry point")


_ONE_STEP_GEMM = _LibrarySetting(_apply_one_step_gemm)  # _OneStepSetters


def use_one_step_gemm(choice: str | None) -> None:
    """Choose the GEMMs of a float32 forward call of one step for every library loaded or loaded
    later: one of :data:`ONE_STEP_GEMM_CHOICES`, or ``None`` for the processor's default
    (:func:`one_step_sgemm_by_default`); ``"mkl"`` where PyTorch has no MKL packs. Not while a
    kernel runs (benchmarks and tests switch between calls)."""
    if choice is not None and choice not in ONE_STEP_GEMM_CHOICES:
        raise ValueError(
            f"use_one_step_gemm: choice must be one of {ONE_STEP_GEMM_CHOICES} or None, got "
            f"{choice!r}"
        )
    _ONE_STEP_GEMM.choose(choice)


def one_step_gemm_in_use() -> str:
    """``"mkl"`` or ``"packed"``: what a float32 forward call of one step of more than
    :func:`direct_rows` rows multiplies by on the selected target."""
    wanted = _one_step_sgemm_wanted(targets.selected().name, _ONE_STEP_GEMM.choice)
    return "mkl" if wanted and torch_sgemm() else "packed"


def one_step_half_gemm_in_use() -> bool:
    """Whether a bfloat16 layer's one-step call (computed in float32 by its twin) multiplies by
    MKL's ``gemm_bf16bf16f32`` on the weights as stored, on the selected target: where the
    one-step choice is ``"mkl"`` (:func:`use_one_step_gemm`), PyTorch exports that GEMM and the
    target has the processor's bfloat16 dot products (:func:`half_gemm`). Without them MKL
    widens the operands itself, slower than copying the weights and multiplying in float32:
    (M, K, N) = (1, 256, 1024), one thread, Intel Xeon held to AVX2 (``MKL_ENABLE_INSTRUCTIONS``),
    205 µs against sgemm's 24 and the copy's 78 (with AVX512-BF16 and AMX: 12 µs)."""
    return (
        _one_step_sgemm_wanted(targets.selected().name, _ONE_STEP_GEMM.choice)
        and half_gemm()
        and torch_half_gemm() is not None
    )


def gemm_in_use() -> str:
    """``"mkl"`` or ``"tile"``: what the sequence kernels' float32 GEMMs run on where each GEMM
    runs on one thread (the tile shares the others out by columns), on the selected target."""
    wanted = _packed_gemm_wanted(targets.selected().name, _GEMM.choice)
    return "mkl" if wanted and torch_packed_gemm() else "tile"


def _build(target: targets.Target | None = None, variant: tuple[str, ...] = ()) -> Path:
    """Compile the kernels for ``target`` (default: the selected one) unless cached; ``variant``:
    more compiler flags (a benchmark's build setting, e.g. ``-DGEMM_MR=12``), in a library of its
    own name."""
    target = targets.selected() if target is None else target
    name = f"layernorm_rnn_{target.name}" + ("_variant" if variant else "")
    return cbuild.build_shared_library(
        SOURCES, name, (*EXTRA_FLAGS, *variant), isa_flags=target.flags
    )


@functools.cache
def _library_for(
    isa: str, variant: tuple[str, ...] = ()
) -> tuple[KernelTable, int, int, bool] | None:
    """The kernels of target ``isa``'s library (built on first use, with the compiler flags
    ``variant`` added), its GEMM's vector bytes, its direct rows (:func:`direct_rows`) and whether
    it has the bfloat16 GEMMs (:func:`half_gemm`), or ``None`` after a warning when it cannot be
    built or loaded."""
    try:
        # checked, and rebuilt once if damaged
        lib = cache.load_library(lambda: _build(targets.target(isa), variant))
        fns: KernelTable = {}
        for kernel in rnn_abi.KERNELS:
            for dtype, (_, suffix) in rnn_abi.RNN_INSTANCES.items():
                fn = getattr(lib, f"{kernel.name}_{suffix}")
                fn.restype = ctypes.c_int
                fn.argtypes = tuple(
                    ctypes.POINTER(rnn_abi.structure(s, dtype)) for s in kernel.structs
                )
                fns[kernel.name, dtype] = fn
        for name in ("rnn_vector_bytes", "rnn_direct_rows", "rnn_half_gemm"):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = ()
        lib.rnn_set_packed_gemm.argtypes = (ctypes.c_void_p,) * 3
        lib.rnn_set_one_step_sgemm.argtypes = (ctypes.c_void_p,)
        lib.rnn_set_one_step_half_gemm.argtypes = (ctypes.c_void_p,)
        lib.rnn_set_forward_group.argtypes = (ctypes.c_int,)
        lib.rnn_set_batch_split_bytes.argtypes = (ctypes.c_int64,)
        lib.rnn_set_amx.argtypes, lib.rnn_amx.argtypes = (ctypes.c_int,), ()
        for name in ("packed_gemm", "one_step_sgemm", "one_step_half_gemm", "forward_group",
                     "batch_split_bytes", "amx"):  # fmt: skip
            getattr(lib, f"rnn_set_{name}").restype = ctypes.c_int
        lib.rnn_amx.restype = ctypes.c_int
        one_step = _OneStepSetters(lib.rnn_set_one_step_sgemm, lib.rnn_set_one_step_half_gemm)
        _GEMM.bind(isa, variant, lib.rnn_set_packed_gemm)
        _ONE_STEP_GEMM.bind(isa, variant, one_step)
        _FORWARD_GROUP.bind(isa, variant, lib.rnn_set_forward_group)
        _BATCH_SPLIT.bind(isa, variant, lib.rnn_set_batch_split_bytes)
        _AMX.bind(isa, variant, _AmxSetters(lib.rnn_set_amx, lib.rnn_amx))
        return fns, lib.rnn_vector_bytes(), lib.rnn_direct_rows(), lib.rnn_half_gemm() == 1
    except Exception as err:  # any failure falls back to the eager step functions
        warnings.warn(
            f"layernorm: C recurrent kernels unavailable, using eager ops ({err})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _library() -> tuple[KernelTable, int, int, bool] | None:
    """The kernels of the selected target (see :mod:`.targets`)."""
    return _library_for(targets.selected().name)


def _fn(kernel: str, dtype: torch.dtype) -> Any:
    """The loaded entry point of ``kernel`` for ``dtype`` on the selected target (building the
    library on first use)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("layernorm: the C recurrent kernels are unavailable (see the warning)")
    return lib[0][kernel, dtype]


def kernel_address(kernel: str, dtype: torch.dtype) -> int:
    """The address of ``kernel``'s entry point for ``dtype`` on the selected target, for a C++
    caller (``csrc_torch/rnn_ops.cpp``)."""
    address = ctypes.cast(_fn(kernel, dtype), ctypes.c_void_p).value
    assert address is not None  # a loaded symbol
    return address


def available(x: Tensor) -> bool:
    """Whether the kernels run on ``x``: a CPU float32/float64 tensor, switch on, library built."""
    if x.dtype not in rnn_abi.RNN_INSTANCES or not x.is_cpu:
        return False
    return not compile_switched_off() and _library() is not None


def vector_bytes() -> int:
    """Bytes per vector of the sequence kernels' GEMM as built for the selected target (64 with
    AVX-512, 32 with AVX2); 0 when it is not built."""
    lib = _library()
    return 0 if lib is None else lib[1]


def direct_rows() -> int:
    """Rows in all steps up to which a forward sequence kernel reads ``W_hh`` and ``W_ih`` as
    stored (a decoder's token) instead of packing them; 0 when the library is not built."""
    lib = _library()
    return 0 if lib is None else lib[2]


def half_gemm() -> bool:
    """Whether the selected target's float sequence kernels run a bfloat16 layer's recurrent GEMMs
    (and inference's input projection) with the processor's bfloat16 dot products, as
    ``torch.nn.LSTM`` does in bfloat16 (see :func:`pack_sequence`'s ``half_gemm``): builds for
    AVX512-BF16, on the AMX tiles where the processor has them (:func:`amx`). Both sum in float32
    and treat subnormal operands (below 2⁻¹²⁶) as zero; products of bfloat16 values are otherwise
    exact."""
    lib = _library()
    return lib is not None and lib[3]


def _switch(setter: str, choice: object) -> bool | None:
    """``choice`` for an on/off setting that ``None`` returns to the processor's default."""
    if choice is not None and type(choice) is not bool:
        raise ValueError(f"{setter}: choice must be True, False or None, got {choice!r}")
    return choice


class _AmxSetters(NamedTuple):
    """A loaded library's AMX switch and its state."""

    set: Any  # rnn_set_amx
    state: Any  # rnn_amx


def _apply_amx(isa: str, setters: _AmxSetters, choice: bool | None) -> None:
    # on unless told not to; where the processor or the system has no AMX it stays off (-1)
    setters.set(0 if choice is False else 1)


_AMX = _LibrarySetting(_apply_amx)


def use_amx(choice: bool | None) -> None:
    """Whether the bfloat16 products (:func:`half_gemm`) run on the processor's AMX tiles where it
    has them (AMX-TILE and AMX-BF16, and a Linux that grants the process their state):
    ``True`` or ``None`` (the default: where there are tiles, use them) or ``False`` (the
    AVX512-BF16 dot products). For every library loaded or loaded later; not while a kernel
    runs."""
    _AMX.choose(_switch("use_amx", choice))


def amx() -> bool:
    """Whether the selected target's bfloat16 products (:func:`half_gemm`) run on the AMX tiles:
    the build has the products, the processor and the system the tiles, and :func:`use_amx`
    did not turn them off. One thread, Intel Xeon (family 6 model 207), a product of 16 rows by
    (K, N) = (256, 1024): 313 G multiply-adds a second on the tiles, about 50 by ``vdpbf16ps``,
    96 by the float32 tile (benchmarks/RESULTS.md)."""
    if not half_gemm():
        return False
    entry = _AMX.setters.get((targets.selected().name, ()))  # loaded by half_gemm()
    return entry is not None and entry.state() == 1


def bfloat16_projection_by_default() -> bool:
    """Whether a bfloat16 layer's input projection takes the processor's bfloat16 dot products
    unless told (:func:`use_bfloat16_projection`), where the build has them (:func:`half_gemm`):
    not on Intel processors. There ``vdpbf16ps`` (32 multiply-adds) took four times an FMA's
    (16) time an instruction, half the FMAs' rate (``benchmarks/bf16_dot_rate.py``: 0.74 against
    0.18 ns), and the input projection by it took longer than the float32 tile: bfloat16
    LN-LSTM inference 1.06-1.18x the time of the float32 projection with one thread, LN-GRU
    1.06-1.26x, training level to 1.16x (Intel Xeon, family 6 model 207, both alternated in one
    process, five shapes; benchmarks/RESULTS.md). On AMD Zen 4, where it was measured first, the
    dot products outweigh their per-call cost from a few hundred rows. Where the products run on
    the AMX tiles (:func:`amx`) they are taken everywhere: about three times the float32 tile's
    rate."""
    return amx() or targets.cpu_vendor() != "GenuineIntel"


_bfloat16_projection_choice: bool | None = None


def use_bfloat16_projection(choice: bool | None) -> None:
    """Whether a bfloat16 layer's input projection takes the processor's bfloat16 dot products
    (where the build has them): ``True``, ``False``, or ``None`` for the processor's default
    (:func:`bfloat16_projection_by_default`). Inside
    ``layernorm.recurrent.bfloat16_recurrent_products()`` every product takes them regardless.
    The results differ only in the order of float32 sums (the products of bfloat16 values are
    exact either way). Not while a kernel runs."""
    global _bfloat16_projection_choice
    _bfloat16_projection_choice = _switch("use_bfloat16_projection", choice)


def bfloat16_projection() -> bool:
    """Whether a bfloat16 layer's input projection runs on the processor's bfloat16 dot products
    on the selected target: the build has them (:func:`half_gemm`) and the choice
    (:func:`use_bfloat16_projection`, else the processor's default) asks for them."""
    if not half_gemm():
        return False
    choice = _bfloat16_projection_choice
    return bfloat16_projection_by_default() if choice is None else choice


def sequence_enabled() -> bool:
    """Whether the recurrent layers run each direction in one call to the sequence kernels on
    the selected target (see :attr:`.targets.Target.rnn_sequence`)."""
    return targets.selected().rnn_sequence and vector_bytes() > 0


def prepare(
    struct: rnn_abi.Struct,
    dtype: torch.dtype,
    values: Mapping[str, object],
    sizes: Mapping[str, int],
) -> ctypes.Structure:
    """The checked argument struct of ``values`` (see :func:`.rnn_abi.check`)."""
    return rnn_abi.pack(struct, dtype, values, sizes)


def _raise_for(status: int, kernel: str) -> None:
    if status == rnn_abi.ERR_NOMEM:
        raise MemoryError(f"layernorm recurrent CPU kernel {kernel} could not allocate its buffers")
    if status == rnn_abi.ERR_INPUT_NORM:
        raise ValueError(
            f"layernorm recurrent CPU kernel {kernel}: the layer norm of gx needs w0 with b0, mx "
            f"and rx (forward; gx, mx and rx backward) and layer_norm=1, and with an input "
            f"projection x, no w0 or b0 of the projection's own; nothing was written"
        )
    if status == rnn_abi.ERR_PROJECTION and kernel == "matmul":
        raise ValueError(
            f"layernorm recurrent CPU kernel {kernel}: w must be (N, K) with transposed=1 and "
            f"(K, N) with transposed=0 for x (M, K) and y (M, N); nothing was written"
        )
    if status == rnn_abi.ERR_PROJECTION and kernel.startswith("block_norm"):
        raise ValueError(
            f"layernorm recurrent CPU kernel {kernel}: split must be at most G (the columns of a "
            f"row); nothing was written"
        )
    if status == rnn_abi.ERR_PROJECTION:
        raise ValueError(
            f"layernorm recurrent CPU kernel {kernel}: the input projection needs x and w_ih "
            f"together, 0 < split <= G and gx of B or N rows (without it, N rows), its gradient "
            f"w_ih and dx together (the LSTM's kernels only), and the Elman kernels take neither; "
            f"the recurrent projection w_hr needs hr and out_r (P = H without it) and only the "
            f"LSTM's forward takes it, in inference (kept buffers of B rows) without zoneout of "
            f"h; the bfloat16 weights w_half and w_ih_half (w_half alone without x) need one "
            f"step of a float32 kernel without w_hr; nothing was written"
        )
    if status != 0:
        raise ValueError(
            f"layernorm recurrent CPU kernel {kernel}: a step's rows lie outside the buffers "
            f"(status {status}); nothing was written for it"
        )


def step(kernel: str, dtype: torch.dtype, args: Any, off: int, rows: int, threads: int) -> None:
    """Run step kernel ``kernel`` (``"lstm_fwd_step"``, ...) on rows ``[off, off + rows)`` with
    the struct from :func:`prepare`. C refuses rows outside the buffers."""
    args.off, args.rows, args.threads = off, rows, max(1, threads)
    _raise_for(_fn(kernel, dtype)(ctypes.byref(args)), kernel)


def call(kernel: str, dtype: torch.dtype, args: Any) -> None:
    """Run ``kernel`` whose whole call is the one struct from :func:`prepare` (the cells'
    kernels, ``"gru_cell_fwd"``, ...)."""
    _raise_for(_fn(kernel, dtype)(ctypes.byref(args)), kernel)


def sequence(kernel: str, dtype: torch.dtype, args: Any, *pack_args: Any, **pack_kw: Any) -> None:
    """Run sequence kernel ``kernel`` (``"lstm_fwd_seq"``, ...) on the step struct ``args`` from
    :func:`prepare` and a sequence struct packed from the rest (:func:`pack_sequence`'s
    arguments after ``kernel`` and ``dtype``)."""
    run_sequence(kernel, dtype, args, pack_sequence(kernel, dtype, *pack_args, **pack_kw))


def pack_sequence(
    kernel: str,
    dtype: torch.dtype,
    w: Tensor,
    steps: Tensor,
    sizes: Mapping[str, int],
    threads: int,
    grain: int,
    gemm_grain: int,
    options: Mapping[str, object] | None = None,
    half_gemm: int = 0,
) -> ctypes.Structure:
    """The checked sequence struct of kernel ``kernel``, for :func:`run_sequence`: every step of
    ``steps`` (an ``(S, 2)`` int64 tensor of (first row, rows) pairs in the forward pass's order;
    backward kernels walk them in reverse) with the recurrent weight ``w`` (``W_hh``; forward
    kernels multiply by its transpose).

    ``options``: the sequence struct's optional fields. Forward kernels: ``x``, ``w_ih``, ``w0``,
    ``b0`` and ``split`` of :data:`.rnn_abi.SEQ_FWD`, for a kernel that computes each step's
    ``gx`` rows itself (the step struct's gx then has B rows, or N rows kept raw for backward);
    without them gx holds every row already; and ``w_hr``, ``hr``, ``out_r``, for the LSTM's
    inference with torch.nn.LSTM's projection (``w`` then has W_hr's rows as columns); and
    ``w_half``, ``w_ih_half``, a bfloat16 layer's weights as stored, read in place of ``w`` and
    ``w_ih`` for one step of bfloat16 values (``rnn_abi``'s ``_HALF_WEIGHTS``). Backward
    kernels: ``hp_grads``, ``c_grads`` and
    ``x_grads`` of :data:`.rnn_abi.SEQ_BWD`, where the kernel sums the layer norms' gain and bias
    gradients, and ``w_ih`` with ``dx``, where it computes each step's rows of x's gradient.

    ``half_gemm``: the struct's ``half_gemm``, for a bfloat16 layer computed in float32 (its
    weights and inputs bfloat16 values): the kernels built with AVX512-BF16 (:func:`half_gemm`)
    then run the input projection (1) and the recurrent GEMMs (2, ``h_{t−1}`` and ``dhp`` rounded
    to bfloat16) with the processor's bfloat16 dot products, summed in float32; other builds
    ignore it."""
    seq_struct = rnn_abi.BY_NAME[kernel].structs[1]
    opts = dict(options or {})
    values = {"w": w, "steps": steps, "threads": max(1, threads), "grain": grain,
              "gemm_grain": gemm_grain, "split": sizes.get("G", 0),
              "half_gemm": half_gemm, **opts}  # fmt: skip
    # I from whichever of x (dx backward) and W_ih is given (C refuses one without the other)
    given = [
        t
        for t in (opts.get("x"), opts.get("dx"), opts.get("w_ih"))
        if isinstance(t, Tensor) and t.dim() == 2
    ]
    in_features = given[0].shape[1] if given else 0
    # P: the columns of the state the recurrence carries, W_hr's rows with torch.nn.LSTM's
    # projection (forward kernels), else H
    w_hr = opts.get("w_hr")
    state_cols = w_hr.shape[0] if isinstance(w_hr, Tensor) and w_hr.dim() == 2 else sizes["H"]
    seq_sizes = {**sizes, "S": steps.shape[0], "I": in_features, "P": state_cols}
    return rnn_abi.pack(seq_struct, dtype, values, seq_sizes)


def run_sequence(kernel: str, dtype: torch.dtype, args: Any, seq_args: Any) -> None:
    """Run sequence kernel ``kernel`` on a step struct from :func:`prepare` and a sequence struct
    from :func:`pack_sequence` (on the selected target)."""
    _raise_for(_fn(kernel, dtype)(ctypes.byref(args), ctypes.byref(seq_args)), kernel)


def matmul(
    x: Tensor,
    w: Tensor,
    transposed: bool,
    out: Tensor,
    threads: int,
    gemm_grain: int,
    half: bool = False,
) -> Tensor:
    """``x · wᵀ`` (``transposed``: ``w`` ``(N, K)``, as a layer stores W_ih) or ``x · w``
    (``w`` ``(K, N)``) into ``out`` ``(M, N)``, with the C GEMM. ``half``: ``x`` and ``w`` (float32)
    hold bfloat16 values, whose products the processor's bfloat16 dot products compute exactly
    (summed in float32; subnormal operands as zero) where the build has them (:func:`half_gemm`;
    elsewhere the float GEMM): a value that is not a bfloat16 would be rounded."""
    rows, inner = x.shape
    cols = out.shape[-1] if out.dim() else 0  # W's orientation is checked by the kernel
    values = {"x": x, "w": w, "y": out, "threads": max(1, threads), "gemm_grain": gemm_grain,
              "transposed": int(transposed), "half_gemm": int(half)}  # fmt: skip
    sizes = {"M": rows, "K": inner, "N": cols, "R": w.shape[0], "C": w.shape[1]}
    args = rnn_abi.pack(rnn_abi.MATMUL, x.dtype, values, sizes)
    _raise_for(_fn("matmul", x.dtype)(ctypes.byref(args)), "matmul")
    return out


def weight_grad(dhp: Tensor, hprev: Tensor, threads: int, gemm_grain: int) -> Tensor:
    """``dhpᵀ · hprev`` (``(N, G)``, ``(N, H)`` → ``(G, H)``) with the C GEMM."""
    n_rows, gates = dhp.shape
    hs = hprev.shape[1]
    # a buffer of the cache: a weight's gradient, freed by zero_grad() and faulting its pages
    # afresh on every step otherwise
    dw = buffers.empty(dhp, (gates, hs))
    values = {"dhp": dhp, "hprev": hprev, "dw": dw, "threads": max(1, threads),
              "gemm_grain": gemm_grain}  # fmt: skip
    sizes = {"N": n_rows, "G": gates, "H": hs}
    args = rnn_abi.pack(rnn_abi.WEIGHT_GRAD, dhp.dtype, values, sizes)
    _raise_for(_fn("weight_grad", dhp.dtype)(ctypes.byref(args)), "weight_grad")
    return dw


def block_norm_fwd(
    x: Tensor, w: Tensor, b: Tensor, split: int, eps: float, threads: int
) -> tuple[Tensor, Tensor]:
    """``LN`` of each ``(N, G)`` row's column blocks ``[0, split)`` and ``[split, G)`` of ``x``,
    each with its own statistics, gain ``w`` and bias ``b`` ``(G)``: ``(y, stats)``, ``stats``
    ``(N, BLOCK_NORM_STATS)`` each row's mean and 1/std of each block
    (:data:`.rnn_abi.BLOCK_NORM_FWD`)."""
    n_rows, cols = x.shape
    y = buffers.empty(x, (n_rows, cols))  # a training pass: the cache's (see buffers)
    stats = x.new_empty(n_rows, rnn_abi.BLOCK_NORM_STATS)
    values = {"x": x, "w": w, "b": b, "y": y, "stats": stats, "split": split, "eps": eps,
              "threads": max(1, threads)}  # fmt: skip
    args = rnn_abi.pack(rnn_abi.BLOCK_NORM_FWD, x.dtype, values, {"N": n_rows, "G": cols})
    _raise_for(_fn("block_norm_fwd", x.dtype)(ctypes.byref(args)), "block_norm_fwd")
    return y, stats


def block_norm_bwd(
    dy: Tensor, x: Tensor, w: Tensor, stats: Tensor, split: int, threads: int
) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`block_norm_fwd`: ``(dx, dparams)``, ``dparams`` ``(2, G)`` the
    gain's and the bias's, summed over the rows (:data:`.rnn_abi.BLOCK_NORM_BWD`)."""
    n_rows, cols = x.shape
    dx = buffers.empty(x, (n_rows, cols))
    dparams = x.new_empty(2, cols)
    values = {"dy": dy, "x": x, "w": w, "stats": stats, "dx": dx, "dparams": dparams,
              "split": split, "threads": max(1, threads)}  # fmt: skip
    args = rnn_abi.pack(rnn_abi.BLOCK_NORM_BWD, x.dtype, values, {"N": n_rows, "G": cols})
    _raise_for(_fn("block_norm_bwd", x.dtype)(ctypes.byref(args)), "block_norm_bwd")
    return dx, dparams
