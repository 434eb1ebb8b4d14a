"""The recurrent C kernels' argument description (:mod:`layernorm.kernels.cpu.rnn_abi`) and what
follows from it: the checked-in C header, the ctypes structs, and the checks before C sees a
pointer, both in Python (every tensor of a struct) and in C (a step's rows against the buffers).
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from kernel_paths import needs_sequence_kernels
from layernorm.kernels.cpu import rnn, rnn_abi
from layernorm.recurrent import _fused

needs_c = pytest.mark.skipif(
    not rnn.available(torch.zeros(1)), reason="needs the C recurrent kernels (a C compiler)"
)


def test_checked_in_header_is_the_generated_one() -> None:
    """The compiler reads the file on disk; it must be what rnn_abi.py describes (regenerate with
    ``python -m layernorm.kernels.cpu.rnn_abi``)."""
    assert rnn_abi.header_path().read_text() == rnn_abi.c_header()


@pytest.mark.parametrize("struct", rnn_abi.STRUCTS, ids=lambda s: s.name)
def test_every_field_has_a_rule_over_bound_sizes(struct) -> None:
    names = [f.name for f in struct.fields]
    assert len(set(names)) == len(names)
    bound = {f.symbol or f.name for f in struct.fields if f.kind is rnn_abi.Kind.SIZE}
    if struct in (rnn_abi.SEQ_FWD, rnn_abi.SEQ_BWD):
        bound |= {"N", "B", "H"}  # passed with a step struct, whose sizes they share
    for f in struct.fields:
        if f.is_pointer:
            assert f.shape
            symbols = {t.lstrip("0123456789") for t in f.shape} - {""}
            # G is bound by the caller from the cell's gate count (4H, 3H)
            assert symbols <= bound | {"G"}, (f.name, symbols)
        else:
            assert not f.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("struct", rnn_abi.STRUCTS, ids=lambda s: s.name)
def test_ctypes_struct_follows_the_description(struct, dtype) -> None:
    ct = rnn_abi.structure(struct, dtype)
    assert [name for name, _ in ct._fields_] == [f.name for f in struct.layout()]
    for f in struct.fields:
        if f.is_pointer:
            assert dict(ct._fields_)[f.name] is ctypes.c_void_p
    # pointers first, then 8-byte numbers, then 4-byte ones: each field right after the last
    offset = 0
    for name, ctype in ct._fields_:
        assert getattr(ct, name).offset == offset, name
        offset += ctypes.sizeof(ctype)


def test_size_terms() -> None:
    sizes = {"N": 7, "H": 5}
    assert [rnn_abi.size_of(t, sizes) for t in ("N", "4H", "H", "2")] == [7, 20, 5, 2]
    with pytest.raises(ValueError, match="bad shape term"):
        rnn_abi.size_of("H4", sizes)


def _lstm_inputs(hs: int = 3, batch: int = 2, steps: int = 4, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    gx = torch.randn(steps * batch, 4 * hs, generator=gen, dtype=dtype)
    h0 = torch.randn(batch, hs, generator=gen, dtype=dtype)
    c0 = torch.randn(batch, hs, generator=gen, dtype=dtype)
    w_hh = torch.randn(4 * hs, hs, generator=gen, dtype=dtype)
    params = {"w1": torch.ones(4 * hs, dtype=dtype), "b1": torch.zeros(4 * hs, dtype=dtype),
              "w3": torch.ones(hs, dtype=dtype), "b3": torch.zeros(hs, dtype=dtype)}  # fmt: skip
    sched = _fused.make_schedule([batch] * steps, reverse=False)
    return gx, h0, c0, w_hh, params, sched


def _lstm(gx, h0, c0, w_hh, params, sched):
    return _fused.LSTMSequence.apply(
        gx, h0, c0, w_hh, params["w1"], params["b1"], params["w3"], params["b3"], sched, 1e-5,
        True, False,
    )  # fmt: skip


@needs_c
@pytest.mark.parametrize("name", ["w1", "b1", "w3", "b3"])
def test_sequence_function_refuses_a_gain_of_the_wrong_size_dtype_or_layout(name) -> None:
    """Called directly (below the layers' own checks), the fused LSTM node still checks every
    tensor against the kernel's description before C reads it."""
    gx, h0, c0, w_hh, params, sched = _lstm_inputs()
    size = params[name].numel()
    unit = "4H" if size == 12 else "H"
    bad = dict(params, **{name: params[name][:1].clone()})
    with pytest.raises(ValueError, match=rf"{name} must have shape \({unit}\) = \({size},\)"):
        _lstm(gx, h0, c0, w_hh, bad, sched)
    bad = dict(params, **{name: params[name].float()})
    with pytest.raises(
        TypeError, match=rf"{name} must have dtype torch.float64, got torch.float32"
    ):
        _lstm(gx, h0, c0, w_hh, bad, sched)
    bad = dict(params, **{name: torch.ones(2 * size, dtype=torch.float64)[::2]})
    with pytest.raises(ValueError, match=rf"{name} must be contiguous"):
        _lstm(gx, h0, c0, w_hh, bad, sched)


@needs_sequence_kernels
@needs_c
def test_sequence_function_refuses_a_recurrent_weight_of_the_wrong_shape() -> None:
    gx, h0, c0, w_hh, params, sched = _lstm_inputs()
    with pytest.raises(ValueError, match=r"w must have shape \(G, P\) = \(12, 3\), got \(12, 2\)"):
        _lstm(gx, h0, c0, w_hh[:, :2], params, sched)


def _lstm_fwd_struct(
    hs: int = 3,
    n: int = 8,
    b: int = 2,
    kept: int | None = None,
    gx_rows: int | None = None,
    dtype: torch.dtype = torch.float64,
):
    """A checked LSTM forward struct (the ``dtype`` instance) over zeroed buffers of N = n rows
    and B = b state rows, the kept buffers with ``kept`` rows (default N), gx with ``gx_rows``
    (default N)."""
    f64 = {"dtype": dtype}
    kept = n if kept is None else kept
    gx_rows = n if gx_rows is None else gx_rows
    rows = {"gx": gx_rows, "out": n}
    t = {k: torch.zeros(rows.get(k, kept), c, **f64)
         for k, c in (("hp", 4 * hs), ("gx", 4 * hs), ("out", hs), ("hprev", hs), ("cprev", hs),
                      ("acts", 4 * hs), ("cn", hs), ("tc", hs))}  # fmt: skip
    t.update({k: torch.zeros(kept, **f64) for k in ("mh", "rh", "mc", "rc")})
    t.update(w1=torch.ones(4 * hs, **f64), b1=torch.zeros(4 * hs, **f64), w3=torch.ones(hs, **f64),
             b3=torch.zeros(hs, **f64), h=torch.ones(b, hs, **f64),
             c=torch.ones(b, hs, **f64))  # fmt: skip
    values = {**t, "eps": 1e-5, "off": 0, "rows": 0, "threads": 1, "layer_norm": 1,
              "normalize_cell_state": 0}  # fmt: skip
    sizes = {"N": n, "B": b, "H": hs, "G": 4 * hs, "R": kept, "X": gx_rows}
    return rnn.prepare(rnn_abi.LSTM_FWD, dtype, values, sizes), t, sizes


@needs_c
@pytest.mark.parametrize(("off", "rows"), [(7, 2), (-1, 1), (0, 3), (8, 0)])
def test_c_refuses_step_rows_outside_the_buffers(off, rows) -> None:
    """A step kernel given rows outside its buffers (N = 8 rows, B = 2 state rows) returns an
    error before touching memory; (8, 0) is an empty step at the end, which is in range."""
    args, t, _ = _lstm_fwd_struct()
    before = {k: v.clone() for k, v in t.items()}
    if (off, rows) == (8, 0):
        rnn.step("lstm_fwd_step", torch.float64, args, off, rows, 1)
    else:
        with pytest.raises(ValueError, match="rows lie outside the buffers"):
            rnn.step("lstm_fwd_step", torch.float64, args, off, rows, 1)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k


@needs_c
@pytest.mark.parametrize("kernel", ["lstm_fwd_step", "lstm_fwd_seq"])
@pytest.mark.parametrize("buffer", ["kept", "gx"])
def test_c_refuses_kept_buffers_of_neither_n_nor_b_rows(kernel, buffer) -> None:
    """Kept buffers and gx have N rows (training) or B (inference, rows [0, rows) each step);
    with any other count (here 3, between B = 2 and N = 8) C returns an error and touches
    nothing (a sequence kernel's gx without x must have N rows: the projection's error)."""
    args, t, sizes = _lstm_fwd_struct(**{"kept" if buffer == "kept" else "gx_rows": 3})
    before = {k: v.clone() for k, v in t.items()}
    projection = buffer == "gx" and kernel == "lstm_fwd_seq"
    message = "gx of B or N rows" if projection else "rows lie outside the buffers"
    with pytest.raises(ValueError, match=message):
        if kernel == "lstm_fwd_step":
            rnn.step(kernel, torch.float64, args, 0, 2, 1)
        else:
            w, steps = torch.zeros(12, 3, dtype=torch.float64), torch.tensor([[0, 2], [2, 2]])
            rnn.sequence(kernel, torch.float64, args, w, steps, sizes, 1, 1, 1)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k


@needs_c
def test_c_inference_buffers_of_b_rows() -> None:
    """With kept buffers of B rows a sequence writes the same outputs as with N rows, and its kept
    rows hold the last step's values (rows 6 and 7 of the N-row run)."""
    w = torch.linspace(-1, 1, 36, dtype=torch.float64).view(12, 3)
    steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 2]])
    runs = []
    for kept in (8, 2):
        args, t, sizes = _lstm_fwd_struct(kept=kept)
        t["gx"].copy_(torch.linspace(-2, 2, t["gx"].numel(), dtype=torch.float64).view_as(t["gx"]))
        rnn.sequence("lstm_fwd_seq", torch.float64, args, w, steps, sizes, 1, 1, 1)
        runs.append(t)
    full, inference = runs
    assert full["out"].abs().min() > 0
    for k, v in inference.items():
        if k in ("out", "h", "c"):
            assert torch.equal(v, full[k]), k
        elif v.shape[0] == 2 and k not in ("gx",):
            assert torch.equal(v, full[k][6:]), k


def _gru_bwd_struct(
    dgh_rows: int, layer_norm: int, hs: int = 3, n: int = 8, b: int = 2, previous: str = "kept",
    reverse: int = 0,
):  # fmt: skip
    """A checked GRU backward struct over N = n rows, B = b state rows and dgh of ``dgh_rows``
    rows, its inputs drawn in their ranges (r, z in (0, 1), n in (-1, 1), 1/σ > 0). h_{t−1}:
    ``previous`` "kept" (hprev), "later rows" (hprev NULL: h0 and the output y, steps in order
    or in ``reverse``) or "none" (hprev NULL, nothing to take it from)."""
    gen = torch.Generator().manual_seed(6)
    f64 = {"dtype": torch.float64, "generator": gen}
    t = {"dout": torch.randn(n, hs, **f64), "dh": torch.randn(b, hs, **f64),
         "hprev": torch.randn(n, hs, **f64), "hp": torch.randn(n, 3 * hs, **f64),
         "rz": torch.rand(n, 2 * hs, **f64), "n": torch.rand(n, hs, **f64) * 2 - 1,
         "ghn": torch.randn(n, hs, **f64), "mh": torch.randn(n, **f64),
         "rh": torch.rand(n, **f64) + 0.5, "mn": torch.randn(n, **f64),
         "rn": torch.rand(n, **f64) + 0.5, "w_rz": torch.randn(2 * hs, **f64),
         "w_n": torch.randn(hs, **f64), "dgx": torch.zeros(n, 3 * hs, dtype=torch.float64),
         "dgh": torch.zeros(dgh_rows, 3 * hs, dtype=torch.float64),
         "dhp": torch.zeros(n, 3 * hs, dtype=torch.float64),
         "h0": torch.randn(b, hs, **f64), "y": torch.randn(n, hs, **f64),
         "b_n": torch.randn(hs, **f64), "b_hn": torch.randn(hs, **f64)}  # fmt: skip
    if previous == "kept":  # what the C backward reads in place of hprev without it
        prev = (
            torch.cat([t["h0"], t["y"][:-b]]) if not reverse else torch.cat([t["y"][b:], t["h0"]])
        )
        t["hprev"] = prev.contiguous()
    else:
        t["hprev"] = None
    if previous != "later rows":
        t["h0"] = t["y"] = None
    values = {**t, "off": 0, "rows": 0, "threads": 1, "layer_norm": layer_norm, "eps": 1e-5,
              "reverse": reverse}  # fmt: skip
    sizes = {"N": n, "B": b, "H": hs, "G": 3 * hs, "D": dgh_rows}
    return rnn.prepare(rnn_abi.GRU_BWD, torch.float64, values, sizes), t


@needs_c
def test_c_gru_backward_takes_dgh_as_a_scratch_of_b_rows() -> None:
    """With layer norms the GRU backward's dgh may have B rows (each step's rows [0, rows), D =
    B): dgx, dhp and dh come out as with dgh of N rows, steps in reverse as a sequence runs."""
    runs = []
    for dgh_rows in (8, 2):
        args, t = _gru_bwd_struct(dgh_rows, 1)
        for off in (6, 4, 2, 0):
            rnn.step("gru_bwd_step", torch.float64, args, off, 2, 1)
        runs.append(t)
    full, scratch = runs
    assert full["dhp"].abs().min() > 0
    assert full["dgh"].abs().sum(1).min() > 0  # with N rows every row is kept
    for k in ("dgx", "dhp", "dh"):
        assert torch.equal(scratch[k], full[k]), k
    assert torch.equal(scratch["dgh"], full["dgh"][:2])  # the last step's (rows 0, 1)


@needs_c
@pytest.mark.parametrize(("dgh_rows", "layer_norm"), [(2, 0), (3, 1)])
def test_c_refuses_dgh_of_b_rows_without_layer_norm(dgh_rows, layer_norm) -> None:
    """Without layer norms dgh is dhp, which the caller reads for every row after the loop: B
    rows are refused there, and any count but N or B always; nothing is written."""
    args, t = _gru_bwd_struct(dgh_rows, layer_norm)
    before = {k: v.clone() for k, v in t.items() if v is not None}
    with pytest.raises(ValueError, match="rows lie outside the buffers"):
        rnn.step("gru_bwd_step", torch.float64, args, 0, 2, 1)
    for k, v in before.items():
        assert torch.equal(t[k], v), k


@needs_c
@pytest.mark.parametrize("reverse", [0, 1])
def test_c_gru_backward_takes_h_before_from_the_step_before(reverse) -> None:
    """Without a kept h_{t−1} (hprev NULL) the GRU backward reads h0 for the first step's rows and
    the output of the step before for the others (B rows earlier, later in reverse): the same
    gradients as from the kept copy."""
    runs = []
    for previous in ("kept", "later rows"):
        args, t = _gru_bwd_struct(8, 1, previous=previous, reverse=reverse)
        for off in (6, 4, 2, 0) if not reverse else (0, 2, 4, 6):
            rnn.step("gru_bwd_step", torch.float64, args, off, 2, 1)
        runs.append(t)
    kept, later = runs
    for k in ("dgx", "dhp", "dh"):
        assert torch.equal(later[k], kept[k]), k


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("layer_norm", [1, 0])
def test_c_gru_backward_recomputes_ghn_to_the_bit(layer_norm, dtype) -> None:
    """Where the forward keeps no LN(hp_n) + b_hn (ghn NULL) the backward computes it again from
    hp, finding the row statistics as the forward did: the same gradients to the bit as from the
    kept values, on rows whose mean (1e6) is far from their spread (1), where the mean's low part
    in the normalized value matters (float32: the mean is split in two float32 parts)."""
    hs, n = 5, 4
    gen = torch.Generator().manual_seed(8)
    f64 = {"dtype": dtype, "generator": gen}
    offset = 1e6 if layer_norm else 0.0  # without layer norms the gates would saturate
    fwd = {"hp": offset + torch.randn(n, 3 * hs, **f64), "gx": torch.randn(n, 3 * hs, **f64),
           "w_rz": torch.randn(2 * hs, **f64), "b_rz": torch.randn(2 * hs, **f64),
           "w_n": torch.randn(hs, **f64), "b_n": torch.randn(hs, **f64),
           "b_hn": torch.randn(hs, **f64), "h": torch.randn(n, hs, **f64),
           "out": torch.zeros(n, hs, dtype=dtype), "hprev": None,
           "rz": torch.zeros(n, 2 * hs, dtype=dtype),
           "n": torch.zeros(n, hs, dtype=dtype),
           "ghn": torch.zeros(n, hs, dtype=dtype),
           **{k: torch.zeros(n, dtype=dtype) for k in ("mh", "rh", "mn", "rn")},
           }  # fmt: skip
    sizes = {"N": n, "B": n, "H": hs, "G": 3 * hs, "R": n, "X": n, "D": n}
    common = {"eps": 1e-5, "off": 0, "rows": 0, "threads": 1, "layer_norm": layer_norm}
    h0 = fwd["h"].clone()
    args = rnn.prepare(rnn_abi.GRU_FWD, dtype, {**fwd, **common}, sizes)
    rnn.step("gru_fwd_step", dtype, args, 0, n, 1)
    runs = []
    for ghn in (fwd["ghn"], None):
        bwd = {k: fwd[k] for k in ("hp", "rz", "n", "mh", "rh", "mn", "rn", "w_rz", "w_n", "b_n",
                                   "b_hn")}  # fmt: skip
        bwd.update(dout=torch.linspace(-1, 1, n * hs, dtype=dtype).view(n, hs),
                   dh=torch.full((n, hs), 0.5, dtype=dtype), hprev=h0, h0=None, y=None,
                   ghn=ghn, dgx=torch.zeros(n, 3 * hs, dtype=dtype),
                   dgh=torch.zeros(n, 3 * hs, dtype=dtype),
                   dhp=torch.zeros(n, 3 * hs, dtype=dtype), zh=None, cm=None)  # fmt: skip
        args = rnn.prepare(rnn_abi.GRU_BWD, dtype, {**bwd, **common, "reverse": 0}, sizes)
        rnn.step("gru_bwd_step", dtype, args, 0, n, 1)
        runs.append(bwd)
    kept, recomputed = runs
    assert kept["dgx"].abs().min() > 0
    for k in ("dgx", "dgh", "dhp", "dh"):
        assert torch.equal(recomputed[k], kept[k]), k


@needs_c
@pytest.mark.parametrize(("previous", "rows"), [("none", 2), ("later rows", 1)])
def test_c_refuses_a_gru_backward_without_h_before(previous, rows) -> None:
    """hprev NULL needs h0 and y, and steps of all B rows (a packed step's rows are not B rows
    from the step before's): refused, nothing written."""
    args, t = _gru_bwd_struct(8, 1, previous=previous)
    before = {k: v.clone() for k, v in t.items() if v is not None}
    with pytest.raises(ValueError, match="rows lie outside the buffers"):
        rnn.step("gru_bwd_step", torch.float64, args, 2, rows, 1)
    for k, v in before.items():
        assert torch.equal(t[k], v), k


@needs_c
def test_c_refuses_sequence_steps_outside_the_buffers() -> None:
    args, t, sizes = _lstm_fwd_struct()
    w = torch.zeros(12, 3, dtype=torch.float64)
    before = {k: v.clone() for k, v in t.items()}
    steps = torch.tensor([[6, 2], [8, 2]])  # the second step would run past row 8
    with pytest.raises(ValueError, match="rows lie outside the buffers"):
        rnn.sequence("lstm_fwd_seq", torch.float64, args, w, steps, sizes, 1, 1, 1)
    # only the good first step ran: it stored h_{t-1} (ones) in its rows of hprev
    assert torch.equal(t["hprev"][:6], before["hprev"][:6])
    assert torch.equal(t["hprev"][6:], torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sizes \['G'\] not given"):
        rnn.sequence(
            "lstm_fwd_seq", torch.float64, args, w, steps,
            {"N": 8, "B": 2, "H": 3, "R": 8, "X": 8}, 1, 1, 1,
        )  # fmt: skip


def _projection(n: int = 8, inputs: int = 5, hs: int = 3) -> dict[str, object]:
    gen = torch.Generator().manual_seed(3)
    f64 = {"dtype": torch.float64, "generator": gen}
    return {"x": torch.randn(n, inputs, **f64), "w_ih": torch.randn(4 * hs, inputs, **f64),
            "w0": 1 + 0.3 * torch.randn(4 * hs, **f64), "b0": 0.3 * torch.randn(4 * hs, **f64),
            "split": 4 * hs}  # fmt: skip


@needs_c
@pytest.mark.parametrize("gx_rows", [2, 8], ids=["B rows", "N rows"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layer_norm", [1, 0])
def test_c_projection_inside_the_time_loop_equals_a_given_gx(layer_norm, threads, gx_rows) -> None:
    """A forward sequence given x and W_ih computes each step's gx rows itself, into a B-row gx
    (inference) or into its rows of an N-row gx (kept): the outputs are those of the same
    sequence given gx = LN(x W_ihᵀ)·w0 + b0 (without layer norm x W_ihᵀ + b0) for every row, to
    float64 rounding (another summation order)."""
    w = torch.linspace(-1, 1, 36, dtype=torch.float64).view(12, 3)
    steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 2]])
    proj = _projection()
    xp = proj["x"] @ proj["w_ih"].t()
    if layer_norm:
        xp = torch.nn.functional.layer_norm(xp, (12,), proj["w0"], proj["b0"], 1e-5)
    else:
        xp = xp + proj["b0"]
    runs = []
    for given in (True, False):
        args, t, sizes = _lstm_fwd_struct(kept=2, gx_rows=8 if given else gx_rows)
        args.layer_norm = layer_norm
        if given:
            t["gx"].copy_(xp)
        rnn.sequence("lstm_fwd_seq", torch.float64, args, w, steps, sizes, threads, 1, 1,
                     None if given else proj)  # fmt: skip
        runs.append(t)
    assert runs[0]["out"].abs().min() > 0
    for k in ("out", "h", "c"):
        torch.testing.assert_close(runs[1][k], runs[0][k], rtol=1e-12, atol=1e-14)
    # a B-row gx holds the last step's rows, an N-row gx every step's
    torch.testing.assert_close(runs[1]["gx"], xp[8 - gx_rows :], rtol=1e-12, atol=1e-14)


def _half_weights_case(dtype: torch.dtype = torch.float32, rows: int = 2, steps: int = 1):
    """An LSTM forward struct of ``steps`` steps of ``rows`` rows in ``dtype`` projecting its
    input in the loop, with bfloat16 values for x, h_0, W_ih and W_hh (so that their products
    are exact): ``(args, t, sizes, w, steps, projection, w_half, w_ih_half)``."""
    gen = torch.Generator().manual_seed(6)

    def bf16_values(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).bfloat16()

    hs, inputs = 3, 5
    args, t, sizes = _lstm_fwd_struct(hs, rows * steps, rows, kept=rows, gx_rows=rows,
                                      dtype=dtype)  # fmt: skip
    w_half, w_ih_half = bf16_values(4 * hs, hs), bf16_values(4 * hs, inputs)
    t["h"].copy_(bf16_values(rows, hs))
    t["c"].copy_(torch.randn(rows, hs, generator=gen))
    proj = {"x": bf16_values(rows * steps, inputs).to(dtype), "w_ih": w_ih_half.to(dtype),
            "w0": None, "b0": None, "split": 4 * hs}  # fmt: skip
    step_rows = torch.tensor([[k * rows, rows] for k in range(steps)])
    return args, t, sizes, w_half.to(dtype), step_rows, proj, w_half, w_ih_half


@needs_c
@pytest.mark.parametrize("rows", [2, 13], ids=["direct rows", "more rows"])
@pytest.mark.parametrize("choice", ["mkl", "packed"])
def test_c_one_step_reads_the_bfloat16_weights_in_place_of_the_float_ones(choice, rows) -> None:
    """One step given W_hh and W_ih as bfloat16 (w_half, w_ih_half) reads them and never the
    float32 ones (NaN here): its outputs are the float32 weights' run's, bit for bit where the
    bfloat16 weights are widened for the dot kernel (``use_one_step_gemm("packed")`` within the
    direct rows: the same products in the same order), else to float32 rounding (MKL's
    gemm_bf16bf16f32 sums in its own order)."""
    runs = []
    try:
        rnn.use_one_step_gemm(choice)
        for half in (False, True):
            args, t, sizes, w, steps, proj, w_half, w_ih_half = _half_weights_case(rows=rows)
            if half:
                proj = {**proj, "w_ih": torch.full_like(proj["w_ih"], math.nan),
                        "w_half": w_half, "w_ih_half": w_ih_half}  # fmt: skip
                w = torch.full_like(w, math.nan)
            rnn.sequence("lstm_fwd_seq", torch.float32, args, w, steps, sizes, 1, 1, 1, proj)
            runs.append(t)
    finally:
        rnn.use_one_step_gemm(None)
    exact = choice == "packed" and rows <= rnn.direct_rows()
    for k in ("out", "h", "c"):
        assert runs[1][k].isfinite().all(), k
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 2e-6, "atol": 2e-6}
        torch.testing.assert_close(runs[1][k], runs[0][k], **tol)


@needs_c
@pytest.mark.parametrize(
    "case", ["two steps", "w_ih_half alone", "without w_ih_half", "without x", "float64"]
)
def test_c_refuses_bfloat16_weights_that_do_not_agree(case) -> None:
    """The bfloat16 weights come as a pair with the projection, alone without it (W_hh's), for
    one step of a float32 kernel: else an error before any memory is touched (a kernel that
    took them would read none of the float weights, or the wrong ones)."""
    dtype = torch.float64 if case == "float64" else torch.float32
    args, t, sizes, w, steps, proj, w_half, w_ih_half = _half_weights_case(
        dtype, steps=2 if case == "two steps" else 1
    )
    proj = {**proj, "w_half": w_half, "w_ih_half": w_ih_half}
    if case == "w_ih_half alone":
        proj["w_half"] = None
    elif case == "without w_ih_half":
        proj["w_ih_half"] = None
    elif case == "without x":
        proj.update(x=None, w_ih=None, w0=None, b0=None)
        args, t, sizes = _lstm_fwd_struct(3, 2, 2, kept=2, gx_rows=2, dtype=dtype)
    before = {k: v.clone() for k, v in t.items()}
    # (without x, I = 0: W_ih's pair is refused by its shape before C is called)
    message = r"w_ih_half must have shape \(G, I\)" if case == "without x" else "bfloat16 weights"
    with pytest.raises(ValueError, match=message):
        rnn.sequence("lstm_fwd_seq", dtype, args, w, steps, sizes, 1, 1, 1, proj)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k


def test_bfloat16_weights_of_another_dtype_are_refused_by_name() -> None:
    """w_half is bfloat16 in every instance of the struct: a float32 tensor there is named."""
    _, _, sizes, w, steps, proj, w_half, w_ih_half = _half_weights_case()
    proj = {**proj, "w_half": w_half.float(), "w_ih_half": w_ih_half}
    message = r"w_half must have dtype torch\.bfloat16, got torch\.float32"
    with pytest.raises(TypeError, match=message):
        rnn.pack_sequence("lstm_fwd_seq", torch.float32, w, steps, sizes, 1, 1, 1, proj)


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
def test_c_projection_into_b_rows_normalized_in_the_step(threads) -> None:
    """Inference with the input side's layer norm in the step: the sequence kernel projects each
    step's raw rows into a B-row gx (the sequence struct without w0, b0) and the step adds
    LN(gx)·w0 + b0, its statistics in mx, rx of B rows: the outputs are those of the sequence
    given gx = LN(x W_ihᵀ)·w0 + b0 for every row, and mx, rx are the last step's rows'."""
    w = torch.linspace(-1, 1, 36, dtype=torch.float64).view(12, 3)
    steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 2]])
    proj = _projection()
    raw = proj["x"] @ proj["w_ih"].t()
    normalized = F.layer_norm(raw, (12,), proj["w0"], proj["b0"], 1e-5)
    args, given, sizes = _lstm_fwd_struct(kept=2)
    given["gx"].copy_(normalized)
    rnn.sequence("lstm_fwd_seq", torch.float64, args, w, steps, sizes, threads, 1, 1)
    _, t, sizes = _lstm_fwd_struct(kept=2, gx_rows=2)
    stats = torch.zeros(2, dtype=torch.float64)
    t.update(w0=proj["w0"], b0=proj["b0"], mx=stats, rx=stats.clone())
    args = rnn.prepare(rnn_abi.LSTM_FWD, torch.float64, {
        **t, "eps": 1e-5, "off": 0, "rows": 0, "threads": 1, "layer_norm": 1,
        "normalize_cell_state": 0}, sizes)  # fmt: skip
    raw_projection = {**proj, "w0": None, "b0": None}
    rnn.sequence("lstm_fwd_seq", torch.float64, args, w, steps, sizes, threads, 1, 1,
                 raw_projection)  # fmt: skip
    assert given["out"].abs().min() > 0
    for k in ("out", "h", "c", "acts", "mh", "rh"):
        torch.testing.assert_close(t[k], given[k], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(t["gx"], raw[6:], rtol=1e-12, atol=1e-14)  # raw, as projected
    torch.testing.assert_close(t["mx"], raw[6:].mean(1), rtol=1e-12, atol=1e-14)
    rstd = (raw[6:].var(1, unbiased=False) + 1e-5).rsqrt()
    torch.testing.assert_close(t["rx"], rstd, rtol=1e-12, atol=1e-14)


@needs_c
@pytest.mark.parametrize(
    ("change", "gx_rows"),
    [({"w_ih": None}, 2), ({"x": None}, 2), ({"split": 0}, 2), ({"split": 13}, 2), ({}, 4)],
    ids=["x-without-w_ih", "w_ih-without-x", "split-0", "split-past-G", "gx-of-other-rows"],
)
def test_c_refuses_an_inconsistent_projection(change, gx_rows) -> None:
    """x and W_ih come together, the split lies in (0, G], and gx has B or N rows when C
    projects into it (N otherwise): anything else is an error before any memory is touched."""
    args, t, sizes = _lstm_fwd_struct(kept=2, gx_rows=gx_rows)
    proj = {**_projection(), **change}
    w, steps = torch.zeros(12, 3, dtype=torch.float64), torch.tensor([[0, 2], [2, 2]])
    before = {k: v.clone() for k, v in t.items()}
    with pytest.raises(ValueError, match="input projection needs x and w_ih together"):
        rnn.sequence("lstm_fwd_seq", torch.float64, args, w, steps, sizes, 1, 1, 1, proj)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k


def _projected_lstm(steps: list[list[int]], hs: int = 3, ps: int = 2, kept: int | None = None):
    """An LSTM forward struct for torch.nn.LSTM's projection (the step's h and out hold the
    unprojected h~, H columns), its projection's operands (W_hr (P, H), the projected state hr
    and output out_r) and W_hh (G, P), over the rows of ``steps``; kept buffers of B rows."""
    n, b = sum(r for _, r in steps), steps[0][1]
    args, t, sizes = _lstm_fwd_struct(hs=hs, n=n, b=b, kept=b if kept is None else kept)
    gen = torch.Generator().manual_seed(5)
    f64 = {"dtype": torch.float64, "generator": gen}
    t["gx"].copy_(torch.randn(n, 4 * hs, **f64))
    projection = {"w_hr": torch.randn(ps, hs, **f64), "hr": torch.randn(b, ps, **f64),
                  "out_r": torch.zeros(n, ps, dtype=torch.float64)}  # fmt: skip
    w = torch.randn(4 * hs, ps, **f64)
    return args, t, sizes, projection, w, torch.tensor(steps)


@needs_c
@pytest.mark.parametrize(
    "steps",
    [[[0, 2], [2, 2]], [[0, 3], [3, 3], [6, 3], [9, 2], [11, 1]], [[0, 4], [4, 4], [8, 4]]],
    ids=["few rows: weights as stored", "ragged: a step's GEMMs shared", "equal: rows split"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_c_recurrent_projection_equals_the_projection_between_steps(steps, threads) -> None:
    """With W_hr the LSTM's sequence kernel carries h_t = W_hr h~_t (P units) as the state its
    recurrent GEMM reads and writes each step's rows to out_r: what the step kernel between
    torch's two GEMMs per step gives (hp = hr W_hhᵀ before, hr = h~ W_hrᵀ after), for a call of
    a few rows (the weights read as stored), ragged steps (a team shares each step's GEMMs) and
    steps of all rows (a team splits them by rows; grains of 1 make a team of two threads)."""
    runs = []
    for in_loop in (True, False):
        args, t, sizes, proj, w, sched = _projected_lstm(steps)
        hr, out_r, w_hr = proj["hr"], proj["out_r"], proj["w_hr"]
        if in_loop:
            rnn.sequence("lstm_fwd_seq", torch.float64, args, w, sched, sizes, threads, 1, 1,
                         proj)  # fmt: skip
        else:
            for off, rows in sched.tolist():
                torch.mm(hr[:rows], w.t(), out=t["hp"][:rows])
                rnn.step("lstm_fwd_step", torch.float64, args, off, rows, 1)
                torch.mm(t["out"][off : off + rows], w_hr.t(), out=hr[:rows])
                out_r[off : off + rows] = hr[:rows]
        runs.append((out_r, hr, t["c"], t["out"]))
    assert runs[1][0].abs().min() > 0
    for got, want in zip(*runs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@needs_c
@pytest.mark.parametrize(
    "change",
    ["hr missing", "out_r missing", "hr without w_hr", "P unlike H without w_hr", "kept N rows",
     "zoneout of h", "GRU kernel"],
)  # fmt: skip
def test_c_refuses_an_inconsistent_recurrent_projection(change) -> None:
    """W_hr comes with hr and out_r, P equals H without it, and only the LSTM's forward takes
    it, in inference and without zoneout of h: anything else is an error before any memory is
    touched."""
    kernel, steps = "lstm_fwd_seq", [[0, 2], [2, 2], [4, 2]]
    kept = 6 if change == "kept N rows" else None
    args, t, sizes, proj, w, sched = _projected_lstm(steps, kept=kept)
    if change == "hr missing":
        proj["hr"] = None
    elif change == "out_r missing":
        proj["out_r"] = None
    elif change == "hr without w_hr":
        proj = {"hr": torch.zeros(2, 3, dtype=torch.float64),
                "out_r": torch.zeros(6, 3, dtype=torch.float64)}  # fmt: skip
        w = torch.zeros(12, 3, dtype=torch.float64)
    elif change == "P unlike H without w_hr":
        proj, w = {}, torch.zeros(12, 3, dtype=torch.float64)
    elif change == "zoneout of h":
        t["zh"] = torch.full((6, 3), 0.5, dtype=torch.float64)
        args.zh = t["zh"].data_ptr()
    elif change == "GRU kernel":
        kernel = "gru_fwd_seq"
        gru = {
            k: torch.zeros(r, c, dtype=torch.float64)
            for k, r, c in (
                ("hp", 2, 9),
                ("gx", 6, 9),
                ("h", 2, 3),
                ("out", 6, 3),
                ("rz", 2, 6),
                ("n", 2, 3),
            )
        }
        gru.update({k: torch.ones(n, dtype=torch.float64) for k, n in (
            ("w_rz", 6), ("b_rz", 6), ("w_n", 3), ("b_n", 3), ("b_hn", 3), ("mh", 2), ("rh", 2),
            ("mn", 2), ("rn", 2))})  # fmt: skip
        sizes = {"N": 6, "B": 2, "H": 3, "G": 9, "R": 2, "X": 6}
        args = rnn.prepare(rnn_abi.GRU_FWD, torch.float64, {**gru, "eps": 1e-5, "off": 0,
                           "rows": 0, "threads": 1, "layer_norm": 1}, sizes)  # fmt: skip
        w = torch.zeros(9, 2, dtype=torch.float64)
        t = gru
    seq_args = rnn.pack_sequence(kernel, torch.float64, w, sched, sizes, 1, 1, 1, proj)
    if change == "P unlike H without w_hr":
        seq_args.P = 2  # past the Python checks: C's own
    before = {k: v.clone() for k, v in {**t, **{k: v for k, v in proj.items() if v is not None}
                                         }.items()}  # fmt: skip
    with pytest.raises(ValueError, match="recurrent projection w_hr needs hr and out_r"):
        rnn.run_sequence(kernel, torch.float64, args, seq_args)
    for k, v in {**t, **{k: v for k, v in proj.items() if v is not None}}.items():
        assert torch.equal(v, before[k]), k


def _elman_fwd_struct(hs: int = 3, n: int = 8, b: int = 2, gx_rows: int | None = None):
    """A checked Elman forward struct over zeroed buffers of N = n rows and B = b state rows, gx
    with ``gx_rows`` (default N)."""
    f64 = {"dtype": torch.float64}
    gx_rows = n if gx_rows is None else gx_rows
    t = {k: torch.zeros(gx_rows if k == "gx" else n, hs, **f64)
         for k in ("hp", "gx", "out", "hprev")}  # fmt: skip
    t.update(mh=torch.zeros(n, **f64), rh=torch.zeros(n, **f64), w=torch.ones(hs, **f64),
             b=torch.zeros(hs, **f64), h=torch.ones(b, hs, **f64))  # fmt: skip
    values = {**t, "eps": 1e-5, "off": 0, "rows": 0, "threads": 1, "layer_norm": 1, "relu": 0}
    sizes = {"N": n, "B": b, "H": hs, "G": hs, "R": n, "X": gx_rows}
    return rnn.prepare(rnn_abi.ELMAN_FWD, torch.float64, values, sizes), t, sizes


@needs_c
@pytest.mark.parametrize(("off", "rows"), [(7, 2), (-1, 1), (0, 3)])
def test_c_refuses_elman_step_rows_outside_the_buffers(off, rows) -> None:
    args, t, _ = _elman_fwd_struct()
    before = {k: v.clone() for k, v in t.items()}
    with pytest.raises(ValueError, match="rows lie outside the buffers"):
        rnn.step("elman_fwd_step", torch.float64, args, off, rows, 1)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k


@needs_c
def test_c_elman_sequence_refuses_an_input_projection() -> None:
    """The Elman step normalizes hp + gx as one, so its sequence kernel takes gx as given and
    refuses the projection the LSTM's and GRU's compute inside the loop into gx's B rows (it
    would normalize the projection on its own), before any memory is touched."""
    args, t, sizes = _elman_fwd_struct(n=4, gx_rows=2)
    f64 = {"dtype": torch.float64}
    proj = {"x": torch.zeros(4, 5, **f64), "w_ih": torch.zeros(3, 5, **f64), "split": 3}
    w, steps = torch.zeros(3, 3, dtype=torch.float64), torch.tensor([[0, 2], [2, 2]])
    before = {k: v.clone() for k, v in t.items()}
    with pytest.raises(ValueError, match="the Elman kernels take neither"):
        rnn.sequence("elman_fwd_seq", torch.float64, args, w, steps, sizes, 1, 1, 1, proj)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k
    args, t, sizes = _elman_fwd_struct(n=4)  # gx of every row, given: it runs
    rnn.sequence("elman_fwd_seq", torch.float64, args, w, steps, sizes, 1, 1, 1)
    assert torch.equal(t["h"], torch.zeros(2, 3, dtype=torch.float64))  # tanh(LN(0)) = 0


def _input_norm(hs: int = 3, n: int = 8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    f64 = {"dtype": torch.float64, "generator": gen}
    stats = torch.zeros(n, dtype=torch.float64)
    return {"w0": 1 + 0.3 * torch.randn(4 * hs, **f64), "b0": 0.3 * torch.randn(4 * hs, **f64),
            "mx": stats, "rx": stats.clone()}  # fmt: skip


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
def test_c_input_norm_in_the_step_equals_a_normalized_gx(threads) -> None:
    """A forward sequence given the raw gx and w0, b0 adds LN(gx)·w0 + b0 inside the step: its
    outputs are those of the sequence given the normalized gx, and mx, rx are gx's row mean and
    1/std. Backward turns the gates' gradient into the raw gx's, and sums w0's and b0's
    gradients, as torch's layer_norm backward has them."""
    w = torch.linspace(-1, 1, 36, dtype=torch.float64).view(12, 3)
    steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 2]])
    raw = torch.randn(8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    norm = _input_norm()
    runs = []
    for inside in (False, True):
        args, t, sizes = _lstm_fwd_struct()
        if inside:
            t.update(norm)
            t["gx"].copy_(raw)
            args = rnn.prepare(rnn_abi.LSTM_FWD, torch.float64, {
                **t, "eps": 1e-5, "off": 0, "rows": 0, "threads": 1, "layer_norm": 1,
                "normalize_cell_state": 0}, sizes)  # fmt: skip
        else:
            t["gx"].copy_(F.layer_norm(raw, (12,), norm["w0"], norm["b0"], 1e-5))
        rnn.sequence("lstm_fwd_seq", torch.float64, args, w, steps, sizes, threads, 1, 1)
        runs.append(t)
    for k in ("out", "h", "c", "acts", "mh", "rh"):
        torch.testing.assert_close(runs[1][k], runs[0][k], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(runs[1]["mx"], raw.mean(1), rtol=1e-12, atol=1e-14)
    rstd = (raw.var(1, unbiased=False) + 1e-5).rsqrt()
    torch.testing.assert_close(runs[1]["rx"], rstd, rtol=1e-12, atol=1e-14)
    # backward: a made-up gates gradient through the input side's layer norm
    args, t, sizes = _lstm_bwd_struct(keep_cprev=True)
    f = runs[1]
    dgates = []
    for inside in (False, True):
        args, t, sizes = _lstm_bwd_struct(keep_cprev=True)
        extra = {"gx": raw, "w0": norm["w0"], "mx": f["mx"], "rx": f["rx"]} if inside else {}
        args = rnn.prepare(rnn_abi.LSTM_BWD, torch.float64, {
            **t, **extra, "cprev": t["cprev"], "off": 0, "rows": 0, "threads": 1,
            "layer_norm": 1, "normalize_cell_state": 0, "reverse": 0}, sizes)  # fmt: skip
        sums = {"hp_grads": torch.zeros(24, dtype=torch.float64),
                "x_grads": torch.zeros(24, dtype=torch.float64)}  # fmt: skip
        rnn.sequence("lstm_bwd_seq", torch.float64, args, w, steps, sizes, threads, 1, 1, sums)
        dgates.append((t["dgates"].clone(), sums))
    (dg, _), (dgx, sums) = dgates
    xr = raw.clone().requires_grad_(True)
    w0, b0 = (norm[k].clone().requires_grad_(True) for k in ("w0", "b0"))
    F.layer_norm(xr, (12,), w0, b0, 1e-5).backward(dg)
    torch.testing.assert_close(dgx, xr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(sums["x_grads"], torch.cat((w0.grad, b0.grad)), rtol=1e-10,
                               atol=1e-12)  # fmt: skip
    torch.testing.assert_close(sums["x_grads"][12:], sums["hp_grads"][12:], rtol=0, atol=0)


@needs_c
@pytest.mark.parametrize(
    ("kernel", "drop"),
    [("lstm_fwd_seq", "b0"), ("lstm_fwd_seq", "mx"), ("lstm_fwd_seq", "layer_norm"),
     ("lstm_fwd_seq", "with-x"), ("lstm_fwd_seq", "with-x-normalized"),
     ("lstm_fwd_step", "rx"), ("lstm_bwd_seq", "gx"),
     ("lstm_bwd_step", "mx")],
)  # fmt: skip
def test_c_refuses_a_half_given_input_norm(kernel, drop) -> None:
    """w0 comes with its bias and statistics (forward), with gx and the statistics (backward),
    with layer_norm, and not with a projection the kernel normalizes itself (the sequence
    struct's w0 and b0 given, into B or N rows of gx): else an error before any memory is
    touched."""
    w, steps = torch.zeros(12, 3, dtype=torch.float64), torch.tensor([[0, 2], [2, 2]])
    norm = _input_norm()
    if "_fwd" in kernel:
        args, t, sizes = _lstm_fwd_struct(gx_rows=2 if drop == "with-x" else 8)
        t.update(norm)
    else:
        args, t, sizes = _lstm_bwd_struct(keep_cprev=True)
        t.update(gx=torch.ones(8, 12, dtype=torch.float64), w0=norm["w0"], mx=norm["mx"],
                 rx=norm["rx"])  # fmt: skip
    struct = rnn_abi.LSTM_FWD if "_fwd" in kernel else rnn_abi.LSTM_BWD
    values = {**t, "off": 0, "rows": 0, "threads": 1, "layer_norm": int(drop != "layer_norm"),
              "normalize_cell_state": 0, "eps": 1e-5, "reverse": 0}  # fmt: skip
    if drop in values and drop != "layer_norm":
        values[drop] = None
    args = rnn.prepare(struct, torch.float64, values, sizes)
    before = {k: v.clone() for k, v in t.items()}
    with pytest.raises(ValueError, match="the layer norm of gx needs w0"):
        if kernel.endswith("_seq"):
            proj = _projection() if drop.startswith("with-x") else None
            rnn.sequence(kernel, torch.float64, args, w, steps, sizes, 1, 1, 1, proj)
        else:
            rnn.step(kernel, torch.float64, args, 0, 2, 1)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("eps", float("nan"), ValueError, "eps must be finite and >= 0"),
        ("eps", -1.0, ValueError, "eps must be finite and >= 0"),
        ("layer_norm", 2, ValueError, "layer_norm must be 0 or 1"),
        ("threads", 0, ValueError, "threads must be >= 1"),
        ("off", -1, ValueError, "off must be >= 0"),
        ("eps", "1e-5", TypeError, "eps must be a float, got str"),
        ("hp", None, TypeError, "hp must be a torch.Tensor, got NoneType"),
        # a mask is optional (None: NULL, the option off), but checked like any input when given
        ("zh", torch.zeros(2, 3), ValueError, r"zh must have shape \(N, H\) = \(2, 2\)"),
        ("cm", torch.zeros(1, 2, dtype=torch.float64), TypeError, "cm must have dtype"),
        ("cm", torch.zeros(1, 4)[:, ::2], ValueError, "cm must be contiguous"),
    ],
)
@pytest.mark.parametrize("entry", ["check", "pack"])
def test_numbers_and_missing_tensors_are_refused(field, value, error, message, entry) -> None:
    """``check`` and ``pack`` (whose fast test hands what it refuses to the same checks)."""
    hs, n, b = 2, 2, 1
    sizes = {"N": n, "B": b, "H": hs, "R": n, "X": n}
    values = _good_values(rnn_abi.GRU_FWD, sizes)
    call = getattr(rnn_abi, entry)
    call(rnn_abi.GRU_FWD, torch.float32, values, sizes)  # the good ones pass
    call(rnn_abi.GRU_FWD, torch.float32, {**values, "zh": None, "cm": None}, sizes)
    values[field] = value
    with pytest.raises(error, match=message):
        call(rnn_abi.GRU_FWD, torch.float32, values, sizes)


def _good_values(struct, sizes, dtype=torch.float32) -> dict[str, object]:
    """Well-formed values of every field of ``struct`` but its sizes."""
    values: dict[str, object] = {}
    for i, f in enumerate(struct.fields):
        if f.kind is rnn_abi.Kind.STEPS:
            values[f.name] = torch.zeros([rnn_abi.size_of(t, sizes) for t in f.shape],
                                         dtype=torch.int64)  # fmt: skip
        elif f.is_pointer:
            shape = [rnn_abi.size_of(t, sizes) for t in f.shape]
            values[f.name] = torch.full(shape, float(i), dtype=f.tensor_dtype(dtype))
        elif f.kind is rnn_abi.Kind.FLOAT:
            values[f.name] = 1e-5 + f.minimum
        elif f.kind is rnn_abi.Kind.FLAG:
            values[f.name] = i % 2
        elif f.kind is not rnn_abi.Kind.SIZE:
            values[f.name] = int(max(f.minimum, 1)) + i
    return values


_ALL_SIZES = {"N": 6, "B": 2, "H": 3, "G": 12, "S": 3, "I": 5, "R": 6, "X": 6, "D": 6, "M": 4,
              "K": 5, "C": 5, "P": 2}  # fmt: skip


@pytest.mark.parametrize("struct", rnn_abi.STRUCTS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fast_packing_fills_every_field_as_the_checked_one(struct, dtype) -> None:
    sizes = _ALL_SIZES
    values = _good_values(struct, sizes, dtype)
    plan = rnn_abi._fast_plan(struct, dtype, rnn_abi._sizes_key(sizes))
    assert (
        rnn_abi._fast_fields(plan, values, [None] * len(plan)) is not None
    )  # the fast test takes them
    fast = rnn_abi.pack(struct, dtype, values, sizes)
    slow = rnn_abi.structure(struct, dtype)()
    rnn_abi._checked(struct, dtype, values, sizes, slow)
    for f in struct.fields:
        assert getattr(fast, f.name) == getattr(slow, f.name), f.name
    assert bytes(fast) == bytes(slow)


def _bound_case(struct, dtype):
    """A BoundStruct of ``struct`` with its numbers and every third tensor fixed, every other
    third tensor (of the instance's dtype: not steps, not bfloat16) a block of one region
    buffer, the rest the call's; the values of a call, and the same call as plain values (the
    blocks as views of the buffer)."""
    values = _good_values(struct, _ALL_SIZES, dtype)
    pointers = [f for f in struct.layout() if f.is_pointer]
    fixed = {f.name: values[f.name] for f in struct.fields
             if not f.is_pointer and f.kind is not rnn_abi.Kind.SIZE}  # fmt: skip
    fixed.update({f.name: values[f.name] for f in pointers[0::3]})
    blocks, offset = {}, 1  # one element of the buffer before the first block: offsets count
    for f in pointers[1::3]:
        if f.tensor_dtype(dtype) is not dtype:
            continue
        shape = tuple(rnn_abi.size_of(t, _ALL_SIZES) for t in f.shape)
        blocks[f.name] = (offset, shape)
        offset += math.prod(shape)
    region = rnn_abi.Region(offset + 2, blocks)
    bound = rnn_abi.BoundStruct(struct, dtype, _ALL_SIZES, fixed, {"buffer": region})
    buffer = torch.randn(region.numel, dtype=torch.float64).to(dtype)
    call = {n: v for n, v in values.items() if n not in fixed and n not in blocks}
    call["buffer"] = buffer
    plain = dict(values)
    for name, (off, shape) in blocks.items():
        plain[name] = buffer[off : off + math.prod(shape)].view(shape)
    return bound, call, plain


@pytest.mark.parametrize("struct", rnn_abi.STRUCTS, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_bound_struct_packs_every_field_as_pack(struct, dtype) -> None:
    """Fixed fields, blocks of a region buffer and the call's own: the same bytes as ``pack``
    of the same values (the blocks' addresses are those of views of the buffer)."""
    bound, call, plain = _bound_case(struct, dtype)
    fast = bound.pack(call)
    assert bytes(fast) == bytes(rnn_abi.pack(struct, dtype, plain, _ALL_SIZES))


def test_a_bound_struct_packs_what_only_the_checks_take() -> None:
    """A call's value the fast test refuses and the checks take (an int of a subclass) packs
    through the checks, blocks and all: the same bytes."""
    bound, call, plain = _bound_case(rnn_abi.LSTM_FWD, torch.float32)
    fixed = {n: v for n, v in bound._fixed.items() if n != "threads"}
    loose = rnn_abi.BoundStruct(rnn_abi.LSTM_FWD, torch.float32, _ALL_SIZES, fixed,
                                bound._region_defs)  # fmt: skip

    class Count(int):
        pass

    want = bytes(rnn_abi.pack(rnn_abi.LSTM_FWD, torch.float32, plain, _ALL_SIZES))
    assert bytes(loose.pack({**call, "threads": plain["threads"]})) == want
    assert bytes(loose.pack({**call, "threads": Count(plain["threads"])})) == want


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ("base dtype", TypeError, "buffer must have dtype torch.float32"),
        ("base size", ValueError, "buffer must be a contiguous buffer of"),
        ("base layout", ValueError, "buffer must be a contiguous buffer of"),
        ("base missing", TypeError, "buffer must be a torch.Tensor, got NoneType"),
        ("call tensor shape", ValueError, r"must have shape \("),
        ("call tensor missing", TypeError, "must be a torch.Tensor, got NoneType"),
    ],
)
def test_a_bound_struct_refuses_a_bad_call(change, error, message) -> None:
    """Each call's region buffer and own fields are checked, with the errors ``pack`` gives."""
    bound, call, _ = _bound_case(rnn_abi.LSTM_FWD, torch.float32)
    buffer = call["buffer"]
    own = next(n for n, v in call.items() if isinstance(v, torch.Tensor) and n != "buffer"
               and not rnn_abi.LSTM_FWD.field(n).optional)  # fmt: skip
    if change == "base dtype":
        call["buffer"] = buffer.double()
    elif change == "base size":
        call["buffer"] = torch.zeros(buffer.numel() + 1)
    elif change == "base layout":
        call["buffer"] = torch.zeros(2 * buffer.numel())[::2]
    elif change == "base missing":
        del call["buffer"]
    elif change == "call tensor shape":
        call[own] = torch.zeros(1)
    else:
        del call[own]
    with pytest.raises(error, match=message):
        bound.pack(call)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ("fixed eps", ValueError, "eps must be finite and >= 0"),
        ("fixed tensor", ValueError, r"w1 must have shape \(4H\)"),
        ("unknown field", ValueError, r"no fields \['nonsense'\]"),
        ("block shape", ValueError, "hp must have shape"),
        ("block outside", ValueError, "hp must have shape"),
        ("block of steps", ValueError, "not a tensor field"),
        ("size", ValueError, "size B must be an int >= 0"),
    ],
)
def test_a_bound_struct_refuses_a_bad_plan(change, error, message) -> None:
    """What a BoundStruct fixes is checked once, when it is made."""
    sizes = {"N": 6, "B": 2, "H": 3, "G": 12, "R": 6, "X": 6}
    fixed: dict[str, object] = {"eps": 1e-5, "off": 0, "rows": 0, "threads": 1, "layer_norm": 1,
                                "normalize_cell_state": 0, "w1": torch.ones(12)}  # fmt: skip
    struct, blocks = rnn_abi.LSTM_FWD, {"hp": (0, (6, 12))}
    if change == "fixed eps":
        fixed["eps"] = float("nan")
    elif change == "fixed tensor":
        fixed["w1"] = torch.ones(3)
    elif change == "unknown field":
        fixed["nonsense"] = 1
    elif change == "block shape":
        blocks = {"hp": (0, (6, 3))}
    elif change == "block outside":
        blocks = {"hp": (1, (6, 12))}
    elif change == "block of steps":
        struct, blocks, fixed = rnn_abi.SEQ_FWD, {"steps": (0, (3, 2))}, {}
        sizes = {**sizes, "S": 3, "I": 0, "P": 3}
    else:
        sizes["B"] = -1
    with pytest.raises(error, match=message):
        rnn_abi.BoundStruct(struct, torch.float32, sizes, fixed, {"kept": rnn_abi.Region(72,
                            blocks)})  # fmt: skip


@pytest.mark.parametrize("size", [2.0, "2", -2])
def test_a_size_equal_to_a_packed_one_is_checked_again(size) -> None:
    # the fast path keeps a plan per struct, dtype and sizes; 2.0 equals 2 as a dict key, and
    # must still be refused as no size once the plan of 2 is kept
    sizes = {"N": 6, "B": 2, "H": 3, "G": 12, "S": 3, "I": 5, "R": 6, "X": 6, "D": 6}
    values = _good_values(rnn_abi.LSTM_FWD, sizes)
    rnn_abi.pack(rnn_abi.LSTM_FWD, torch.float32, values, sizes)
    with pytest.raises(ValueError, match="size B must be an int >= 0"):
        rnn_abi.pack(rnn_abi.LSTM_FWD, torch.float32, values, {**sizes, "B": size})


def _lstm_bwd_struct(
    keep_cprev: bool, reverse: int = 0, hs: int = 3, n: int = 8, b: int = 2,
    dtype: torch.dtype = torch.float64,
):  # fmt: skip
    """A checked LSTM backward struct over seeded buffers (N = n, B = b): with the carried
    c_{t−1} kept in ``cprev`` (= c0 then cn shifted by a step), or not kept (``cprev`` NULL)."""
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen, dtype=torch.float64) + 0.1).to(dtype)

    t = {
        k: r(n, c)
        for k, c in (
            ("dout", hs),
            ("hp", 4 * hs),
            ("acts", 4 * hs),
            ("cn", hs),
            ("tc", hs),
            ("dgates", 4 * hs),
            ("dhp", 4 * hs),
            ("dlc", hs),
        )
    }
    t.update({k: r(n) for k in ("mh", "rh", "mc", "rc")})
    t.update(w1=r(4 * hs), w3=r(hs), dh=r(b, hs), dc=r(b, hs), c0=r(b, hs))
    later = t["cn"][b:] if reverse else t["cn"][:-b]
    steps = [t["c0"], later] if not reverse else [later, t["c0"]]
    if keep_cprev:
        t["cprev"] = torch.cat(steps)  # in t: the struct holds its address
    values = {**t, "cprev": t.get("cprev"), "off": 0, "rows": 0, "threads": 1,
              "layer_norm": 1, "normalize_cell_state": 0, "reverse": reverse}  # fmt: skip
    sizes = {"N": n, "B": b, "H": hs, "G": 4 * hs}
    return rnn.prepare(rnn_abi.LSTM_BWD, dtype, values, sizes), t, sizes


@needs_c
@pytest.mark.parametrize("reverse", [0, 1])
def test_c_lstm_backward_takes_the_previous_cell_state_from_the_step_before(reverse) -> None:
    """Without cprev the backward reads c_{t−1} from c0 (first step) and cn of the step before
    (B rows earlier, later in reverse): every gradient equals the run with cprev kept."""
    w = torch.linspace(-1, 1, 36, dtype=torch.float64).view(12, 3)
    steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 2]])
    runs = []
    for keep in (True, False):
        args, t, sizes = _lstm_bwd_struct(keep, reverse)
        sched = steps.flip(0).contiguous() if reverse else steps
        rnn.sequence("lstm_bwd_seq", torch.float64, args, w, sched, sizes, 1, 1, 1)
        runs.append(t)
    for k in ("dgates", "dhp", "dlc", "dh", "dc"):
        assert torch.equal(runs[0][k], runs[1][k]), k


@needs_c
@pytest.mark.parametrize("case", ["no c0", "short step"])
def test_c_refuses_a_backward_without_the_previous_cell_state(case) -> None:
    """cprev NULL needs c0 and steps of all B rows; else C returns an error and touches nothing."""
    args, t, sizes = _lstm_bwd_struct(False)
    if case == "no c0":
        args.c0 = None
        steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 2]])
    else:
        steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 1]])
    before = {k: v.clone() for k, v in t.items()}
    w = torch.zeros(12, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="rows lie outside the buffers"):
        rnn.sequence("lstm_bwd_seq", torch.float64, args, w, steps, sizes, 1, 1, 1)
    with pytest.raises(ValueError, match="rows lie outside the buffers"):
        rnn.step("lstm_bwd_step", torch.float64, args, 6, 1 if case != "no c0" else 2, 1)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k


@needs_c
@pytest.mark.parametrize("threads", [1, 2])
def test_c_backward_projects_x_s_gradient_in_the_time_loop(threads) -> None:
    """A backward sequence given W_ih and dx writes each step's dx rows as dgx · W_ih (the
    LSTM's dgates): every other output as without them, dx as torch's product of the results."""
    w = torch.linspace(-1, 1, 36, dtype=torch.float64).view(12, 3)
    steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 2]])
    w_ih = torch.randn(12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    runs = []
    for with_dx in (False, True):
        args, t, sizes = _lstm_bwd_struct(keep_cprev=True)
        opts = {"w_ih": w_ih, "dx": torch.full((8, 5), float("nan"), dtype=torch.float64)}
        rnn.sequence("lstm_bwd_seq", torch.float64, args, w, steps, sizes, threads, 1, 1,
                     opts if with_dx else None)  # fmt: skip
        runs.append((t, opts["dx"]))
    (plain, _), (t, dx) = runs
    for k in ("dgates", "dhp", "dlc", "dh", "dc"):
        assert torch.equal(t[k], plain[k]), k
    torch.testing.assert_close(dx, t["dgates"] @ w_ih, rtol=1e-12, atol=1e-14)


@needs_c
@pytest.mark.parametrize("case", ["w_ih-without-dx", "dx-without-w_ih", "gru", "elman"])
def test_c_refuses_an_inconsistent_projection_gradient(case) -> None:
    """W_ih and dx come together, for the LSTM's backward kernel only (the GRU's and the
    Elman's refuse them): else an error before any memory is touched."""
    f64 = {"dtype": torch.float64}
    w_ih, dx = torch.zeros(12, 5, **f64), torch.zeros(8, 5, **f64)
    if case == "elman":
        struct, t, sizes = rnn_abi.ELMAN_BWD, {}, {"N": 8, "B": 2, "H": 3, "G": 3}
        t = {k: torch.zeros(8, 3, **f64) for k in ("dout", "hp", "own", "dhp")}
        t.update(dh=torch.zeros(2, 3, **f64), mh=torch.zeros(8, **f64), rh=torch.zeros(8, **f64),
                 w=torch.ones(3, **f64))  # fmt: skip
        args = rnn.prepare(struct, torch.float64, {**t, "off": 0, "rows": 0, "threads": 1,
                                                   "layer_norm": 1, "relu": 0}, sizes)  # fmt: skip
        kernel, w, opts = "elman_bwd_seq", torch.zeros(3, 3, **f64), {"w_ih": w_ih[:3], "dx": dx}
    elif case == "gru":
        args, t = _gru_bwd_struct(dgh_rows=8, layer_norm=1)
        t = {k: v for k, v in t.items() if v is not None}
        sizes = {"N": 8, "B": 2, "H": 3, "G": 9, "D": 8}
        kernel, w, opts = "gru_bwd_seq", torch.zeros(9, 3, **f64), {"w_ih": w_ih[:9], "dx": dx}
    else:
        args, t, sizes = _lstm_bwd_struct(keep_cprev=True)
        kernel, w = "lstm_bwd_seq", torch.zeros(12, 3, **f64)
        opts = {"w_ih": w_ih} if case == "w_ih-without-dx" else {"dx": dx}
    before = {k: v.clone() for k, v in t.items()}
    steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 2]])
    with pytest.raises(ValueError, match="input projection"):
        rnn.sequence(kernel, torch.float64, args, w, steps, sizes, 1, 1, 1, opts)
    for k, v in t.items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(dx, torch.zeros_like(dx))


@needs_c
@pytest.mark.parametrize("half_gemm", [0, 1, 2])
def test_c_backward_x_s_gradient_is_never_a_rounded_product(half_gemm) -> None:
    """x's gradient, dgx · W_ih, is not a recurrent product: whatever ``half_gemm`` asks of the
    recurrent GEMMs (2: rounded to bfloat16 where the build has the dot products), it stays a
    float32 product, within float32 rounding of float64 on the same dgx (a bfloat16 rounding of
    dgx would be 2⁻⁹ off)."""
    w = torch.linspace(-1, 1, 36 * 16, dtype=torch.float32).view(48, 12)
    steps = torch.tensor([[0, 2], [2, 2], [4, 2], [6, 2]])
    w_ih = torch.randn(48, 7, generator=torch.Generator().manual_seed(6))
    args, t, sizes = _lstm_bwd_struct(keep_cprev=True, hs=12, dtype=torch.float32)
    dx = torch.zeros(8, 7)
    rnn.sequence("lstm_bwd_seq", torch.float32, args, w, steps, sizes, 1, 1, 1,
                 {"w_ih": w_ih, "dx": dx}, half_gemm=half_gemm)  # fmt: skip
    ref = t["dgates"].double() @ w_ih.double()
    assert ((dx.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
