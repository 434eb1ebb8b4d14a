"""Fused Triton time steps of the layer-normalized LSTM and GRU (Ba et al. 2016, supplementary).

After the recurrent GEMM ``hp = W_hh h_{t−1}``, everything else of a step is elementwise or a row
reduction over at most ``4H`` values, so one program per batch row does it in registers: one kernel
launch per step instead of ~20 small ops. Gate order is torch's (LSTM ``i, f, g, o``; GRU
``r, z, n``), so ``torch.nn.LSTM``/``GRU`` weights fit. Statistics and arithmetic are float32;
tensors may be float32, float16 or bfloat16 (:data:`DTYPES`). float64 is refused with a
``TypeError`` rather than computed in float32 (the recurrent layers keep it on the eager steps).

LN-LSTM step (``LN(z; α, β) = α ⊙ (z − μ)/σ + β`` over the 4H units of all gates together)::

    a   = LN(hp; α_h, β_h) + gx          gx = LN(W_x x_t; α_x, β_x) + b  (the input half)
    c_t = σ(a_f) ⊙ c_{t−1} + σ(a_i) ⊙ tanh(a_g)
    h_t = σ(a_o) ⊙ tanh(LN(c_t; α_c, β_c))

and the state carried to the next step is the un-normalized ``c_t`` (the paper; the variant
carrying ``LN(c_t)``, as TF-Addons and PyTorch's fastrnns do, is a flag).

LN-GRU step, with ``LN`` over the ``(r, z)`` block (2H) and the candidate block (H) separately::

    (a_r, a_z) = LN(hp_rz; α_rz, β_rz) + gx_rz
    n   = tanh(gx_n + σ(a_r) ⊙ (LN(hp_n; α_n, β_n) + b_hn))
    h_t = (1 − σ(a_z)) ⊙ n + σ(a_z) ⊙ h_{t−1}

which is the paper's ``h_t = (1 − σ(z)) h_{t−1} + σ(z) ĥ_t`` with ``z → −z`` (torch's convention).

The input half ``gx`` does not depend on the recurrence, so a sequence layer normalizes it for all
time steps at once; the step kernels take it finished. :func:`ln_lstm_step` / :func:`ln_gru_step`
are the self-contained per-step functions of the papers' equations (they normalize ``gx`` with the
Triton layer-norm kernels and differentiate everything):

    ln_lstm_step(gh, gx, c_prev, w_h, b_h, w_x, b_x, bias, w_c, b_c, eps=1e-5,
                 carry_normalized=False) -> (h_t, c_t)
        gh, gx: (B, 4H) = W_hh h_{t−1}, W_ih x_t (no bias); c_prev: (B, H)
        w_h, b_h, w_x, b_x, bias: (4H,); w_c, b_c: (H,); bias may be None
    ln_gru_step(gh, gx, h_prev, w_h, b_h, w_x, b_x, b_hn=None, eps=1e-5) -> h_t
        gh, gx: (B, 3H) in r, z, n order; h_prev: (B, H)
        w_h, b_h, w_x, b_x: (3H,) = [(r, z) block's gain/bias (2H), candidate block's (H)]
        b_hn: (H,) or None, added to the normalized hidden candidate inside σ(r) ⊙ (·)

Both return tensors that autograd differentiates with the fused backward kernels (gradients of
``gh`` carry on into the GEMM ``W_hh h_{t−1}`` through ordinary autograd).

The device seam of :mod:`layernorm.recurrent` (``StepKernels``: ``lstm_fwd``, ``lstm_bwd``,
``gru_fwd``, ``gru_bwd``, each ``fn(st, off, bs)`` on the sequence buffers in ``st``) is served by
:func:`seam_functions`, which falls back to the given functions where these kernels do not apply
(no layer norm, an absent gain or bias, ``H > MAX_HIDDEN``, float64 buffers)::

    register_step_kernels("cuda", StepKernels(**rnn_step.seam_functions(EAGER)))

Below both sit the launchers :func:`lstm_step_fwd` / :func:`lstm_step_bwd` /
:func:`gru_step_fwd` / :func:`gru_step_bwd`: one step on ``(B, ·)`` row blocks that may be strided
views into the sequence buffers. The forward returns (or fills, when passed as ``saved``) the
dict of activations and float32 row statistics its backward takes as ``sv``; the seam functions
pass slices ``[off, off + bs)`` of ``st``'s buffers, so nothing is copied per step. The kernels
themselves are in :mod:`._rnn_kernels`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import triton
from torch import Tensor

from . import layer_norm as _ln
from ._norm_core import check_runnable
from ._rnn_kernels import (
    _gru_step_bwd_kernel,
    _gru_step_fwd_kernel,
    _lstm_step_bwd_kernel,
    _lstm_step_fwd_kernel,
)

# Registers hold ~22 row vectors of BLOCK_H in the LSTM backward; at 4 elements per thread and
# vector (num_warps = BLOCK_H / 128, at most 16) that stays under 128 registers up to H = 2048.
MAX_HIDDEN: int = 2048


def _num_warps(block_h: int) -> int:
    return max(1, min(16, block_h // 128))


def _block(h: int) -> dict[str, int]:
    """The kernels' ``BLOCK_H`` and ``num_warps`` for rows of ``h`` units."""
    block = triton.next_power_of_2(h)
    return {"BLOCK_H": block, "num_warps": _num_warps(block)}


# Per-step buffers, by name, with their widths in units of H (B rows each): the activations a
# forward saves for its backward, then its float32 row statistics (B,), and the gradients the
# backward writes. The sequence buffers of layernorm.recurrent use the same names.
_LSTM_SAVED = {"acts": 4, "cn": 1, "tc": 1}
_LSTM_STATS = ("mh", "rh", "mc", "rc")
_LSTM_GRADS = {"dgates": 4, "dhp": 4, "dlc": 1}
_GRU_SAVED = {"rz": 2, "n": 1, "ghn": 1}
_GRU_STATS = ("mh", "rh", "mn", "rn")
_GRU_GRADS = {"dgx": 3, "dgh": 3, "dhp": 3}


def _shapes(widths: dict[str, int], b: int, h: int) -> dict[str, tuple[int, int]]:
    return {key: (b, w * h) for key, w in widths.items()}


#: Tensor dtypes the kernels take. They compute in float32, so float64 would silently lose
#: precision: it is refused by the step functions and routed to the fallback by the seam.
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def supports(hidden_size: int) -> bool:
    """Whether the fused step kernels take this hidden size (else use the eager step)."""
    return 1 <= hidden_size <= MAX_HIDDEN


def supports_dtype(dtype: torch.dtype) -> bool:
    """Whether the fused step kernels take tensors of ``dtype`` (:data:`DTYPES`)."""
    return dtype in DTYPES


# --------------------------------------------------------------------------------------------
# Launchers: one step on (B, ·) row blocks. Every 2-D tensor needs unit column stride.
# --------------------------------------------------------------------------------------------


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _buffers(
    like: Tensor,
    given: dict[str, Tensor] | None,
    shapes: dict[str, tuple[int, ...]],
    stat_keys: tuple[str, ...] = (),
) -> dict[str, Tensor]:
    """``given`` completed with new tensors of ``shapes`` (``like``'s dtype) and float32 row
    statistics ``stat_keys`` of ``like``'s rows, for those not passed in."""
    sv = dict(given) if given is not None else {}
    for key, shape in shapes.items():
        if key not in sv:
            sv[key] = like.new_empty(shape)
    for key in stat_keys:
        if key not in sv:
            sv[key] = torch.empty(like.shape[0], dtype=torch.float32, device=like.device)
    return sv


def _check_hidden(h: int, what: str) -> None:
    if not supports(h):
        raise ValueError(
            f"{what}: the fused Triton step takes hidden sizes 1..{MAX_HIDDEN}, got {h}; "
            "use the eager step for larger layers"
        )


def _check_input(t: Tensor, what: str) -> None:
    """A device the kernels run on (see ``_norm_core.check_runnable``) and a supported dtype."""
    check_runnable(t)
    if not supports_dtype(t.dtype):
        names = ", ".join(str(d) for d in DTYPES)
        raise TypeError(
            f"{what}: the fused Triton step computes in float32 and takes {names} tensors, got "
            f"{t.dtype}; use the eager step (layernorm.recurrent's loop) for {t.dtype}"
        )


def lstm_step_fwd(
    hp: Tensor,
    gx: Tensor,
    c_prev: Tensor,
    w_h: Tensor,
    b_h: Tensor,
    w_c: Tensor,
    b_c: Tensor,
    eps: float,
    carry_normalized: bool = False,
    saved: dict[str, Tensor] | None = None,
    h_out: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """One LN-LSTM step from ``hp`` (raw) and the finished input half ``gx``.

    Returns ``(h_t, carried_state, saved)`` where ``saved`` holds ``acts, cn, tc, mh, rh, mc, rc``
    (pass preallocated tensors in ``saved``, and ``h_out``, to have them written in place).
    """
    b, h4 = hp.shape
    h = c_prev.shape[1]
    if h4 != 4 * h or gx.shape != hp.shape or c_prev.shape[0] != b:
        raise ValueError(
            f"lstm step: hp and gx must be (B, 4H) and c_prev (B, H), got {tuple(hp.shape)}, "
            f"{tuple(gx.shape)}, {tuple(c_prev.shape)}"
        )
    _check_hidden(h, "lstm step")
    _check_input(hp, "lstm step")
    hp, gx, c_prev = _rows(hp), _rows(gx), _rows(c_prev)
    sv = _buffers(hp, saved, _shapes(_LSTM_SAVED, b, h), _LSTM_STATS)
    if h_out is None:
        h_out = hp.new_empty((b, h))
    lc = hp.new_empty((b, h)) if carry_normalized else h_out  # dummy pointer when not written
    if sv["cn"].stride() != h_out.stride() or sv["tc"].stride() != h_out.stride():
        raise ValueError("lstm step: saved cn/tc buffers must be contiguous (B, H)")
    if b > 0:
        _lstm_step_fwd_kernel[(b,)](
            hp, gx, c_prev, w_h, b_h, w_c, b_c, h_out, lc,
            sv["acts"], sv["cn"], sv["tc"], sv["mh"], sv["rh"], sv["mc"], sv["rc"],
            hp.stride(0), gx.stride(0), c_prev.stride(0), h_out.stride(0), sv["acts"].stride(0),
            h, eps, CARRY_NORMALIZED=carry_normalized, **_block(h),
        )  # fmt: skip
    return h_out, (lc if carry_normalized else sv["cn"]), sv


def lstm_step_bwd(
    dh: Tensor,
    dc: Tensor,
    hp: Tensor,
    c_prev: Tensor,
    w_h: Tensor,
    w_c: Tensor,
    sv: dict[str, Tensor],
    carry_normalized: bool = False,
    out: dict[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Backward of :func:`lstm_step_fwd`, given its ``saved`` dict as ``sv``: returns
    ``(dc_prev, grads)`` with ``grads`` holding ``dgates`` (of the gate pre-activations, = of
    ``gx``), ``dhp`` and ``dlc`` (of LN(c_t)); pass preallocated tensors in ``out`` to have them
    written in place. ``dh`` is the total gradient of ``h_t`` (from the output and the next
    step)."""
    b, h = dh.shape
    dh, dc, hp, c_prev = _rows(dh), _rows(dc), _rows(hp), _rows(c_prev)
    if c_prev.stride(0) != h or dc.stride(0) != h or dh.stride(0) != h:
        dh, dc, c_prev = dh.contiguous(), dc.contiguous(), c_prev.contiguous()
    g = _buffers(hp, out, _shapes(_LSTM_GRADS, b, h))
    dc_prev = hp.new_empty((b, h))
    if b > 0:
        _lstm_step_bwd_kernel[(b,)](
            dh, dc, hp, c_prev, sv["acts"], sv["cn"], sv["tc"],
            sv["mh"], sv["rh"], sv["mc"], sv["rc"], w_h, w_c,
            g["dgates"], g["dhp"], g["dlc"], dc_prev,
            h, hp.stride(0), sv["acts"].stride(0), h,
            CARRY_NORMALIZED=carry_normalized, **_block(h),
        )  # fmt: skip
    return dc_prev, g


def gru_step_fwd(
    hp_rz: Tensor,
    hp_n: Tensor,
    gx: Tensor,
    h_prev: Tensor,
    w_rz: Tensor,
    b_rz: Tensor,
    w_n: Tensor,
    b_n: Tensor,
    b_hn: Tensor | None,
    eps: float,
    saved: dict[str, Tensor] | None = None,
    h_out: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """One LN-GRU step; returns ``(h_t, saved)`` with ``saved``: ``rz, n, ghn, mh, rh, mn, rn``."""
    b, h = h_prev.shape
    if hp_rz.shape != (b, 2 * h) or hp_n.shape != (b, h) or gx.shape != (b, 3 * h):
        raise ValueError(
            f"gru step: hp_rz (B, 2H), hp_n (B, H), gx (B, 3H) for h_prev {tuple(h_prev.shape)}, "
            f"got {tuple(hp_rz.shape)}, {tuple(hp_n.shape)}, {tuple(gx.shape)}"
        )
    _check_hidden(h, "gru step")
    _check_input(h_prev, "gru step")
    hp_rz, hp_n, gx, h_prev = _rows(hp_rz), _rows(hp_n), _rows(gx), h_prev.contiguous()
    sv = _buffers(hp_rz, saved, _shapes(_GRU_SAVED, b, h), _GRU_STATS)
    if sv["rz"].stride(-1) != 1:
        raise ValueError("gru step: the saved rz buffer must have unit column stride")
    if h_out is None:
        h_out = h_prev.new_empty((b, h))
    if h_out.stride() != h_prev.stride():
        raise ValueError("gru step: h_out must be contiguous (B, H)")
    if b > 0:
        _gru_step_fwd_kernel[(b,)](
            hp_rz, hp_n, gx, h_prev, w_rz, b_rz, w_n, b_n, b_hn if b_hn is not None else b_n,
            h_out, sv["rz"], sv["n"], sv["ghn"], sv["mh"], sv["rh"], sv["mn"], sv["rn"],
            hp_rz.stride(0), sv["rz"].stride(0), hp_n.stride(0), gx.stride(0), h,
            h, eps, HAS_B_HN=b_hn is not None, **_block(h),
        )  # fmt: skip
    return h_out, sv


def gru_step_bwd(
    dh: Tensor,
    h_prev: Tensor,
    hp_rz: Tensor,
    hp_n: Tensor,
    w_rz: Tensor,
    w_n: Tensor,
    sv: dict[str, Tensor],
    out: dict[str, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Backward of :func:`gru_step_fwd`, given its ``saved`` dict as ``sv``: returns
    ``(dh_prev_direct, grads)`` with ``grads`` holding ``dgx``, ``dgh`` (of LN(hp_rz)'s output and
    of ``ghn``) and ``dhp`` (of ``hp_rz``, ``hp_n``), all (B, 3H), written in place into ``out``'s
    tensors where given. ``dh_prev_direct`` is the gradient of ``h_{t−1}`` through
    ``z ⊙ h_{t−1}`` only; the caller adds ``dhp · W_hh``."""
    b, h = dh.shape
    dh, h_prev = dh.contiguous(), h_prev.contiguous()
    hp_rz, hp_n = _rows(hp_rz), _rows(hp_n)
    for key, t in (out or {}).items():
        if key in _GRU_GRADS and t.stride() != (3 * h, 1):
            raise ValueError(f"gru step: the {key} buffer must be contiguous (B, 3H)")
    g = _buffers(dh, out, _shapes(_GRU_GRADS, b, h))
    dh_prev = dh.new_empty((b, h))
    if b > 0:
        _gru_step_bwd_kernel[(b,)](
            dh, h_prev, hp_rz, hp_n, sv["rz"], sv["n"], sv["ghn"],
            sv["mh"], sv["rh"], sv["mn"], sv["rn"], w_rz, w_n,
            g["dgx"], g["dgh"], g["dhp"], dh_prev,
            h, hp_rz.stride(0), sv["rz"].stride(0), hp_n.stride(0), 3 * h, h, **_block(h),
        )  # fmt: skip
    return dh_prev, g


# --------------------------------------------------------------------------------------------
# Per-step autograd functions of the papers' equations
# --------------------------------------------------------------------------------------------


def _saved_dtype(x: Tensor) -> torch.dtype:
    # activations saved for backward in float32 for half inputs: per-step tensors are small and the
    # backward's products of saved values would otherwise round twice
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _empty_saved(like: Tensor, shapes: dict[str, tuple[int, int]]) -> dict[str, Tensor]:
    dt = _saved_dtype(like)
    return {k: torch.empty(s, dtype=dt, device=like.device) for k, s in shapes.items()}


def _sum_rows(t: Tensor) -> Tensor:
    return t.float().sum(0)


def _xhat(x: Tensor, mean: Tensor, rstd: Tensor) -> Tensor:
    return (x.float() - mean.float()[:, None]) * rstd.float()[:, None]


def _cast(g: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if g is None or like is None else g.to(like.dtype)


class LNLSTMStepFunction(torch.autograd.Function):
    """``(h_t, c_t) = LN-LSTM step(gh, gx, c_{t−1})``; see :func:`ln_lstm_step`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gh: Tensor,
        gx: Tensor,
        c_prev: Tensor,
        w_h: Tensor,
        b_h: Tensor,
        w_x: Tensor,
        b_x: Tensor,
        bias: Tensor | None,
        w_c: Tensor,
        b_c: Tensor,
        eps: float,
        carry_normalized: bool,
    ) -> tuple[Tensor, Tensor]:
        b, h = c_prev.shape
        # LN(gx; α_x, β_x) + b = LN(gx; α_x, β_x + b): one normalization of the input half
        b_x_eff = b_x if bias is None else b_x.float() + bias.float()
        # half inputs: the normalized input half stays float32 (no rounding inside the step)
        gx_dtype = gx.dtype
        gx = gx.to(_saved_dtype(gx)).contiguous()
        gxn, mx, rx = _ln.layer_norm_fwd(gx, w_x, b_x_eff, eps)
        saved = _empty_saved(gh, _shapes(_LSTM_SAVED, b, h))
        h_t, carried, sv = lstm_step_fwd(
            gh, gxn, c_prev, w_h, b_h, w_c, b_c, eps, carry_normalized, saved=saved
        )
        ctx.save_for_backward(
            gh, gx, c_prev, w_h, b_h, w_x, b_x, bias, w_c, b_c, mx, rx, *sv.values()
        )
        ctx.sv_keys = tuple(sv)
        ctx.carry_normalized = carry_normalized
        ctx.gx_dtype = gx_dtype
        # a copy: the saved c_t must not alias an output the caller may modify in place
        return h_t, carried.to(c_prev.dtype, copy=True)

    @staticmethod
    def backward(ctx: Any, dh: Tensor | None, dc: Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        gh, gx, c_prev, w_h, b_h, w_x, b_x, bias, w_c, b_c, mx, rx, *rest = ctx.saved_tensors
        sv = dict(zip(ctx.sv_keys, rest, strict=True))
        b, h = c_prev.shape
        dh = torch.zeros_like(c_prev) if dh is None else dh.to(c_prev.dtype)
        dc = torch.zeros_like(c_prev) if dc is None else dc.to(c_prev.dtype)
        grads = _empty_saved(gh, _shapes(_LSTM_GRADS, b, h))
        dc_prev, g = lstm_step_bwd(dh, dc, gh, c_prev, w_h, w_c, sv, ctx.carry_normalized, grads)
        dgates = g["dgates"]
        # gx went through LN(·; α_x, β_x + b): its backward also gives dα_x and Σ dgates
        dgx, dw_x, db_x = _ln.layer_norm_bwd(
            dgates, gx, mx, rx, w_x, False, False, True, True, True
        )
        dw_h = _sum_rows(dgates * _xhat(gh, sv["mh"], sv["rh"]))
        dw_c = _sum_rows(g["dlc"] * _xhat(sv["cn"], sv["mc"], sv["rc"]))
        db_c = _sum_rows(g["dlc"])
        return (
            g["dhp"].to(gh.dtype),
            None if dgx is None else dgx.to(ctx.gx_dtype),
            dc_prev,
            _cast(dw_h, w_h),
            _cast(db_x, b_h),  # Σ dgates, like β_x and b
            _cast(dw_x, w_x),
            _cast(db_x, b_x),
            _cast(db_x, bias),
            _cast(dw_c, w_c),
            _cast(db_c, b_c),
            None,
            None,
        )


class LNGRUStepFunction(torch.autograd.Function):
    """``h_t = LN-GRU step(gh, gx, h_{t−1})``; see :func:`ln_gru_step`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gh: Tensor,
        gx: Tensor,
        h_prev: Tensor,
        w_h: Tensor,
        b_h: Tensor,
        w_x: Tensor,
        b_x: Tensor,
        b_hn: Tensor | None,
        eps: float,
    ) -> Tensor:
        b, h = h_prev.shape
        ctx.gx_dtype = gx.dtype
        gx = gx.to(_saved_dtype(gx))  # the normalized input half stays float32 for half inputs
        gx_rz, gx_n = gx[:, : 2 * h].contiguous(), gx[:, 2 * h :].contiguous()
        grz, mxr, rxr = _ln.layer_norm_fwd(gx_rz, w_x[: 2 * h], b_x[: 2 * h], eps)
        gn, mxn, rxn = _ln.layer_norm_fwd(gx_n, w_x[2 * h :], b_x[2 * h :], eps)
        gxn = torch.cat([grz, gn], dim=1)
        hp_rz, hp_n = gh[:, : 2 * h], gh[:, 2 * h :]  # strided views: the kernels take row strides
        saved = _empty_saved(gh, _shapes(_GRU_SAVED, b, h))
        h_t, sv = gru_step_fwd(
            hp_rz, hp_n, gxn, h_prev, w_h[: 2 * h], b_h[: 2 * h], w_h[2 * h :], b_h[2 * h :],
            b_hn, eps, saved=saved,
        )  # fmt: skip
        ctx.save_for_backward(
            h_prev, hp_rz, hp_n, gx_rz, gx_n, w_h, b_h, w_x, b_x, b_hn,
            mxr, rxr, mxn, rxn, *sv.values(),
        )  # fmt: skip
        ctx.sv_keys = tuple(sv)
        return h_t

    @staticmethod
    def backward(ctx: Any, dh: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        h_prev, hp_rz, hp_n, gx_rz, gx_n, w_h, b_h, w_x, b_x, b_hn, mxr, rxr, mxn, rxn, *rest = (
            ctx.saved_tensors
        )
        sv = dict(zip(ctx.sv_keys, rest, strict=True))
        b, h = h_prev.shape
        grads = _empty_saved(hp_rz, _shapes(_GRU_GRADS, b, h))
        dh_prev, g = gru_step_bwd(
            dh.to(h_prev.dtype), h_prev, hp_rz, hp_n, w_h[: 2 * h], w_h[2 * h :], sv, grads
        )
        dgx_rz, dwx_rz, dbx_rz = _ln.layer_norm_bwd(
            g["dgx"][:, : 2 * h].contiguous(), gx_rz, mxr, rxr, w_x[: 2 * h],
            False, False, True, True, True,
        )  # fmt: skip
        dgx_n, dwx_n, dbx_n = _ln.layer_norm_bwd(
            g["dgx"][:, 2 * h :].contiguous(), gx_n, mxn, rxn, w_x[2 * h :],
            False, False, True, True, True,
        )  # fmt: skip
        dgh_out = g["dgh"]  # gradient of LN(hp_rz)'s output and of ghn = LN(hp_n) + b_hn
        dw_h = torch.cat([
            _sum_rows(dgh_out[:, : 2 * h] * _xhat(hp_rz, sv["mh"], sv["rh"])),
            _sum_rows(dgh_out[:, 2 * h :] * _xhat(hp_n, sv["mn"], sv["rn"])),
        ])  # fmt: skip
        db_h = _sum_rows(dgh_out)
        assert dgx_rz is not None and dgx_n is not None
        return (
            g["dhp"].to(h_prev.dtype),
            torch.cat([dgx_rz, dgx_n], dim=1).to(ctx.gx_dtype),
            dh_prev,
            _cast(dw_h, w_h),
            _cast(db_h, b_h),
            _cast(torch.cat([dwx_rz.float(), dwx_n.float()]), w_x),  # type: ignore[union-attr]
            _cast(torch.cat([dbx_rz.float(), dbx_n.float()]), b_x),  # type: ignore[union-attr]
            _cast(db_h[2 * h :], b_hn),
            None,
        )


def _check_step(
    name: str, state: Tensor, gh: Tensor, gx: Tensor, blocks: int, params: dict[str, Any]
) -> None:
    if state.dim() != 2:
        raise ValueError(f"{name}: the state must be (B, H), got shape {tuple(state.shape)}")
    b, h = state.shape
    for what, t in (("gh", gh), ("gx", gx)):
        if tuple(t.shape) != (b, blocks * h):
            raise ValueError(
                f"{name}: {what} must be (B, {blocks}H) = {(b, blocks * h)} for a state of shape "
                f"{(b, h)}, got {tuple(t.shape)}"
            )
        if t.dtype != state.dtype or t.device != state.device:
            raise TypeError(
                f"{name}: {what} is {t.dtype} on {t.device} but the state is {state.dtype} on "
                f"{state.device}"
            )
    for pname, (p, n) in params.items():
        if p is None:
            continue
        if tuple(p.shape) != (n * h,):
            raise ValueError(f"{name}: {pname} must have shape ({n * h},), got {tuple(p.shape)}")
        if p.device != state.device:
            raise ValueError(f"{name}: {pname} is on {p.device} but the state is on {state.device}")
    _check_hidden(h, name)
    _check_input(state, name)


def ln_lstm_step(
    gh: Tensor,
    gx: Tensor,
    c_prev: Tensor,
    w_h: Tensor,
    b_h: Tensor,
    w_x: Tensor,
    b_x: Tensor,
    bias: Tensor | None,
    w_c: Tensor,
    b_c: Tensor,
    eps: float = 1e-5,
    carry_normalized: bool = False,
) -> tuple[Tensor, Tensor]:
    """One layer-normalized LSTM step (Ba et al. 2016, supplementary), fused forward and backward.

    ``(i, f, g, o) = LN(gh; w_h, b_h) + LN(gx; w_x, b_x) + bias``,
    ``c_t = σ(f)c_{t−1} + σ(i)tanh(g)``, ``h_t = σ(o) tanh(LN(c_t; w_c, b_c))``. Returns
    ``(h_t, c_t)`` (``LN(c_t)`` as the second output with ``carry_normalized=True``). Shapes in
    the module docstring.
    """
    _check_step(
        "ln_lstm_step", c_prev, gh, gx, 4,
        {"w_h": (w_h, 4), "b_h": (b_h, 4), "w_x": (w_x, 4), "b_x": (b_x, 4), "bias": (bias, 4),
         "w_c": (w_c, 1), "b_c": (b_c, 1)},
    )  # fmt: skip
    return LNLSTMStepFunction.apply(  # type: ignore[no-any-return]
        gh, gx, c_prev, w_h, b_h, w_x, b_x, bias, w_c, b_c, float(eps), bool(carry_normalized)
    )


def ln_gru_step(
    gh: Tensor,
    gx: Tensor,
    h_prev: Tensor,
    w_h: Tensor,
    b_h: Tensor,
    w_x: Tensor,
    b_x: Tensor,
    b_hn: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """One layer-normalized GRU step (Ba et al. 2016, supplementary), fused forward and backward.

    ``(r, z) = LN(gh_rz) + LN(gx_rz)``, ``n = tanh(LN(gx_n) + σ(r) ⊙ (LN(gh_n) + b_hn))``,
    ``h_t = (1 − σ(z)) n + σ(z) h_{t−1}``; torch's r, z, n layout. Shapes in the module docstring.
    """
    _check_step(
        "ln_gru_step", h_prev, gh, gx, 3,
        {"w_h": (w_h, 3), "b_h": (b_h, 3), "w_x": (w_x, 3), "b_x": (b_x, 3), "b_hn": (b_hn, 1)},
    )  # fmt: skip
    return LNGRUStepFunction.apply(  # type: ignore[no-any-return]
        gh, gx, h_prev, w_h, b_h, w_x, b_x, b_hn, float(eps)
    )


# --------------------------------------------------------------------------------------------
# The layernorm.recurrent device seam
# --------------------------------------------------------------------------------------------


def seam_functions(fallback: Any) -> dict[str, Callable[..., Any]]:
    """``lstm_fwd``, ``lstm_bwd``, ``gru_fwd``, ``gru_bwd`` for :mod:`layernorm.recurrent`'s step
    seam: ``fn(st, off, bs)`` reading and writing the sequence buffers in ``st`` (names and shapes
    documented in ``layernorm.recurrent._pointwise``). They run these kernels and defer to
    ``fallback``'s functions of the same names when a step has no layer norm, a gain or bias is
    absent, ``H`` exceeds :data:`MAX_HIDDEN`, or the buffers are of a dtype the kernels do not
    take (float64: they compute in float32, see :data:`DTYPES`)."""
    lstm_keys = ("w1", "b1", "w3", "b3")
    gru_keys = ("w_rz", "b_rz", "w_n", "b_n")

    def views(st: dict[str, Any], keys: Iterable[str], sl: slice) -> dict[str, Tensor]:
        return {k: st[k][sl] for k in keys}

    def fused(st: dict[str, Any], keys: tuple[str, ...]) -> bool:
        return (
            bool(st["normalize"])
            and supports(st["H"])
            and all(st[k] is not None for k in keys)
            and supports_dtype(st["gx"].dtype)
        )

    def lstm_fwd(st: dict[str, Any], off: int, bs: int) -> None:
        if not fused(st, lstm_keys):
            return fallback.lstm_fwd(st, off, bs)
        sl = slice(off, off + bs)
        h, c = st["h"][:bs], st["c"][:bs]
        st["hprev"][sl] = h
        c_prev = st["cprev"][sl]
        c_prev.copy_(c)
        sv = views(st, (*_LSTM_SAVED, *_LSTM_STATS), sl)
        h_new, carried, _ = lstm_step_fwd(
            st["hp"][sl], st["gx"][sl], c_prev, st["w1"], st["b1"], st["w3"], st["b3"],
            st["eps"], st["carry_normalized"], saved=sv, h_out=st["out"][sl],
        )  # fmt: skip
        h.copy_(h_new)
        c.copy_(carried)
        return None

    def lstm_bwd(st: dict[str, Any], off: int, bs: int) -> None:
        if not fused(st, lstm_keys):
            return fallback.lstm_bwd(st, off, bs)
        sl = slice(off, off + bs)
        dh_t = st["dh"][:bs] + st["dout"][sl]
        dc = st["dc"][:bs]
        sv = views(st, (*_LSTM_SAVED, *_LSTM_STATS), sl)
        out = views(st, _LSTM_GRADS, sl)
        dc_prev, _ = lstm_step_bwd(
            dh_t, dc, st["hp"][sl], st["cprev"][sl], st["w1"], st["w3"], sv,
            st["carry_normalized"], out=out,
        )  # fmt: skip
        dc.copy_(dc_prev)
        return None

    def gru_fwd(st: dict[str, Any], off: int, bs: int) -> None:
        if not fused(st, gru_keys):
            return fallback.gru_fwd(st, off, bs)
        hs, sl = st["H"], slice(off, off + bs)
        h = st["h"][:bs]
        h_prev = st["hprev"][sl]
        h_prev.copy_(h)
        hp = st["hp"][sl]
        sv = views(st, (*_GRU_SAVED, *_GRU_STATS), sl)
        h_new, _ = gru_step_fwd(
            hp[:, : 2 * hs], hp[:, 2 * hs :], st["gx"][sl], h_prev, st["w_rz"], st["b_rz"],
            st["w_n"], st["b_n"], st["b_hn"], st["eps"], saved=sv, h_out=st["out"][sl],
        )  # fmt: skip
        h.copy_(h_new)
        return None

    def gru_bwd(st: dict[str, Any], off: int, bs: int) -> None:
        if not fused(st, gru_keys):
            return fallback.gru_bwd(st, off, bs)
        hs, sl = st["H"], slice(off, off + bs)
        dh = st["dh"][:bs]
        dh_t = dh + st["dout"][sl]
        hp = st["hp"][sl]
        sv = views(st, (*_GRU_SAVED, *_GRU_STATS), sl)
        out = views(st, _GRU_GRADS, sl)
        dh_prev, _ = gru_step_bwd(
            dh_t, st["hprev"][sl], hp[:, : 2 * hs], hp[:, 2 * hs :], st["w_rz"], st["w_n"], sv,
            out=out,
        )  # fmt: skip
        dh.copy_(dh_prev)
        return None

    return {"lstm_fwd": lstm_fwd, "lstm_bwd": lstm_bwd, "gru_fwd": gru_fwd, "gru_bwd": gru_bwd}


# --------------------------------------------------------------------------------------------
# Compile specifications for tests/test_triton_compile.py: the largest supported hidden size.
# --------------------------------------------------------------------------------------------


def _spec(kernel: Any, constexprs: dict[str, Any]) -> tuple:
    names = kernel.arg_names
    stats = {"MH", "RH", "MC", "RC", "MN", "RN"}
    ints = tuple(a for a in names if a.startswith("stride") or a == "H")
    ptrs = {
        a: ("fp32" if a in stats or a[:2] in ("W_", "B_") else "bf16")
        for a in names
        if a.isupper() and a not in constexprs and a not in ints
    }
    floats = tuple(a for a in names if a == "eps")
    block = constexprs["BLOCK_H"]
    return (kernel.__name__, ptrs, ints, floats, constexprs, _num_warps(block))


def _compile_specs() -> list[tuple]:
    block = triton.next_power_of_2(MAX_HIDDEN)
    return [
        _spec(_lstm_step_fwd_kernel, {"CARRY_NORMALIZED": True, "BLOCK_H": block}),
        _spec(_lstm_step_bwd_kernel, {"CARRY_NORMALIZED": False, "BLOCK_H": block}),
        _spec(_gru_step_fwd_kernel, {"HAS_B_HN": True, "BLOCK_H": block}),
        _spec(_gru_step_bwd_kernel, {"BLOCK_H": block}),
    ]


COMPILE_SPECS: list[tuple] = _compile_specs()
