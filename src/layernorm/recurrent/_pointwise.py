"""One time step's work around the recurrent GEMM, forward and backward: the device seam.

The fused sequence functions in :mod:`layernorm.recurrent._fused` keep every tensor of a sequence
in a dict ``st`` of ``(N, ·)`` buffers (N = rows of the packed sequence, a step owns rows
``[off, off + bs)``) and ``(B, H)`` state buffers whose rows ``[:bs]`` a step updates. Per step they
do the GEMM ``hp = h_{t−1} W_hhᵀ`` themselves and call

* ``lstm_fwd(st, off, bs)`` / ``gru_fwd``: everything else of the step, given the two gate
  pre-activation matrices ``st["hp"]`` (recurrent, raw) and ``st["gx"]`` (input side, already
  ``LN(W_ih x) + b``): the layer norms, gates, state update, output, and the stores backward needs;
* ``lstm_bwd(st, off, bs)`` / ``gru_bwd``: the step's pointwise backward, leaving the gradient of
  ``hp`` for the caller's GEMM ``dh_{t−1} = dhp · W_hh``.

:func:`step_kernels` picks the implementation for a tensor: for CUDA tensors the fused Triton
steps of :mod:`layernorm.kernels.triton.rnn_step` (one launch per step; they defer to the eager
functions where they do not apply), for CPU float32/float64 the C kernels of
:mod:`layernorm.kernels.cpu.rnn` (through :mod:`._cstep`), otherwise the eager functions below
(PyTorch ops plus this library's layer-norm backend kernels), which run on any device.
:func:`register_step_kernels` overrides the choice for a device type. All read and write the same
buffers, whose names and shapes are documented at each eager function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..backend import select_backend
from ..ops._dispatch import backend_module
from . import _cstep

StepFn = Callable[[dict[str, Any], int, int], None]
# (st, w_hh, schedule): a whole direction, the recurrent GEMMs included (see ``StepKernels``).
SeqFn = Callable[[dict[str, Any], Tensor, tuple[tuple[int, int, int], ...]], None]


@dataclass(frozen=True)
class StepKernels:
    """The per-step functions of one implementation (see the module docstring).

    The optional ``*_seq`` functions run a whole direction instead, time loop and recurrent GEMMs
    included, with the same buffers as a loop of GEMM + step function would leave (the C kernels:
    one foreign call per direction instead of two calls per step). The optional ``weight_grad``
    replaces ``dhp.t().mm(hprev)``, the recurrent weight's gradient over all rows.
    """

    lstm_fwd: StepFn
    lstm_bwd: StepFn
    gru_fwd: StepFn
    gru_bwd: StepFn
    lstm_fwd_seq: SeqFn | None = None
    lstm_bwd_seq: SeqFn | None = None
    gru_fwd_seq: SeqFn | None = None
    gru_bwd_seq: SeqFn | None = None
    # the Elman RNN has whole-sequence functions only: without them it loops over PyTorch ops
    elman_fwd_seq: SeqFn | None = None
    elman_bwd_seq: SeqFn | None = None
    weight_grad: Callable[[Tensor, Tensor], Tensor] | None = None


_REGISTRY: dict[str, StepKernels] = {}


def register_step_kernels(device_type: str, kernels: StepKernels | None) -> None:
    """Use ``kernels`` for tensors on ``device_type`` (``"cuda"``, ...); ``None`` unregisters."""
    if kernels is None:
        _REGISTRY.pop(device_type, None)
    else:
        _REGISTRY[device_type] = kernels


def step_kernels(x: Tensor) -> StepKernels:
    """The step functions for ``x``: a registered backend's; the Triton steps for CUDA tensors
    other than float64 when the Triton backend serves them; the C kernels for CPU
    float32/float64; else the eager ones. (The sequence layers send only float32/float64 here.)"""
    registered = _REGISTRY.get(x.device.type)
    if registered is not None:
        return registered
    # The Triton steps compute in float32, so float64 keeps full precision on the eager steps
    # (their seam functions route float64 to the eager steps too, see rnn_step.DTYPES).
    if x.is_cuda and x.dtype != torch.float64 and select_backend(x) == "triton":
        triton_steps = _triton_step_kernels()
        if triton_steps is not None:
            return triton_steps
    if not _cstep.available(x):
        return EAGER
    return C_KERNELS if _cstep.sequence_gemm() else C_STEPS


@functools.cache
def _triton_step_kernels() -> StepKernels | None:
    """The fused Triton LN-LSTM/GRU steps (falling back to eager where they do not apply)."""
    try:
        from ..kernels.triton import rnn_step
    except ImportError:
        return None
    return StepKernels(**rnn_step.seam_functions(EAGER))


def ln_kernels(x: Tensor) -> ModuleType:
    """The layer-norm backend module (CPU kernels, or Triton on CUDA) for ``x``."""
    return backend_module(x, "layer_norm")


def _ln_fwd(
    st: dict[str, Any], x: Tensor, w: Tensor | None, b: Tensor | None, m: Tensor, r: Tensor
):
    y, mean, rstd = ln_kernels(x).layer_norm_fwd(x.contiguous(), w, b, st["eps"])
    m.copy_(mean)
    r.copy_(rstd)
    return y


def _ln_dx(dy: Tensor, x: Tensor, m: Tensor, r: Tensor, w: Tensor | None) -> Tensor:
    dx, _, _ = ln_kernels(x).layer_norm_bwd(
        dy.contiguous(), x.contiguous(), m, r, w, False, False, True, False, False
    )
    return dx


# ---------------------------------------------------------------------------------------------
# LSTM buffers (H hidden units, gates i, f, g, o):
#   in   gx (N, 4H)  LN(W_ih x) + b      hp (N, 4H)  W_hh h_{t−1} (raw)      w1, b1 (4H)  w3, b3 (H)
#   state h, c (B, H)                    out (N, H)  h_t
#   saved hprev, cprev (N, H)  acts (N, 4H) σ(i), σ(f), tanh(g), σ(o)  mh, rh (N,) stats of LN(hp)
#         cn (N, H) c_t un-normalized    mc, rc (N,) stats of LN(c_t)    tc (N, H) tanh(LN(c_t))
#   backward: dout (N, H); dh, dc (B, H) state gradients; dgates, dhp (N, 4H); dlc (N, H)
#   masks (optional, see layernorm.recurrent._options; absent or None = off; the eager and C
#   steps): zh (N, P), zc (N, H) zoneout coefficients of h and of the carried c; cm (B, H)
#   recurrent dropout on tanh(g). With zh the step's backward writes the direct path zh ⊙ dh_t
#   into dh, and the caller adds the GEMM's dh_{t−1} to it.
#   projection (optional; eager and per-step C steps): w_hr (P, H),
#   h_t = W_hr(σ(o) ⊙ tanh(LN(c_t))); then h, hprev, out, dh, dout have P columns; saved hu (N, H)
#   the unprojected h; backward dhr (N, P) the gradient of the projected h̃_t, for W_hr's gradient
#   dhrᵀ · hu.
# ---------------------------------------------------------------------------------------------


def _zone(d: Tensor | None, previous: Tensor, new: Tensor) -> Tensor:
    """Zoneout ``d ⊙ previous + (1 − d) ⊙ new`` (``new`` where ``d`` is ``None``)."""
    return new if d is None else d * previous + (1.0 - d) * new


def _rows(st: dict[str, Any], name: str, sl: slice) -> Tensor | None:
    """Rows ``sl`` of mask ``name``, or ``None`` where there is none."""
    m = st.get(name)
    return None if m is None else m[sl]


def needs_eager_steps(st: dict[str, Any], kernels: StepKernels | None = None) -> bool:
    """Whether ``st`` carries what ``kernels`` cannot take, so that the eager step functions must
    run: masks acting inside the time loop (zoneout, recurrent dropout) or a projection ``w_hr``.
    The C kernels (:data:`C_STEPS`, :data:`C_KERNELS`) take all of them (the projection on the
    per-step path); the others (Triton, registered backends) none."""
    if kernels is C_STEPS or kernels is C_KERNELS:
        return False
    return any(st.get(k) is not None for k in ("zh", "zc", "cm", "w_hr"))


def lstm_fwd(st: dict[str, Any], off: int, bs: int) -> None:
    hs, sl = st["H"], slice(off, off + bs)
    h, c = st["h"][:bs], st["c"][:bs]
    h_prev = st["hprev"][sl]
    h_prev.copy_(h)
    c_prev = st["cprev"][sl]
    c_prev.copy_(c)
    if st["normalize"]:
        gates = _ln_fwd(st, st["hp"][sl], st["w1"], st["b1"], st["mh"][sl], st["rh"][sl])
        gates = gates + st["gx"][sl]
    else:
        gates = st["hp"][sl] + st["gx"][sl]
    acts = st["acts"][sl]
    torch.sigmoid(gates, out=acts)
    acts[:, 2 * hs : 3 * hs] = torch.tanh(gates[:, 2 * hs : 3 * hs])
    i, f, g, o = acts.split(hs, dim=1)
    cn = st["cn"][sl]
    cm = _rows(st, "cm", slice(0, bs))
    torch.addcmul(f * c_prev, i, g if cm is None else g * cm, out=cn)
    lc = _ln_fwd(st, cn, st["w3"], st["b3"], st["mc"][sl], st["rc"][sl]) if st["normalize"] else cn
    tc = st["tc"][sl]
    torch.tanh(lc, out=tc)
    h_own = o * tc
    w_hr = st.get("w_hr")
    if w_hr is not None:
        st["hu"][sl] = h_own
        h_own = h_own.mm(w_hr.t())
    h_new = _zone(_rows(st, "zh", sl), h_prev, h_own)
    c_new = _zone(_rows(st, "zc", sl), c_prev, lc if st["carry_normalized"] else cn)
    st["out"][sl] = h_new
    h.copy_(h_new)
    c.copy_(c_new)


def lstm_bwd(st: dict[str, Any], off: int, bs: int) -> None:
    hs, sl = st["H"], slice(off, off + bs)
    zh, zc, cm = _rows(st, "zh", sl), _rows(st, "zc", sl), _rows(st, "cm", slice(0, bs))
    dh_zoned = st["dh"][:bs] + st["dout"][sl]  # of the output h_t
    dc_zoned = st["dc"][:bs]  # of the carried c_t
    # of the cell's own h̃_t, c̃_t (all of it without zoneout)
    dh_t = dh_zoned if zh is None else (1.0 - zh) * dh_zoned
    dc = dc_zoned if zc is None else (1.0 - zc) * dc_zoned
    w_hr = st.get("w_hr")
    if w_hr is not None:  # back through the projection to the unprojected h
        st["dhr"][sl] = dh_t
        dh_t = dh_t.mm(w_hr)
    acts, tc = st["acts"][sl], st["tc"][sl]
    i, f, g, o = acts.split(hs, dim=1)
    dgates, dlc = st["dgates"][sl], st["dlc"][sl]
    d_i, d_f, d_g, d_o = dgates.split(hs, dim=1)
    torch.mul(dh_t, tc, out=d_o)
    torch.mul(dh_t * o, 1.0 - tc * tc, out=dlc)
    if st["carry_normalized"]:
        dlc.add_(dc)
    if st["normalize"]:
        dcn = _ln_dx(dlc, st["cn"][sl], st["mc"][sl], st["rc"][sl], st["w3"])
    else:
        dcn = dlc.clone()
    if not st["carry_normalized"]:
        dcn = dcn + dc
    torch.mul(dcn, g if cm is None else g * cm, out=d_i)
    torch.mul(dcn, st["cprev"][sl], out=d_f)
    torch.mul(dcn, i if cm is None else i * cm, out=d_g)
    deriv = acts * (1.0 - acts)  # σ' = s(1 − s) for i, f, o; tanh' = 1 − g² for g
    deriv[:, 2 * hs : 3 * hs] = 1.0 - g * g
    dgates.mul_(deriv)
    if st["normalize"]:
        st["dhp"][sl] = _ln_dx(dgates, st["hp"][sl], st["mh"][sl], st["rh"][sl], st["w1"])
    dc_prev = dcn * f if zc is None else dcn * f + zc * dc_zoned
    st["dc"][:bs] = dc_prev
    if zh is not None:
        st["dh"][:bs] = zh * dh_zoned  # the direct path to h_{t−1}; the GEMM adds the rest


# ---------------------------------------------------------------------------------------------
# GRU buffers (gates r, z, n):
#   in   gx (N, 3H)  LN(W_ih x) + b_ih + [b_hr, b_hz, 0]    hp (N, 3H)  W_hh h_{t−1} (raw)
#        w_rz, b_rz (2H), w_n, b_n (H): the two LNs of hp;  b_hn (H)
#   state h (B, H)    out (N, H)
#   saved hprev (N, H)  rz (N, 2H) σ(r), σ(z)  n (N, H)  ghn (N, H) LN(hp_n) + b_hn
#         mh, rh, mn, rn (N,) stats of the two LNs
#   backward: dout (N, H); dh (B, H); dgx, dgh, dhp (N, 3H)
#   masks (optional, eager and C steps): zh (N, H) zoneout of h; cm (B, H) recurrent dropout on n
# ---------------------------------------------------------------------------------------------


def gru_fwd(st: dict[str, Any], off: int, bs: int) -> None:
    hs, sl = st["H"], slice(off, off + bs)
    h = st["h"][:bs]
    h_prev = st["hprev"][sl]
    h_prev.copy_(h)
    hp = st["hp"][sl]
    if st["normalize"]:
        g_rz = _ln_fwd(st, hp[:, : 2 * hs], st["w_rz"], st["b_rz"], st["mh"][sl], st["rh"][sl])
        g_n = _ln_fwd(st, hp[:, 2 * hs :], st["w_n"], st["b_n"], st["mn"][sl], st["rn"][sl])
    else:
        g_rz, g_n = hp[:, : 2 * hs], hp[:, 2 * hs :]
    ghn = st["ghn"][sl]
    ghn.copy_(g_n if st["b_hn"] is None else g_n + st["b_hn"])
    gx = st["gx"][sl]
    rz = st["rz"][sl]
    torch.sigmoid(g_rz + gx[:, : 2 * hs], out=rz)
    n = st["n"][sl]
    torch.tanh(torch.addcmul(gx[:, 2 * hs :], rz[:, :hs], ghn), out=n)
    cm = _rows(st, "cm", slice(0, bs))
    nm = n if cm is None else n * cm
    h_new = _zone(_rows(st, "zh", sl), h_prev, torch.addcmul(nm, rz[:, hs:], h_prev - nm))
    st["out"][sl] = h_new
    h.copy_(h_new)


def gru_bwd(st: dict[str, Any], off: int, bs: int) -> None:
    hs, sl = st["H"], slice(off, off + bs)
    dh = st["dh"][:bs]
    zh, cm = _rows(st, "zh", sl), _rows(st, "cm", slice(0, bs))
    dh_zoned = dh + st["dout"][sl]
    dh_t = dh_zoned if zh is None else (1.0 - zh) * dh_zoned  # of the cell's own h̃_t
    rz, n, ghn, h_prev = st["rz"][sl], st["n"][sl], st["ghn"][sl], st["hprev"][sl]
    r, z = rz[:, :hs], rz[:, hs:]
    nm = n if cm is None else n * cm
    dgx, dgh = st["dgx"][sl], st["dgh"][sl]
    d_n = dgx[:, 2 * hs :]
    torch.mul(dh_t * (1.0 - z), 1.0 - n * n, out=d_n)
    if cm is not None:
        d_n.mul_(cm)
    torch.mul(d_n, ghn, out=dgx[:, :hs])
    torch.mul(dh_t, h_prev - nm, out=dgx[:, hs : 2 * hs])
    dgx[:, : 2 * hs].mul_(rz * (1.0 - rz))
    dgh[:, : 2 * hs] = dgx[:, : 2 * hs]
    torch.mul(d_n, r, out=dgh[:, 2 * hs :])
    if st["normalize"]:
        hp, dhp = st["hp"][sl], st["dhp"][sl]
        dhp[:, : 2 * hs] = _ln_dx(
            dgh[:, : 2 * hs], hp[:, : 2 * hs], st["mh"][sl], st["rh"][sl], st["w_rz"]
        )
        dhp[:, 2 * hs :] = _ln_dx(
            dgh[:, 2 * hs :], hp[:, 2 * hs :], st["mn"][sl], st["rn"][sl], st["w_n"]
        )
    dh.copy_(dh_t * z if zh is None else dh_t * z + zh * dh_zoned)


EAGER = StepKernels(lstm_fwd=lstm_fwd, lstm_bwd=lstm_bwd, gru_fwd=gru_fwd, gru_bwd=gru_bwd)
# The C step kernels with the time loop in Python (per step torch.mm, then one C call).
C_STEPS = StepKernels(
    lstm_fwd=_cstep.lstm_fwd,
    lstm_bwd=_cstep.lstm_bwd,
    gru_fwd=_cstep.gru_fwd,
    gru_bwd=_cstep.gru_bwd,
)
# The same plus the whole-sequence functions (time loop and recurrent GEMMs in C).
C_KERNELS = StepKernels(
    lstm_fwd=_cstep.lstm_fwd,
    lstm_bwd=_cstep.lstm_bwd,
    gru_fwd=_cstep.gru_fwd,
    gru_bwd=_cstep.gru_bwd,
    lstm_fwd_seq=_cstep.lstm_fwd_seq,
    lstm_bwd_seq=_cstep.lstm_bwd_seq,
    gru_fwd_seq=_cstep.gru_fwd_seq,
    gru_bwd_seq=_cstep.gru_bwd_seq,
    elman_fwd_seq=_cstep.elman_fwd_seq,
    elman_bwd_seq=_cstep.elman_bwd_seq,
    weight_grad=_cstep.weight_grad,
)
