"""The C++ operators of :mod:`layernorm.kernels.cpu.torch_ops` (``csrc_torch/norm_ops.cpp``).

They call the same kernels as the ops' Python path (the autograd.Function of :mod:`layernorm.ops`),
so every result, forward and backward, must be those bits (the Python path's accuracy against the
float64 reference is tested elsewhere, on every target); a double backward and a batched backward
must be the reference's, as the Python path's are; a wrong argument must be refused with a message
naming what was expected and what came; and the ops must take the operators exactly where
:func:`~layernorm.kernels.cpu.torch_ops.takes` says.
"""

from __future__ import annotations

import os

import pytest
import torch

import layernorm
import layernorm.functional as LF
from conftest import make_param, make_x
from layernorm.kernels.cpu import buffers, cbuild, targets, torch_ops
from layernorm.ops import _dispatch as dispatch

AVAILABLE = cbuild.cxx_compiler() is not None and torch_ops.enabled()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason="no C++ compiler: the Python path only")

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = [(1, 8), (3, 768), (37, 7), (5, 1), (0, 16), (16, 1031)]
OPS = torch.ops.layernorm_cpu if AVAILABLE else None


def _norm(kind: str, x, w, b):
    """The op of ``kind`` through the functional API (which routes small calls to C++)."""
    n = x.shape[-1]
    if kind == "layer_norm":
        return LF.layer_norm(x, (n,), w, b)
    if kind == "detach_mean":
        return LF.layer_norm(x, (n,), w, b, detach_mean=True)
    if kind == "detach_std":
        return LF.layer_norm(x, (n,), w, b, detach_std=True)
    if kind == "detach_both":
        return LF.layer_norm(x, (n,), w, b, detach_mean=True, detach_std=True)
    if kind == "rms_norm":
        return LF.rms_norm(x, (n,), w, 1e-6)
    assert kind == "ada_norm"
    return LF.ada_norm(x, (n,), 0.3, 1.5)


KINDS = ["layer_norm", "detach_mean", "detach_std", "detach_both", "rms_norm", "ada_norm"]
HAS_BIAS = {"rms_norm": False, "ada_norm": False}
HAS_GAIN = {"ada_norm": False}


def _inputs(kind, shape, dtype, param_dtype, affine):
    x = make_x(shape, dtype, requires_grad=True)
    n = shape[-1]
    gain = affine and HAS_GAIN.get(kind, True)
    bias = affine and HAS_BIAS.get(kind, True)
    w = make_param((n,), param_dtype, center=1.0, requires_grad=True) if gain else None
    b = make_param((n,), param_dtype, center=0.0, requires_grad=True) if bias else None
    return x, w, b


def _run(kind, x, w, b, dy):
    leaves = [t for t in (x, w, b) if t is not None]
    y = _norm(kind, x, w, b)
    grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return y, grads


def _node(y) -> str:
    """The name of ``y``'s autograd node: ``CppNode<...NormFn>`` for the C++ operators' nodes."""
    return y.grad_fn.name() if y.grad_fn is not None else "None"


def _cpp(y) -> bool:
    return _node(y).endswith("NormFn>")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_operators_give_the_python_paths_bits(kind, dtype, shape, affine, threads, monkeypatch):
    """Forward and every gradient, bit for bit the autograd.Function's on the same kernels."""
    torch.set_num_threads(threads)
    try:
        x, w, b = _inputs(kind, shape, dtype, dtype, affine)
        dy = make_x(shape, dtype, offset=0.5)
        y, grads = _run(kind, x, w, b, dy)
        assert _cpp(y), _node(y)
        monkeypatch.setitem(torch_ops._switch, "on", False)
        y_py, grads_py = _run(kind, x, w, b, dy)
        assert not _cpp(y_py), _node(y_py)
    finally:
        torch.set_num_threads(1)
    assert y.dtype == y_py.dtype and torch.equal(y, y_py)
    for g, g_py in zip(grads, grads_py, strict=True):
        assert g.dtype == g_py.dtype and torch.equal(g, g_py)


@pytest.mark.parametrize("shape", [(24,), (2, 3, 24), (2, 1, 2, 24)], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_any_rank_is_rows_along_the_last_dimension(kind, shape):
    """x of one, three or four dimensions: the results of its 2-D rows, bit for bit, in x's
    shape (the operators take x as it is, no view between)."""
    x, w, b = _inputs(kind, shape, torch.float32, torch.float32, True)
    dy = make_x(shape, offset=0.5)
    y, grads = _run(kind, x, w, b, dy)
    assert _cpp(y) and y.shape == x.shape
    rows = x.detach().reshape(-1, shape[-1]).requires_grad_()
    y2, grads2 = _run(kind, rows, w, b, dy.reshape(-1, shape[-1]))
    assert torch.equal(y, y2.view(shape))
    assert torch.equal(grads[0], grads2[0].view(shape))
    for g, g2 in zip(grads[1:], grads2[1:], strict=True):
        assert torch.equal(g, g2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("gain_dtype", "bias_dtype"),
    [(torch.float32, torch.float32), ("x", torch.float32), (torch.float32, "x"), ("x", "x")],
    ids=str,
)
def test_half_inputs_with_every_parameter_dtype(dtype, gain_dtype, bias_dtype, monkeypatch):
    """Half x with float32 gains and biases, its own dtype, and the two mixed: the Python
    path's bits, each gradient in its parameter's dtype."""
    gd = dtype if gain_dtype == "x" else gain_dtype
    bd = dtype if bias_dtype == "x" else bias_dtype
    x = make_x((6, 40), dtype, requires_grad=True)
    w = make_param((40,), gd, center=1.0, requires_grad=True)
    b = make_param((40,), bd, center=0.0, requires_grad=True)
    dy = make_x((6, 40), dtype, offset=0.5)
    y, grads = _run("layer_norm", x, w, b, dy)
    assert _cpp(y)
    monkeypatch.setitem(torch_ops._switch, "on", False)
    y_py, grads_py = _run("layer_norm", x, w, b, dy)
    assert torch.equal(y, y_py)
    for g, g_py, t in zip(grads, grads_py, (x, w, b), strict=True):
        assert g.dtype == t.dtype and torch.equal(g, g_py)


@pytest.mark.parametrize("kind", KINDS)
def test_no_grad_and_inference_mode_forwards(kind):
    """Where nothing needs a gradient the operator runs the forward alone (no node), under
    no_grad and under inference_mode, with the autograd node's forward values."""
    x, w, b = _inputs(kind, (4, 24), torch.float32, torch.float32, True)
    y = _norm(kind, x, w, b)
    assert _cpp(y)
    with torch.no_grad():
        y0 = _norm(kind, x, w, b)
    with torch.inference_mode():
        y1 = _norm(kind, x.detach(), None if w is None else w.detach(),
                   None if b is None else b.detach())  # fmt: skip
    assert y0.grad_fn is None and torch.equal(y0, y.detach())
    assert torch.equal(y1, y.detach())


def _second_order(kind, x, w, b):
    """The gradients of the squared first-order gradients' sum: a double backward."""
    leaves = tuple(t for t in (x, w, b) if t is not None)
    y = _norm(kind, x, w, b)
    dy = torch.linspace(-1.0, 2.0, y.numel(), dtype=y.dtype).view(y.shape)
    grads = torch.autograd.grad(y, leaves, dy, create_graph=True)
    total = sum((g.double() ** 2).sum() for g in grads)
    return _node(y), torch.autograd.grad(total, leaves, allow_unused=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_double_backward_differentiates_the_reference(kind, dtype, monkeypatch):
    """create_graph=True: the operators' backward runs the reference's ops, as the Python path's
    does: the same second-order gradients (DetachNorm's and AdaNorm's first-order gradients are
    not the forward's derivative, so finite differences cannot check them)."""
    x, w, b = _inputs(kind, (3, 6), dtype, dtype, True)
    node, second = _second_order(kind, x, w, b)
    assert node.endswith("NormFn>"), node
    monkeypatch.setitem(torch_ops._switch, "on", False)
    node_py, second_py = _second_order(kind, x, w, b)
    assert not node_py.endswith("NormFn>")
    for g, g_py in zip(second, second_py, strict=True):
        assert (g is None and g_py is None) or torch.equal(g, g_py)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_gradgradcheck_through_the_node(kind):
    """The layer norm's and RMSNorm's first and second derivatives through the C++ node against
    finite differences, in float64."""
    x, w, b = _inputs(kind, (3, 6), torch.float64, torch.float64, True)
    leaves = tuple(t for t in (x, w, b) if t is not None)
    assert _cpp(_norm(kind, x, w, b))

    def fn(*args):
        return _norm(kind, *args, *([None] * (3 - len(args))))

    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


@pytest.mark.parametrize("kind", KINDS)
def test_batched_backward_equals_one_at_a_time(kind):
    """is_grads_batched=True hands the node a vmap-batched gradient, which the kernels cannot
    read: the reference's gradients, equal to one backward per gradient."""
    x, w, b = _inputs(kind, (3, 10), torch.float64, torch.float64, True)
    leaves = tuple(t for t in (x, w, b) if t is not None)
    y = _norm(kind, x, w, b)
    assert _cpp(y)
    vs = torch.randn(4, *y.shape, dtype=y.dtype)
    batched = torch.autograd.grad(y, leaves, vs, retain_graph=True, is_grads_batched=True)
    for i in range(vs.shape[0]):
        one = torch.autograd.grad(y, leaves, vs[i], retain_graph=True)
        for g, g1 in zip(batched, one, strict=True):
            torch.testing.assert_close(g[i], g1, rtol=1e-12, atol=1e-12)


def test_routes_by_size_and_switch(monkeypatch):
    """With gradients, calls take the C++ node below TRAINING_MAX_BYTES (here made 64 rows of
    1024 float32), the Python path from there; without, up to the buffer cache's output size
    (here 128 rows); every call the Python path with the operators switched off and with
    LAYERNORM_CPU_COMPILE=0."""
    n = 1024
    monkeypatch.setattr(torch_ops, "TRAINING_MAX_BYTES", 64 * n * 4)
    monkeypatch.setattr(buffers, "OUTPUT_MIN_BYTES", 128 * n * 4)
    small = make_x((4, n), requires_grad=True)
    large = make_x((64, n), requires_grad=True)
    assert _cpp(LF.layer_norm(small, (n,)))
    assert _node(LF.layer_norm(large, (n,))) == "_LayerNormEagerBackward"
    assert _cpp(LF.layer_norm(make_x((63, n), requires_grad=True), (n,)))
    assert not torch_ops.takes(large.detach(), True)
    assert torch_ops.takes(large[:63].detach(), True)
    assert torch_ops.takes(large.detach(), False)
    assert not torch_ops.takes(make_x((128, n)), False)
    monkeypatch.setitem(torch_ops._switch, "on", False)
    assert _node(LF.layer_norm(small, (n,))) == "_LayerNormEagerBackward"
    monkeypatch.setitem(torch_ops._switch, "on", True)
    monkeypatch.setenv("LAYERNORM_CPU_COMPILE", "0")
    assert not torch_ops.takes(small.detach(), True)


def _takes_node_composed(x, normalized_shape, eps, *params, grad=None):
    """What ``functional._takes_node`` writes out in one function, as the functions that state
    each rule: :func:`lean_input`, the shapes, :func:`needs_grad`, :func:`torch_ops.takes`."""
    n = normalized_shape
    if type(n) in (tuple, list, torch.Size) and len(n) == 1:
        n = n[0]
    lean = dispatch.aten_input(x, eps) and not dispatch.transformed()
    if type(n) is not int or n < 1 or not lean:
        return False
    if x.dim() == 0 or x.shape[-1] != n:
        return False
    plain = (torch.Tensor, torch.nn.Parameter)
    if any(p is not None and (type(p) not in plain or p.shape != (n,)) for p in params):
        return False
    if grad is None:
        grad = dispatch.needs_grad(x, *params)
    return torch_ops.takes(x, grad, *params)


def _takes_node_cases():
    """Calls of every kind _takes_node tells apart: x's type, dtype, shape, layout and size, the
    normalized shape's forms, eps's, each param's type, shape, dtype and layout, grad given or
    found."""
    x = make_x((3, 8))
    w, b = make_param((8,), torch.float32, center=1.0), make_param((8,), torch.float32, center=0.0)
    big = torch.zeros(torch_ops.TRAINING_MAX_BYTES // 4 // 8, 8)
    xs = [x, x.double(), x.bfloat16(), x.half(), x.int(), x.t().contiguous().t(), x[:, :4],
          x.requires_grad_(False).clone().requires_grad_(), torch.zeros(0, 8), torch.tensor(1.0),
          torch.nn.Parameter(x.clone()), big, big[:-1], "not a tensor"]  # fmt: skip
    shapes = [8, (8,), [8], torch.Size([8]), (3, 8), 0, 8.0, 4]
    epss = [1e-5, 0.0, float("inf"), float("nan"), 1]
    params = [(), (None, None), (w, b), (torch.nn.Parameter(w.clone()), b), (w[:4], b),
              (w.double(), b), (w.bfloat16(), None), (torch.stack([w, w], 1)[:, 0], b),
              (w.requires_grad_(False).clone().requires_grad_(), None), (1.0, b),
              (w.to("meta"), b)]  # fmt: skip
    for xi in xs:
        for n in shapes:
            for eps in epss:
                for ps in params:
                    for grad in (None, True, False):
                        yield xi, n, eps, ps, grad


def test_takes_node_is_the_composition_of_its_rules():
    """``functional._takes_node`` (every check in one function, for a per-token call's time)
    says yes exactly where the functions that state its rules do, with and without grad mode,
    under forward-mode AD, and with the operators or the kernels switched off."""
    checked = 0
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            for x, n, eps, ps, grad in _takes_node_cases():
                want = _takes_node_composed(x, n, eps, *ps, grad=grad)
                assert LF._takes_node(x, n, eps, *ps, grad=grad) is want, (x, n, eps, ps, grad)
                checked += want
    assert checked > 100  # the grid reaches the operators, not only refusals
    x = make_x((3, 8))
    assert LF._takes_node(x, 8, 1e-5)
    with torch.autograd.forward_ad.dual_level():
        assert not LF._takes_node(x, 8, 1e-5) and not _takes_node_composed(x, 8, 1e-5)
    with torch_ops.switched(False):
        assert not LF._takes_node(x, 8, 1e-5) and not _takes_node_composed(x, 8, 1e-5)


def test_lean_input_is_aten_input_untransformed():
    """``lean_input`` (aten_input's and transformed's checks in one expression) is their
    conjunction, outside any tracer and under forward-mode AD and a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = make_x((2, 4))
    cases = [(x, 1e-5), (x.double(), 1e-5), (x.int(), 1e-5), (x, 0.0), (x, 1), ("x", 1e-5)]
    for xi, eps in cases:
        want = dispatch.aten_input(xi, eps) and not dispatch.transformed()
        assert dispatch.lean_input(xi, eps) is want, (xi, eps)
    assert dispatch.lean_input(x, 1e-5)
    with torch.autograd.forward_ad.dual_level():
        assert not dispatch.lean_input(x, 1e-5)
    with Watching():
        assert not dispatch.lean_input(x, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(10, 32), (2, 5, 32)], ids=str)
def test_modules_take_the_operators(dtype, shape):
    """DetachNorm, AdaNorm and RMSNorm modules with gradients run the C++ nodes on x as it is
    (no view node between), LayerNorm too in bfloat16 (in float32 torch's kernel, whose node
    costs as little and whose call from the module less); LayerNorm without gradients torch's
    kernel."""
    x = make_x(shape, dtype, requires_grad=True)
    modules = (layernorm.LayerNorm(32), layernorm.LayerNorm(32, detach_mean=True),
               layernorm.AdaNorm(32), layernorm.RMSNorm(32))  # fmt: skip
    for module in modules:
        y = module.to(dtype)(x)
        assert y.shape == x.shape
        if module is modules[0] and dtype is torch.float32:
            assert _node(y) == "NativeLayerNormBackward0"
        else:
            assert _cpp(y), module
    with torch.no_grad():
        expected = torch.nn.functional.layer_norm(x, (32,), modules[0].weight, modules[0].bias)
        assert torch.equal(modules[0](x), expected)


def _runnable_targets() -> list[str]:
    return list(targets.available())


@pytest.mark.parametrize("name", _runnable_targets())
def test_operators_follow_the_selected_target(name, monkeypatch):
    """Inside targets.use(name) the operators call that target's kernels: the bits of the
    Python path there; after it, the default target's again."""
    x = make_x((7, 300), torch.bfloat16, requires_grad=True)
    w = make_param((300,), torch.bfloat16, center=1.0, requires_grad=True)
    dy = make_x((7, 300), torch.bfloat16, offset=0.5)
    with targets.use(name):
        y, g = _run("layer_norm", x, w, None, dy)
        monkeypatch.setitem(torch_ops._switch, "on", False)
        y_py, g_py = _run("layer_norm", x, w, None, dy)
        monkeypatch.setitem(torch_ops._switch, "on", True)
    assert torch.equal(y, y_py) and all(torch.equal(a, c) for a, c in zip(g, g_py, strict=True))
    assert torch_ops._state["target"] is targets.target(name)
    _run("layer_norm", x, w, None, dy)
    assert torch_ops._state["target"] is targets.selected()


# ------------------------------------------------------------------------------------------------
# The operators' own argument checks (they are public: torch.ops.layernorm_cpu.*)
# ------------------------------------------------------------------------------------------------

X = torch.ones(4, 8)


def _bad_calls():
    f64 = torch.ones(8, dtype=torch.float64)
    yield "0-D x", lambda: OPS.layer_norm(torch.tensor(1.0), None, None, 1e-5), "last dimension"
    yield "strided x", lambda: OPS.layer_norm(torch.ones(8, 4).t(), None, None, 1e-5), "contig"
    yield "int x", lambda: OPS.ada_norm(torch.ones(4, 8, dtype=torch.int32), 0.1, 1.0, 1e-5), "Int"
    yield "N = 0", lambda: OPS.layer_norm(torch.ones(4, 0), None, None, 1e-5), r"N >= 1"
    yield (
        "meta x",
        lambda: OPS.layer_norm(torch.ones(4, 8, device="meta"), None, None, 1e-5),
        "meta",
    )
    yield "short weight", lambda: OPS.layer_norm(X, torch.ones(7), None, 1e-5), "8 elements"
    yield "2-D bias", lambda: OPS.layer_norm(X, None, torch.ones(1, 8), 1e-5), "1-D"
    yield "float64 gain", lambda: OPS.rms_norm(X, f64, 1e-5), "Double"
    yield "strided gain", lambda: OPS.rms_norm(X, torch.ones(16)[::2], 1e-5), "contig"
    yield "eps 0", lambda: OPS.layer_norm(X, None, None, 0.0), "eps > 0"
    yield "eps nan", lambda: OPS.rms_norm(X, None, float("nan")), "eps > 0"
    yield "k inf", lambda: OPS.ada_norm(X, float("inf"), 1.0, 1e-5), "k to be finite"
    yield "scale nan", lambda: OPS.ada_norm(X, 0.1, float("nan"), 1e-5), "scale to be finite"
    yield "kernel name", lambda: OPS.set_kernel("ln_fwd_f8", 1), "no kernel named"
    yield "null kernel", lambda: OPS.set_kernel("ln_fwd_f32", 0), "null address"
    yield "grain", lambda: OPS.configure(0, 0), "grain >= 1"


@pytest.mark.parametrize(("what", "call", "message"), list(_bad_calls()) if AVAILABLE else [])
def test_bad_arguments_are_refused_by_name(what, call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def test_nan_rows_stay_nan():
    """A NaN in a row comes out as NaN in that row's outputs and gradients, never hidden."""
    x = make_x((3, 16))
    x[1, 5] = float("nan")
    x.requires_grad_()
    y = OPS.layer_norm(x, None, None, 1e-5)
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()
    assert g[1].isnan().all() and not g[[0, 2]].isnan().any()


def test_the_build_is_cached():
    """A second build finds the first one's library."""
    assert torch_ops.build() == torch_ops.build()


def test_environment_switch_is_read_at_import():
    """LAYERNORM_CPU_TORCH_OPS=0 keeps a process on the Python path; switched() changes it."""
    import subprocess
    import sys

    code = (
        "import torch, layernorm.functional as LF\n"
        "from layernorm.kernels.cpu import torch_ops\n"
        "x = torch.randn(2, 8, requires_grad=True)\n"
        # a Python Function's node has no name() on some PyTorch versions (2.11)
        "def node(y):\n"
        "    g = y.grad_fn\n"
        "    return type(g).__name__ if isinstance(g, torch.autograd.function.BackwardCFunction)"
        " else g.name()\n"
        "a = node(LF.layer_norm(x, 8))\n"
        "with torch_ops.switched(True):\n"
        "    b = node(LF.layer_norm(x, 8))\n"
        "print(torch_ops.enabled(), a, b, sep='|')\n"
    )
    env = {**os.environ, torch_ops.ENV_SWITCH: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    enabled, before, after = out.stdout.strip().split("|")
    assert enabled == "False" and not before.endswith("NormFn>") and after.endswith("NormFn>")
