"""torch.compile(fullgraph=True) traces the ops and modules in one graph, forward and backward.

Kept few: an Inductor compile costs ~10 s on a small CPU machine. The graph-break checks use
Dynamo alone (CompileCounter backend), the backward check AOTAutograd without code generation
(aot_eager), and a single test goes through Inductor end to end.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import layernorm
from conftest import make_x


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Net(torch.nn.Module):
    """Every norm of the library in one model, on inputs of rank 3 with a 2-D normalized shape."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(12, 12)
        self.ln = layernorm.LayerNorm(12)
        self.simple = layernorm.LayerNorm(12, elementwise_affine=False)
        self.detach = layernorm.LayerNorm((3, 12), detach_mean=True, detach_std=True)
        self.rms = layernorm.RMSNorm(12)
        self.ada = layernorm.AdaNorm(12, k=0.1, scale=2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.proj(x))
        h = self.simple(h) + self.detach(h)
        h = self.rms(h) * self.ada(h)
        w = self.ln.weight
        return (
            h
            + layernorm.layer_norm(h, 12, w, None, 1e-4, detach_std=True)
            + layernorm.rms_norm(h, (3, 12), eps=None)
            + layernorm.ada_norm(h, 12)
        )


def _eager_and_grads(model, x):
    x = x.detach().clone().requires_grad_()
    model.zero_grad()
    y = model(x)
    y.pow(2).sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


def test_no_graph_breaks():
    model = _Net()
    x = make_x((2, 3, 12))
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x))
    assert counter.frame_count == 1
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    # The custom ops stay opaque in the graph: each norm is one call, not a decomposition.
    assert counter.op_count > 0


def test_dynamic_batch_does_not_recompile():
    """The ops flatten to (M, N) before the custom op, so a symbolic M is all Dynamo sees."""
    counter = CompileCounter()

    def f(x):
        return layernorm.layer_norm(x, 12) + layernorm.rms_norm(x, 12) + layernorm.ada_norm(x, 12)

    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for m in (2, 5, 9):
        x = make_x((m, 4, 12))
        torch.testing.assert_close(compiled(x), f(x))
    assert counter.frame_count == 1


def test_forward_and_backward_under_aot_autograd():
    """fullgraph through AOTAutograd: the fake implementations give the right shapes and dtypes
    and the registered backward traces; gradients equal eager ones."""
    model = _Net().double()
    x = make_x((2, 3, 12), torch.float64)
    y_e, dx_e, dp_e = _eager_and_grads(model, x)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    y_c, dx_c, dp_c = _eager_and_grads(compiled, x)
    torch.testing.assert_close(y_c, y_e)
    torch.testing.assert_close(dx_c, dx_e)
    for a, b in zip(dp_c, dp_e, strict=True):
        torch.testing.assert_close(a, b)


def test_inductor_end_to_end_half_inputs():
    """One full Inductor compile, forward and backward, on bfloat16 activations with float32
    parameters (the mixed-precision case, where stats and parameter grads are float32)."""
    model = torch.nn.Sequential(torch.nn.Linear(12, 12), layernorm.LayerNorm(12), torch.nn.GELU(),
                                layernorm.RMSNorm(12))  # fmt: skip
    x = make_x((5, 12), torch.bfloat16)

    def run(m):
        xx = x.detach().clone().requires_grad_()
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xx)
        y.float().pow(2).sum().backward()
        return y, xx.grad, [p.grad.clone() for p in m.parameters()]

    y_e, dx_e, dp_e = run(model)
    y_c, dx_c, dp_c = run(torch.compile(model, fullgraph=True))
    assert y_c.dtype == y_e.dtype == torch.bfloat16
    # bfloat16 outputs: Inductor fuses the Linear/GELU differently, one or two bf16 ulps (2⁻⁸ rel.)
    torch.testing.assert_close(y_c.float(), y_e.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(dx_c.float(), dx_e.float(), atol=5e-2, rtol=3e-2)
    for a, b in zip(dp_c, dp_e, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=0.1, rtol=3e-2)


@pytest.mark.parametrize(
    ("dtype", "wdtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)], ids=str
)
def test_fake_implementations_agree_with_kernels(dtype, wdtype):
    """torch.library.opcheck: schema, fake tensors (shapes, dtypes, devices) and, for the forward
    ops, the autograd registration and AOT dispatch, against the real kernels."""
    from torch.library import opcheck

    ops = torch.ops.layernorm
    x = make_x((4, 9), dtype).requires_grad_()
    w = torch.randn(9, dtype=wdtype, requires_grad=True)
    b = torch.randn(9, dtype=wdtype, requires_grad=True)
    opcheck(ops.layer_norm_fwd.default, (x, w, b, 1e-5, False, True))
    opcheck(ops.rms_norm_fwd.default, (x, w, 1e-5))
    opcheck(ops.ada_norm_fwd.default, (x, 0.1, 2.0, 1e-5))
    fake_only = ("test_schema", "test_faketensor")
    with torch.no_grad():
        _, mean, rstd = ops.layer_norm_fwd(x, w, b, 1e-5)
        dy = torch.randn_like(x)
        t, f = True, False
        needs = [(t, t, t), (t, f, f), (f, t, f), (f, f, t)]
        for need in needs:
            args = (dy, x, mean, rstd, w, True, False, *need)
            opcheck(ops.layer_norm_bwd.default, args, test_utils=fake_only)
        opcheck(ops.rms_norm_bwd.default, (dy, x, rstd, w, True, True), test_utils=fake_only)
        opcheck(ops.ada_norm_bwd.default, (dy, x, mean, rstd, 0.1, 2.0), test_utils=fake_only)
        # statistics are kept in float32 for half inputs
        assert mean.dtype == rstd.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)


# Other tracers and transforms on the sequence layers: the fused path (raw pointers, preallocated
# buffers, autograd.Functions without functorch support) steps aside and the step-by-step loop runs.
_RNN_KINDS = ["LSTM", "GRU", "RNN"]


def _rnn(kind: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(layernorm, f"LayerNorm{kind}")(3, 4, num_layers=2, bidirectional=True, **kw)


@pytest.mark.parametrize("kind", _RNN_KINDS)
def test_sequence_layers_under_jit_trace(kind):
    # the fused path under torch.jit.trace used to crash the interpreter (segmentation fault);
    # saving and loading the trace: test_jit_trace.py
    model = _rnn(kind)
    x = make_x((5, 2, 3), torch.float32)
    traced = torch.jit.trace(model, x, check_trace=False)
    torch.testing.assert_close(traced(x)[0], model(x)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", _RNN_KINDS)
def test_sequence_layers_under_torch_func(kind):
    model = _rnn(kind, dtype=torch.float64)
    x = make_x((5, 2, 3), torch.float64)
    params = dict(model.named_parameters())

    def loss(p, x):
        out, _ = torch.func.functional_call(model, p, (x,))
        return (out**2).sum()

    grads = torch.func.grad(loss)(params, x)
    expected = torch.autograd.grad(loss(params, x), list(params.values()))
    for (name, g), e in zip(grads.items(), expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10, msg=name)
    # vmap over a batch of sequences, each unbatched (T, I)
    out = torch.func.vmap(lambda s: model(s)[0], in_dims=1, out_dims=1)(x)
    torch.testing.assert_close(out, model(x)[0], atol=1e-10, rtol=1e-10)
    # jacfwd (forward mode) agrees with jacrev
    jf = torch.func.jacfwd(lambda s: model(s)[0])(x[:, 0])
    jr = torch.func.jacrev(lambda s: model(s)[0])(x[:, 0])
    torch.testing.assert_close(jf, jr, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", _RNN_KINDS)
def test_sequence_layers_under_cpu_autocast(kind):
    # the fused LSTM/RNN path used to fail on autocast's bfloat16 projections
    model = _rnn(kind)
    x = make_x((5, 2, 3), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = model(x)
    torch.testing.assert_close(out.float(), model(x)[0], atol=0.1, rtol=0.1)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


@pytest.mark.parametrize(
    "make",
    [
        lambda: layernorm.LayerNorm(4),
        lambda: layernorm.RMSNorm(4),
        lambda: layernorm.AdaNorm(4),
        lambda: layernorm.BatchNorm(4),
        lambda: layernorm.LayerNormLSTM(4, 4),
        lambda: layernorm.LayerNormGRUCell(4, 4),
        lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), layernorm.LayerNorm(4)),
    ],
    ids=["LayerNorm", "RMSNorm", "AdaNorm", "BatchNorm", "LayerNormLSTM", "GRUCell", "nested"],
)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_jit_script_says_what_to_use_instead(make):
    # TorchScript cannot compile the modules; the error names the module and the alternatives
    # (it used to be "Unknown type annotation: 'nn.Parameter | None'")
    with pytest.raises(TypeError, match=r"cannot be compiled by torch.jit.script.*torch.compile"):
        torch.jit.script(make())


def test_jit_trace_of_the_norms():
    model = _Net()
    x = make_x((2, 3, 12), torch.float32)
    traced = torch.jit.trace(model, x, check_trace=False)
    torch.testing.assert_close(traced(x), model(x))


def test_compiled_torch_func_grad():
    # torch.compile(torch.func.grad(f)): Dynamo traces the transform, the ops trace their
    # reference into the graph (the custom op failed there on a GradTrackingTensor)
    model = _Net()
    x = make_x((2, 3, 12), torch.float32)
    grad = torch.func.grad(lambda x: model(x).pow(2).sum())
    counter = CompileCounter()
    got = torch.compile(grad, backend=counter, fullgraph=True)(x)
    torch.testing.assert_close(got, grad(x), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("kind", _RNN_KINDS)
def test_sequence_layers_export_with_a_dynamic_batch(kind):
    model = getattr(layernorm, f"LayerNorm{kind}")(3, 4, batch_first=True)
    x = make_x((4, 5, 3), torch.float32)
    batch = torch.export.Dim("batch")
    exported = torch.export.export(model, (x,), dynamic_shapes=({0: batch},)).module()
    x7 = make_x((7, 5, 3), torch.float32)
    torch.testing.assert_close(exported(x7)[0], model(x7)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", _RNN_KINDS)
def test_recurrent_layers_take_autocast_activations(kind):
    # under autocast an nn.Linear hands a bfloat16 activation to float32 weights, as torch's RNNs
    # accept; outside autocast that mix stays a TypeError
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    layer = _rnn(kind)
    cell = getattr(layernorm, f"LayerNorm{kind}Cell")(3, 4)
    x = make_x((5, 2, 3), torch.float32)
    h = torch.zeros(4, 2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = lin(x)
        assert a.dtype == torch.bfloat16
        out, _ = layer(a, (h, h) if kind == "LSTM" else h)
        c_out = cell(a[0])
    c_out = c_out[0] if kind == "LSTM" else c_out
    ref = layer(lin(x))[0]
    c_ref = cell(lin(x[0]))
    c_ref = c_ref[0] if kind == "LSTM" else c_ref
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.1)
    torch.testing.assert_close(c_out.float(), c_ref, atol=0.1, rtol=0.1)
    with pytest.raises(TypeError, match=r"input has dtype torch\.bfloat16 but the weights are"):
        layer(x.bfloat16())
