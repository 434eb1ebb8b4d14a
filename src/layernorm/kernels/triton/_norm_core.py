"""Triton kernels shared by layer norm, RMSNorm and AdaNorm: one row-normalization core, 3 modes.

The three ops differ only in whether the row is centred and in what multiplies the normalized row,
so one set of kernels with compile-time switches (``MODE``, ``HAS_W``, ...) serves all of them and
the per-op modules (``layer_norm.py``, ``rms_norm.py``, ``ada_norm.py``) stay thin. For one row of
``N`` elements, with statistics always in float32:

    μ    = mean(x)                       (0 for RMSNorm)
    rstd = 1 / sqrt(mean((x − μ)²) + eps)
    x̂    = (x − μ) · rstd
    y    = x̂ ⊙ w + b                     layer norm / RMSNorm
    z    = C·x̂ − C·k·x̂²                  AdaNorm, z = φ(x̂) ⊙ x̂ with φ = C(1 − k x̂)

Backward, with ``g = dy ⊙ w`` (``g = dz ⊙ φ(x̂)`` for AdaNorm, φ detached):

    dx = rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂))      each term dropped by the DetachNorm flags
    dw = Σ_rows dy ⊙ x̂,   db = Σ_rows dy

Two kernel shapes, chosen by ``N``:

* **fused** (``N ≤ MAX_FUSED_BLOCK_N_FWD``, ``_BWD``): a tile of ``BLOCK_M`` whole rows lives in
  registers.
  The forward reads ``x`` once and writes ``y`` once. The backward reads ``x`` and ``dy`` once and
  writes ``dx``; it runs a *persistent* grid of ``P`` programs, each looping over row tiles and
  keeping its own float32 ``dw``/``db`` partial sums in registers, written once to a ``(P, N)``
  buffer.
* **looped** (longer rows): the forward walks the row in ``BLOCK_N`` chunks twice (statistics, then
  normalize; the second read is mostly served by L2). Statistics merge per-chunk (count, mean, M2)
  with Chan et al.'s parallel update, so a large row mean does not cancel the variance as
  ``E[x²] − E[x]²`` would. The backward first computes the two per-row coefficients ``mean(g)`` and
  ``mean(g ⊙ x̂)`` (one looped pass), then a 2-D grid of (column block, row group) programs writes
  ``dx`` and the ``(P, N)`` partials.

The partials are summed over dim 0 by ``torch.sum``: no atomics, and the summation order depends
only on the shapes, so ``dw``/``db`` are bitwise identical from run to run.

Launch heuristics are deliberately simple (``_num_warps``, ``_fused_block_m``, ``_num_programs``)
and read their constants from the current :class:`LaunchSettings`; :func:`launch_settings` swaps
other values in for a ``with`` block, which is how ``benchmarks/bench_norms_gpu.py --tune`` times
the candidates on a GPU. ``LAYERNORM_TRITON_LAUNCH="max_fused_block_n_bwd=16384,..."`` in the
environment sets them for a whole process (a one-off experiment without code changes).
"""

# Kernel bodies keep compile-time branches as plain `if` blocks, the form the Triton front end
# resolves statically in every version.
# ruff: noqa: SIM102, SIM108

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from ..._validation import stats_dtype

MODE_LN: int = 0  # centred: layer norm, LN-simple, DetachNorm
MODE_RMS: int = 1  # not centred: RMSNorm
MODE_ADA: int = 2  # centred, z = C·x̂·(1 − k·x̂): AdaNorm

# Defaults of LaunchSettings, from `benchmarks/bench_norms_gpu.py --tune` on an H200 (Triton 3.6,
# 2026-11-26; benchmarks/RESULTS.md). Rows up to these lengths are normalized in registers; longer
# rows use the looped kernels. The warp counts keep about 16 elements per thread for each row-sized
# operand (32 in the forward from 16384 up, and in the backward of rows up to 512: below; the
# forward at 32768 still measured 19-51% over the looped forward).
# Compiled for sm_90 (ptxas -v), the backward at 8192 x 16 warps uses 128 registers with no spills,
# while at 16384 it spills over 1.8 KB per thread (x, dy, w and the two partial-sum vectors all
# live in registers).
MAX_FUSED_BLOCK_N_FWD: int = 32768
MAX_FUSED_BLOCK_N_BWD: int = 8192
# Chunk length of the looped kernels.
LOOPED_BLOCK_N: int = 4096
# Row tiles of the fused kernels hold about this many elements, so short rows still give each
# program enough bytes in flight. The backward's tiles are smaller, so that short rows run 4 warps
# per program instead of 8: at N = 512 and 1024 that measured 1.2-2.5x the bandwidth, at 256 and
# 2048 0.86-1.28x (the same sweep before and after, on the H200).
FUSED_TILE_ELEMS: int = 4096
FUSED_TILE_ELEMS_BWD: int = 2048
MAX_FUSED_BLOCK_M: int = 32
# Programs per SM for the persistent backward; on CPU (the interpreter) a small fixed count.
PROGRAMS_PER_SM: int = 4
INTERPRETER_PROGRAMS: int = 4
ELEMS_PER_THREAD: int = 16
# The looped backward (N > 8192) with twice the warps: 0.94-1.15x the bandwidth, median 1.04x.
LOOPED_ELEMS_PER_THREAD_BWD: int = 8
# The fused backward of short rows (a tile of several rows, N <= SHORT_ROWS_BWD_MAX_N): 32 elements
# per thread (half the warps) and 8 programs per SM. At N = 256 and 512 on the H200 (2026-11-30,
# three interleaved rounds): bfloat16 layer norm 650 -> 1994 GB/s and 1059 -> 3064, RMSNorm 1251
# -> 3323 and 1770 -> 2829, float32 1.00-1.14x; at N = 1024 and longer the rule mixed gains and
# losses (0.88-1.24x, and float32 RMSNorm at 4096 0.92x with 32 elements per thread alone).
SHORT_ROWS_BWD_MAX_N: int = 512
SHORT_ROWS_ELEMS_PER_THREAD_BWD: int = 32
SHORT_ROWS_PROGRAMS_PER_SM: int = 8
# The fused forward of long rows (N >= LONG_ROWS_FWD_MIN_N, one row per tile): 32 elements per
# thread, 16 warps instead of 32 at N = 16384. On the H200 (2026-11-26 tune, the same forward kernel
# as now): bfloat16 layer norm 2336 -> 3525 GB/s, float32 +2.8%, RMSNorm -0.2% and +0.6%; at 8192
# 32 elements per thread measured -1%. At 32768 the 32-warp cap gives 32 elements per thread
# either way.
LONG_ROWS_FWD_MIN_N: int = 16384
LONG_ROWS_ELEMS_PER_THREAD_FWD: int = 32
# Triton's limit on the elements of one block (tl.arange, a register tile).
_MAX_BLOCK_ELEMS: int = 1 << 20
LAUNCH_ENV_VAR: str = "LAYERNORM_TRITON_LAUNCH"
# Launch options of the backward kernels. No multiply-add contraction: it would round g = dy ⊙ w
# once inside ``g − mean(g)`` (a fused multiply-add) and once in ``mean(g)``, so a row whose g is
# constant (N = 1, say) would get rstd · (rounding of dy ⊙ w) instead of an exact 0, and rstd is
# up to 1/√eps there. The backward is bound by memory, not by its arithmetic. (The interpreter
# ignores launch options.)
BWD_LAUNCH_OPTIONS: dict[str, bool] = {"enable_fp_fusion": False}


# Fields that count programs, not elements: any positive int, not only a power of two.
_ANY_COUNT_FIELDS: frozenset[str] = frozenset({"programs_per_sm", "short_rows_programs_per_sm"})


@dataclass(frozen=True)
class LaunchSettings:
    """Constants of the launch heuristics (kernel choice, tile sizes, warps, grid size).

    Every field is a positive int; all but the programs per SM must be powers of two (they become
    block shapes or divide into warp counts, which Triton needs as powers of two). Block sizes are
    at most 2^20, Triton's limit for one block.

    Attributes:
        max_fused_block_n_fwd: longest (power-of-two padded) row the forward keeps in registers.
        max_fused_block_n_bwd: the same for the backward.
        looped_block_n: chunk length of the looped kernels.
        fused_tile_elems: about this many elements per row tile of the fused forward.
        fused_tile_elems_bwd: the same for the fused backward.
        max_fused_block_m: at most this many rows per fused tile.
        programs_per_sm: programs per SM of the persistent backward grid (CUDA only).
        elems_per_thread: target elements per thread and operand; sets ``num_warps``.
        looped_elems_per_thread_bwd: the same for the looped backward kernels.
        short_rows_bwd_max_n: rows up to this (padded) length take the fused backward's short-row
            launch, the next two fields.
        short_rows_elems_per_thread_bwd: ``elems_per_thread`` of that launch.
        short_rows_programs_per_sm: ``programs_per_sm`` of that launch.
        long_rows_fwd_min_n: rows of at least this (padded) length take the fused forward's
            long-row launch, the next field.
        long_rows_elems_per_thread_fwd: ``elems_per_thread`` of that launch.
    """

    max_fused_block_n_fwd: int = MAX_FUSED_BLOCK_N_FWD
    max_fused_block_n_bwd: int = MAX_FUSED_BLOCK_N_BWD
    looped_block_n: int = LOOPED_BLOCK_N
    fused_tile_elems: int = FUSED_TILE_ELEMS
    fused_tile_elems_bwd: int = FUSED_TILE_ELEMS_BWD
    max_fused_block_m: int = MAX_FUSED_BLOCK_M
    programs_per_sm: int = PROGRAMS_PER_SM
    elems_per_thread: int = ELEMS_PER_THREAD
    looped_elems_per_thread_bwd: int = LOOPED_ELEMS_PER_THREAD_BWD
    short_rows_bwd_max_n: int = SHORT_ROWS_BWD_MAX_N
    short_rows_elems_per_thread_bwd: int = SHORT_ROWS_ELEMS_PER_THREAD_BWD
    short_rows_programs_per_sm: int = SHORT_ROWS_PROGRAMS_PER_SM
    long_rows_fwd_min_n: int = LONG_ROWS_FWD_MIN_N
    long_rows_elems_per_thread_fwd: int = LONG_ROWS_ELEMS_PER_THREAD_FWD

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LaunchSettings.{f.name} must be a positive int, got {value!r}")
            if f.name in _ANY_COUNT_FIELDS:
                continue
            if value & (value - 1):
                raise ValueError(
                    f"LaunchSettings.{f.name} must be a power of two, got {value}"
                    f" (nearest: {triton.next_power_of_2(value) // 2} or "
                    f"{triton.next_power_of_2(value)})"
                )
            if value > _MAX_BLOCK_ELEMS:
                raise ValueError(
                    f"LaunchSettings.{f.name} must be at most {_MAX_BLOCK_ELEMS} (Triton's block "
                    f"limit), got {value}"
                )

    def replace(self, **overrides: int) -> LaunchSettings:
        """A copy with ``overrides`` applied; unknown names raise ``TypeError``, bad values
        ``ValueError``."""
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise TypeError(f"unknown launch setting(s) {unknown}; expected some of {names}")
        return dataclasses.replace(self, **overrides)


def parse_launch_spec(spec: str, source: str = LAUNCH_ENV_VAR) -> dict[str, int]:
    """``"name=value,name=value"`` as ``{name: value}``, checked against :class:`LaunchSettings`
    (names and values); ``source`` names where the text came from in the errors."""
    overrides: dict[str, int] = {}
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError("no '='")
            overrides[name.strip()] = int(value)
        except ValueError:
            raise ValueError(
                f"{source} must be comma-separated name=integer pairs, e.g. "
                f"'max_fused_block_n_bwd=16384,elems_per_thread=8'; got item {item!r}"
            ) from None
    try:
        LaunchSettings().replace(**overrides)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}={spec!r}: {err}") from None
    return overrides


def _settings_from_env() -> LaunchSettings:
    """Defaults, with ``LAYERNORM_TRITON_LAUNCH="name=value,name=value"`` applied if set."""
    spec = os.environ.get(LAUNCH_ENV_VAR, "").strip()
    return LaunchSettings().replace(**parse_launch_spec(spec)) if spec else LaunchSettings()


_settings: LaunchSettings = _settings_from_env()


def current_launch_settings() -> LaunchSettings:
    """The settings the launchers use now."""
    return _settings


@contextmanager
def launch_settings(
    settings: LaunchSettings | None = None, /, **overrides: int
) -> Iterator[LaunchSettings]:
    """Launch the kernels with other heuristic constants inside a ``with`` block.

    ``settings`` (default: the current ones) with ``overrides`` applied, e.g.
    ``with launch_settings(max_fused_block_n_bwd=16384, elems_per_thread=8): ...``; the previous
    settings come back on exit, also after an exception. Block sizes and ``num_warps`` are
    constexprs and launch options of the kernels, so Triton compiles (and caches) a variant per
    setting. The settings are process-wide, not per thread: for benchmarks and experiments.
    """
    global _settings
    if settings is not None and not isinstance(settings, LaunchSettings):
        raise TypeError(f"settings must be a LaunchSettings or None, got {type(settings).__name__}")
    new = (settings or _settings).replace(**overrides)
    previous = _settings
    _settings = new
    try:
        yield new
    finally:
        _settings = previous


def _num_warps(tile_elems: int, elems_per_thread: int | None = None) -> int:
    """About ``elems_per_thread`` (default: the setting) elements per thread for each operand, 2 to
    32 warps."""
    per_thread = elems_per_thread or _settings.elems_per_thread
    return max(2, min(32, tile_elems // (32 * per_thread)))


def _fused_block_m(block_n: int, *, backward: bool = False) -> int:
    tile = _settings.fused_tile_elems_bwd if backward else _settings.fused_tile_elems
    return max(1, min(_settings.max_fused_block_m, tile // block_n))


def _short_rows_bwd(block_n: int) -> bool:
    """Whether a fused backward of ``block_n``-element (padded) rows takes the short-row launch
    (``short_rows_elems_per_thread_bwd`` and ``short_rows_programs_per_sm``)."""
    return block_n <= _settings.short_rows_bwd_max_n


def _num_programs(device: torch.device, work_items: int, per_sm: int | None = None) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        target = sms * (per_sm or _settings.programs_per_sm)
    else:
        target = INTERPRETER_PROGRAMS
    return max(1, min(target, work_items))


# Row sums go through ``tl.reduce`` instead of ``tl.sum``: ``tl.sum`` is itself a ``@triton.jit``
# function of Triton's standard library (as are ``tl.zeros``, ``tl.cdiv``, ``tl.sigmoid``,
# ``tl.max``), fixed as compiled or interpreted when ``triton`` is first imported, while builtins
# (``tl.reduce``, ``tl.full``, ``tl.where``, ...) follow the kernel. So these kernels run under the
# interpreter whenever *this* module was imported with ``TRITON_INTERPRET=1``, even in a process
# that imported ``triton`` before (torch.compile does). The combine function is Triton's own
# ``_sum_combine`` where it exists: the interpreter recognizes it and sums with numpy, where any
# other function costs one Python call per element.
@triton.jit
def _add(a, b):
    return a + b


_SUM_COMBINE = getattr(tl.standard, "_sum_combine", None) or _add


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _SUM_COMBINE)


@triton.jit
def _ld(ptr, mask):
    """Masked load, as float32 (the arithmetic's precision); 0 where masked off."""
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _st(ptr, value, mask):
    """Masked store, cast to the buffer's dtype."""
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_out(xhat, W, B, cols, mask, k, scale, MODE: tl.constexpr, HAS_W: tl.constexpr,
              HAS_B: tl.constexpr):  # fmt: skip
    """The op's output from x̂, float32: ``x̂ ⊙ w + b``, or AdaNorm's ``C·x̂ − C·k·x̂²``.

    ``w`` and ``b`` are loaded at ``cols`` and broadcast over x̂'s rows if x̂ is a row tile.
    """
    if MODE == 2:
        y = scale * xhat - (scale * k) * xhat * xhat
    else:
        y = xhat
        if HAS_W:
            y = y * _ld(W + cols, mask)
        if HAS_B:
            y = y + _ld(B + cols, mask)
    return y


@triton.jit
def _grad_xhat(dy, xhat, w, k, scale, MODE: tl.constexpr, HAS_W: tl.constexpr):
    """``g``, the gradient reaching x̂: ``dy ⊙ w`` (``dy`` without a gain), or AdaNorm's
    ``dz ⊙ φ(x̂)`` with φ = C(1 − k x̂) detached. ``w`` is unused unless ``HAS_W``."""
    if MODE == 2:
        g = dy * (scale - (scale * k) * xhat)
    elif HAS_W:
        g = dy * w
    else:
        g = dy
    return g


@triton.jit
def _grad_x(g, xhat, rstd, mean_g, mean_gx, MODE: tl.constexpr, DETACH_MEAN: tl.constexpr,
            DETACH_STD: tl.constexpr):  # fmt: skip
    """``dx = rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂))`` from the two row means; DetachNorm drops
    the first (μ detached) or the second (σ detached) term, RMSNorm has no first term. The
    arguments broadcast: row tiles pass per-row columns ``[:, None]``, single rows scalars."""
    dx = g
    if MODE != 1:
        if not DETACH_MEAN:
            dx = dx - mean_g
    if not DETACH_STD:
        dx = dx - xhat * mean_gx
    return dx * rstd


@dataclass(frozen=True)
class LaunchConfig:
    """Which kernel runs and with what tile. ``looped`` rows are walked in ``block_n`` chunks."""

    looped: bool
    block_m: int
    block_n: int
    num_warps: int


def launch_config(n: int, block_n: int | None = None, *, backward: bool = False) -> LaunchConfig:
    """Kernel choice for rows of ``n`` elements; ``block_n`` forces the looped path's chunk size.

    ``block_n`` smaller than ``n`` selects the looped kernels even for short rows, which is how the
    tests exercise them at sizes the interpreter runs quickly.
    """
    st = _settings
    looped_per_thread = st.looped_elems_per_thread_bwd if backward else st.elems_per_thread
    if block_n is not None:
        if block_n <= 0 or block_n & (block_n - 1):
            raise ValueError(f"block_n must be a positive power of two, got {block_n}")
        if block_n < n:
            return LaunchConfig(True, 1, block_n, _num_warps(block_n, looped_per_thread))
    full = triton.next_power_of_2(n)
    if full <= (st.max_fused_block_n_bwd if backward else st.max_fused_block_n_fwd):
        block_m = _fused_block_m(full, backward=backward)
        per_thread = None
        if backward and _short_rows_bwd(full):
            per_thread = st.short_rows_elems_per_thread_bwd
        elif not backward and full >= st.long_rows_fwd_min_n:
            per_thread = st.long_rows_elems_per_thread_fwd
        return LaunchConfig(False, block_m, full, _num_warps(block_m * full, per_thread))
    return LaunchConfig(
        True, 1, st.looped_block_n, _num_warps(st.looped_block_n, looped_per_thread)
    )


def backward_groups(
    cfg: LaunchConfig, m: int, n: int, device: torch.device, num_programs: int | None = None
) -> int:
    """Programs along the rows of the backward (persistent fused grid, or the looped path's row
    groups per column block): the number of ``dw``/``db`` partial-sum rows. ``num_programs``
    overrides the heuristic (clamped to the work there is)."""
    if cfg.looped:
        # the column blocks already spread the work: split rows into just enough groups
        col_blocks = triton.cdiv(n, cfg.block_n)
        groups = num_programs or triton.cdiv(_num_programs(device, m * col_blocks), col_blocks)
        return max(1, min(groups, m))
    tiles = triton.cdiv(m, cfg.block_m)
    per_sm = _settings.short_rows_programs_per_sm if _short_rows_bwd(cfg.block_n) else None
    return max(1, min(num_programs or _num_programs(device, tiles, per_sm), tiles))


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


@triton.jit
def _norm_fwd_fused_kernel(
    X,  # input, (M, N) contiguous
    Y,  # output, (M, N), x's dtype
    W,  # gain, (N,); unused unless HAS_W
    B,  # bias, (N,); unused unless HAS_B
    MEAN,  # row means, (M,); written unless MODE == MODE_RMS
    RSTD,  # row 1/σ, (M,)
    M,  # rows
    N,  # row length
    eps,  # added to the variance (mean square for RMSNorm)
    k,  # AdaNorm k
    scale,  # AdaNorm C
    MODE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = _ld(X + offs, mask)  # BLOCK_M, BLOCK_N
    if MODE == 1:
        xc = x
    else:
        mean = _sum(x, axis=1) / N  # BLOCK_M
        # two passes over registers: exact centring before squaring
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean.to(MEAN.dtype.element_ty), mask=row_mask)
    var = _sum(xc * xc, axis=1) / N  # BLOCK_M; biased, like torch.var(unbiased=False)
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(RSTD + rows, rstd.to(RSTD.dtype.element_ty), mask=row_mask)
    y = _norm_out(xc * rstd[:, None], W, B, cols, col_mask, k, scale, MODE, HAS_W, HAS_B)
    _st(Y + offs, y, mask)


@triton.jit
def _norm_fwd_looped_kernel(
    X,  # input, (M, N) contiguous
    Y,  # output, (M, N)
    W,  # gain, (N,); unused unless HAS_W
    B,  # bias, (N,); unused unless HAS_B
    MEAN,  # row means, (M,); written unless MODE == MODE_RMS
    RSTD,  # row 1/σ, (M,)
    N,  # row length
    eps,
    k,
    scale,
    MODE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * N
    Y += row * N
    cols0 = tl.arange(0, BLOCK_N)
    # Pass 1: statistics. Chan et al.'s merge of per-chunk (count, mean, M2) keeps the centring
    # exact within each chunk.
    mean = _sum(tl.full([BLOCK_N], 0.0, tl.float32), axis=0)
    m2 = _sum(tl.full([BLOCK_N], 0.0, tl.float32), axis=0)
    count = _sum(tl.full([BLOCK_N], 0.0, tl.float32), axis=0)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        msk = cols < N
        x = _ld(X + cols, msk)
        if MODE == 1:
            m2 += _sum(x * x, axis=0)
        else:
            nb = _sum(msk.to(tl.float32), axis=0)
            mb = _sum(x, axis=0) / nb
            d = tl.where(msk, x - mb, 0.0)
            delta = mb - mean
            total = count + nb
            mean += delta * (nb / total)
            m2 += _sum(d * d, axis=0) + delta * delta * (count * nb / total)
            count = total
    rstd = 1.0 / tl.sqrt(m2 / N + eps)
    if MODE != 1:
        tl.store(MEAN + row, mean.to(MEAN.dtype.element_ty))
    tl.store(RSTD + row, rstd.to(RSTD.dtype.element_ty))
    # Pass 2: normalize.
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        msk = cols < N
        x = _ld(X + cols, msk)
        if MODE == 1:
            xhat = x * rstd
        else:
            xhat = (x - mean) * rstd
        y = _norm_out(xhat, W, B, cols, msk, k, scale, MODE, HAS_W, HAS_B)
        _st(Y + cols, y, msk)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------


@triton.jit
def _norm_bwd_fused_kernel(
    DY,  # upstream gradient, (M, N) contiguous
    X,  # forward input, (M, N)
    W,  # gain, (N,); unused unless HAS_W
    MEAN,  # row means, (M,); unused for MODE == MODE_RMS
    RSTD,  # row 1/σ, (M,)
    DX,  # input gradient, (M, N); written if STORE_DX
    DW_PART,  # float32 (num_programs, N): this program's Σ dy ⊙ x̂ over its rows
    DB_PART,  # float32 (num_programs, N): this program's Σ dy over its rows
    M,
    N,
    k,
    scale,
    MODE: tl.constexpr,
    HAS_W: tl.constexpr,
    DETACH_MEAN: tl.constexpr,
    DETACH_STD: tl.constexpr,
    STORE_DX: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = 1.0  # no gain
    if HAS_W:
        w = _ld(W + cols, col_mask)
    dw_acc = tl.full([BLOCK_N], 0.0, tl.float32)
    db_acc = tl.full([BLOCK_N], 0.0, tl.float32)
    num_tiles = (M + BLOCK_M - 1) // BLOCK_M
    # Persistent loop: a fixed, shape-determined set of row tiles per program, so the partial sums
    # (and their final reduction) are reproducible bit for bit.
    for tile in range(pid, num_tiles, num_programs):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = _ld(X + offs, mask)
        dy = _ld(DY + offs, mask)
        rstd = _ld(RSTD + rows, row_mask)
        if MODE == 1:
            xhat = x * rstd[:, None]
        else:
            mean = _ld(MEAN + rows, row_mask)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if NEED_DW:
            dw_acc += _sum(dy * xhat, axis=0)
        if NEED_DB:
            db_acc += _sum(dy, axis=0)
        if STORE_DX:
            g = _grad_xhat(dy, xhat, w, k, scale, MODE, HAS_W)
            # the compiler drops a row mean that a detached term leaves unused
            mean_g = (_sum(g, axis=1) / N)[:, None]
            mean_gx = (_sum(g * xhat, axis=1) / N)[:, None]
            dx = _grad_x(g, xhat, rstd[:, None], mean_g, mean_gx, MODE, DETACH_MEAN, DETACH_STD)
            _st(DX + offs, dx, mask)
    if NEED_DW:
        tl.store(DW_PART + pid * N + cols, dw_acc, mask=col_mask)
    if NEED_DB:
        tl.store(DB_PART + pid * N + cols, db_acc, mask=col_mask)


@triton.jit
def _norm_bwd_coeffs_kernel(
    DY,  # upstream gradient, (M, N)
    X,  # forward input, (M, N)
    W,  # gain, (N,); unused unless HAS_W
    MEAN,  # row means, (M,); unused for MODE == MODE_RMS
    RSTD,  # row 1/σ, (M,)
    C1,  # float32 (M,): mean(g), μ's gradient path
    C2,  # float32 (M,): mean(g ⊙ x̂), σ's gradient path
    N,
    k,
    scale,
    MODE: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    X += row * N
    DY += row * N
    cols0 = tl.arange(0, BLOCK_N)
    rstd = tl.load(RSTD + row).to(tl.float32)
    if MODE == 1:
        mean = 0.0
    else:
        mean = tl.load(MEAN + row).to(tl.float32)
    sum_g = tl.full([BLOCK_N], 0.0, tl.float32)
    sum_gx = tl.full([BLOCK_N], 0.0, tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + cols0
        msk = cols < N
        x = _ld(X + cols, msk)
        dy = _ld(DY + cols, msk)
        xhat = tl.where(msk, (x - mean) * rstd, 0.0)
        w = 1.0  # no gain
        if HAS_W:
            w = _ld(W + cols, msk)
        g = _grad_xhat(dy, xhat, w, k, scale, MODE, HAS_W)
        sum_g += g
        sum_gx += g * xhat
    # Which of the two terms enter dx is decided by _norm_bwd_cols_kernel's flags.
    tl.store(C1 + row, _sum(sum_g, axis=0) / N)
    tl.store(C2 + row, _sum(sum_gx, axis=0) / N)


@triton.jit
def _norm_bwd_cols_kernel(
    DY,  # upstream gradient, (M, N)
    X,  # forward input, (M, N)
    W,  # gain, (N,); unused unless HAS_W
    MEAN,  # row means, (M,); unused for MODE == MODE_RMS
    RSTD,  # row 1/σ, (M,)
    C1,  # float32 (M,) from _norm_bwd_coeffs_kernel; read only if STORE_DX
    C2,  # float32 (M,)
    DX,  # input gradient, (M, N); written if STORE_DX
    DW_PART,  # float32 (num_row_groups, N)
    DB_PART,  # float32 (num_row_groups, N)
    M,
    N,
    k,
    scale,
    MODE: tl.constexpr,
    HAS_W: tl.constexpr,
    DETACH_MEAN: tl.constexpr,
    DETACH_STD: tl.constexpr,
    STORE_DX: tl.constexpr,
    NEED_DW: tl.constexpr,
    NEED_DB: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program (column block, row group): rows group, group + G, group + 2G, ... of one column block.
    col_block = tl.program_id(0)
    group = tl.program_id(1)
    num_groups = tl.num_programs(1)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = 1.0  # no gain
    if HAS_W:
        w = _ld(W + cols, col_mask)
    dw_acc = tl.full([BLOCK_N], 0.0, tl.float32)
    db_acc = tl.full([BLOCK_N], 0.0, tl.float32)
    # 64-bit row offsets: pointers start at this group's first row and step num_groups rows
    step = num_groups.to(tl.int64) * N
    X += group.to(tl.int64) * N
    DY += group.to(tl.int64) * N
    DX += group.to(tl.int64) * N
    for row in range(group, M, num_groups):
        x = _ld(X + cols, col_mask)
        dy = _ld(DY + cols, col_mask)
        rstd = tl.load(RSTD + row).to(tl.float32)
        if MODE == 1:
            xhat = x * rstd
        else:
            xhat = (x - tl.load(MEAN + row).to(tl.float32)) * rstd
        if NEED_DW:
            dw_acc += dy * xhat
        if NEED_DB:
            db_acc += dy
        if STORE_DX:
            g = _grad_xhat(dy, xhat, w, k, scale, MODE, HAS_W)
            # C1/C2 are written whenever dx is stored; the compiler drops a load left unused
            dx = _grad_x(g, xhat, rstd, tl.load(C1 + row), tl.load(C2 + row), MODE, DETACH_MEAN,
                         DETACH_STD)  # fmt: skip
            _st(DX + cols, dx, col_mask)
        X += step
        DY += step
        DX += step
    if NEED_DW:
        tl.store(DW_PART + group * N + cols, dw_acc, mask=col_mask)
    if NEED_DB:
        tl.store(DB_PART + group * N + cols, db_acc, mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


@triton.jit
def _range_probe_kernel(OUT, n):
    """A loop bounded by a run-time integer: what the interpreter check below runs."""
    for i in range(0, n, 1):
        tl.store(OUT + i, i)


@functools.cache
def _interpreter_problem() -> str | None:
    """Why the Triton interpreter cannot run these kernels in this environment, or ``None``.

    Triton 3.6's interpreter turns a run-time integer (held as a 1-element array) into a Python int
    with ``int()``, which NumPy 2.4 refuses for arrays of one dimension; every kernel looping to a
    run-time bound then fails deep in the interpreter. One tiny launch tells.
    """
    out = torch.zeros(2, dtype=torch.int32, device="cpu")
    try:
        _range_probe_kernel[(1,)](out, 2)
    except Exception as e:  # any failure here means the kernels cannot run
        import numpy as np

        return (
            f"the Triton interpreter (Triton {triton.__version__}, NumPy {np.__version__}) cannot "
            f"run a loop with a run-time bound: {e!r}. Triton 3.6's interpreter needs NumPy < 2.4; "
            "Triton 3.9 runs with either"
        )
    if out.tolist() != [0, 1]:
        return f"the Triton interpreter computed {out.tolist()} for [0, 1] in a probe kernel"
    return None


def check_runnable(t: Tensor) -> None:
    """``RuntimeError`` with the reason unless the kernels can run on ``t``'s device.

    CUDA tensors run compiled kernels. Other tensors run only when this module's kernels were
    decorated under ``TRITON_INTERPRET=1`` (set before the first import of the Triton backend), and
    the interpreter works with the installed NumPy.
    """
    if t.is_cuda:
        return
    if not isinstance(_range_probe_kernel, InterpretedFunction):
        raise RuntimeError(
            f"the Triton kernels got a {t.device.type} tensor: off CUDA they run only under the "
            "Triton interpreter, with TRITON_INTERPRET=1 set before layernorm's Triton backend is "
            "first imported"
        )
    problem = _interpreter_problem()
    if problem is not None:
        raise RuntimeError(problem)


def _check_rows(x: Tensor, name: str = "x") -> None:
    check_runnable(x)
    if x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D (M, N) tensor of rows, got shape {tuple(x.shape)}")


def norm_fwd(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    mode: int,
    k: float = 0.0,
    scale: float = 1.0,
    *,
    block_n: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` for rows of ``x``; ``mean`` is all zeros for RMSNorm (never read)."""
    _check_rows(x)
    x = x.contiguous()
    m, n = x.shape
    sdt = stats_dtype(x.dtype)
    y = torch.empty_like(x)
    # RMSNorm never writes the mean; zeros keep the returned tensor defined
    mean = x.new_zeros(m, dtype=sdt) if mode == MODE_RMS else x.new_empty(m, dtype=sdt)
    rstd = x.new_empty(m, dtype=sdt)
    if m == 0:
        return y, mean, rstd
    w = weight.contiguous() if weight is not None else x  # dummy pointer when absent
    b = bias.contiguous() if bias is not None else x
    cfg = launch_config(n, block_n)
    common = dict(
        MODE=mode, HAS_W=weight is not None, HAS_B=bias is not None, num_warps=cfg.num_warps
    )
    if cfg.looped:
        _norm_fwd_looped_kernel[(m,)](
            x, y, w, b, mean, rstd, n, eps, k, scale, BLOCK_N=cfg.block_n, **common
        )
    else:
        grid = (triton.cdiv(m, cfg.block_m),)
        _norm_fwd_fused_kernel[grid](
            x, y, w, b, mean, rstd, m, n, eps, k, scale,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **common,
        )  # fmt: skip
    return y, mean, rstd


def norm_bwd(
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    mode: int,
    *,
    detach_mean: bool = False,
    detach_std: bool = False,
    need_dx: bool = True,
    need_dw: bool = False,
    need_db: bool = False,
    k: float = 0.0,
    scale: float = 1.0,
    block_n: int | None = None,
    num_programs: int | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dw, db)``: ``dx`` in ``x``'s dtype, ``dw`` in the weight's, ``db`` as a float32 sum
    (the caller casts it to the bias dtype).

    ``num_programs`` fixes how many partial-sum rows the weight gradients are reduced from (the
    persistent grid size, or the number of row groups on the looped path).
    """
    _check_rows(x)
    _check_rows(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    x, dy = x.contiguous(), dy.contiguous()
    m, n = x.shape
    need_dw = need_dw and weight is not None
    dx = torch.empty_like(x) if need_dx else None
    if m == 0:
        zeros = torch.zeros(n, dtype=torch.float32, device=x.device)
        dw0 = zeros.to(weight.dtype) if need_dw else None  # type: ignore[union-attr]
        return dx, dw0, (zeros.clone() if need_db else None)
    if not (need_dx or need_dw or need_db):
        return None, None, None
    w = weight.contiguous() if weight is not None else x
    cfg = launch_config(n, block_n, backward=True)
    dx_arg = dx if dx is not None else x  # dummy pointer when dx is not wanted
    groups = backward_groups(cfg, m, n, x.device, num_programs)
    part_shape = (groups, n) if (need_dw or need_db) else (1, 1)
    dw_part = torch.empty(part_shape, dtype=torch.float32, device=x.device)
    db_part = torch.empty(part_shape, dtype=torch.float32, device=x.device)
    flags = dict(MODE=mode, HAS_W=weight is not None, NEED_DW=need_dw, NEED_DB=need_db)
    if cfg.looped:
        if need_dx:
            c1 = torch.empty(m, dtype=torch.float32, device=x.device)
            c2 = torch.empty(m, dtype=torch.float32, device=x.device)
            _norm_bwd_coeffs_kernel[(m,)](
                dy, x, w, mean, rstd, c1, c2, n, k, scale,
                MODE=mode, HAS_W=weight is not None, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                **BWD_LAUNCH_OPTIONS,
            )  # fmt: skip
        else:
            c1 = c2 = rstd  # unused
        _norm_bwd_cols_kernel[(triton.cdiv(n, cfg.block_n), groups)](
            dy, x, w, mean, rstd, c1, c2, dx_arg, dw_part, db_part, m, n, k, scale,
            DETACH_MEAN=detach_mean, DETACH_STD=detach_std, STORE_DX=need_dx,
            BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, **flags, **BWD_LAUNCH_OPTIONS,
        )  # fmt: skip
    else:
        _norm_bwd_fused_kernel[(groups,)](
            dy, x, w, mean, rstd, dx_arg, dw_part, db_part, m, n, k, scale,
            DETACH_MEAN=detach_mean, DETACH_STD=detach_std, STORE_DX=need_dx,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, **flags,
            **BWD_LAUNCH_OPTIONS,
        )  # fmt: skip
    dw = dw_part.sum(dim=0).to(weight.dtype) if need_dw else None  # type: ignore[union-attr]
    db = db_part.sum(dim=0) if need_db else None
    return dx, dw, db
