"""Fused sequence path: one autograd node per (layer, direction) with an analytic backward in time.

What makes an eager LN-LSTM slow is not arithmetic (layer norm adds ~1% FLOPs) but the hundreds of
small autograd nodes per step. The split used here:

* The input half ``LN(W_ih x_t)`` does not depend on the recurrence, so the sequence layer computes
  it for **all** time steps with one GEMM and one layer norm (ordinary autograd, big tensors).
* The recurrence is a single :class:`torch.autograd.Function` per direction. Forward runs the steps
  without recording a graph, writing what backward needs into preallocated ``(N, ·)`` buffers
  (N = rows of the packed sequence); backward walks the steps in reverse, per step one GEMM for
  ``dh_{t−1}`` plus the step's pointwise backward (:mod:`._pointwise`), and then gets the weight
  and gain gradients with **one** GEMM / reduction over all steps.

Sequences are handled in packed form: a padded ``(T, B, ·)`` input is the special case of ``T``
steps of ``B`` rows. A step of ``bs`` rows updates rows ``[:bs]`` of the ``(B, H)`` state buffer, so
sequences that ended (forward direction) or have not yet begun (reverse) keep their state and
padded positions never enter any statistic.

The reference for these functions is the step-by-step loop over :mod:`._steps`; the tests compare
both in float64, forward and every gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._pointwise import ln_kernels, step_kernels

Schedule = tuple[tuple[int, int, int], ...]  # (time index, first row, rows) in processing order


def make_schedule(batch_sizes: list[int], reverse: bool) -> Schedule:
    """Steps of a packed sequence, in the order a direction processes them."""
    offsets, off = [], 0
    for t, bs in enumerate(batch_sizes):
        offsets.append((t, off, bs))
        off += bs
    return tuple(reversed(offsets)) if reverse else tuple(offsets)


def _grad_or_none(needed: bool, fn: Any) -> Tensor | None:
    return fn() if needed else None


def _ln_param_grads(
    ln: Any,
    dy: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    w: Tensor | None,
    need_w: bool,
    need_b: bool,
) -> tuple[Tensor | None, Tensor | None]:
    """Gain / bias gradients of a layer norm over all steps at once (one reduction)."""
    if not (need_w or need_b):
        return None, None
    _, dw, db = ln.layer_norm_bwd(
        dy.contiguous(), x, mean, rstd, w, False, False, False, need_w and w is not None, need_b
    )
    return (dw if need_w else None), (db.to(x.dtype) if need_b and db is not None else None)


class LSTMSequence(torch.autograd.Function):
    """Recurrence of one LSTM direction given ``gx = LN(W_ih x) + b`` for all rows.

    Inputs: ``gx (N, 4H)``, ``h0, c0 (B, H)``, ``w_hh (4H, H)``, LN(hp) gain/bias ``(4H)``, LN(c)
    gain/bias ``(H)`` (``None`` when absent), the schedule, eps, whether to normalize, whether the
    carried state is LN(c). Outputs: ``out (N, H)`` (h at every row), ``h_n, c_n (B, H)``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gx: Tensor,
        h0: Tensor,
        c0: Tensor,
        w_hh: Tensor,
        w1: Tensor | None,
        b1: Tensor | None,
        w3: Tensor | None,
        b3: Tensor | None,
        sched: Schedule,
        eps: float,
        normalize: bool,
        carry_normalized: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        n_rows, hs = gx.shape[0], h0.shape[1]
        kern = step_kernels(gx)
        p = {"ln": ln_kernels(gx), "w_hh_ln": w1, "b_hh_ln": b1, "w_c_ln": w3, "b_c_ln": b3,
             "eps": eps, "normalize": normalize, "carry_normalized": carry_normalized}  # fmt: skip
        h, c = h0.contiguous().clone(), c0.contiguous().clone()
        new = gx.new_empty
        out, hprev_all, cprev_all = new(n_rows, hs), new(n_rows, hs), new(n_rows, hs)
        hp_all = new(n_rows, 4 * hs)
        bufs = {"acts": new(n_rows, 4 * hs), "cn": new(n_rows, hs), "tc": new(n_rows, hs),
                **{k: new(n_rows) for k in ("mh", "rh", "mc", "rc")}}  # fmt: skip
        w_t = w_hh.t()
        for _, off, bs in sched:
            sl = slice(off, off + bs)
            hprev, cprev = hprev_all[sl], cprev_all[sl]
            hprev.copy_(h[:bs])
            cprev.copy_(c[:bs])
            hp = torch.mm(hprev, w_t, out=hp_all[sl])
            h_new, c_new = kern.lstm_fwd(hp, gx[sl], cprev, p, {k: v[sl] for k, v in bufs.items()})
            out[sl] = h_new
            h[:bs] = h_new
            c[:bs] = c_new
        ctx.save_for_backward(w_hh, w1, w3, hprev_all, cprev_all, hp_all, *bufs.values())
        ctx.buf_names = tuple(bufs)
        ctx.p, ctx.sched = p, sched
        return out, h, c

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dh_n: Tensor, dc_n: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        w_hh, w1, w3, hprev_all, cprev_all, hp_all, *rest = ctx.saved_tensors
        bufs = dict(zip(ctx.buf_names, rest, strict=True))
        p, kern = ctx.p, step_kernels(hp_all)
        n_rows, hs = hprev_all.shape
        dh, dc = dh_n.contiguous().clone(), dc_n.contiguous().clone()
        new = hp_all.new_empty
        dbufs = {"dgates": new(n_rows, 4 * hs), "dhp": new(n_rows, 4 * hs), "dlc": new(n_rows, hs)}
        for _, off, bs in reversed(ctx.sched):
            sl = slice(off, off + bs)
            dh_t = dh[:bs] + dout[sl]
            dc_prev = kern.lstm_bwd(
                dh_t, dc[:bs], hp_all[sl], cprev_all[sl], p,
                {k: v[sl] for k, v in bufs.items()}, {k: v[sl] for k, v in dbufs.items()},
            )  # fmt: skip
            torch.mm(dbufs["dhp"][sl], w_hh, out=dh[:bs])
            dc[:bs] = dc_prev
        need = ctx.needs_input_grad
        d_w_hh = _grad_or_none(need[3], lambda: dbufs["dhp"].t().mm(hprev_all))
        ln = p["ln"]
        dw1 = db1 = dw3 = db3 = None
        if p["normalize"]:
            dw1, db1 = _ln_param_grads(
                ln, dbufs["dgates"], hp_all, bufs["mh"], bufs["rh"], w1, need[4], need[5]
            )
            dw3, db3 = _ln_param_grads(
                ln, dbufs["dlc"], bufs["cn"], bufs["mc"], bufs["rc"], w3, need[6], need[7]
            )
        return (dbufs["dgates"], dh, dc, d_w_hh, dw1, db1, dw3, db3, None, None, None, None)


class GRUSequence(torch.autograd.Function):
    """Recurrence of one GRU direction given ``gx = LN(W_ih x) + b_ih + [b_hr, b_hz, 0]``.

    Inputs: ``gx (N, 3H)``, ``h0 (B, H)``, ``w_hh (3H, H)``, the ``(r, z)`` LN's gain/bias (2H), the
    candidate LN's gain/bias (H), ``b_hn (H)`` (``None`` when absent), schedule, eps, normalize.
    Outputs: ``out (N, H)``, ``h_n (B, H)``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gx: Tensor,
        h0: Tensor,
        w_hh: Tensor,
        w_rz: Tensor | None,
        b_rz: Tensor | None,
        w_n: Tensor | None,
        b_n: Tensor | None,
        b_hn: Tensor | None,
        sched: Schedule,
        eps: float,
        normalize: bool,
    ) -> tuple[Tensor, Tensor]:
        n_rows, hs = gx.shape[0], h0.shape[1]
        kern = step_kernels(gx)
        p = {"ln": ln_kernels(gx), "w_rz_ln": w_rz, "b_rz_ln": b_rz, "w_n_ln": w_n, "b_n_ln": b_n,
             "b_hn": b_hn, "eps": eps, "normalize": normalize}  # fmt: skip
        h = h0.contiguous().clone()
        new = gx.new_empty
        out, hprev_all = new(n_rows, hs), new(n_rows, hs)
        hprz_all, hpn_all = new(n_rows, 2 * hs), new(n_rows, hs)
        bufs = {"rz": new(n_rows, 2 * hs), "n": new(n_rows, hs), "ghn": new(n_rows, hs),
                **{k: new(n_rows) for k in ("mh", "rh", "mn", "rn")}}  # fmt: skip
        w_rz_t, w_n_t = w_hh[: 2 * hs].t(), w_hh[2 * hs :].t()
        for _, off, bs in sched:
            sl = slice(off, off + bs)
            hprev = hprev_all[sl]
            hprev.copy_(h[:bs])
            hp_rz = torch.mm(hprev, w_rz_t, out=hprz_all[sl])
            hp_n = torch.mm(hprev, w_n_t, out=hpn_all[sl])
            h_new = kern.gru_fwd(hp_rz, hp_n, gx[sl], hprev, p, {k: v[sl] for k, v in bufs.items()})
            out[sl] = h_new
            h[:bs] = h_new
        ctx.save_for_backward(w_hh, w_rz, w_n, hprev_all, hprz_all, hpn_all, *bufs.values())
        ctx.buf_names = tuple(bufs)
        ctx.p, ctx.sched = p, sched
        return out, h

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dh_n: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        w_hh, w_rz, w_n, hprev_all, hprz_all, hpn_all, *rest = ctx.saved_tensors
        bufs = dict(zip(ctx.buf_names, rest, strict=True))
        p, kern = ctx.p, step_kernels(hprev_all)
        n_rows, hs = hprev_all.shape
        dh = dh_n.contiguous().clone()
        new = hprev_all.new_empty
        dbufs = {"dgx": new(n_rows, 3 * hs), "dgh": new(n_rows, 3 * hs), "dhp": new(n_rows, 3 * hs)}
        for _, off, bs in reversed(ctx.sched):
            sl = slice(off, off + bs)
            dh_t = dh[:bs] + dout[sl]
            direct = kern.gru_bwd(
                dh_t, hprev_all[sl], hprz_all[sl], hpn_all[sl], p,
                {k: v[sl] for k, v in bufs.items()}, {k: v[sl] for k, v in dbufs.items()},
            )  # fmt: skip
            torch.addmm(direct, dbufs["dhp"][sl], w_hh, out=dh[:bs])
        need = ctx.needs_input_grad
        d_w_hh = _grad_or_none(need[2], lambda: dbufs["dhp"].t().mm(hprev_all))
        dgh = dbufs["dgh"]
        dw_rz = db_rz = dw_n = db_n = None
        if p["normalize"]:
            ln = p["ln"]
            dw_rz, db_rz = _ln_param_grads(
                ln, dgh[:, : 2 * hs], hprz_all, bufs["mh"], bufs["rh"], w_rz, need[3], need[4]
            )
            dw_n, db_n = _ln_param_grads(
                ln, dgh[:, 2 * hs :], hpn_all, bufs["mn"], bufs["rn"], w_n, need[5], need[6]
            )
        d_b_hn = _grad_or_none(need[7], lambda: dgh[:, 2 * hs :].sum(0))
        return (dbufs["dgx"], dh, d_w_hh, dw_rz, db_rz, dw_n, db_n, d_b_hn, None, None, None)


class RNNSequence(torch.autograd.Function):
    """Recurrence of one Elman-RNN direction (Eq. 4) given ``xp = W_ih x`` for all rows.

    ``h_t = f(LN(xp_t + W_hh h_{t−1}; g, b))`` with ``b`` the LN bias plus both torch biases;
    without normalization ``xp`` already holds the biases and ``h_t = f(xp_t + W_hh h_{t−1})``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        xp: Tensor,
        h0: Tensor,
        w_hh: Tensor,
        g: Tensor | None,
        b: Tensor | None,
        sched: Schedule,
        eps: float,
        normalize: bool,
        relu: bool,
    ) -> tuple[Tensor, Tensor]:
        n_rows, hs = xp.shape[0], h0.shape[1]
        ln = ln_kernels(xp)
        h = h0.contiguous().clone()
        new = xp.new_empty
        out, hprev_all, a_all = new(n_rows, hs), new(n_rows, hs), new(n_rows, hs)
        mean_all, rstd_all = new(n_rows), new(n_rows)
        w_t = w_hh.t()
        for _, off, bs in sched:
            sl = slice(off, off + bs)
            hprev = hprev_all[sl]
            hprev.copy_(h[:bs])
            a = torch.addmm(xp[sl], hprev, w_t, out=a_all[sl])
            if normalize:
                y, m, r = ln.layer_norm_fwd(a, g, b, eps)
                mean_all[sl] = m
                rstd_all[sl] = r
            else:
                y = a
            if relu:
                torch.clamp_min(y, 0.0, out=out[sl])
            else:
                torch.tanh(y, out=out[sl])
            h[:bs] = out[sl]
        ctx.save_for_backward(w_hh, g, out, hprev_all, a_all, mean_all, rstd_all)
        ctx.sched, ctx.normalize, ctx.relu, ctx.ln = sched, normalize, relu, ln
        return out, h

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dh_n: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        w_hh, g, out, hprev_all, a_all, mean_all, rstd_all = ctx.saved_tensors
        ln = ctx.ln
        dh = dh_n.contiguous().clone()
        dy_all, da_all = torch.empty_like(a_all), torch.empty_like(a_all)
        for _, off, bs in reversed(ctx.sched):
            sl = slice(off, off + bs)
            dy = dy_all[sl]
            torch.add(dh[:bs], dout[sl], out=dy)
            h = out[sl]
            if ctx.relu:
                dy.mul_(h > 0)
            else:
                dy.mul_(1.0 - h * h)
            if ctx.normalize:
                da, _, _ = ln.layer_norm_bwd(
                    dy, a_all[sl], mean_all[sl], rstd_all[sl], g, False, False, True, False, False
                )
                da_all[sl] = da
            else:
                da_all[sl] = dy
            torch.mm(da_all[sl], w_hh, out=dh[:bs])
        need = ctx.needs_input_grad
        d_w_hh = _grad_or_none(need[2], lambda: da_all.t().mm(hprev_all))
        dg = db = None
        if ctx.normalize:
            dg, db = _ln_param_grads(ln, dy_all, a_all, mean_all, rstd_all, g, need[3], need[4])
        return (da_all, dh, d_w_hh, dg, db, None, None, None, None)
