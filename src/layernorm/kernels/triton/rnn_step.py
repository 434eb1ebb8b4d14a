"""Fused Triton time steps of the layer-normalized LSTM and GRU (Ba et al. 2016, supplementary).

After the recurrent GEMM ``hp = W_hh h_{t−1}``, everything else of a step is elementwise or a row
reduction over at most ``4H`` values, so one program per batch row does it in registers: one kernel
launch per step instead of ~20 small ops. Gate order is torch's (LSTM ``i, f, g, o``; GRU
``r, z, n``), so ``torch.nn.LSTM``/``GRU`` weights fit. Statistics and arithmetic are float32.

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
``gru_fwd``, ``gru_bwd`` with their ``p``/``sv``/``dsv`` dictionaries) is served by
:func:`seam_functions`, which falls back to the given eager functions where these kernels do not
apply (no layer norm, ``H > MAX_HIDDEN``)::

    register_step_kernels("cuda", StepKernels(**rnn_step.seam_functions(EAGER)))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import layer_norm as _ln
from ._norm_core import _sum  # tl.reduce-based row sum (see there why not tl.sum)

# Registers hold ~22 row vectors of BLOCK_H in the LSTM backward; at 4 elements per thread and
# vector (num_warps = BLOCK_H / 128, at most 16) that stays under 128 registers up to H = 2048.
MAX_HIDDEN: int = 2048


def _num_warps(block_h: int) -> int:
    return max(1, min(16, block_h // 128))


def supports(hidden_size: int) -> bool:
    """Whether the fused step kernels take this hidden size (else use the eager step)."""
    return 1 <= hidden_size <= MAX_HIDDEN


@triton.jit
def _sigmoid(a):
    return 1.0 / (1.0 + tl.exp(-a))


@triton.jit
def _tanh(a):
    # tanh from exp(−2|a|) ∈ (0, 1]: no overflow for any a; absolute error a few float32 ulps
    e = tl.exp(-2.0 * tl.abs(a))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0, -t, t)


# --------------------------------------------------------------------------------------------
# LSTM
# --------------------------------------------------------------------------------------------


@triton.jit
def _lstm_step_fwd_kernel(
    HP,  # (B, 4H) W_hh h_{t−1}, raw; row stride stride_hp
    GX,  # (B, 4H) finished input half LN(W_ih x_t) + b
    C_PREV,  # (B, H) c_{t−1}
    W_H,  # (4H,) gain of LN(hp)
    B_H,  # (4H,) bias of LN(hp)
    W_C,  # (H,) gain of LN(c_t)
    B_C,  # (H,) bias of LN(c_t)
    H_OUT,  # (B, H) h_t
    LC_OUT,  # (B, H) LN(c_t), written if CARRY_NORMALIZED (the carried state then)
    ACTS,  # (B, 4H) σ(a_i), σ(a_f), tanh(a_g), σ(a_o), saved for backward
    CN,  # (B, H) c_t un-normalized, saved
    TC,  # (B, H) tanh(LN(c_t)), saved
    MH,  # (B,) mean of hp
    RH,  # (B,) rstd of hp
    MC,  # (B,) mean of c_t
    RC,  # (B,) rstd of c_t
    stride_hp,
    stride_gx,
    stride_c,  # row stride of C_PREV
    stride_h,  # row stride of H_OUT, LC_OUT, CN, TC
    stride_a,  # row stride of ACTS
    H,
    eps,
    CARRY_NORMALIZED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    hp_row = HP + row * stride_hp
    gx_row = GX + row * stride_gx
    # the four gate blocks of hp, each (BLOCK_H,)
    h_i = tl.load(hp_row + cols, mask=m, other=0.0).to(tl.float32)
    h_f = tl.load(hp_row + H + cols, mask=m, other=0.0).to(tl.float32)
    h_g = tl.load(hp_row + 2 * H + cols, mask=m, other=0.0).to(tl.float32)
    h_o = tl.load(hp_row + 3 * H + cols, mask=m, other=0.0).to(tl.float32)
    # LN over all 4H gate pre-activations together, as the authors' code does
    mean_h = (_sum(h_i, axis=0) + _sum(h_f, axis=0) + _sum(h_g, axis=0) + _sum(h_o, axis=0)) / (
        4 * H
    )
    h_i = tl.where(m, h_i - mean_h, 0.0)
    h_f = tl.where(m, h_f - mean_h, 0.0)
    h_g = tl.where(m, h_g - mean_h, 0.0)
    h_o = tl.where(m, h_o - mean_h, 0.0)
    var_h = (
        _sum(h_i * h_i, axis=0)
        + _sum(h_f * h_f, axis=0)
        + _sum(h_g * h_g, axis=0)
        + _sum(h_o * h_o, axis=0)
    ) / (4 * H)
    rstd_h = 1.0 / tl.sqrt(var_h + eps)
    a_i = h_i * rstd_h * tl.load(W_H + cols, mask=m, other=0.0).to(tl.float32)
    a_f = h_f * rstd_h * tl.load(W_H + H + cols, mask=m, other=0.0).to(tl.float32)
    a_g = h_g * rstd_h * tl.load(W_H + 2 * H + cols, mask=m, other=0.0).to(tl.float32)
    a_o = h_o * rstd_h * tl.load(W_H + 3 * H + cols, mask=m, other=0.0).to(tl.float32)
    a_i += tl.load(B_H + cols, mask=m, other=0.0).to(tl.float32)
    a_f += tl.load(B_H + H + cols, mask=m, other=0.0).to(tl.float32)
    a_g += tl.load(B_H + 2 * H + cols, mask=m, other=0.0).to(tl.float32)
    a_o += tl.load(B_H + 3 * H + cols, mask=m, other=0.0).to(tl.float32)
    a_i += tl.load(gx_row + cols, mask=m, other=0.0).to(tl.float32)
    a_f += tl.load(gx_row + H + cols, mask=m, other=0.0).to(tl.float32)
    a_g += tl.load(gx_row + 2 * H + cols, mask=m, other=0.0).to(tl.float32)
    a_o += tl.load(gx_row + 3 * H + cols, mask=m, other=0.0).to(tl.float32)
    s_i = _sigmoid(a_i)
    s_f = _sigmoid(a_f)
    t_g = _tanh(a_g)
    s_o = _sigmoid(a_o)
    c_prev = tl.load(C_PREV + row * stride_c + cols, mask=m, other=0.0).to(tl.float32)
    c = s_f * c_prev + s_i * t_g
    # LN(c_t) over the H cells
    mean_c = _sum(tl.where(m, c, 0.0), axis=0) / H
    cc = tl.where(m, c - mean_c, 0.0)
    rstd_c = 1.0 / tl.sqrt(_sum(cc * cc, axis=0) / H + eps)
    lc = cc * rstd_c * tl.load(W_C + cols, mask=m, other=0.0).to(tl.float32)
    lc += tl.load(B_C + cols, mask=m, other=0.0).to(tl.float32)
    tc = _tanh(lc)
    h = s_o * tc
    out = row * stride_h + cols
    a_row = ACTS + row * stride_a
    tl.store(a_row + cols, s_i.to(ACTS.dtype.element_ty), mask=m)
    tl.store(a_row + H + cols, s_f.to(ACTS.dtype.element_ty), mask=m)
    tl.store(a_row + 2 * H + cols, t_g.to(ACTS.dtype.element_ty), mask=m)
    tl.store(a_row + 3 * H + cols, s_o.to(ACTS.dtype.element_ty), mask=m)
    tl.store(CN + out, c.to(CN.dtype.element_ty), mask=m)
    tl.store(TC + out, tc.to(TC.dtype.element_ty), mask=m)
    tl.store(H_OUT + out, h.to(H_OUT.dtype.element_ty), mask=m)
    if CARRY_NORMALIZED:
        tl.store(LC_OUT + out, lc.to(LC_OUT.dtype.element_ty), mask=m)
    tl.store(MH + row, mean_h.to(MH.dtype.element_ty))
    tl.store(RH + row, rstd_h.to(RH.dtype.element_ty))
    tl.store(MC + row, mean_c.to(MC.dtype.element_ty))
    tl.store(RC + row, rstd_c.to(RC.dtype.element_ty))


@triton.jit
def _lstm_step_bwd_kernel(
    DH,  # (B, H) gradient of h_t
    DC,  # (B, H) gradient of the carried state (c_t, or LN(c_t) if CARRY_NORMALIZED)
    HP,  # (B, 4H) the forward's hp
    C_PREV,  # (B, H)
    ACTS,  # (B, 4H) saved activations
    CN,  # (B, H) saved c_t
    TC,  # (B, H) saved tanh(LN(c_t))
    MH,  # (B,) saved statistics
    RH,
    MC,
    RC,
    W_H,  # (4H,)
    W_C,  # (H,)
    DGATES,  # (B, 4H) out: gradient of the gate pre-activations a (= of gx)
    DHP,  # (B, 4H) out: gradient of hp
    DLC,  # (B, H) out: gradient of LN(c_t)'s output (for α_c, β_c)
    DC_PREV,  # (B, H) out: gradient of c_{t−1}
    stride_h,  # row stride of DH, DC, C_PREV, CN, TC, DLC, DC_PREV
    stride_hp,  # row stride of HP
    stride_a,  # row stride of ACTS, DGATES, DHP
    H,
    CARRY_NORMALIZED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    hrow = row * stride_h + cols
    a_row = ACTS + row * stride_a
    s_i = tl.load(a_row + cols, mask=m, other=0.0).to(tl.float32)
    s_f = tl.load(a_row + H + cols, mask=m, other=0.0).to(tl.float32)
    t_g = tl.load(a_row + 2 * H + cols, mask=m, other=0.0).to(tl.float32)
    s_o = tl.load(a_row + 3 * H + cols, mask=m, other=0.0).to(tl.float32)
    dh = tl.load(DH + hrow, mask=m, other=0.0).to(tl.float32)
    dc = tl.load(DC + hrow, mask=m, other=0.0).to(tl.float32)
    tc = tl.load(TC + hrow, mask=m, other=0.0).to(tl.float32)
    # h = σ(o) ⊙ tanh(LN(c)):  ∂/∂a_o and ∂/∂LN(c)
    d_o = dh * tc * s_o * (1.0 - s_o)
    dlc = dh * s_o * (1.0 - tc * tc)
    if CARRY_NORMALIZED:
        dlc += dc
    tl.store(DLC + hrow, dlc.to(DLC.dtype.element_ty), mask=m)
    # back through LN(c_t) over H
    rstd_c = tl.load(RC + row).to(tl.float32)
    chat = tl.where(
        m,
        (tl.load(CN + hrow, mask=m, other=0.0).to(tl.float32) - tl.load(MC + row).to(tl.float32))
        * rstd_c,
        0.0,
    )
    g_c = dlc * tl.load(W_C + cols, mask=m, other=0.0).to(tl.float32)
    dcn = rstd_c * (g_c - _sum(g_c, axis=0) / H - chat * (_sum(g_c * chat, axis=0) / H))
    if not CARRY_NORMALIZED:
        dcn += dc
    c_prev = tl.load(C_PREV + hrow, mask=m, other=0.0).to(tl.float32)
    # c = σ(f) c_prev + σ(i) tanh(g)
    d_i = dcn * t_g * s_i * (1.0 - s_i)
    d_f = dcn * c_prev * s_f * (1.0 - s_f)
    d_g = dcn * s_i * (1.0 - t_g * t_g)
    tl.store(DC_PREV + hrow, (dcn * s_f).to(DC_PREV.dtype.element_ty), mask=m)
    dg_row = DGATES + row * stride_a
    tl.store(dg_row + cols, d_i.to(DGATES.dtype.element_ty), mask=m)
    tl.store(dg_row + H + cols, d_f.to(DGATES.dtype.element_ty), mask=m)
    tl.store(dg_row + 2 * H + cols, d_g.to(DGATES.dtype.element_ty), mask=m)
    tl.store(dg_row + 3 * H + cols, d_o.to(DGATES.dtype.element_ty), mask=m)
    # back through LN(hp) over 4H: dhp = rstd·(g − mean(g) − x̂·mean(g ⊙ x̂)), g = da ⊙ α_h
    mean_h = tl.load(MH + row).to(tl.float32)
    rstd_h = tl.load(RH + row).to(tl.float32)
    hp_row = HP + row * stride_hp
    x_i = tl.where(
        m, (tl.load(hp_row + cols, mask=m, other=0.0).to(tl.float32) - mean_h) * rstd_h, 0.0
    )
    x_f = tl.where(
        m, (tl.load(hp_row + H + cols, mask=m, other=0.0).to(tl.float32) - mean_h) * rstd_h, 0.0
    )
    x_g = tl.where(
        m, (tl.load(hp_row + 2 * H + cols, mask=m, other=0.0).to(tl.float32) - mean_h) * rstd_h, 0.0
    )
    x_o = tl.where(
        m, (tl.load(hp_row + 3 * H + cols, mask=m, other=0.0).to(tl.float32) - mean_h) * rstd_h, 0.0
    )
    g_i = d_i * tl.load(W_H + cols, mask=m, other=0.0).to(tl.float32)
    g_f = d_f * tl.load(W_H + H + cols, mask=m, other=0.0).to(tl.float32)
    g_g = d_g * tl.load(W_H + 2 * H + cols, mask=m, other=0.0).to(tl.float32)
    g_o = d_o * tl.load(W_H + 3 * H + cols, mask=m, other=0.0).to(tl.float32)
    c1 = (_sum(g_i, axis=0) + _sum(g_f, axis=0) + _sum(g_g, axis=0) + _sum(g_o, axis=0)) / (4 * H)
    c2 = (
        _sum(g_i * x_i, axis=0)
        + _sum(g_f * x_f, axis=0)
        + _sum(g_g * x_g, axis=0)
        + _sum(g_o * x_o, axis=0)
    ) / (4 * H)
    dhp_row = DHP + row * stride_a
    tl.store(dhp_row + cols, (rstd_h * (g_i - c1 - x_i * c2)).to(DHP.dtype.element_ty), mask=m)
    tl.store(dhp_row + H + cols, (rstd_h * (g_f - c1 - x_f * c2)).to(DHP.dtype.element_ty), mask=m)
    tl.store(
        dhp_row + 2 * H + cols, (rstd_h * (g_g - c1 - x_g * c2)).to(DHP.dtype.element_ty), mask=m
    )
    tl.store(
        dhp_row + 3 * H + cols, (rstd_h * (g_o - c1 - x_o * c2)).to(DHP.dtype.element_ty), mask=m
    )


# --------------------------------------------------------------------------------------------
# GRU
# --------------------------------------------------------------------------------------------


@triton.jit
def _gru_step_fwd_kernel(
    HP_RZ,  # (B, 2H) W_{hr,hz} h_{t−1}, raw
    HP_N,  # (B, H) W_hn h_{t−1}, raw
    GX,  # (B, 3H) finished input half, r, z, n blocks
    H_PREV,  # (B, H)
    W_RZ,  # (2H,) gain of LN(hp_rz)
    B_RZ,  # (2H,) bias of LN(hp_rz)
    W_N,  # (H,) gain of LN(hp_n)
    B_N,  # (H,) bias of LN(hp_n)
    B_HN,  # (H,) extra bias inside r ⊙ (·), if HAS_B_HN
    H_OUT,  # (B, H) h_t
    RZ,  # (B, 2H) σ(a_r), σ(a_z), saved
    NC,  # (B, H) candidate n, saved
    GHN,  # (B, H) LN(hp_n) + b_hn, saved
    MH,  # (B,) mean / rstd of hp_rz
    RH,
    MN,  # (B,) mean / rstd of hp_n
    RN,
    stride_hrz,  # row stride of HP_RZ
    stride_rz,  # row stride of RZ
    stride_n,  # row stride of HP_N
    stride_gx,
    stride_h,  # row stride of H_PREV, H_OUT, NC, GHN
    H,
    eps,
    HAS_B_HN: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    rz_row = HP_RZ + row * stride_hrz
    h_r = tl.load(rz_row + cols, mask=m, other=0.0).to(tl.float32)
    h_z = tl.load(rz_row + H + cols, mask=m, other=0.0).to(tl.float32)
    mean_rz = (_sum(h_r, axis=0) + _sum(h_z, axis=0)) / (2 * H)
    h_r = tl.where(m, h_r - mean_rz, 0.0)
    h_z = tl.where(m, h_z - mean_rz, 0.0)
    rstd_rz = 1.0 / tl.sqrt((_sum(h_r * h_r, axis=0) + _sum(h_z * h_z, axis=0)) / (2 * H) + eps)
    h_n = tl.load(HP_N + row * stride_n + cols, mask=m, other=0.0).to(tl.float32)
    mean_n = _sum(h_n, axis=0) / H
    h_n = tl.where(m, h_n - mean_n, 0.0)
    rstd_n = 1.0 / tl.sqrt(_sum(h_n * h_n, axis=0) / H + eps)
    gx_row = GX + row * stride_gx
    a_r = h_r * rstd_rz * tl.load(W_RZ + cols, mask=m, other=0.0).to(tl.float32)
    a_z = h_z * rstd_rz * tl.load(W_RZ + H + cols, mask=m, other=0.0).to(tl.float32)
    a_r += tl.load(B_RZ + cols, mask=m, other=0.0).to(tl.float32)
    a_z += tl.load(B_RZ + H + cols, mask=m, other=0.0).to(tl.float32)
    a_r += tl.load(gx_row + cols, mask=m, other=0.0).to(tl.float32)
    a_z += tl.load(gx_row + H + cols, mask=m, other=0.0).to(tl.float32)
    ghn = h_n * rstd_n * tl.load(W_N + cols, mask=m, other=0.0).to(tl.float32)
    ghn += tl.load(B_N + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_B_HN:
        ghn += tl.load(B_HN + cols, mask=m, other=0.0).to(tl.float32)
    s_r = _sigmoid(a_r)
    s_z = _sigmoid(a_z)
    n = _tanh(tl.load(gx_row + 2 * H + cols, mask=m, other=0.0).to(tl.float32) + s_r * ghn)
    hrow = row * stride_h + cols
    h_prev = tl.load(H_PREV + hrow, mask=m, other=0.0).to(tl.float32)
    h = n + s_z * (h_prev - n)
    tl.store(H_OUT + hrow, h.to(H_OUT.dtype.element_ty), mask=m)
    out_rz = RZ + row * stride_rz
    tl.store(out_rz + cols, s_r.to(RZ.dtype.element_ty), mask=m)
    tl.store(out_rz + H + cols, s_z.to(RZ.dtype.element_ty), mask=m)
    tl.store(NC + hrow, n.to(NC.dtype.element_ty), mask=m)
    tl.store(GHN + hrow, ghn.to(GHN.dtype.element_ty), mask=m)
    tl.store(MH + row, mean_rz.to(MH.dtype.element_ty))
    tl.store(RH + row, rstd_rz.to(RH.dtype.element_ty))
    tl.store(MN + row, mean_n.to(MN.dtype.element_ty))
    tl.store(RN + row, rstd_n.to(RN.dtype.element_ty))


@triton.jit
def _gru_step_bwd_kernel(
    DH,  # (B, H) gradient of h_t
    H_PREV,  # (B, H)
    HP_RZ,  # (B, 2H) forward's raw hp_rz
    HP_N,  # (B, H) forward's raw hp_n
    RZ,  # (B, 2H) saved σ(a_r), σ(a_z)
    NC,  # (B, H) saved candidate
    GHN,  # (B, H) saved LN(hp_n) + b_hn
    MH,  # (B,) saved statistics
    RH,
    MN,
    RN,
    W_RZ,  # (2H,)
    W_N,  # (H,)
    DGX,  # (B, 3H) out: gradient of gx (r, z, n pre-activations)
    DGH,  # (B, 3H) out: gradient of LN(hp_rz)'s output and of ghn
    DHP,  # (B, 3H) out: gradient of hp_rz and hp_n
    DH_PREV,  # (B, H) out: the part of ∂h_{t−1} not through W_hh, dh ⊙ σ(a_z)
    stride_h,  # row stride of DH, H_PREV, NC, GHN, DH_PREV
    stride_hrz,  # row stride of HP_RZ
    stride_rz,  # row stride of RZ
    stride_n,  # row stride of HP_N
    stride_3,  # row stride of DGX, DGH, DHP
    H,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    m = cols < H
    hrow = row * stride_h + cols
    dh = tl.load(DH + hrow, mask=m, other=0.0).to(tl.float32)
    h_prev = tl.load(H_PREV + hrow, mask=m, other=0.0).to(tl.float32)
    n = tl.load(NC + hrow, mask=m, other=0.0).to(tl.float32)
    ghn = tl.load(GHN + hrow, mask=m, other=0.0).to(tl.float32)
    rz_row = RZ + row * stride_rz
    s_r = tl.load(rz_row + cols, mask=m, other=0.0).to(tl.float32)
    s_z = tl.load(rz_row + H + cols, mask=m, other=0.0).to(tl.float32)
    # h = n + σ(z)(h_prev − n);  n = tanh(gx_n + σ(r) ⊙ ghn)
    d_n = dh * (1.0 - s_z) * (1.0 - n * n)
    d_r = d_n * ghn * s_r * (1.0 - s_r)
    d_z = dh * (h_prev - n) * s_z * (1.0 - s_z)
    d_ghn = d_n * s_r
    tl.store(DH_PREV + hrow, (dh * s_z).to(DH_PREV.dtype.element_ty), mask=m)
    row3 = row * stride_3
    tl.store(DGX + row3 + cols, d_r.to(DGX.dtype.element_ty), mask=m)
    tl.store(DGX + row3 + H + cols, d_z.to(DGX.dtype.element_ty), mask=m)
    tl.store(DGX + row3 + 2 * H + cols, d_n.to(DGX.dtype.element_ty), mask=m)
    tl.store(DGH + row3 + cols, d_r.to(DGH.dtype.element_ty), mask=m)
    tl.store(DGH + row3 + H + cols, d_z.to(DGH.dtype.element_ty), mask=m)
    tl.store(DGH + row3 + 2 * H + cols, d_ghn.to(DGH.dtype.element_ty), mask=m)
    # LN(hp_rz) backward over 2H
    mean_rz = tl.load(MH + row).to(tl.float32)
    rstd_rz = tl.load(RH + row).to(tl.float32)
    hp_row = HP_RZ + row * stride_hrz
    x_r = tl.where(
        m, (tl.load(hp_row + cols, mask=m, other=0.0).to(tl.float32) - mean_rz) * rstd_rz, 0.0
    )
    x_z = tl.where(
        m, (tl.load(hp_row + H + cols, mask=m, other=0.0).to(tl.float32) - mean_rz) * rstd_rz, 0.0
    )
    g_r = d_r * tl.load(W_RZ + cols, mask=m, other=0.0).to(tl.float32)
    g_z = d_z * tl.load(W_RZ + H + cols, mask=m, other=0.0).to(tl.float32)
    c1 = (_sum(g_r, axis=0) + _sum(g_z, axis=0)) / (2 * H)
    c2 = (_sum(g_r * x_r, axis=0) + _sum(g_z * x_z, axis=0)) / (2 * H)
    tl.store(DHP + row3 + cols, (rstd_rz * (g_r - c1 - x_r * c2)).to(DHP.dtype.element_ty), mask=m)
    tl.store(
        DHP + row3 + H + cols, (rstd_rz * (g_z - c1 - x_z * c2)).to(DHP.dtype.element_ty), mask=m
    )
    # LN(hp_n) backward over H
    rstd_n = tl.load(RN + row).to(tl.float32)
    x_n = tl.where(
        m,
        (
            tl.load(HP_N + row * stride_n + cols, mask=m, other=0.0).to(tl.float32)
            - tl.load(MN + row).to(tl.float32)
        )
        * rstd_n,
        0.0,
    )
    g_n = d_ghn * tl.load(W_N + cols, mask=m, other=0.0).to(tl.float32)
    dhp_n = rstd_n * (g_n - _sum(g_n, axis=0) / H - x_n * (_sum(g_n * x_n, axis=0) / H))
    tl.store(DHP + row3 + 2 * H + cols, dhp_n.to(DHP.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------------------------
# Launchers: one step on (B, ·) row blocks. Every 2-D tensor needs unit column stride.
# --------------------------------------------------------------------------------------------


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _stats_buffer(like: Tensor, b: int) -> Tensor:
    return torch.empty(b, dtype=torch.float32, device=like.device)


def _check_hidden(h: int, what: str) -> None:
    if not supports(h):
        raise ValueError(
            f"{what}: the fused Triton step takes hidden sizes 1..{MAX_HIDDEN}, got {h}; "
            "use the eager step for larger layers"
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
    hp, gx, c_prev = _rows(hp), _rows(gx), _rows(c_prev)
    sv = dict(saved) if saved is not None else {}
    for key, shape in (("acts", (b, 4 * h)), ("cn", (b, h)), ("tc", (b, h))):
        if key not in sv:
            sv[key] = hp.new_empty(shape)
    for key in ("mh", "rh", "mc", "rc"):
        if key not in sv:
            sv[key] = _stats_buffer(hp, b)
    if h_out is None:
        h_out = hp.new_empty((b, h))
    lc = hp.new_empty((b, h)) if carry_normalized else h_out  # dummy pointer when not written
    if sv["cn"].stride() != h_out.stride() or sv["tc"].stride() != h_out.stride():
        raise ValueError("lstm step: saved cn/tc buffers must be contiguous (B, H)")
    if b > 0:
        block = triton.next_power_of_2(h)
        _lstm_step_fwd_kernel[(b,)](
            hp, gx, c_prev, w_h, b_h, w_c, b_c, h_out, lc,
            sv["acts"], sv["cn"], sv["tc"], sv["mh"], sv["rh"], sv["mc"], sv["rc"],
            hp.stride(0), gx.stride(0), c_prev.stride(0), h_out.stride(0), sv["acts"].stride(0),
            h, eps, CARRY_NORMALIZED=carry_normalized, BLOCK_H=block, num_warps=_num_warps(block),
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
    """Backward of :func:`lstm_step_fwd`: returns ``(dc_prev, grads)`` with ``grads`` holding
    ``dgates`` (of the gate pre-activations, = of ``gx``), ``dhp`` and ``dlc`` (of LN(c_t))."""
    b, h = dh.shape
    dh, dc, hp, c_prev = _rows(dh), _rows(dc), _rows(hp), _rows(c_prev)
    if c_prev.stride(0) != h or dc.stride(0) != h or dh.stride(0) != h:
        dh, dc, c_prev = dh.contiguous(), dc.contiguous(), c_prev.contiguous()
    g = dict(out) if out is not None else {}
    for key, shape in (("dgates", (b, 4 * h)), ("dhp", (b, 4 * h)), ("dlc", (b, h))):
        if key not in g:
            g[key] = hp.new_empty(shape)
    dc_prev = hp.new_empty((b, h))
    if b > 0:
        block = triton.next_power_of_2(h)
        _lstm_step_bwd_kernel[(b,)](
            dh, dc, hp, c_prev, sv["acts"], sv["cn"], sv["tc"],
            sv["mh"], sv["rh"], sv["mc"], sv["rc"], w_h, w_c,
            g["dgates"], g["dhp"], g["dlc"], dc_prev,
            h, hp.stride(0), sv["acts"].stride(0), h,
            CARRY_NORMALIZED=carry_normalized, BLOCK_H=block, num_warps=_num_warps(block),
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
    hp_rz, hp_n, gx, h_prev = _rows(hp_rz), _rows(hp_n), _rows(gx), h_prev.contiguous()
    sv = dict(saved) if saved is not None else {}
    for key, shape in (("rz", (b, 2 * h)), ("n", (b, h)), ("ghn", (b, h))):
        if key not in sv:
            sv[key] = hp_rz.new_empty(shape)
    for key in ("mh", "rh", "mn", "rn"):
        if key not in sv:
            sv[key] = _stats_buffer(hp_rz, b)
    if sv["rz"].stride(-1) != 1:
        raise ValueError("gru step: the saved rz buffer must have unit column stride")
    if h_out is None:
        h_out = h_prev.new_empty((b, h))
    if h_out.stride() != h_prev.stride():
        raise ValueError("gru step: h_out must be contiguous (B, H)")
    if b > 0:
        block = triton.next_power_of_2(h)
        _gru_step_fwd_kernel[(b,)](
            hp_rz, hp_n, gx, h_prev, w_rz, b_rz, w_n, b_n, b_hn if b_hn is not None else b_n,
            h_out, sv["rz"], sv["n"], sv["ghn"], sv["mh"], sv["rh"], sv["mn"], sv["rn"],
            hp_rz.stride(0), sv["rz"].stride(0), hp_n.stride(0), gx.stride(0), h,
            h, eps, HAS_B_HN=b_hn is not None, BLOCK_H=block, num_warps=_num_warps(block),
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
    """Backward of :func:`gru_step_fwd`: ``(dh_prev_direct, grads)`` with ``grads`` holding ``dgx``,
    ``dgh`` (of LN(hp_rz)'s output and of ``ghn``) and ``dhp`` (of ``hp_rz``, ``hp_n``), (B, 3H)."""
    b, h = dh.shape
    dh, h_prev = dh.contiguous(), h_prev.contiguous()
    hp_rz, hp_n = _rows(hp_rz), _rows(hp_n)
    g = dict(out) if out is not None else {}
    for key in ("dgx", "dgh", "dhp"):
        if key not in g:
            g[key] = dh.new_empty((b, 3 * h))
        elif g[key].stride() != (3 * h, 1):
            raise ValueError(f"gru step: the {key} buffer must be contiguous (B, 3H)")
    dh_prev = dh.new_empty((b, h))
    if b > 0:
        block = triton.next_power_of_2(h)
        _gru_step_bwd_kernel[(b,)](
            dh, h_prev, hp_rz, hp_n, sv["rz"], sv["n"], sv["ghn"],
            sv["mh"], sv["rh"], sv["mn"], sv["rn"], w_rz, w_n,
            g["dgx"], g["dgh"], g["dhp"], dh_prev,
            h, hp_rz.stride(0), sv["rz"].stride(0), hp_n.stride(0), 3 * h, h,
            BLOCK_H=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return dh_prev, g


# --------------------------------------------------------------------------------------------
# Per-step autograd functions of the papers' equations
# --------------------------------------------------------------------------------------------


def _saved_dtype(x: Tensor) -> torch.dtype:
    # activations saved for backward in float32 for half inputs: per-step tensors are small and the
    # backward's products of saved values would otherwise round twice
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _empty_saved(like: Tensor, b: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
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
        saved = _empty_saved(gh, b, {"acts": (b, 4 * h), "cn": (b, h), "tc": (b, h)})
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
        grads = _empty_saved(gh, b, {"dgates": (b, 4 * h), "dhp": (b, 4 * h), "dlc": (b, h)})
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
        saved = _empty_saved(gh, b, {"rz": (b, 2 * h), "n": (b, h), "ghn": (b, h)})
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
        grads = _empty_saved(hp_rz, b, {k: (b, 3 * h) for k in ("dgx", "dgh", "dhp")})
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
    absent, or ``H`` exceeds :data:`MAX_HIDDEN`."""
    lstm_keys = ("w1", "b1", "w3", "b3")
    gru_keys = ("w_rz", "b_rz", "w_n", "b_n")

    def fused(st: dict[str, Any], keys: tuple[str, ...]) -> bool:
        return bool(st["normalize"]) and supports(st["H"]) and all(st[k] is not None for k in keys)

    def lstm_fwd(st: dict[str, Any], off: int, bs: int) -> None:
        if not fused(st, lstm_keys):
            return fallback.lstm_fwd(st, off, bs)
        sl = slice(off, off + bs)
        h, c = st["h"][:bs], st["c"][:bs]
        st["hprev"][sl] = h
        c_prev = st["cprev"][sl]
        c_prev.copy_(c)
        sv = {k: st[k][sl] for k in ("acts", "cn", "tc", "mh", "rh", "mc", "rc")}
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
        sv = {k: st[k][sl] for k in ("acts", "cn", "tc", "mh", "rh", "mc", "rc")}
        out = {k: st[k][sl] for k in ("dgates", "dhp", "dlc")}
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
        sv = {k: st[k][sl] for k in ("rz", "n", "ghn", "mh", "rh", "mn", "rn")}
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
        sv = {k: st[k][sl] for k in ("rz", "n", "ghn", "mh", "rh", "mn", "rn")}
        out = {k: st[k][sl] for k in ("dgx", "dgh", "dhp")}
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
