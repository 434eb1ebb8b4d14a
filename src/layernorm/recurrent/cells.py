r"""Layer-normalized recurrent cells (Ba, Kiros & Hinton 2016, Section 3.1 and supplementary).

A cell computes one time step, like :class:`torch.nn.RNNCell` / ``LSTMCell`` / ``GRUCell``, with
the same weight names and shapes (``weight_ih``, ``weight_hh``, ``bias_ih``, ``bias_hh``, gates
stacked in torch's order) plus the layer-norm gains ``ln_weight_*`` (init ``gain_init``, 1.0 by
default) and biases ``ln_bias_*`` (init 0). The statistics are computed per example and per time
step; one set of gains is shared by all steps, so a cell works on sequences of any length and at
batch size 1.

Drive a cell over time::

    cell = LayerNormLSTMCell(10, 20)
    x = torch.randn(7, 3, 10)           # (time, batch, features)
    state = None
    outputs = []
    for x_t in x:
        h, c = state = cell(x_t, state)
        outputs.append(h)

A call is one step of a few rows, so what it costs is mostly the calls of its ops: the layer
norms run torch's own kernel where :class:`layernorm.LayerNorm` does (a plain float CPU tensor;
with gradients up to 2^20 elements in float32 / float64, bfloat16 and float16 by torch's
float32 kernel; :func:`layernorm.ops._dispatch.torch_layer_norm`), the fused kernels otherwise.
Where nothing is differentiated (``torch.no_grad()``, inference mode) the LSTM and GRU cells run
a float32 / float64 CPU step as the one-step call of a sequence layer over the cell's own
parameters, by a plan kept per cell and signature (``_StepPlan``): one call of the C kernel.
With gradients, their float32 / float64 CPU steps (bfloat16 / float16 with small weights,
computed in float32) run as one autograd node on the C cell kernels (:mod:`._cellstep`: the two
products, one kernel forward and one backward) where the ops take some 20 to 27 nodes; an LSTM
step of many rows runs the layers' planned node (:func:`._cellstep.planned_step_pays`).
Zoneout, the LSTM's normalized carry, tracers, autocast, a forced backend and parametrized
weights keep the ops. For whole sequences the layers (:mod:`.layers`) run the time loop in C.

.. code-block:: bibtex

    @article{ba2016layer,
      title={Layer Normalization},
      author={Ba, Jimmy Lei and Kiros, Jamie Ryan and Hinton, Geoffrey E},
      journal={arXiv preprint arXiv:1607.06450}, year={2016}}
"""

from __future__ import annotations

import math
import weakref
from typing import Any, NamedTuple, Self

import torch
from torch import Tensor, nn

from .._torchscript import NotScriptable
from .._validation import check_flag
from ..ops._dispatch import plain_eager
from . import _cellstep, _cstep, _fused, _options, _planned, _steps
from ._checks import (
    check_cell_input,
    check_eps,
    check_gain,
    check_params_match,
    check_probability,
    check_size,
    check_state,
    describe,
)
from ._from_torch import build_from_torch, require_torch_kind
from .layers import (
    _FUSED_DTYPES,
    _INFERENCE_PLANS,
    LayerNormGRU,
    LayerNormLSTM,
    _LNRNNBase,
    _state_signature,
)

__all__ = ["LayerNormGRUCell", "LayerNormLSTMCell", "LayerNormRNNCell"]

_TORCH_CELLS: dict[str, type[nn.RNNCellBase]] = {
    "RNN": nn.RNNCell, "LSTM": nn.LSTMCell, "GRU": nn.GRUCell,
}  # fmt: skip


# The suffix of the one-step layer's parameters (layer 0, forward): the cell's names with it.
_SFX = "_l0"
_LAYERS: dict[str, type[_LNRNNBase]] = {"LSTM": LayerNormLSTM, "GRU": LayerNormGRU}


# the planned node's arguments in its order: torch's weights and biases, then the layer norms'
# (LN(hp), LN(c_t), LN(gx)) gains and biases
_NODE_PARAMS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "ln_weight_hh", "ln_bias_hh",
                "ln_weight_c", "ln_bias_c", "ln_weight_ih", "ln_bias_ih")  # fmt: skip


class _StepPlan(NamedTuple):
    """A cell's inference step kept for the next call of the same signature
    (:meth:`_LNCellBase._step_signature`): the step is the one-step call of a sequence layer of
    the cell's mode and settings whose parameters are the cell's own (``weight_ih_l0`` is the
    cell's ``weight_ih``), by that layer's kept inference plan (:class:`._fused.InferencePlan`):
    the whole-sequence C kernel of one step, no autograd node, no checks, the structs packed
    once. A call of few rows is then a few tensor operations and one kernel, where the ops of
    :mod:`._steps` take a dozen calls of torch's (each of them microseconds of dispatch).

    Taken only where nothing can be recorded or differentiated (gradients off, no tracer or
    autocast, asked on every call) and the signature holds: the input's and the states' shapes,
    dtypes and device, the settings, threads, inference mode and kernel target, and each
    parameter's identity, address, shape, dtype and layout (an update in place changes none of
    them: the plan reads the parameters where they are, and the input side's bias is folded
    again on every call)."""

    signature: tuple[Any, ...]
    layer: _LNRNNBase
    plan: _fused.InferencePlan
    zeros: Tensor  # the initial state of a call without hx (the plan copies it into its own)

    def run(self, input: Tensor, hx: Any) -> Any:
        """The cell's result for ``input`` and ``hx``, or ``None`` where the plan is busy
        (another thread): the cell then runs the step itself."""
        if hx is None:
            h0, c0 = self.zeros, (self.zeros if self.layer.mode == "LSTM" else None)
        elif type(hx) is tuple:
            h0, c0 = hx
        else:
            h0, c0 = hx, None
        # one step: the output is h_n, whose copy the plan can skip
        result = self.layer._run_kept(self.plan, input, h0, c0, final_hidden=False)
        if result is None:
            return None
        out, _, c_n = result
        return out if c_n is None else (out, c_n)


# Each cell's kept step (and the one-step layer over its parameters, with the settings it was
# built for): kept beside the cell, not in it, so that copies and pickles of a cell carry none.
_STEP_PLANS: weakref.WeakKeyDictionary[nn.Module, _StepPlan] = weakref.WeakKeyDictionary()
_STEP_LAYERS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], _LNRNNBase]] = (
    weakref.WeakKeyDictionary()
)


class _LNCellBase(NotScriptable, nn.Module):
    """Weights as torch's cells plus the layer norms of :data:`._steps.LN_PARTS` for ``mode``.

    The subclasses check and set their own options after this constructor, then call
    :meth:`reset_parameters`.
    """

    mode = "RNN"  # "RNN", "LSTM" or "GRU", as the sequence layers'
    gate_count = 1

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool,
        gain_init: float,
        eps: float,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.input_size = check_size(input_size, "input_size", owner)
        self.hidden_size = check_size(hidden_size, "hidden_size", owner)
        self.bias = check_flag(bias, "bias", owner)
        self.gain_init = check_gain(gain_init, "gain_init", owner)
        self.eps = check_eps(eps, owner)
        factory = {"device": device, "dtype": dtype}
        hs = self.hidden_size
        gh = self.gate_count * hs
        self.weight_ih = nn.Parameter(torch.empty(gh, self.input_size, **factory))
        self.weight_hh = nn.Parameter(torch.empty(gh, hs, **factory))
        if self.bias:
            self.bias_ih = nn.Parameter(torch.empty(gh, **factory))
            self.bias_hh = nn.Parameter(torch.empty(gh, **factory))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self._ln_names: list[tuple[str, str]] = []
        for suffix, units in _steps.LN_PARTS[self.mode]:
            self._add_ln(suffix, units * hs, factory)

    @classmethod
    def from_torch(cls, cell: nn.RNNCellBase, **kwargs: Any) -> Self:
        """Build this cell with ``cell``'s sizes, ``bias`` (and ``nonlinearity``, for an
        ``RNNCell``), device and dtype, and copy its weights and biases (torch's names match).

        ``kwargs`` go to the constructor (e.g. ``gain_init``); the layer-norm gains and biases keep
        their initial values, so the cell computes the LN recurrence with torch's weights.
        """
        require_torch_kind(cls, cell, _TORCH_CELLS[cls.mode])
        cfg: dict[str, Any] = {
            "bias": cell.bias, "device": cell.weight_ih.device, "dtype": cell.weight_ih.dtype,
        }  # fmt: skip
        if isinstance(cell, nn.RNNCell):
            cfg["nonlinearity"] = cell.nonlinearity
        return build_from_torch(cls, cell, cfg, kwargs)

    def _add_ln(self, suffix: str, size: int, factory: dict[str, Any]) -> None:
        """Gain ``ln_weight{suffix}`` and, with ``bias=True``, bias ``ln_bias{suffix}``."""
        w, b = f"ln_weight{suffix}", f"ln_bias{suffix}"
        self.register_parameter(w, nn.Parameter(torch.empty(size, **factory)))
        if self.bias:
            self.register_parameter(b, nn.Parameter(torch.empty(size, **factory)))
        else:
            self.register_parameter(b, None)
        self._ln_names.append((w, b))

    def reset_parameters(self) -> None:
        """torch's uniform(±1/√H) weights; biases 0; LN gains ``gain_init``, LN biases 0."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        nn.init.uniform_(self.weight_ih, -bound, bound)
        nn.init.uniform_(self.weight_hh, -bound, bound)
        for p in (self.bias_ih, self.bias_hh):
            if p is not None:
                nn.init.zeros_(p)
        for w, b in self._ln_names:
            nn.init.constant_(getattr(self, w), self.gain_init)
            if getattr(self, b) is not None:
                nn.init.zeros_(getattr(self, b))

    def _hidden(self, hx: object, x: Tensor, batched: bool) -> Tensor:
        """The RNN/GRU cells' ``hx``: zeros when ``None``, else checked by :meth:`_state`."""
        if hx is None:
            return x.new_zeros(x.shape[0], self.hidden_size)
        return self._state(hx, "hx", x, batched)

    def _states(self, hx: Any, x: Tensor, batched: bool) -> tuple[Tensor, Tensor | None]:
        """The checked ``(h, c)`` of ``hx``: the RNN's and GRU's ``h`` (:meth:`_hidden`) and
        no ``c`` (the LSTM cell's own carries one)."""
        return self._hidden(hx, x, batched), None

    def _settings(self) -> tuple[Any, ...]:
        """What the one-step layer is built with (:meth:`_step_layer`)."""
        carried = getattr(self, "normalize_cell_state", False)
        return (self.input_size, self.hidden_size, self.bias, self.eps, carried)

    def _step_signature(self, input: Tensor, hx: Any) -> tuple[Any, ...]:
        """What a kept step (:class:`_StepPlan`) holds for besides the values of the input, the
        state and the parameters."""
        return (
            input.shape, input.dtype, input.is_cpu, _state_signature(hx), self._settings(),
            torch.get_num_threads(), torch.is_inference_mode_enabled(), _cstep.configuration(),
            *[(id(p), p.data_ptr(), p.shape, p.dtype, p.is_contiguous())
              for p in self._parameters.values() if p is not None],
        )  # fmt: skip

    def _step_layer(self) -> _LNRNNBase:
        """The one-layer, one-direction sequence layer of the cell's mode and settings whose
        parameters are the cell's own (built on the meta device, then pointed at them)."""
        settings = self._settings()
        kept = _STEP_LAYERS.get(self)
        if kept is not None and kept[0] == settings:
            layer = kept[1]
        else:
            options: dict[str, Any] = {"bias": self.bias, "eps": self.eps, "device": "meta"}
            if self.mode == "LSTM":
                options["normalize_cell_state"] = self.normalize_cell_state
            layer = _LAYERS[self.mode](self.input_size, self.hidden_size, **options)
            _STEP_LAYERS[self] = (settings, layer)
        for name, p in self._parameters.items():
            layer._parameters[name + _SFX] = p
        return layer

    def _planned_step(self, input: Any, hx: Any) -> Any:
        """The step by its kept plan (:class:`_StepPlan`), building it on the first call of a
        signature; ``None`` where the call is not of the planned kind (gradients on, a tracer,
        autocast, zoneout, an unbatched or non-float32/float64 CPU input, a state that is not a
        plain tensor or tuple of them, a parameter that is not a registered parameter: a
        parametrization's output, say): then the ops of :mod:`._steps` run it."""
        if torch.is_grad_enabled() or type(input) is not Tensor or input.dim() != 2:
            return None
        if self._modules.get("parametrizations") is not None:
            return None  # computed weights: the one-step layer takes registered parameters only
        if input.dtype not in _FUSED_DTYPES or not input.is_cpu:
            return None
        if self.zoneout_hidden or getattr(self, "zoneout_cell", 0.0):
            return None
        if not plain_eager() or torch.is_autocast_enabled("cpu"):
            return None
        signature = self._step_signature(input, hx)
        kept = _STEP_PLANS.get(self)
        if kept is not None and kept.signature == signature:
            result = kept.run(input, hx)
            if result is not None:
                return result
        if signature[3] is False:
            return None
        return self._first_planned_step(input, hx, signature)

    def _first_planned_step(self, input: Tensor, hx: Any, signature: tuple[Any, ...]) -> Any:
        """A step of a new signature: the checks a step makes, then the one-step layer's call,
        whose inference plan is kept where the layer kept one."""
        x, batched = self._prepare(input)
        h, c = self._states(hx, x, batched)
        layer = self._step_layer()
        if any(p is not None and p.is_meta for p in layer._parameters.values()):
            return None  # a parameter the cell does not hold as one (a plain tensor in its place)
        out, _, c_n = layer._direction(x, [x.shape[0]], _SFX, False, h, c)
        kept = _INFERENCE_PLANS.get(layer, {}).get(_SFX)
        if kept is not None:
            zeros = x.new_zeros(x.shape[0], self.hidden_size)
            _STEP_PLANS[self] = _StepPlan(signature, layer, kept[1], zeros)
        return out if c_n is None else (out, c_n)

    # a parameter from the module's dict, else an attribute: the layers' lookup
    _get = _LNRNNBase._get

    def _weight(self, name: str) -> Tensor:
        """A weight the step cannot do without (``weight_ih``, ``weight_hh``)."""
        w = self._get(name)
        if w is None:
            raise AttributeError(f"{type(self).__name__}: it has no {name}, a weight it needs")
        return w

    def _weights(self) -> _steps.Weights:
        get = self._get
        return _steps.Weights(self._weight("weight_ih"), self._weight("weight_hh"),
                              get("bias_ih"), get("bias_hh"))  # fmt: skip

    def _norm(self, suffix: str, grouped: bool = False) -> _steps.Norm:
        """The step's layer norm ``suffix`` (``""``, ``"_ih"``, ``"_hh"``, ``"_c"``) with torch's
        kernel (lean); ``grouped``: the GRU's two groups."""
        w, b = self._get(f"ln_weight{suffix}"), self._get(f"ln_bias{suffix}")
        if grouped:
            return _steps.make_grouped_ln(w, b, self.eps, self.hidden_size, lean=True)
        return _steps.make_ln(w, b, self.eps, lean=True)

    def _zoneout_rate(self, value: object, name: str) -> float:
        return check_probability(value, name, type(self).__name__, allow_one=True)

    def _zone(self, p: float, previous: Tensor, new: Tensor) -> Tensor:
        """Zoneout of one step (Krueger et al. 2016): ``d ⊙ previous + (1 − d) ⊙ new`` with
        ``d ~ Bernoulli(p)`` per unit and example, drawn on each call in training; ``d = p`` (the
        expectation) at eval. A cell call is one step, so this is the paper's per-step mask."""
        if p == 0.0:
            return new
        d = _options.zoneout_coefficients(tuple(new.shape), p, self.training, new)
        return _options.zoneout(d, previous, new)

    def _prepare(self, x: object) -> tuple[Tensor, bool]:
        owner = type(self).__name__
        x_, batched = check_cell_input(x, self.input_size, owner)
        check_params_match(x_, self._weight("weight_ih"), owner)
        return (x_ if batched else x_.unsqueeze(0)), batched

    def _state(self, t: object, name: str, x: Tensor, batched: bool) -> Tensor:
        """Check an hx/cx against the input's batch; unbatched states are ``(hidden_size,)``."""
        b = x.shape[0]
        expected = (b, self.hidden_size) if batched else (self.hidden_size,)
        t_ = check_state(t, name, expected, x, type(self).__name__)
        return t_ if batched else t_.unsqueeze(0)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if not self.bias:
            s += ", bias=False"
        if self.gain_init != 1.0:
            s += f", gain_init={self.gain_init}"
        if self.eps != 1e-5:
            s += f", eps={self.eps}"
        for name in ("zoneout_hidden", "zoneout_cell"):
            if getattr(self, name, 0.0):
                s += f", {name}={getattr(self, name)}"
        return s


class LayerNormRNNCell(_LNCellBase):
    r"""Layer-normalized Elman RNN cell, Eq. 4 of Ba et al. (2016).

    .. math::
        a_t = W_{hh} h_{t-1} + W_{ih} x_t,\qquad
        h_t = f\Big(\frac{g}{\sigma_t} \odot (a_t - \mu_t) + b\Big)

    with μ_t, σ_t the mean and (biased) standard deviation of the H summed inputs ``a_t`` of each
    example. ``g`` is ``ln_weight``; ``b`` is ``ln_bias + bias_ih + bias_hh`` (torch's two biases
    kept so that :class:`torch.nn.RNNCell` weights load by name).

    Args:
        input_size: features of ``x_t``.
        hidden_size: units ``H``.
        bias: ``False`` drops every additive bias (``bias_ih``, ``bias_hh`` and ``ln_bias``).
        nonlinearity: ``"tanh"`` or ``"relu"``.
        gain_init: initial LN gain (the paper uses 1.0).
        eps: added to the variance.
        zoneout_hidden: zoneout of ``h`` (Krueger et al. 2016; see :meth:`_zone`): in training
            ``h' = d ⊙ h + (1 − d) ⊙ h̃``, ``d ~ Bernoulli(p)`` drawn per call; at eval
            ``p h + (1 − p) h̃``.

    Shape:
        ``x``: ``(B, input_size)`` or ``(input_size,)``; ``hx``: ``(B, H)`` or ``(H,)``, zeros when
        ``None``. Returns ``h'`` of ``hx``'s shape.
    """

    mode = "RNN"

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        nonlinearity: str = "tanh",
        *,
        gain_init: float = 1.0,
        eps: float = 1e-5,
        zoneout_hidden: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, hidden_size, bias, gain_init, eps, device, dtype)
        self.zoneout_hidden = self._zoneout_rate(zoneout_hidden, "zoneout_hidden")
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(
                f"LayerNormRNNCell: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}"
            )
        self.nonlinearity = nonlinearity
        self.reset_parameters()

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        """``h' = cell(x, h)``; ``hx=None`` starts from zeros (shapes in the class docstring)."""
        # no step plan (_StepPlan): the Elman step is few ops, which took less than the plan's
        # call (one thread, AMD EPYC, under no_grad, (B, I, H) = (1, 64, 128) 28 against 42 µs,
        # (8, 64, 128) 36 against 52, (32, 128, 256) 135 against 144)
        inferring = not torch.is_grad_enabled()
        if inferring and type(input) is Tensor and (hx is None or type(hx) is Tensor):
            inferred = self._inference_step(input, hx)  # its own checks: no more are needed
            if inferred is not None:
                return inferred
        x, batched = self._prepare(input)
        h_prev = self._hidden(hx, x, batched)
        inferred = self._inference_step(x, h_prev) if inferring else None
        if inferred is not None:
            return inferred if batched else inferred.squeeze(0)
        trained = None if inferring else self._node_step(x, h_prev)
        if trained is not None:
            return trained if batched else trained.squeeze(0)
        h = _steps.rnn_step(
            x, h_prev, self._weights(),
            self._norm(""), self.nonlinearity,
        )  # fmt: skip
        h = self._zone(self.zoneout_hidden, h_prev, h)
        return h if batched else h.squeeze(0)

    def _node_step(self, x: Tensor, h: Tensor) -> Tensor | None:
        """A training step by the C++ node of the step's ops (:func:`._cellstep.elman_node`, one
        autograd node where the ops take seven), where :func:`._cellstep.elman_params` allows
        it; ``None`` elsewhere (the step's ops run it): no zoneout, besides that function's
        rules."""
        if self.zoneout_hidden:
            return None
        params = _cellstep.elman_params(self, "", x, self.hidden_size)
        if params is None:
            return None
        return _cellstep.elman_node(x, h, params, self.eps, self.nonlinearity)

    def _inference_step(self, x: Tensor, h: Tensor | None) -> Tensor | None:
        """The step where nothing is recorded and ``x``, ``h`` are rows of the cell's sizes (``h``
        ``None``: the zero state), in the fewest ops (:func:`._steps.elman_inference_step`), or
        ``None``. Its checks are all the call needs, so :meth:`forward` tries it before its own
        (which name what is wrong where this says ``None``), and again after them for what they
        turn into such a call (an unbatched input). One thread, AMD EPYC Zen 4,
        ``bench_cells.py``, x ``torch.nn.RNNCell``'s time, after the checks / before them:
        (B, I, H) = (1, 64, 128) 1.44-1.47 / 1.25-1.26, (8, 64, 128) 1.37-1.38 / 1.19-1.23,
        (1, 256, 256) 1.34 / 1.18-1.21, (32, 128, 256) 1.11-1.12 / 1.07-1.09 (RESULTS.md,
        2026-11-30)."""
        if self.zoneout_hidden:
            return None
        get = self._get
        w_ih, w_hh = get("weight_ih"), get("weight_hh")
        if w_ih is None or w_hh is None:
            return None  # the full path names the missing weight
        return _steps.elman_inference_step(
            x, h, w_ih, w_hh, get("bias_ih"), get("bias_hh"), get("ln_weight"), get("ln_bias"),
            self.eps, self.nonlinearity,
        )  # fmt: skip

    def extra_repr(self) -> str:
        s = super().extra_repr()
        return s if self.nonlinearity == "tanh" else s + f", nonlinearity={self.nonlinearity!r}"


class LayerNormLSTMCell(_LNCellBase):
    r"""Layer-normalized LSTM cell (Ba et al. 2016, supplementary material).

    .. math::
        (i, f, g, o) = LN(W_{hh} h_{t-1}; α_1, β_1) + LN(W_{ih} x_t; α_2, β_2) + b \\
        c_t = σ(f) ⊙ c_{t-1} + σ(i) ⊙ \tanh(g) \\
        h_t = σ(o) ⊙ \tanh(LN(c_t; α_3, β_3))

    Each of the first two LNs normalizes all four gates' pre-activations together (4H units). The
    carried cell state is the **un-normalized** ``c_t``; ``normalize_cell_state=True`` carries
    ``LN(c_t)`` instead (the TF-Addons / PyTorch fastrnns variant). ``b = bias_ih + bias_hh``;
    (α_1, β_1) = ``ln_weight_hh, ln_bias_hh``; (α_2, β_2) = ``ln_weight_ih, ln_bias_ih``;
    (α_3, β_3) = ``ln_weight_c, ln_bias_c``. Gates in torch's order ``i, f, g, o``.

    Blank inputs: where ``W_{ih} x_t`` has (nearly) zero variance across the 4H units, as for an
    all-zero ``x_t`` (MNIST's empty rows fed row by row) or the recurrent half at ``h_0 = 0``,
    LN divides by ``σ ≈ √eps``, so its Jacobian is of order ``α/√eps`` (≈ 316 at the default
    ``eps=1e-5``). Gradients through it are amplified at every such step and can explode over
    long blank stretches. Standardize the inputs (per-feature zero mean and unit variance, so a
    blank row is no longer the zero vector), or use a larger ``eps`` (e.g. ``1e-3``).

    Args:
        input_size, hidden_size, bias: as :class:`torch.nn.LSTMCell` (``bias=False`` also drops
            the LN biases β).
        normalize_cell_state: carry ``LN(c_t)`` instead of ``c_t``.
        gain_init: initial α (1.0 in the paper; 0.1 was found worse for the attentive reader).
        eps: added to the variance.
        forget_bias: initial bias of the forget gate (haste's ``forget_bias``, whose default is
            1.0; Gers et al. 2000, Jozefowicz et al. 2015). ``None`` (default) leaves it at 0 like
            the other biases, so the cell starts as before; loading weights overrides it.
        zoneout_hidden, zoneout_cell: zoneout of ``h`` and of the carried ``c`` (Krueger et al.
            2016): in training ``h' = d ⊙ h + (1 − d) ⊙ h̃`` with ``d ~ Bernoulli(p)`` drawn per
            call (a call is a step), at eval ``p h + (1 − p) h̃``; the same for ``c``.

    Shape:
        ``x``: ``(B, input_size)`` or ``(input_size,)``; ``hx``: a tuple ``(h, c)`` of ``(B, H)`` or
        ``(H,)`` tensors, zeros when ``None``. Returns ``(h', c')``.
    """

    mode = "LSTM"
    gate_count = 4

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        normalize_cell_state: bool = False,
        *,
        gain_init: float = 1.0,
        eps: float = 1e-5,
        forget_bias: float | None = None,
        zoneout_hidden: float = 0.0,
        zoneout_cell: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, hidden_size, bias, gain_init, eps, device, dtype)
        owner = "LayerNormLSTMCell"
        self.zoneout_hidden = self._zoneout_rate(zoneout_hidden, "zoneout_hidden")
        self.zoneout_cell = self._zoneout_rate(zoneout_cell, "zoneout_cell")
        self.normalize_cell_state = check_flag(normalize_cell_state, "normalize_cell_state", owner)
        self.forget_bias = (
            None if forget_bias is None else check_gain(forget_bias, "forget_bias", owner)
        )
        if self.forget_bias is not None and not self.bias:
            raise ValueError(f"{owner}: forget_bias={forget_bias!r} needs bias=True")
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As the other cells; with ``forget_bias`` the forget gate's rows of ``bias_ih`` start at
        it (``bias_hh``'s and the LN biases at 0, so the gate's summed bias is ``forget_bias``)."""
        super().reset_parameters()
        if getattr(self, "forget_bias", None) is not None:
            hs = self.hidden_size
            with torch.no_grad():
                self.bias_ih[hs : 2 * hs] = self.forget_bias

    def _states(self, hx: Any, x: Tensor, batched: bool) -> tuple[Tensor, Tensor | None]:
        """The checked ``(h, c)`` of ``hx`` (zeros when ``None``)."""
        if hx is None:
            h = x.new_zeros(x.shape[0], self.hidden_size)
            return h, h
        if not isinstance(hx, tuple | list) or len(hx) != 2:
            raise TypeError(f"LayerNormLSTMCell: hx must be a tuple (h, c), got {describe(hx)}")
        return self._state(hx[0], "hx[0]", x, batched), self._state(hx[1], "hx[1]", x, batched)

    def forward(
        self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(h', c') = cell(x, (h, c))``; ``hx=None`` starts from zeros (shapes in the class
        docstring). ``c'`` is the carried state: ``c_t``, or ``LN(c_t)`` with
        ``normalize_cell_state``."""
        planned = self._planned_step(input, hx)
        if planned is not None:
            return planned  # type: ignore[no-any-return]
        x, batched = self._prepare(input)
        h, c = self._states(hx, x, batched)
        trained = self._node_step(x, h, c) if batched else None
        if trained is None:
            trained = self._kernel_step(x, h, c)
        if trained is not None:
            h, c = trained
            return (h, c) if batched else (h.squeeze(0), c.squeeze(0))
        h_new, c_new = _steps.lstm_step(
            x, h, c, self._weights(),
            self._norm("_ih"), self._norm("_hh"), self._norm("_c"),
            self.normalize_cell_state,
        )  # fmt: skip
        h, c = self._zone(self.zoneout_hidden, h, h_new), self._zone(self.zoneout_cell, c, c_new)
        return (h, c) if batched else (h.squeeze(0), c.squeeze(0))

    def _node_step(self, x: Tensor, h: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """A training step of many rows by the layers' planned node of one step
        (:func:`._planned.lstm_training`: the C sequence kernels forward and backward, one
        autograd node), where :func:`._cellstep.planned_step_pays`; ``None`` elsewhere (the
        step's ops run it): gradients on, plain eager, no autocast, no zoneout or normalized
        carry, every parameter a registered one (no parametrization or plain tensor in its
        place) in the input's dtype and contiguous."""
        if not _cellstep.node_context():
            return None  # (a tracer's sizes are tensors: the rule's arithmetic comes after)
        if not _cellstep.planned_step_pays(x, self.hidden_size):
            return None
        if self.zoneout_hidden or self.zoneout_cell or self.normalize_cell_state:
            return None
        params = _cellstep.registered_params(self, _NODE_PARAMS, "", x.dtype)
        if params is None:
            return None
        w_ih, w_hh, b_ih, b_hh, *ln = params
        result = _planned.lstm_training(
            x.contiguous(), [x.shape[0]], False, h.contiguous(), c.contiguous(), w_ih, w_hh,
            b_ih, b_hh, tuple(ln), self.eps, True, False, _options.Masks(), None,
        )  # fmt: skip
        if result is None:
            return None
        out, _, c_new = result
        return out, c_new

    def _kernel_step(self, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor] | None:
        """A training step by the C cell kernels' node (:func:`._cellstep.lstm_node`: the two
        products, one kernel forward and one backward, from C++ or the autograd.Function), where
        :func:`._cellstep.node_params` allows it; ``None`` elsewhere (the step's ops run it):
        gradients on, plain eager, no autocast or forced backend, no zoneout or normalized carry,
        every parameter a registered one in the input's dtype and contiguous."""
        if self.zoneout_hidden or self.zoneout_cell or self.normalize_cell_state:
            return None
        params = _cellstep.node_params(self, _cellstep.LSTM_PARAMS, "", x, self.hidden_size)
        if params is None:
            return None
        return _cellstep.lstm_node(x, h, c, params, self.eps)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        s = super().extra_repr()
        if self.forget_bias is not None:
            s += f", forget_bias={self.forget_bias}"
        return s + ", normalize_cell_state=True" if self.normalize_cell_state else s


class LayerNormGRUCell(_LNCellBase):
    r"""Layer-normalized GRU cell (Ba et al. 2016, supplementary material), on torch's GRU layout.

    .. math::
        (r, z) = σ(LN(W_{h} h_{t-1}) + LN(W_{x} x_t) + b_{rz}) \\
        n_t = \tanh(LN(W_{in} x_t) + b_{in} + r ⊙ (LN(W_{hn} h_{t-1}) + b_{hn})) \\
        h_t = (1 - z) ⊙ n_t + z ⊙ h_{t-1}

    The paper's ``ĥ_t = tanh(LN(W x_t) + σ(r) ⊙ LN(U h_{t−1}))``: the ``(r, z)`` rows (2H units) and
    the candidate rows (H units) of each projection are normalized separately, so ``ln_weight_ih``
    / ``ln_weight_hh`` (3H each) hold two LNs' gains. torch's ``z`` is the paper's ``1 − z`` (the
    update gate's pre-activation negated), kept so that plain GRU weights mean the same thing.

    ``zoneout_hidden``: zoneout of ``h`` (Krueger et al. 2016), as :class:`LayerNormRNNCell`'s.

    Shape:
        ``x``: ``(B, input_size)`` or ``(input_size,)``; ``hx``: ``(B, H)`` or ``(H,)``, zeros when
        ``None``. Returns ``h'``.
    """

    mode = "GRU"
    gate_count = 3

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        *,
        gain_init: float = 1.0,
        eps: float = 1e-5,
        zoneout_hidden: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, hidden_size, bias, gain_init, eps, device, dtype)
        self.zoneout_hidden = self._zoneout_rate(zoneout_hidden, "zoneout_hidden")
        self.reset_parameters()

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        """``h' = cell(x, h)``; ``hx=None`` starts from zeros (shapes in the class docstring)."""
        planned = self._planned_step(input, hx)
        if planned is not None:
            return planned  # type: ignore[no-any-return]
        x, batched = self._prepare(input)
        h_prev = self._hidden(hx, x, batched)
        h = self._kernel_step(x, h_prev)
        if h is not None:
            return h if batched else h.squeeze(0)
        h = _steps.gru_step(
            x, h_prev, self._weights(),
            self._norm("_ih", grouped=True), self._norm("_hh", grouped=True),
        )  # fmt: skip
        h = self._zone(self.zoneout_hidden, h_prev, h)
        return h if batched else h.squeeze(0)

    def _kernel_step(self, x: Tensor, h: Tensor) -> Tensor | None:
        """A training step by the C cell kernels' node (:func:`._cellstep.gru_node`: the two
        products, one kernel forward and one backward, from C++ or the autograd.Function), where
        :func:`._cellstep.node_params` allows it; ``None`` elsewhere (the step's ops run it):
        gradients on, plain eager, no autocast or forced backend, no zoneout, every parameter a
        registered one in the input's dtype and contiguous."""
        if self.zoneout_hidden:
            return None
        params = _cellstep.node_params(self, _cellstep.GRU_PARAMS, "", x, self.hidden_size)
        if params is None:
            return None
        return _cellstep.gru_node(x, h, params, self.eps)  # type: ignore[no-any-return]
