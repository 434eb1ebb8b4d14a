"""Triton kernels of the fused LN-LSTM and LN-GRU time steps; launchers, autograd functions and
the equations are in :mod:`.rnn_step`.

One program per batch row; a row's gate blocks (4H for the LSTM, 3H for the GRU) are loaded as
separate ``(BLOCK_H,)`` vectors, so layer norms over several blocks sum the blocks' partial sums.
Arithmetic and statistics are float32; every store casts to its buffer's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

# _sum is tl.reduce-based (see there why not tl.sum); _ld/_st: masked float32 loads, casting stores
from ._norm_core import _ld, _st, _sum


@triton.jit
def _sigmoid(a):
    return 1.0 / (1.0 + tl.exp(-a))


@triton.jit
def _tanh(a):
    # tanh from exp(−2|a|) ∈ (0, 1]: no overflow for any a; absolute error a few float32 ulps
    e = tl.exp(-2.0 * tl.abs(a))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0, -t, t)


@triton.jit
def _ln_stats(x, m, n, eps):
    """``(mean, x − mean, rstd)`` of one row block of ``n`` valid elements; ``x`` must be 0 where
    the mask ``m`` is off, and so is the centred block."""
    mean = _sum(x, axis=0) / n
    xc = tl.where(m, x - mean, 0.0)
    return mean, xc, 1.0 / tl.sqrt(_sum(xc * xc, axis=0) / n + eps)


@triton.jit
def _ln_affine(xc, rstd, W, B, cols, m):
    """``w ⊙ xc·rstd + b`` of a centred block; gain and bias at ``W + cols``, ``B + cols``."""
    return xc * rstd * _ld(W + cols, m) + _ld(B + cols, m)


@triton.jit
def _xhat(ptr, m, mean, rstd):
    """x̂ of a saved row block, recomputed from its statistics; 0 where masked off."""
    return tl.where(m, (_ld(ptr, m) - mean) * rstd, 0.0)


@triton.jit
def _ln_grad(g, xhat, rstd, mean_g, mean_gx):
    """Layer-norm backward, ``rstd · (g − mean(g) − x̂ · mean(g ⊙ x̂))``, from the two means over
    the normalized group (which may span several row blocks)."""
    return rstd * (g - mean_g - xhat * mean_gx)


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
    h_i = _ld(hp_row + cols, m)
    h_f = _ld(hp_row + H + cols, m)
    h_g = _ld(hp_row + 2 * H + cols, m)
    h_o = _ld(hp_row + 3 * H + cols, m)
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
    a_i = _ln_affine(h_i, rstd_h, W_H, B_H, cols, m)
    a_f = _ln_affine(h_f, rstd_h, W_H + H, B_H + H, cols, m)
    a_g = _ln_affine(h_g, rstd_h, W_H + 2 * H, B_H + 2 * H, cols, m)
    a_o = _ln_affine(h_o, rstd_h, W_H + 3 * H, B_H + 3 * H, cols, m)
    a_i += _ld(gx_row + cols, m)
    a_f += _ld(gx_row + H + cols, m)
    a_g += _ld(gx_row + 2 * H + cols, m)
    a_o += _ld(gx_row + 3 * H + cols, m)
    s_i = _sigmoid(a_i)
    s_f = _sigmoid(a_f)
    t_g = _tanh(a_g)
    s_o = _sigmoid(a_o)
    c_prev = _ld(C_PREV + row * stride_c + cols, m)
    c = s_f * c_prev + s_i * t_g
    # LN(c_t) over the H cells
    mean_c, cc, rstd_c = _ln_stats(tl.where(m, c, 0.0), m, H, eps)
    lc = _ln_affine(cc, rstd_c, W_C, B_C, cols, m)
    tc = _tanh(lc)
    h = s_o * tc
    out = row * stride_h + cols
    a_row = ACTS + row * stride_a
    _st(a_row + cols, s_i, m)
    _st(a_row + H + cols, s_f, m)
    _st(a_row + 2 * H + cols, t_g, m)
    _st(a_row + 3 * H + cols, s_o, m)
    _st(CN + out, c, m)
    _st(TC + out, tc, m)
    _st(H_OUT + out, h, m)
    if CARRY_NORMALIZED:
        _st(LC_OUT + out, lc, m)
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
    s_i = _ld(a_row + cols, m)
    s_f = _ld(a_row + H + cols, m)
    t_g = _ld(a_row + 2 * H + cols, m)
    s_o = _ld(a_row + 3 * H + cols, m)
    dh = _ld(DH + hrow, m)
    dc = _ld(DC + hrow, m)
    tc = _ld(TC + hrow, m)
    # h = σ(o) ⊙ tanh(LN(c)):  ∂/∂a_o and ∂/∂LN(c)
    d_o = dh * tc * s_o * (1.0 - s_o)
    dlc = dh * s_o * (1.0 - tc * tc)
    if CARRY_NORMALIZED:
        dlc += dc
    _st(DLC + hrow, dlc, m)
    # back through LN(c_t) over H
    rstd_c = tl.load(RC + row).to(tl.float32)
    chat = _xhat(CN + hrow, m, tl.load(MC + row).to(tl.float32), rstd_c)
    g_c = dlc * _ld(W_C + cols, m)
    dcn = _ln_grad(g_c, chat, rstd_c, _sum(g_c, axis=0) / H, _sum(g_c * chat, axis=0) / H)
    if not CARRY_NORMALIZED:
        dcn += dc
    c_prev = _ld(C_PREV + hrow, m)
    # c = σ(f) c_prev + σ(i) tanh(g)
    d_i = dcn * t_g * s_i * (1.0 - s_i)
    d_f = dcn * c_prev * s_f * (1.0 - s_f)
    d_g = dcn * s_i * (1.0 - t_g * t_g)
    _st(DC_PREV + hrow, dcn * s_f, m)
    dg_row = DGATES + row * stride_a
    _st(dg_row + cols, d_i, m)
    _st(dg_row + H + cols, d_f, m)
    _st(dg_row + 2 * H + cols, d_g, m)
    _st(dg_row + 3 * H + cols, d_o, m)
    # back through LN(hp) over 4H: dhp = rstd·(g − mean(g) − x̂·mean(g ⊙ x̂)), g = da ⊙ α_h
    mean_h = tl.load(MH + row).to(tl.float32)
    rstd_h = tl.load(RH + row).to(tl.float32)
    hp_row = HP + row * stride_hp
    x_i = _xhat(hp_row + cols, m, mean_h, rstd_h)
    x_f = _xhat(hp_row + H + cols, m, mean_h, rstd_h)
    x_g = _xhat(hp_row + 2 * H + cols, m, mean_h, rstd_h)
    x_o = _xhat(hp_row + 3 * H + cols, m, mean_h, rstd_h)
    g_i = d_i * _ld(W_H + cols, m)
    g_f = d_f * _ld(W_H + H + cols, m)
    g_g = d_g * _ld(W_H + 2 * H + cols, m)
    g_o = d_o * _ld(W_H + 3 * H + cols, m)
    c1 = (_sum(g_i, axis=0) + _sum(g_f, axis=0) + _sum(g_g, axis=0) + _sum(g_o, axis=0)) / (4 * H)
    c2 = (
        _sum(g_i * x_i, axis=0)
        + _sum(g_f * x_f, axis=0)
        + _sum(g_g * x_g, axis=0)
        + _sum(g_o * x_o, axis=0)
    ) / (4 * H)
    dhp_row = DHP + row * stride_a
    _st(dhp_row + cols, _ln_grad(g_i, x_i, rstd_h, c1, c2), m)
    _st(dhp_row + H + cols, _ln_grad(g_f, x_f, rstd_h, c1, c2), m)
    _st(dhp_row + 2 * H + cols, _ln_grad(g_g, x_g, rstd_h, c1, c2), m)
    _st(dhp_row + 3 * H + cols, _ln_grad(g_o, x_o, rstd_h, c1, c2), m)


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
    h_r = _ld(rz_row + cols, m)
    h_z = _ld(rz_row + H + cols, m)
    mean_rz = (_sum(h_r, axis=0) + _sum(h_z, axis=0)) / (2 * H)
    h_r = tl.where(m, h_r - mean_rz, 0.0)
    h_z = tl.where(m, h_z - mean_rz, 0.0)
    rstd_rz = 1.0 / tl.sqrt((_sum(h_r * h_r, axis=0) + _sum(h_z * h_z, axis=0)) / (2 * H) + eps)
    h_n = _ld(HP_N + row * stride_n + cols, m)
    mean_n, h_n, rstd_n = _ln_stats(h_n, m, H, eps)
    gx_row = GX + row * stride_gx
    a_r = _ln_affine(h_r, rstd_rz, W_RZ, B_RZ, cols, m)
    a_z = _ln_affine(h_z, rstd_rz, W_RZ + H, B_RZ + H, cols, m)
    a_r += _ld(gx_row + cols, m)
    a_z += _ld(gx_row + H + cols, m)
    ghn = _ln_affine(h_n, rstd_n, W_N, B_N, cols, m)
    if HAS_B_HN:
        ghn += _ld(B_HN + cols, m)
    s_r = _sigmoid(a_r)
    s_z = _sigmoid(a_z)
    n = _tanh(_ld(gx_row + 2 * H + cols, m) + s_r * ghn)
    hrow = row * stride_h + cols
    h_prev = _ld(H_PREV + hrow, m)
    h = n + s_z * (h_prev - n)
    _st(H_OUT + hrow, h, m)
    out_rz = RZ + row * stride_rz
    _st(out_rz + cols, s_r, m)
    _st(out_rz + H + cols, s_z, m)
    _st(NC + hrow, n, m)
    _st(GHN + hrow, ghn, m)
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
    dh = _ld(DH + hrow, m)
    h_prev = _ld(H_PREV + hrow, m)
    n = _ld(NC + hrow, m)
    ghn = _ld(GHN + hrow, m)
    rz_row = RZ + row * stride_rz
    s_r = _ld(rz_row + cols, m)
    s_z = _ld(rz_row + H + cols, m)
    # h = n + σ(z)(h_prev − n);  n = tanh(gx_n + σ(r) ⊙ ghn)
    d_n = dh * (1.0 - s_z) * (1.0 - n * n)
    d_r = d_n * ghn * s_r * (1.0 - s_r)
    d_z = dh * (h_prev - n) * s_z * (1.0 - s_z)
    d_ghn = d_n * s_r
    _st(DH_PREV + hrow, dh * s_z, m)
    row3 = row * stride_3
    _st(DGX + row3 + cols, d_r, m)
    _st(DGX + row3 + H + cols, d_z, m)
    _st(DGX + row3 + 2 * H + cols, d_n, m)
    _st(DGH + row3 + cols, d_r, m)
    _st(DGH + row3 + H + cols, d_z, m)
    _st(DGH + row3 + 2 * H + cols, d_ghn, m)
    # LN(hp_rz) backward over 2H
    mean_rz = tl.load(MH + row).to(tl.float32)
    rstd_rz = tl.load(RH + row).to(tl.float32)
    hp_row = HP_RZ + row * stride_hrz
    x_r = _xhat(hp_row + cols, m, mean_rz, rstd_rz)
    x_z = _xhat(hp_row + H + cols, m, mean_rz, rstd_rz)
    g_r = d_r * _ld(W_RZ + cols, m)
    g_z = d_z * _ld(W_RZ + H + cols, m)
    c1 = (_sum(g_r, axis=0) + _sum(g_z, axis=0)) / (2 * H)
    c2 = (_sum(g_r * x_r, axis=0) + _sum(g_z * x_z, axis=0)) / (2 * H)
    _st(DHP + row3 + cols, _ln_grad(g_r, x_r, rstd_rz, c1, c2), m)
    _st(DHP + row3 + H + cols, _ln_grad(g_z, x_z, rstd_rz, c1, c2), m)
    # LN(hp_n) backward over H
    rstd_n = tl.load(RN + row).to(tl.float32)
    x_n = _xhat(HP_N + row * stride_n + cols, m, tl.load(MN + row).to(tl.float32), rstd_n)
    g_n = d_ghn * _ld(W_N + cols, m)
    dhp_n = _ln_grad(g_n, x_n, rstd_n, _sum(g_n, axis=0) / H, _sum(g_n * x_n, axis=0) / H)
    _st(DHP + row3 + 2 * H + cols, dhp_n, m)
