"""Recurrent layers on bfloat16/float16 CPU inputs: the fused whole-sequence path, computed in
float32 and returned in the input's dtype, against the float64 step-by-step reference on the same
rounded inputs and parameters."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import layernorm
from kernel_paths import needs_sequence_kernels, one_step_gemm_calls, spy_projected_calls
from layernorm.kernels.cpu import rnn, torch_ops
from layernorm.recurrent import _cstep, _fused, _steps, layers
from tolerances import UNIT_ROUNDOFF

LAYERS = (layernorm.LayerNormLSTM, layernorm.LayerNormGRU, layernorm.LayerNormRNN)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_half_layers_take_the_fused_path_and_match_float64(cls, dtype, monkeypatch):
    torch.manual_seed(0)
    m = cls(16, 24, bidirectional=True).to(dtype)
    x = torch.randn(9, 3, 16, dtype=torch.float64).to(dtype).requires_grad_()
    ref = copy.deepcopy(m).double()
    ref.impl = "loop"

    def no_loop(*args, **kwargs):
        raise AssertionError("the step-by-step loop ran")

    monkeypatch.setattr(layers._LNRNNBase, "_loop", no_loop)
    out, state = m(x)
    assert out.dtype == dtype
    for s in state if isinstance(state, tuple) else (state,):
        assert s.dtype == dtype
    dy = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    params = list(m.parameters())
    grads = torch.autograd.grad(out, [x, *params], dy)
    monkeypatch.undo()

    xr = x.detach().double().requires_grad_()
    out_r, _ = ref(xr)
    grads_r = torch.autograd.grad(out_r, [xr, *ref.parameters()], dy.double())
    # float32 arithmetic, one rounding of the outputs and of each gradient to the half type
    u = UNIT_ROUNDOFF[dtype]
    err = (out.double() - out_r).abs().max() / out_r.abs().max()
    assert err <= 4 * u, err
    for k, (g, gr) in enumerate(zip(grads, grads_r, strict=True)):
        assert g.dtype == dtype
        err = (g.double() - gr).abs().max() / gr.abs().max()
        assert err <= 8 * u, (k, err)


# --- bfloat16 products (AVX512-BF16 builds: rnn.half_gemm) -----------------------------------

needs_half_gemm = pytest.mark.skipif(
    not rnn.half_gemm(), reason="the selected build has no bfloat16 dot products (AVX512-BF16)"
)


@pytest.fixture(params=[True, False], ids=["dot-product projection", "float32 projection"])
def projection(request):
    """Both choices of a bfloat16 layer's input projection (rnn.use_bfloat16_projection), the
    processor's default restored after."""
    rnn.use_bfloat16_projection(request.param)
    yield request.param
    rnn.use_bfloat16_projection(None)


def _skip_without_tiles() -> None:
    """Skip where the processor, the system or the build has no AMX tiles for the products."""
    rnn.use_amx(True)
    try:
        here = rnn.amx()
    finally:
        rnn.use_amx(None)
    if not here:
        pytest.skip("no AMX tiles here (processor, system or build)")


@pytest.fixture(params=[True, False], ids=["AMX tiles", "no AMX"])
def tiles(request):
    """The bfloat16 products on the AMX tiles (skipped where there are none) and off them
    (rnn.use_amx); the default restored after."""
    if request.param:
        _skip_without_tiles()
    rnn.use_amx(request.param)
    yield request.param
    rnn.use_amx(None)


def _bf16_case(cls, steps, batch, in_features, hidden, seed=0):
    """A bfloat16 layer, input and initial state (bfloat16 values, so that a first step's
    recurrent products are exact), and its float64 step-by-step reference."""
    torch.manual_seed(seed)
    m = cls(in_features, hidden).to(torch.bfloat16)
    x = torch.randn(steps, batch, in_features, dtype=torch.float64).to(torch.bfloat16)
    h0 = (0.5 * torch.randn(1, batch, hidden, dtype=torch.float64)).to(torch.bfloat16)
    state = (h0, h0.flip(-1)) if cls is layernorm.LayerNormLSTM else h0
    ref = copy.deepcopy(m).double()
    ref.impl = "loop"
    return m, x, state, ref


def _double(state):
    return tuple(s.double() for s in state) if isinstance(state, tuple) else state.double()


def _grads(m, x, state, dy):
    x = x.detach().requires_grad_()
    out, _ = m(x, state)
    return out, torch.autograd.grad(out, [x, *m.parameters()], dy)


@needs_half_gemm
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("batch", "hidden"), [(9, 23), (17, 40), (30, 8)])
@pytest.mark.parametrize("cls", [layernorm.LayerNormLSTM, layernorm.LayerNormRNN],
                         ids=lambda c: c.__name__)  # fmt: skip
def test_rounded_recurrent_products_of_bfloat16_values_are_exact(cls, batch, hidden, threads,
                                                                 tiles):  # fmt: skip
    """One step from a bfloat16 initial state: the recurrent products under
    bfloat16_recurrent_products take h0 as it is (no rounding), so the packed bfloat16 GEMM
    (an odd K at H = 23, a last panel of fewer columns, tiles of 1 to 14 rows, each thread's
    share) must give the float32 path's accuracy against float64; the backward's gates' gradient
    is rounded once, within the gradients' bound. (One GRU step runs torch's GEMM, not the
    sequence kernels: the GRU's products are in the two tests below.)"""
    m, x, state, ref = _bf16_case(cls, 1, batch, 12, hidden)
    dy = torch.randn(1, batch, hidden, dtype=torch.float64).to(torch.bfloat16)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with layernorm.recurrent.bfloat16_recurrent_products():
            out, grads = _grads(m, x, state, dy)
    finally:
        torch.set_num_threads(old)
    out_r, grads_r = _grads(ref, x.double(), _double(state), dy.double())
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert (out.double() - out_r).abs().max() <= 4 * u * out_r.abs().max()
    for k, (g, gr) in enumerate(zip(grads, grads_r, strict=True)):
        assert (g.double() - gr).abs().max() <= 8 * u * gr.abs().max(), k


@needs_half_gemm
@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_rounded_recurrent_products_hold_only_inside_their_block(cls):
    """Over several steps the rounded products change the results (h_{t−1} is rounded), only
    inside the block; a forward run inside it takes its backward the same way wherever the
    backward runs."""
    m, x, state, _ = _bf16_case(cls, 6, 12, 10, 24)
    dy = torch.randn(6, 12, 24, dtype=torch.float64).to(torch.bfloat16)
    out0, grads0 = _grads(m, x, state, dy)
    with layernorm.recurrent.bfloat16_recurrent_products():
        out1, grads1 = _grads(m, x, state, dy)
        xr = x.detach().requires_grad_()
        out2, _ = m(xr, state)
    grads2 = torch.autograd.grad(out2, [xr, *m.parameters()], dy)  # outside the block
    out3, grads3 = _grads(m, x, state, dy)
    assert not torch.equal(out1, out0)
    assert not torch.equal(grads1[0], grads0[0])
    assert torch.equal(out2, out1) and all(map(torch.equal, grads2, grads1))
    assert torch.equal(out3, out0) and all(map(torch.equal, grads3, grads0))


@pytest.mark.parametrize(("rows", "inner", "cols"), [(40, 3000, 24), (300, 64, 17), (1, 5, 1)])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_rounded_product_is_a_bfloat16_gemm_of_rounded_operands(rows, inner, cols, layout):
    """``_cstep.rounded_product``: the float64 product of both operands rounded to bfloat16,
    within the float32 sums' error (inner · u₃₂ · Σ|a||b|) and one rounding of the result to
    bfloat16; the left operand as rows or as a transposed view (a weight's gradient dᵀ · x)."""
    gen = torch.Generator().manual_seed(rows + inner)
    a = torch.randn(rows, inner, generator=gen) + 0.3
    if layout == "transposed":
        a = (torch.randn(inner, rows, generator=gen) + 0.3).t()
    b = torch.randn(inner, cols, generator=gen) - 0.2
    out = torch.empty(rows, cols)
    got = _cstep.rounded_product(a, b, out)
    assert got is out and got.dtype is torch.float32
    ra, rb = (t.to(torch.bfloat16).double() for t in (a, b))
    ref = ra @ rb
    sums = inner * UNIT_ROUNDOFF[torch.float32] * (ra.abs() @ rb.abs())
    bound = sums + UNIT_ROUNDOFF[torch.bfloat16] * (ref.abs() + sums)
    assert ((got.double() - ref).abs() <= bound).all()
    # the result is a bfloat16 value: rounded once
    assert torch.equal(got, got.to(torch.bfloat16).float())


@needs_half_gemm
@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_rounded_products_take_the_gradients_products_too(cls, monkeypatch, tiles):
    """Inside the rounded recurrent products the backward multiplies as ``torch.nn.LSTM``'s in
    bfloat16 does: W_hh's, W_ih's and the input's gradients by ``_cstep.rounded_product`` (the
    gates' gradient, h_{t−1} and x rounded to bfloat16: torch's bfloat16 GEMM), each once; none
    outside the block. (The Elman layer's input projection, with no layer norm of its own, is
    ``F.linear``'s: autograd's float32 products; W_hh's gradient alone is the layer's.) Against
    the float64 loop whose products round their input as the forward does, within the one-step
    bound; the LSTM's C++ training node gives the Python node's bits. (Every row projected
    before the loop: the loop's limit and the projection node's set to none.)"""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_MAX_BYTES", 0)
    monkeypatch.setattr(_fused, "_PROJECTION_NODE_BYTES", 0)
    shapes = []
    rounded_product = _cstep.rounded_product

    def spy(a, b, out):
        shapes.append(tuple(out.shape))
        return rounded_product(a, b, out)

    monkeypatch.setattr(_cstep, "rounded_product", spy)
    steps, batch, inputs, hidden = 7, 40, 64, 48
    m, x, state, ref = _bf16_case(cls, steps, batch, inputs, hidden)
    dy = torch.randn(steps, batch, hidden, dtype=torch.float64).to(torch.bfloat16)
    with torch_ops.switched(False):  # the Python training node, whose products the spy sees
        _grads(m, x, state, dy)
        assert shapes == []
        with layernorm.recurrent.bfloat16_recurrent_products():
            out, grads = _grads(m, x, state, dy)
    gates = m.weight_hh_l0.shape[0]
    expected = [(gates, hidden)]
    if cls is not layernorm.LayerNormRNN:
        expected += [(gates, inputs), (steps * batch, inputs)]
    assert sorted(shapes) == sorted(expected)
    monkeypatch.setattr(_steps, "F", _RoundedProducts())
    out_r, grads_r = _grads(ref, x.double(), _double(state), dy.double())
    monkeypatch.undo()
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert (out.double() - out_r).abs().max() <= 2 * u * out_r.abs().max()
    for k, (g, gr) in enumerate(zip(grads, grads_r, strict=True)):
        assert (g.double() - gr).abs().max() <= 8 * u * gr.abs().max(), k
    if cls is layernorm.LayerNormLSTM and torch_ops.recurrent_nodes():
        monkeypatch.setattr(_fused, "_LOOP_PROJECTION_MAX_BYTES", 0)
        monkeypatch.setattr(_fused, "_PROJECTION_NODE_BYTES", 0)
        with layernorm.recurrent.bfloat16_recurrent_products():
            out_cpp, grads_cpp = _grads(m, x, state, dy)
        assert torch.equal(out_cpp, out) and all(map(torch.equal, grads_cpp, grads))


@pytest.mark.parametrize("inputs", [33, 2048])
@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_bfloat16_inference_projection_matches_float64(cls, inputs, projection, tiles):
    """Inference with enough rows a step that the sequence kernel projects the inputs itself:
    by bfloat16 dot products of x and W_ih (bfloat16 values: exact products, float32 sums) where
    the build has them and the choice asks for them, else in float32; either way the float32
    path's accuracy.
    I = 33: an odd count of pairs' values; I = 2048: rows of 1024 pairs, 4 KiB, which the rounded
    rows hold a cache line further apart (``half_rows_apart``)."""
    m, x, state, ref = _bf16_case(cls, 7, 40, inputs, 48)
    with torch.no_grad():
        out, _ = m(x, state)
        out_r, _ = ref(x.double(), _double(state))
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert (out.double() - out_r).abs().max() <= 4 * u * out_r.abs().max()


def _bf16_call(m, x, state, dy, training):
    """A bfloat16 layer's output and (``training``) its input's and parameters' gradients."""
    if training:
        return _grads(m, x, state, dy)
    with torch.no_grad():
        return m(x, state)[0], ()


@pytest.mark.parametrize("mode", ["training", "inference"])
@pytest.mark.parametrize("cls", LAYERS[:2], ids=lambda c: c.__name__)
def test_bfloat16_projection_of_all_rows_matches_float64(cls, mode, projection, monkeypatch):
    """A projection of all rows before the time loop (here every one: the loop's limit and the
    projection node's set to none) multiplies a bfloat16 layer's input and W_ih, bfloat16 values
    both, by bfloat16 dot products where the build has them and the choice asks for them
    (``rnn.matmul`` with ``half``: exact products, float32 sums), else in float32; the float32
    path's accuracy either way, and the input's gradient (dgx · W_ih, not bfloat16 values) never
    by them. The LSTM's C++ training node takes the same route: the Python node's bits."""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_MAX_BYTES", 0)
    monkeypatch.setattr(_fused, "_PROJECTION_NODE_BYTES", 0)
    halves = []
    matmul = rnn.matmul

    def spy(x, w, transposed, out, threads, grain, half=False):
        halves.append((transposed, half))
        return matmul(x, w, transposed, out, threads, grain, half)

    monkeypatch.setattr(rnn, "matmul", spy)
    m, x, state, ref = _bf16_case(cls, 7, 40, 64, 48)
    dy = torch.randn(7, 40, 48, dtype=torch.float64).to(torch.bfloat16)
    training = mode == "training"
    with torch_ops.switched(False):  # the Python training node, whose products the spy sees
        out, grads = _bf16_call(m, x, state, dy, training)
    out_r, grads_r = _bf16_call(ref, x.double(), _double(state), dy.double(), training)
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert (out.double() - out_r).abs().max() <= 4 * u * out_r.abs().max()
    for k, (g, gr) in enumerate(zip(grads, grads_r, strict=True)):
        assert (g.double() - gr).abs().max() <= 8 * u * gr.abs().max(), k
    assert ((True, True) in halves) == bool(projection and rnn.half_gemm()), halves
    assert (False, True) not in halves
    if training and torch_ops.recurrent_nodes():
        out_cpp, grads_cpp = _bf16_call(m, x, state, dy, training)
        assert torch.equal(out_cpp, out) and all(map(torch.equal, grads_cpp, grads))


class _RoundedProducts:
    """``torch.nn.functional`` for the float64 reference loop, with ``linear`` rounding its input
    to bfloat16 first: the loop's products as the rounded recurrent products take them (its
    inputs x are bfloat16 values already)."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def linear(inp, weight, bias=None):
        return torch.nn.functional.linear(inp.to(torch.bfloat16).to(inp.dtype), weight, bias)


@needs_half_gemm
@pytest.mark.parametrize(("batch", "hidden"), [(2, 40), (3, 23), (4, 24), (13, 40)])
@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_rounded_recurrent_products_match_a_reference_that_rounds_h(
    cls, batch, hidden, monkeypatch, tiles
):
    """Twelve steps of the rounded products against the float64 loop with each product's h
    rounded to bfloat16 first: the same products, so only float32 arithmetic differs, and where
    it moves an h across a rounding boundary, by one bfloat16 step of that value (0.5–0.75
    roundings of the largest output measured, 1.7 once; against the plain float64 loop up to 4.4
    for the LN-LSTM). 1 to 4 rows a step: the tile over two panels; 13: the row tiles."""
    m, x, state, ref = _bf16_case(cls, 12, batch, 10, hidden)
    with torch.no_grad():
        with layernorm.recurrent.bfloat16_recurrent_products():
            out, _ = m(x, state)
        monkeypatch.setattr(_steps, "F", _RoundedProducts())
        out_r, _ = ref(x.double(), _double(state))
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert (out.double() - out_r).abs().max() <= 2 * u * out_r.abs().max()


@needs_half_gemm
@pytest.mark.parametrize("batch", [3, 13])
def test_rounded_products_with_proj_size_match_a_reference_that_rounds(
    batch, monkeypatch, tiles
) -> None:
    """torch.nn.LSTM's projection inside the sequence kernel under the rounded products: h̃_t
    rounded to bfloat16 before W_hr, as h_{t−1} is before W_hh, against the float64 loop with
    each product's input rounded so; the bound of the test above."""
    torch.manual_seed(0)
    m = layernorm.LayerNormLSTM(10, 40, proj_size=12).to(torch.bfloat16)
    x = torch.randn(12, batch, 10, dtype=torch.float64).to(torch.bfloat16)
    state = tuple((0.5 * torch.randn(1, batch, n, dtype=torch.float64)).to(torch.bfloat16)
                  for n in (12, 40))  # fmt: skip
    ref = copy.deepcopy(m).double()
    ref.impl = "loop"
    projected = spy_projected_calls(monkeypatch)
    with torch.no_grad():
        with layernorm.recurrent.bfloat16_recurrent_products():
            out, _ = m(x, state)
        monkeypatch.setattr(_steps, "F", _RoundedProducts())
        out_r, _ = ref(x.double(), _double(state))
    assert projected == ["lstm_fwd_seq"]
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert (out.double() - out_r).abs().max() <= 2 * u * out_r.abs().max()


@pytest.mark.parametrize("rounded", [False, True], ids=["default", "rounded"])
@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_bfloat16_nan_input_is_not_hidden(cls, rounded, projection):
    """A NaN in one sequence's input at step 1 makes that sequence's outputs NaN from there on and
    leaves the others finite: through the kernel's bfloat16 projection (20 rows a step) and,
    inside the block, the rounded recurrent products."""
    m, x, state, _ = _bf16_case(cls, 4, 20, 6, 24)
    x[1, 0, 2] = float("nan")
    rounding = layernorm.recurrent.bfloat16_recurrent_products
    with torch.no_grad(), rounding() if rounded else contextlib.nullcontext():
        out, _ = m(x, state)
    assert torch.isnan(out[1:, 0]).all() and not torch.isnan(out[:, 1:]).any()
    assert not torch.isnan(out[0]).any()


@needs_half_gemm
def test_bfloat16_layer_projects_in_the_loop_by_its_packed_bytes():
    """The time loop packs W_ih for an inference projection up to loop_projection_max_bytes() of
    packed copy: a bfloat16 layer's products pack bfloat16 pairs, half of float32's, so a W_ih of
    2600 rows whose float32 copy is past the limit and whose pairs are within it (the limit's
    1.5 times, 6.3 MB where the limit is 4 MiB) is projected in the loop for a bfloat16 layer and
    before it for a float32 one."""
    limit = _fused.loop_projection_max_bytes()
    w_ih = torch.zeros(2600, 3 * limit // (8 * 2600))
    assert w_ih.numel() * 4 > limit >= w_ih.numel() * 2
    source = _fused.InputProjection(torch.zeros(700, w_ih.shape[1]), w_ih, None, None, 1e-5, True)
    assert not _fused._projects_in_loop(source, 20)
    rnn.use_bfloat16_projection(True)
    try:
        with _cstep.bfloat16_layer():
            assert _fused._projects_in_loop(source, 20)
        rnn.use_bfloat16_projection(False)  # float32 products: float32's packed bytes
        with _cstep.bfloat16_layer():
            assert not _fused._projects_in_loop(source, 20)
    finally:
        rnn.use_bfloat16_projection(None)


@pytest.mark.parametrize(
    ("vendor", "on_tiles"),
    [("GenuineIntel", False), ("AuthenticAMD", False), ("GenuineIntel", True)],
    ids=["Intel", "AMD", "Intel with AMX"],
)
def test_bfloat16_projection_by_processor_and_by_choice(vendor, on_tiles, monkeypatch):
    """A bfloat16 layer's products (the sequence struct's half_gemm): the input projection by
    dot products by default on AMD processors and where the products run on AMX tiles, not on
    Intel's without; either where chosen, every product inside bfloat16_recurrent_products; none
    without the build's dot products."""
    monkeypatch.setattr(rnn.targets, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(rnn, "amx", lambda: on_tiles)
    default = vendor == "AuthenticAMD" or on_tiles
    assert rnn.bfloat16_projection_by_default() == default
    has = rnn.half_gemm()
    try:
        for choice, level in ((None, int(default)), (True, 1), (False, 0)):
            rnn.use_bfloat16_projection(choice)
            assert rnn.bfloat16_projection() == (has and bool(level))
            with _cstep.bfloat16_layer():
                assert _cstep._half_gemm() == (level if has else 0)
                with _cstep.rounded_recurrent_products():
                    assert _cstep._half_gemm() == (2 if has else 0)
            assert _cstep._half_gemm() == 0  # a float32 layer
    finally:
        rnn.use_bfloat16_projection(None)
    for bad in (1, "yes", 0.0):
        with pytest.raises(ValueError, match="must be True, False or None"):
            rnn.use_bfloat16_projection(bad)


@needs_half_gemm
@pytest.mark.parametrize(("steps", "batch", "hidden"), [(3, 20, 40), (2, 33, 23), (4, 16, 64)])
def test_amx_tiles_and_dot_products_agree(steps, batch, hidden):
    """The AMX tiles and the AVX512-BF16 dot products sum the same exact products in another
    order: a bfloat16 LN-LSTM training call with zoneout of h (its backward's recurrent product
    adds to the direct path: the tiles' accumulate) inside the rounded products, outputs and
    every gradient within a few bfloat16 roundings of each other over a few steps. Rows past a
    tile of 16 (20, 33), pairs past a block of 16 (K = 40, 23: 20 and 12 pairs), columns past a
    panel of 32 (4H = 160, 92)."""
    _skip_without_tiles()
    runs = []
    try:
        for on in (True, False):
            rnn.use_amx(on)
            torch.manual_seed(3)
            m = layernorm.LayerNormLSTM(30, hidden, zoneout_hidden=0.3).to(torch.bfloat16)
            x = torch.randn(steps, batch, 30, dtype=torch.float64).to(torch.bfloat16)
            dy = torch.randn(steps, batch, hidden, dtype=torch.float64).to(torch.bfloat16)
            torch.manual_seed(4)  # the same masks
            with layernorm.recurrent.bfloat16_recurrent_products():
                runs.append(_grads(m, x, None, dy))
    finally:
        rnn.use_amx(None)
    (out_a, grads_a), (out_b, grads_b) = runs
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert (out_a.double() - out_b.double()).abs().max() <= 4 * u * out_b.double().abs().max()
    for k, (a, b) in enumerate(zip(grads_a, grads_b, strict=True)):
        scale = b.double().abs().max()
        assert (a.double() - b.double()).abs().max() <= 8 * u * scale, k


def test_use_amx_takes_a_choice_and_stays_off_where_there_are_none():
    for bad in (1, "on", None.__class__):
        with pytest.raises(ValueError, match="must be True, False or None"):
            rnn.use_amx(bad)
    try:
        rnn.use_amx(False)
        assert not rnn.amx()
        rnn.use_amx(True)  # on where the processor has tiles, else it stays off
        assert rnn.amx() == (rnn.half_gemm() and "amx_bf16" in rnn.targets.cpu_features())
    finally:
        rnn.use_amx(None)


# --- small inference calls by the layer's float32 twin (layers._HalfTwin) ---------------------


def _half_calls(m, x, hx, monkeypatch):
    """``m``'s results on ``(x, hx)`` under ``no_grad`` by its float32 twin and by the half path
    (the twin's row limit set to zero), the twin used."""
    with torch.no_grad():
        twin_result = m(x, hx)
        twin = layers._HALF_TWINS.get(m)
        monkeypatch.setattr(layers, "_HALF_TWIN_MAX_ROWS", 0)
        half_result = m(x, hx)
        monkeypatch.undo()
    return twin_result, half_result, twin


def _flat(result):
    out, state = result
    return [out, *(state if isinstance(state, tuple) else (state,))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "options",
    [{}, {"num_layers": 2, "bidirectional": True}, {"batch_first": True}, {"norm": "none"},
     {"bias": False}],
    ids=["one layer", "two layers, both directions", "batch first", "no layer norms",
         "no biases"],
)  # fmt: skip
@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_small_half_inference_calls_run_the_float32_twin(cls, options, dtype, monkeypatch):
    """A half-precision inference call of few rows runs the layer's float32 twin: results in the
    input's dtype, within the half path's error model of float64 on the same values (float32
    arithmetic, one rounding), and within one rounding of the half path itself (the input
    products summed in another order; of two layers the first's output rounded before the
    second takes it, as the half path does); the twin's second call by its kept plans."""
    torch.manual_seed(0)
    m = cls(16, 24, **options).to(dtype).eval()
    layers_dirs = m.num_layers * m.num_directions
    shape = (2, 3, 16) if options.get("batch_first") else (3, 2, 16)
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    h0 = (0.5 * torch.randn(layers_dirs, 2, 24, dtype=torch.float64)).to(dtype)
    hx = (h0, h0.flip(-1)) if cls is layernorm.LayerNormLSTM else h0
    ref = copy.deepcopy(m).double()
    ref.impl = "loop"
    u = UNIT_ROUNDOFF[dtype]
    for state in (None, hx):
        got, half, twin = _half_calls(m, x, state, monkeypatch)
        assert twin is not None
        with torch.no_grad():
            want = ref(x.double(), None if state is None else _double(state))
        for a, h, r in zip(_flat(got), _flat(half), _flat(want), strict=True):
            assert a.dtype == dtype and a.shape == r.shape
            assert (a.double() - r).abs().max() <= 4 * u * r.abs().max()
            assert (a.double() - h.double()).abs().max() <= 2 * u * h.double().abs().max()
    if (
        _cstep.available(torch.zeros(1)) and _cstep.sequence_gemm()
    ):  # plans run the sequence kernels
        assert layers._CALL_PLANS.get(twin.module) is not None  # kept by the twin's calls


def _one_step_case(cls, options, rows, dtype=torch.bfloat16):
    """A layer of ``cls`` in ``dtype`` with ``options``, one step of ``rows`` rows and a random
    initial state."""
    torch.manual_seed(1)
    m = cls(16, 24, **options).to(dtype).eval()
    shape = (rows, 1, 16) if options.get("batch_first") else (1, rows, 16)
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    h0 = (0.5 * torch.randn(m.num_layers * m.num_directions, rows, 24)).to(dtype)
    return m, x, ((h0, h0.flip(-1)) if cls is layernorm.LayerNormLSTM else h0)


needs_mkl_half_gemm = pytest.mark.skipif(
    not (rnn.half_gemm() and rnn.torch_half_gemm()),
    reason="needs MKL's gemm_bf16bf16f32 and a target with bfloat16 dot products (AVX512-BF16)",
)


@needs_sequence_kernels
@pytest.mark.parametrize("choice", ["mkl", "packed", "no bfloat16 dot products"])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize(
    "options",
    [{}, {"num_layers": 2, "bidirectional": True}, {"batch_first": True}, {"bias": False}],
    ids=["one layer", "two layers, both directions", "batch first", "no biases"],
)
@pytest.mark.parametrize("cls", LAYERS[:2], ids=lambda c: c.__name__)
def test_one_step_bfloat16_calls_read_the_weights_as_stored(
    cls, options, rows, choice, monkeypatch
):
    """A bfloat16 layer's one-step inference call multiplies by W_ih and W_hh as the layer
    stores them where MKL's bfloat16 GEMM serves it: from the twin's planned call (its third) on,
    its float32 copies of them are not made, nor read (set to NaN, the results are the first
    call's, bit for bit). With ``use_one_step_gemm("packed")``, or on a target without bfloat16
    dot products (where MKL's bfloat16 GEMM is slower than the copy), the copies are made and
    read. The results are within the half path's error model of float64 either way; an in-place
    update of a weight shows in the next call; a call the twin's plan does not serve (two steps)
    copies the weights again."""
    if choice == "mkl" and not (rnn.half_gemm() and rnn.torch_half_gemm()):
        pytest.skip("needs MKL's gemm_bf16bf16f32 and a target with bfloat16 dot products")
    if choice == "no bfloat16 dot products":
        monkeypatch.setattr(rnn, "half_gemm", lambda: False)
    m, x, hx = _one_step_case(cls, options, rows)
    ref = copy.deepcopy(m).double()
    ref.impl = "loop"
    u = UNIT_ROUNDOFF[torch.bfloat16]
    try:
        rnn.use_one_step_gemm("packed" if choice == "packed" else "mkl")
        with torch.no_grad():
            first = _flat(m(x, hx))  # the plans kept
            assert all(torch.equal(a, b) for a, b in zip(_flat(m(x, hx)), first, strict=True))
            twin = layers._HALF_TWINS.get(m)  # the planned call kept
            assert twin is not None
            if choice != "mkl":
                assert twin.as_stored[0] is None
            else:  # ... and taken as reading the weights as stored
                assert twin.as_stored[0] is not None
                for copy_ in twin.weight_shadows:
                    copy_.fill_(float("nan"))
                again = _flat(m(x, hx))
                assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
            want = _flat(ref(x.double(), _double(hx)))
            for a, r in zip(first, want, strict=True):
                assert (a.double() - r).abs().max() <= 4 * u * r.abs().max()
            m.weight_hh_l0.mul_(-1)
            ref.weight_hh_l0.mul_(-1)
            updated = _flat(m(x, hx))
            want = _flat(ref(x.double(), _double(hx)))
            assert not torch.equal(updated[0], first[0])
            for a, r in zip(updated, want, strict=True):
                assert (a.double() - r).abs().max() <= 4 * u * r.abs().max()
            two = torch.cat((x, x.flip(-1)), dim=1 if options.get("batch_first") else 0)
            want = _flat(ref(two.double(), _double(hx)))
            for _ in range(3):  # (the second and third by the twin's plans of two steps)
                got = _flat(m(two, hx))
                for a, r in zip(got, want, strict=True):
                    assert (a.double() - r).abs().max() <= 4 * u * r.abs().max()
            assert twin.as_stored[0] is None  # the planned call of two steps reads the copies
    finally:
        rnn.use_one_step_gemm(None)


@pytest.fixture
def half_gemm_calls():
    """The selected library's calls of MKL's bfloat16 GEMM, counted (one_step_gemm_calls)."""
    with one_step_gemm_calls("half") as calls:
        yield calls


@needs_sequence_kernels
@needs_mkl_half_gemm
@pytest.mark.parametrize("cls", LAYERS[:2], ids=lambda c: c.__name__)
def test_one_step_bfloat16_products_run_on_mkls_bfloat16_gemm(half_gemm_calls, cls):
    """Each direction's one step makes two calls of MKL's bfloat16 GEMM (x · W_ihᵀ, h · W_hhᵀ),
    from the twin's first call on; with ``use_one_step_gemm("packed")``, none (the weights are
    widened for the call); two steps, none."""
    m, x, hx = _one_step_case(cls, {"num_layers": 2, "bidirectional": True}, 5)
    directions = m.num_layers * m.num_directions
    with torch.no_grad():
        for k in range(3):
            m(x, hx)
            assert half_gemm_calls[0] == 2 * directions * (k + 1)
        rnn.use_one_step_gemm("packed")
        m(x, hx)
        m(torch.cat((x, x)), hx)
    assert half_gemm_calls[0] == 6 * directions


def _poisoned_twin(m, one_step: bool = True):
    """``m``'s bfloat16 twin, made now, its copies of W_ih and W_hh set to NaN."""
    twin = m._half_twin(torch.bfloat16, one_step)
    assert twin is not None
    for copy_ in twin.weight_shadows:
        copy_.fill_(float("nan"))
    return twin


@needs_sequence_kernels
@needs_mkl_half_gemm
@pytest.mark.parametrize("cls", LAYERS[:2], ids=lambda c: c.__name__)
def test_one_step_bfloat16_calls_never_copy_the_weights(cls, monkeypatch):
    """A one-step call runs first without copying W_ih and W_hh into the twin (its copies NaN
    from the twin's making on): every call's results are finite, within the half path's error
    model of float64 and the same as a layer's whose twin copies them (``packed``); a call of
    two steps copies them."""
    m, x, hx = _one_step_case(cls, {"num_layers": 2, "bidirectional": True}, 3)
    twin = _poisoned_twin(m)
    with torch.no_grad():
        got = [_flat(m(x, hx)) for _ in range(3)]
        assert twin.speculate[0] == layers._SPECULATION_TRIES and twin.as_stored[0] is not None
        monkeypatch.setattr(layers, "_HALF_TWINS", type(layers._HALF_TWINS)())
        rnn.use_one_step_gemm("packed")
        try:
            copied = _flat(m(x, hx))
        finally:
            rnn.use_one_step_gemm(None)
        ref = copy.deepcopy(m).double()
        want = _flat(ref(x.double(), _double(hx)))
    u = UNIT_ROUNDOFF[torch.bfloat16]
    for run in got:
        for a, c, r in zip(run, copied, want, strict=True):
            assert a.isfinite().all()
            assert (a.double() - r).abs().max() <= 4 * u * r.abs().max()
            assert (a.double() - c.double()).abs().max() <= 2 * u * c.double().abs().max()


@needs_sequence_kernels
@needs_mkl_half_gemm
@pytest.mark.parametrize("lean", [False, True], ids=["twin", "lean twin"])
def test_a_one_step_call_whose_kernels_read_a_copy_runs_again_with_the_copies(monkeypatch, lean):
    """Where a one-step call's kernels did not all take the weights as stored (here made so, by
    a fresh twin whose plans are made again), its result is dropped and the call runs again with
    every parameter copied (a lean twin's by the half path): the results are right. After
    ``_SPECULATION_TRIES`` such calls in a row the twin stops trying; one call served as stored
    in between gives it every try again."""
    if lean:
        monkeypatch.setattr(layers, "_HALF_TWIN_MAX_BYTES", 4 * 100)
    m, x, hx = _one_step_case(layernorm.LayerNormGRU, {}, 3)
    want = _flat(copy.deepcopy(m).double()(x.double(), _double(hx)))
    u = UNIT_ROUNDOFF[torch.bfloat16]
    tries = layers._SPECULATION_TRIES

    def call(fails: bool):
        with monkeypatch.context() as patch:
            if fails:
                patch.setattr(_cstep, "_found_half_weights", lambda *args: {})
            with torch.no_grad():
                got = _flat(m(x, hx))
        for a, r in zip(got, want, strict=True):
            assert (a.double() - r).abs().max() <= 4 * u * r.abs().max()
        for plans in (layers._CALL_PLANS, layers._INFERENCE_PLANS):  # made again next call
            plans.pop(twin.module, None)

    twin = _poisoned_twin(m)
    assert twin.lean == lean
    call(fails=True)
    assert twin.speculate[0] == tries - 1 and twin.as_stored[0] is None
    call(fails=False)
    assert twin.speculate[0] == tries
    for k in range(tries):
        call(fails=True)
        assert twin.speculate[0] == tries - 1 - k
    call(fails=False)  # no try left: copied (a lean twin: the half path)
    assert twin.speculate[0] == 0


@needs_sequence_kernels
@needs_mkl_half_gemm
@pytest.mark.parametrize("cls", LAYERS[:2], ids=lambda c: c.__name__)
def test_a_layer_past_the_twins_size_gets_a_lean_twin_for_one_step_calls(cls, monkeypatch):
    """Past ``_HALF_TWIN_MAX_BYTES`` a layer's one-step calls run a lean twin, which never
    writes its copies of W_ih and W_hh (NaN here: results finite and right); its other calls
    take the half path."""
    monkeypatch.setattr(layers, "_HALF_TWIN_MAX_BYTES", 4 * 100)
    m, x, hx = _one_step_case(cls, {}, 3)
    assert m._half_twin(torch.bfloat16, False) is None  # not for a call of more steps
    twin = _poisoned_twin(m)
    assert twin.lean
    two = torch.cat((x, x.flip(-1)))
    ref = copy.deepcopy(m).double()
    u = UNIT_ROUNDOFF[torch.bfloat16]
    with torch.no_grad():
        for inp in (x, x, x, two, x):
            got = _flat(m(inp, hx))
            want = _flat(ref(inp.double(), _double(hx)))
            for a, r in zip(got, want, strict=True):
                assert (a.double() - r).abs().max() <= 4 * u * r.abs().max()
    assert layers._HALF_TWINS.get(m) is twin and twin.as_stored[0] is not None


@pytest.mark.parametrize("cls", LAYERS[:2], ids=lambda c: c.__name__)
def test_one_step_calls_with_a_weight_not_contiguous(cls):
    """A weight registered as a transposed view (not contiguous) is copied into the twin, as
    before, where the kernels cannot read it as stored: the results are the layer's."""
    m, x, hx = _one_step_case(cls, {}, 3)
    w = m.weight_hh_l0
    m.register_parameter("weight_hh_l0", torch.nn.Parameter(w.detach().t().contiguous().t()))
    assert not m.weight_hh_l0.is_contiguous()
    ref = copy.deepcopy(m).double()
    u = UNIT_ROUNDOFF[torch.bfloat16]
    with torch.no_grad():
        for _ in range(3):
            got = _flat(m(x, hx))
        want = _flat(ref(x.double(), _double(hx)))
    assert layers._HALF_TWINS.get(m).as_stored[0] is None
    for a, r in zip(got, want, strict=True):
        assert (a.double() - r).abs().max() <= 4 * u * r.abs().max()


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_one_step_calls_of_other_layers_copy_every_weight(cls):
    """A float16 layer's twin and the Elman RNN's (which projects its input before the kernel)
    read their weights' float32 copies, made on every call: their one-step results are within
    the half path's error model of float64, and no twin plan is taken as reading the weights as
    stored."""
    half = (torch.float16, torch.bfloat16)
    for dtype in half if cls is layernorm.LayerNormRNN else half[:1]:
        m, x, hx = _one_step_case(cls, {}, 3, dtype)
        ref = copy.deepcopy(m).double()
        u = UNIT_ROUNDOFF[dtype]
        with torch.no_grad():
            for _ in range(2):
                got = _flat(m(x, hx))
            want = _flat(ref(x.double(), _double(hx)))
        twin = layers._HALF_TWINS.get(m)
        assert twin is not None and twin.as_stored[0] is None
        for a, r in zip(got, want, strict=True):
            assert (a.double() - r).abs().max() <= 4 * u * r.abs().max()


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_the_half_twin_reads_the_parameters_as_they_are_now(cls, monkeypatch):
    """Every call copies the parameters into the twin: a write through ``.data`` (which keeps
    the version counter), an update under ``no_grad``, a parameter registered in another's
    place, and a setting written (``eps``) all show in the next call, as in the half path's."""
    torch.manual_seed(0)
    m = cls(8, 12).to(torch.bfloat16)
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    name = "weight_hh_l0"

    def updates():
        yield lambda: getattr(m, name).data.mul_(1.5)
        yield lambda: getattr(m, name).add_(0.25)
        # (not through __setattr__, which counts a new setting: the twin's key holds identities)
        yield lambda: m.register_parameter(name, torch.nn.Parameter(getattr(m, name).flip(0)))
        yield lambda: setattr(m, "eps", 0.5)

    before = None
    for update in updates():
        with torch.no_grad():
            update()
        got, half, twin = _half_calls(m, x, None, monkeypatch)
        assert twin is not None
        u = UNIT_ROUNDOFF[torch.bfloat16]
        for a, h in zip(_flat(got), _flat(half), strict=True):
            assert (a.double() - h.double()).abs().max() <= 2 * u * h.double().abs().max()
        assert before is None or not torch.equal(got[0], before)
        before = got[0]


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_the_half_twin_made_in_inference_mode_serves_no_grad_calls(cls):
    """A twin made under ``torch.inference_mode()`` takes the parameters again under
    ``no_grad`` (its float32 copies are not inference tensors, which only inference mode may
    write), with the same results."""
    torch.manual_seed(0)
    m = cls(8, 12).to(torch.bfloat16)
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    with torch.inference_mode():
        first = m(x)[0]
    with torch.no_grad():
        again = m(x)[0]
    assert torch.equal(first, again)


def test_the_half_twin_keeps_its_copies_on_the_cpu_whatever_the_default_device():
    """A twin made under another default device (``with torch.device("meta")``) keeps its
    float32 parameters on the CPU, where the layer's are."""
    torch.manual_seed(0)
    m = layernorm.LayerNormGRU(8, 12).to(torch.bfloat16)
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    with torch.no_grad():
        want = m(x)[0]
        layers._HALF_TWINS.pop(m)
        with torch.device("meta"):
            got = m(x)[0]
    assert got.device.type == "cpu" and torch.equal(got, want)


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_no_half_twin_where_the_call_is_not_a_small_plain_inference(cls, monkeypatch):
    """No twin with gradients, past ``_HALF_TWIN_MAX_ROWS`` rows, inside the rounded recurrent
    products' block, for a layer past ``_HALF_TWIN_MAX_BYTES``, or with a state of another
    dtype (the half path then names it, as before)."""
    torch.manual_seed(0)
    m = cls(8, 12).to(torch.bfloat16)
    small = torch.randn(2, 3, 8).to(torch.bfloat16)
    m(small)  # gradients on
    with torch.no_grad():
        m(torch.randn(layers._HALF_TWIN_MAX_ROWS + 1, 1, 8).to(torch.bfloat16))
        with layernorm.recurrent.bfloat16_recurrent_products():
            m(small)
        monkeypatch.setattr(layers, "_HALF_TWIN_MAX_BYTES", 4 * 100)
        m(small)
        monkeypatch.undo()
        assert layers._HALF_TWINS.get(m) is None
        h0 = torch.zeros(1, 3, 12)  # float32 state, bfloat16 input
        with pytest.raises(TypeError):
            m(small, (h0, h0) if cls is layernorm.LayerNormLSTM else h0)
        assert layers._HALF_TWINS.get(m) is None
        m(small)
    assert layers._HALF_TWINS.get(m) is not None
