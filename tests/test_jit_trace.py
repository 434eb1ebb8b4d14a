"""torch.jit.trace of every module: traced without TracerWarnings, saved, loaded, same results.

Under the TorchScript tracer the ops go through the registered custom ops (``layernorm::*``), which
a saved module refers to by name: loading one needs ``import layernorm`` first, which registers
them. The eager fast path's autograd.Functions cannot be saved ("Could not export Python
function call '_LayerNormEager'").
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import layernorm
from conftest import make_x

# The deprecation notices of torch.jit.trace/save/load themselves are not this library's.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SRC = Path(layernorm.__file__).resolve().parents[1]


def _seq(kind: str, **kw) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(layernorm, f"LayerNorm{kind}")(3, 4, **kw)


# (make the module, input shape); float64 so that the comparisons below can be tight
MODELS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...]]] = {
    "LayerNorm": (lambda: layernorm.LayerNorm(6), (2, 3, 6)),
    "LayerNorm-2d-shape": (lambda: layernorm.LayerNorm((3, 6)), (2, 3, 6)),
    "LN-simple": (lambda: layernorm.LayerNorm(6, elementwise_affine=False), (5, 6)),
    "DetachNorm-mean": (lambda: layernorm.LayerNorm(6, detach_mean=True), (2, 3, 6)),
    "DetachNorm-std": (lambda: layernorm.LayerNorm(6, detach_std=True), (2, 3, 6)),
    "DetachNorm-both": (
        lambda: layernorm.LayerNorm(6, detach_mean=True, detach_std=True),
        (2, 3, 6),
    ),
    "RMSNorm": (lambda: layernorm.RMSNorm(6), (2, 3, 6)),
    "AdaNorm": (lambda: layernorm.AdaNorm(6, k=0.1, scale=2.0), (2, 3, 6)),
    "BatchNorm": (lambda: layernorm.BatchNorm(6).eval(), (5, 6)),
    "LSTM": (_seq("LSTM", num_layers=2, bidirectional=True), (5, 2, 3)),
    "LSTM-cell-norm": (_seq("LSTM", normalize_cell_state=True, batch_first=True), (2, 5, 3)),
    "LSTM-unbatched": (_seq("LSTM"), (5, 3)),
    "GRU": (_seq("GRU", num_layers=2, bidirectional=True), (5, 2, 3)),
    "RNN": (_seq("RNN", nonlinearity="relu"), (5, 2, 3)),
    "LSTMCell": (_seq("LSTMCell"), (2, 3)),
    "GRUCell": (_seq("GRUCell"), (2, 3)),
    "RNNCell": (_seq("RNNCell"), (2, 3)),
}


def _first(out: torch.Tensor | tuple) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _trace(model: torch.nn.Module, x: torch.Tensor) -> torch.jit.ScriptModule:
    """``torch.jit.trace`` with a TracerWarning made an error: neither the checks nor the choice
    of threads may read the tracer's size tensors as Python values."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        return torch.jit.trace(model, x)


def _grads(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    out = _first(model(x))
    weight = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).view(out.shape)
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad((out * weight).sum(), [x, *params]))


@pytest.mark.parametrize("name", MODELS)
def test_trace_save_load_same_outputs_and_gradients(name, tmp_path):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    x = make_x(shape, torch.float64)
    path = tmp_path / "traced.pt"
    torch.jit.save(_trace(model, x), str(path))
    loaded = torch.jit.load(str(path))
    other = make_x(shape, torch.float64, offset=-1.0, scale=3.0)  # not the traced example
    for inp in (x, other):
        torch.testing.assert_close(_first(loaded(inp)), _first(model(inp)), rtol=1e-12, atol=1e-12)
    # the detach flags only change the backward: it is recorded too
    for got, want in zip(_grads(loaded, other), _grads(model, other), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_traced_norms_refuse_another_normalized_shape():
    # the trace replays a reshape to (-1, N): without a recorded check, (2, 3, 8) would be
    # normalized in halves for N = 4 and come back in its own shape without a word
    traced = _trace(layernorm.LayerNorm(4), make_x((2, 3, 4)))
    assert traced(make_x((5, 7, 4))).shape == (5, 7, 4)  # other leading sizes are fine
    for shape in ((2, 3, 8), (2, 3, 2), (2, 3, 1)):
        with pytest.raises(RuntimeError, match="invalid for input of size"):
            traced(make_x(shape))


def test_saved_trace_loads_in_a_fresh_process(tmp_path):
    model = layernorm.LayerNormLSTM(3, 4)
    x = make_x((5, 2, 3))
    path = tmp_path / "lstm.pt"
    torch.jit.save(_trace(model, x), str(path))
    torch.save({"x": x, "y": model(x)[0].detach()}, tmp_path / "io.pt")
    script = (
        "import sys, torch, layernorm\n"
        "m = torch.jit.load(sys.argv[1])\n"
        "io = torch.load(sys.argv[2], weights_only=True)\n"
        "torch.testing.assert_close(m(io['x'])[0], io['y'], rtol=1e-5, atol=1e-6)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(path), str(tmp_path / "io.pt")],
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
