"""One time step's work after the recurrent matrix product, forward and backward: the device seam.

The fused sequence functions in :mod:`layernorm.recurrent._fused` do, per step, one GEMM
``hp = h_{t−1} W_hhᵀ`` and then hand ``hp``, the precomputed input half ``gx_t`` and the previous
cell state to the functions here, which do everything else of the step (the layer norms, the
gates, the state update) and write what backward needs into slices of preallocated buffers. The
backward counterparts turn the incoming state gradients into the gradients of ``hp`` and ``gx_t``.

:func:`step_kernels` picks the implementation per device. The eager one below (PyTorch ops plus this
library's layer-norm kernels) serves every device; a backend can install a faster one for its
device type with :func:`register_step_kernels` (e.g. a fused Triton LN-LSTM step for CUDA), keeping
the same signatures and buffer layout.

Layer norm runs through the backend kernels of :mod:`layernorm.ops` (``layer_norm_fwd(x, w, b,
eps) -> (y, mean, rstd)`` and its analytic ``layer_norm_bwd``), not a reimplementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..ops._dispatch import backend_module


@dataclass(frozen=True)
class StepKernels:
    """The per-step forward/backward functions of one device (see the module docstring)."""

    lstm_fwd: Any
    lstm_bwd: Any
    gru_fwd: Any
    gru_bwd: Any


_REGISTRY: dict[str, StepKernels] = {}


def register_step_kernels(device_type: str, kernels: StepKernels) -> None:
    """Use ``kernels`` for tensors on ``device_type`` (``"cuda"``, ...) from now on."""
    _REGISTRY[device_type] = kernels


def step_kernels(x: Tensor) -> StepKernels:
    """The step functions for ``x``'s device: a registered backend's, else the eager ones."""
    return _REGISTRY.get(x.device.type, EAGER)


def ln_kernels(x: Tensor) -> ModuleType:
    """The layer-norm backend module (ATen on CPU, Triton on CUDA) for ``x``."""
    return backend_module(x, "layer_norm")


# ---------------------------------------------------------------------------------------------
# LSTM.  Saved per step (slices of (N, ·) buffers; N = rows of the packed sequence):
#   acts   (bs, 4H)  σ(i), σ(f), tanh(g), σ(o)
#   mh, rh (bs,)     mean / rstd of LN(hp)          (unused without LN)
#   cn     (bs, H)   c_t, un-normalized
#   mc, rc (bs,)     mean / rstd of LN(c_t)         (unused without LN)
#   tc     (bs, H)   tanh(LN(c_t))  (tanh(c_t) without LN)
# ---------------------------------------------------------------------------------------------


def lstm_fwd(
    hp: Tensor, gx: Tensor, c_prev: Tensor, p: dict[str, Any], sv: dict[str, Tensor]
) -> tuple[Tensor, Tensor]:
    """``(h_t, c_carried)`` from raw ``hp = W_hh h_{t−1}``, ``gx = LN(W_ih x_t) + b``, c_{t−1}."""
    hs = c_prev.shape[1]
    ln = p["ln"]
    if p["normalize"]:
        gates, mh, rh = ln.layer_norm_fwd(hp, p["w_hh_ln"], p["b_hh_ln"], p["eps"])
        sv["mh"].copy_(mh)
        sv["rh"].copy_(rh)
        gates.add_(gx)
    else:
        gates = hp.add_(gx)
    acts = sv["acts"]
    torch.sigmoid(gates, out=acts)
    torch.tanh(gates[:, 2 * hs : 3 * hs], out=acts[:, 2 * hs : 3 * hs])
    i, f, g, o = acts[:, :hs], acts[:, hs : 2 * hs], acts[:, 2 * hs : 3 * hs], acts[:, 3 * hs :]
    cn = sv["cn"]
    torch.mul(f, c_prev, out=cn)
    cn.addcmul_(i, g)
    if p["normalize"]:
        lc, mc, rc = ln.layer_norm_fwd(cn, p["w_c_ln"], p["b_c_ln"], p["eps"])
        sv["mc"].copy_(mc)
        sv["rc"].copy_(rc)
    else:
        lc = cn
    tc = sv["tc"]
    torch.tanh(lc, out=tc)
    h = o * tc
    return h, (lc if p["carry_normalized"] else cn)


def lstm_bwd(
    dh: Tensor,
    dc: Tensor,
    hp: Tensor,
    c_prev: Tensor,
    p: dict[str, Any],
    sv: dict[str, Tensor],
    dsv: dict[str, Tensor],
) -> Tensor:
    """Backward of :func:`lstm_fwd` for one step.

    ``dh``/``dc``: gradients of the step's outputs h_t and carried c. Writes ``dsv["dgates"]``
    (gradient of the gate pre-activations = of ``gx``), ``dsv["dhp"]`` (of ``hp``) and
    ``dsv["dlc"]`` (of LN(c_t), for the gain gradients); returns the gradient of c_{t−1}.
    """
    hs = c_prev.shape[1]
    ln = p["ln"]
    acts, tc = sv["acts"], sv["tc"]
    i, f, g, o = acts[:, :hs], acts[:, hs : 2 * hs], acts[:, 2 * hs : 3 * hs], acts[:, 3 * hs :]
    dg_all = dsv["dgates"]
    d_i, d_f, d_g, d_o = (dg_all[:, k * hs : (k + 1) * hs] for k in range(4))
    torch.mul(dh, tc, out=d_o)  # ∂/∂σ(o)
    dlc = dsv["dlc"]
    # ∂/∂LN(c) = dh ⊙ σ(o) ⊙ (1 − tanh²)
    torch.mul(dh, o, out=dlc)
    dlc.mul_(1.0 - tc * tc)
    if p["carry_normalized"]:
        dlc.add_(dc)
    if p["normalize"]:
        dcn, _, _ = ln.layer_norm_bwd(
            dlc, sv["cn"], sv["mc"], sv["rc"], p["w_c_ln"], False, False, True, False, False
        )
    else:
        dcn = dlc.clone()
    if not p["carry_normalized"]:
        dcn.add_(dc)
    torch.mul(dcn, g, out=d_i)
    torch.mul(dcn, c_prev, out=d_f)
    torch.mul(dcn, i, out=d_g)
    # through the nonlinearities: σ' = s(1 − s) for i, f, o; tanh' = 1 − g² for g
    deriv = acts * (1.0 - acts)
    deriv[:, 2 * hs : 3 * hs] = 1.0 - g * g
    dg_all.mul_(deriv)
    if p["normalize"]:
        dhp, _, _ = ln.layer_norm_bwd(
            dg_all, hp, sv["mh"], sv["rh"], p["w_hh_ln"], False, False, True, False, False
        )
        dsv["dhp"].copy_(dhp)
    else:
        dsv["dhp"].copy_(dg_all)
    return dcn.mul_(f)


# ---------------------------------------------------------------------------------------------
# GRU.  hp is split as hp_rz = W_{hr,hz} h (bs, 2H) and hp_n = W_hn h (bs, H), LN'd separately.
# Saved per step:  rz (bs, 2H) σ(r), σ(z);  n (bs, H) candidate;  ghn (bs, H) LN(W_hn h) + b_hn;
#                  mh, rh (bs,) and mn, rn (bs,): LN statistics of hp_rz and hp_n.
# ---------------------------------------------------------------------------------------------


def gru_fwd(
    hp_rz: Tensor,
    hp_n: Tensor,
    gx: Tensor,
    h_prev: Tensor,
    p: dict[str, Any],
    sv: dict[str, Tensor],
) -> Tensor:
    """``h_t`` from the raw recurrent products, ``gx = LN(W_ih x_t) + b_ih + [b_hr, b_hz, 0]``."""
    hs = h_prev.shape[1]
    ln = p["ln"]
    rz, ghn = sv["rz"], sv["ghn"]
    if p["normalize"]:
        g_rz, mh, rh = ln.layer_norm_fwd(hp_rz, p["w_rz_ln"], p["b_rz_ln"], p["eps"])
        sv["mh"].copy_(mh)
        sv["rh"].copy_(rh)
        g_n, mn, rn = ln.layer_norm_fwd(hp_n, p["w_n_ln"], p["b_n_ln"], p["eps"])
        sv["mn"].copy_(mn)
        sv["rn"].copy_(rn)
        ghn.copy_(g_n)
    else:
        g_rz = hp_rz.clone()
        ghn.copy_(hp_n)
    if p["b_hn"] is not None:
        ghn.add_(p["b_hn"])
    g_rz.add_(gx[:, : 2 * hs])
    torch.sigmoid(g_rz, out=rz)
    r, z = rz[:, :hs], rz[:, hs:]
    n = sv["n"]
    torch.addcmul(gx[:, 2 * hs :], r, ghn, out=n)
    n.tanh_()
    # h = n + z ⊙ (h_prev − n)
    return torch.addcmul(n, z, h_prev - n)


def gru_bwd(
    dh: Tensor,
    h_prev: Tensor,
    hp_rz: Tensor,
    hp_n: Tensor,
    p: dict[str, Any],
    sv: dict[str, Tensor],
    dsv: dict[str, Tensor],
) -> Tensor:
    """Backward of :func:`gru_fwd`. Writes ``dsv["dgx"]`` (bs, 3H), ``dsv["dgh"]`` (bs, 3H: the
    gradients of LN(hp_rz) and of LN(hp_n) + b_hn) and ``dsv["dhp"]`` (bs, 3H: of hp_rz, hp_n);
    returns the part of the gradient of h_{t−1} that does not pass through ``W_hh``."""
    hs = h_prev.shape[1]
    ln = p["ln"]
    rz, n, ghn = sv["rz"], sv["n"], sv["ghn"]
    r, z = rz[:, :hs], rz[:, hs:]
    dgx, dgh, dhp = dsv["dgx"], dsv["dgh"], dsv["dhp"]
    d_rz, d_n = dgx[:, : 2 * hs], dgx[:, 2 * hs :]
    # ∂/∂n pre-activation: dh ⊙ (1 − z) ⊙ (1 − n²)
    torch.mul(dh, 1.0 - z, out=d_n)
    d_n.mul_(1.0 - n * n)
    torch.mul(d_n, ghn, out=d_rz[:, :hs])  # ∂/∂σ(r)
    torch.mul(dh, h_prev - n, out=d_rz[:, hs:])  # ∂/∂σ(z)
    d_rz.mul_(rz * (1.0 - rz))
    dgh[:, : 2 * hs].copy_(d_rz)
    torch.mul(d_n, r, out=dgh[:, 2 * hs :])
    if p["normalize"]:
        dx_rz, _, _ = ln.layer_norm_bwd(
            dgh[:, : 2 * hs],
            hp_rz,
            sv["mh"],
            sv["rh"],
            p["w_rz_ln"],
            False,
            False,
            True,
            False,
            False,
        )
        dx_n, _, _ = ln.layer_norm_bwd(
            dgh[:, 2 * hs :],
            hp_n,
            sv["mn"],
            sv["rn"],
            p["w_n_ln"],
            False,
            False,
            True,
            False,
            False,
        )
        dhp[:, : 2 * hs].copy_(dx_rz)
        dhp[:, 2 * hs :].copy_(dx_n)
    else:
        dhp.copy_(dgh)
    return dh * z


EAGER = StepKernels(lstm_fwd=lstm_fwd, lstm_bwd=lstm_bwd, gru_fwd=gru_fwd, gru_bwd=gru_bwd)
