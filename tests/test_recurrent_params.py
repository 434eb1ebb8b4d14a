"""Parameters replaced after construction (``load_state_dict(..., assign=True)``, attribute
assignment) reach the fused path's C kernels as raw pointers: each is checked first.

A normalization gain or bias in another floating dtype gives the fused path the same result as
the step-by-step loop (both compute with it in the input's dtype); a parameter of the wrong shape,
kind or device is refused with an error naming it, on both paths. The wrong-shape cases once read
out of bounds in C (finite garbage, or a crash), so they run in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN

LAYERS = {"RNN": LayerNormRNN, "LSTM": LayerNormLSTM, "GRU": LayerNormGRU}
LN_NAMES = {
    "RNN": ("ln_weight_l0", "ln_bias_l0"),
    "LSTM": ("ln_weight_ih_l0", "ln_bias_ih_l0", "ln_weight_hh_l0", "ln_bias_hh_l0",
             "ln_weight_c_l0", "ln_bias_c_l0"),
    "GRU": ("ln_weight_ih_l0", "ln_bias_ih_l0", "ln_weight_hh_l0", "ln_bias_hh_l0"),
}  # fmt: skip
TORCH_NAMES = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")
LN_CASES = [(kind, name) for kind, names in LN_NAMES.items() for name in names]
ALL_CASES = [(kind, name) for kind, names in LN_NAMES.items() for name in TORCH_NAMES + names]
# Against a float64 run with the same parameter values: float32 results to float32 rounding over
# a few steps, a bfloat16 parameter's gradient to its last bit or two (2⁻⁸ relative each).
TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5}, torch.float64: {"rtol": 1e-4, "atol": 1e-5},
       torch.bfloat16: {"rtol": 8e-3, "atol": 1e-5}}  # fmt: skip


def _model(kind: str, impl: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LAYERS[kind](4, 5, impl=impl)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.3 * torch.randn_like(p)
            p.copy_(1.0 + noise if "ln_weight" in name else noise)
    return model


def _run(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Output, final states and the gradients of the input and of every parameter."""
    x = x.detach().clone().requires_grad_()
    out, h_n = model(x)
    states = h_n if isinstance(h_n, tuple) else (h_n,)
    weights = torch.linspace(-1, 2, out.numel()).view_as(out)
    ((out * weights).sum() + sum((s * s).sum() for s in states)).backward()
    grads = [x.grad, *(p.grad for p in model.parameters())]
    return [out.detach(), *(s.detach() for s in states), *grads]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize(("kind", "name"), LN_CASES)
def test_norm_parameter_in_another_dtype_gives_the_loops_result(kind, name, dtype) -> None:
    """Forward equal to the loop's; every gradient equal to a float64 loop's with the same values
    (in the parameter's dtype: the loop's, summed over steps in bfloat16, is rounded more)."""
    x = 0.5 + torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(1))
    runs = {}
    for impl in ("fused", "loop"):
        model = _model(kind, impl)
        state = model.state_dict()
        state[name] = state[name].to(dtype)
        model.load_state_dict(state, assign=True)
        assert getattr(model, name).dtype == dtype
        runs[impl] = _run(model, x)
    ref_model = _model(kind, "loop").double()
    getattr(ref_model, name).data = getattr(model, name).detach().double()
    ref = _run(ref_model, x.double())
    n_out = 2 if kind != "LSTM" else 3
    for a, b in zip(runs["fused"][:n_out], runs["loop"][:n_out], strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    for a, b, r in zip(runs["fused"], runs["loop"], ref, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, r.to(a.dtype), **TOL[a.dtype])


_SUBPROCESS = textwrap.dedent(
    """
    import json, sys
    import torch
    from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
    layers = {"RNN": LayerNormRNN, "LSTM": LayerNormLSTM, "GRU": LayerNormGRU}
    x = torch.randn(6, 3, 4)
    for kind, name, impl, wrong in json.loads(sys.argv[1]):
        model = layers[kind](4, 5, impl=impl)
        p = getattr(model, name).detach()
        bad = torch.ones(3) if wrong == "shape" else p.to("meta")
        setattr(model, name, torch.nn.Parameter(bad))
        try:
            model(x)
            outcome = "no error"
        except Exception as err:
            outcome = f"{type(err).__name__}: {err}"
        print(json.dumps({f"{kind} {name} {impl} {wrong}": outcome}), flush=True)
    """
)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    """Each wrong-shape or wrong-device case's outcome, from one subprocess (a crash fails every
    case that did not finish)."""
    cases = [
        (kind, name, impl, wrong)
        for kind, name in ALL_CASES
        for impl in ("fused", "loop")
        for wrong in ("shape", "device")
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS, json.dumps(cases)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    outcomes: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        outcomes.update(json.loads(line))
    if proc.returncode != 0:
        outcomes["crash"] = f"exit status {proc.returncode}: {proc.stderr[-500:]}"
    return outcomes


@pytest.mark.parametrize("impl", ["fused", "loop"])
@pytest.mark.parametrize(("kind", "name"), ALL_CASES)
def test_parameter_of_the_wrong_shape_or_device_is_refused(outcomes, kind, name, impl) -> None:
    model = LAYERS[kind](4, 5)
    shape = tuple(getattr(model, name).shape)
    owner = type(model).__name__
    expected = {
        "shape": f"ValueError: {owner}: parameter {name} must have shape {shape}, got (3,)",
        "device": f"ValueError: {owner}: parameter {name} is on meta but the input is on cpu",
    }
    if name == "weight_ih_l0":  # the first one checked, with the input
        expected["device"] = f"ValueError: {owner}: input is on cpu but the weights are on meta"
    for wrong, message in expected.items():
        outcome = outcomes.get(f"{kind} {name} {impl} {wrong}")
        assert outcome is not None, outcomes.get("crash", "case did not run")
        assert outcome == message


@pytest.mark.parametrize("impl", ["fused", "loop"])
@pytest.mark.parametrize(("kind", "name"), [(k, n) for k in LAYERS for n in TORCH_NAMES])
def test_torch_weight_in_another_dtype_is_refused(kind, name, impl) -> None:
    model = LAYERS[kind](4, 5, impl=impl)
    setattr(model, name, torch.nn.Parameter(getattr(model, name).detach().double()))
    expected = (
        "input has dtype torch.float32 but the weights are torch.float64"  # the first one checked
        if name == "weight_ih_l0"
        else rf"parameter {name} has dtype torch.float64 but the input has dtype torch.float32"
    )
    with pytest.raises(TypeError, match=expected):
        model(torch.randn(6, 3, 4))


@pytest.mark.parametrize("impl", ["fused", "loop"])
@pytest.mark.parametrize(("kind", "name"), LN_CASES)
def test_norm_parameter_of_the_wrong_kind_is_refused(kind, name, impl) -> None:
    model = LAYERS[kind](4, 5, impl=impl)
    x = torch.randn(6, 3, 4)
    # nn.Parameter refuses integer data; the module's parameter table does not
    model._parameters[name] = torch.ones(getattr(model, name).shape, dtype=torch.int64)  # type: ignore[assignment]
    with pytest.raises(TypeError, match=rf"parameter {name} must be floating point, got dtype"):
        model(x)
    model._parameters[name] = None
    with pytest.raises(TypeError, match=rf"parameter {name} must be a tensor, got NoneType"):
        model(x)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_non_contiguous_parameters_give_the_loops_result(kind) -> None:
    """Every parameter replaced by a strided view of the same values: the fused path copies what
    C reads into contiguous memory (C takes rows of consecutive values)."""
    x = 0.5 + torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(1))
    runs = {}
    for impl in ("fused", "loop"):
        model = _model(kind, impl)
        for name, p in list(model.named_parameters()):
            wide = torch.stack((p.detach(), torch.full_like(p, float("nan"))), dim=-1)
            view = wide[..., 0]
            assert not view.is_contiguous()
            setattr(model, name, torch.nn.Parameter(view))
        runs[impl] = _run(model, x)
    for a, b in zip(runs["fused"], runs["loop"], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_autocast_runs_the_loop(kind) -> None:
    """Under autocast the layers take torch.nn.LSTM's mixed dtypes; both settings of impl then
    give the loop's result (the fused path's buffers take one dtype)."""
    x = 0.5 + torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(1))
    outs = {}
    for impl in ("auto", "loop"):
        model = _model(kind, impl)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[impl] = model(x)[0]
    assert outs["auto"].dtype == outs["loop"].dtype
    torch.testing.assert_close(outs["auto"], outs["loop"], rtol=0, atol=0)
