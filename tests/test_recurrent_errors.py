"""Bad input to the sequence layers: every error names what was expected and what came."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import layernorm
from layernorm import (
    LayerNormGRU,
    LayerNormGRUCell,
    LayerNormLSTM,
    LayerNormLSTMCell,
    LayerNormRNN,
    LayerNormRNNCell,
)


def test_wrong_rank_and_feature_size() -> None:
    model = LayerNormLSTM(3, 4)
    with pytest.raises(
        ValueError, match=r"input_size=3.*\(seq, batch, features\).*got shape \(5, 2, 7\)"
    ):
        model(torch.randn(5, 2, 7))
    with pytest.raises(ValueError, match=r"got shape \(5,\)"):
        model(torch.randn(5))
    with pytest.raises(ValueError, match=r"got shape \(1, 5, 2, 3\)"):
        model(torch.randn(1, 5, 2, 3))
    with pytest.raises(ValueError, match=r"\(batch, seq, features\)"):
        LayerNormGRU(3, 4, batch_first=True)(torch.randn(2, 5, 4))
    with pytest.raises(TypeError, match="floating-point"):
        model(torch.ones(5, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="empty input"):
        model(torch.randn(0, 2, 3))


def test_hx_of_wrong_shape_dtype_device_or_kind() -> None:
    model = LayerNormLSTM(3, 4, num_layers=2)
    x = torch.randn(5, 2, 3)
    good = torch.zeros(2, 2, 4)
    with pytest.raises(ValueError, match=r"hx\[0\] must have shape \(2, 2, 4\), got \(1, 2, 4\)"):
        model(x, (torch.zeros(1, 2, 4), good))
    with pytest.raises(
        TypeError, match=r"hx\[1\] has dtype torch.float64 but the input has dtype torch.float32"
    ):
        model(x, (good, good.double()))
    with pytest.raises(ValueError, match=r"hx\[0\] is on meta but the input is on cpu"):
        model(x, (good.to("meta"), good))
    with pytest.raises(TypeError, match=r"tuple \(h_0, c_0\), got Tensor"):
        model(x, good)
    gru = LayerNormGRU(3, 4)
    with pytest.raises(TypeError, match="tensor h_0, got a tuple"):
        gru(x, (torch.zeros(1, 2, 4),))
    with pytest.raises(ValueError, match=r"hx must have shape \(1, 4\), got \(1, 1, 4\)"):
        gru(x[:, 0], torch.zeros(1, 1, 4))  # unbatched input takes unbatched state


def test_input_dtype_must_match_weights() -> None:
    with pytest.raises(
        TypeError, match=r"input has dtype torch.float64 but the weights are torch.float32"
    ):
        LayerNormRNN(3, 4)(torch.randn(5, 2, 3, dtype=torch.float64))


def test_bad_packed_sequences() -> None:
    model = LayerNormLSTM(3, 4)
    data = torch.randn(6, 3)
    # batch sizes must be non-increasing (sequences sorted by length, or sorted_indices given)
    bad = PackedSequence(data, torch.tensor([2, 3, 1]), None, None)
    with pytest.raises(ValueError, match=r"non-increasing.*enforce_sorted=False.*got \[2, 3, 1\]"):
        model(bad)
    bad_sum = PackedSequence(data, torch.tensor([3, 2]), None, None)
    with pytest.raises(ValueError, match="sum to 5 but data has 6 rows"):
        model(bad_sum)
    bad_perm = PackedSequence(data, torch.tensor([3, 2, 1]), torch.tensor([0, 0, 1]), None)
    with pytest.raises(ValueError, match=r"sorted_indices must be a permutation of range\(3\)"):
        model(bad_perm)
    with pytest.raises(ValueError, match=r"PackedSequence.data of shape \(total_steps, 3\)"):
        model(PackedSequence(torch.randn(6, 5), torch.tensor([3, 2, 1]), None, None))
    # a correct unsorted batch (enforce_sorted=False) is accepted, like torch
    x = torch.randn(4, 3, 3)
    packed = pack_padded_sequence(x, torch.tensor([2, 4, 3]), enforce_sorted=False)
    _out, (h, _c) = model(packed)
    assert h.shape == (1, 3, 4)


def test_bad_constructor_arguments() -> None:
    with pytest.raises(ValueError, match=r"norm must be one of \('layer', 'none'\), got 'batch'"):
        LayerNormGRU(3, 4, norm="batch")
    with pytest.raises(ValueError, match="norm must be one of"):
        LayerNormLSTM(3, 4, norm="group")
    with pytest.raises(ValueError, match="dropout must be a number in"):
        LayerNormLSTM(3, 4, dropout=1.5)
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        LayerNormLSTM(3, 4, num_layers=0)
    with pytest.raises(ValueError, match="impl must be"):
        LayerNormLSTM(3, 4, impl="cuda")
    with pytest.raises(ValueError, match="no fused path"):
        LayerNormLSTM(3, 4, norm="batch", impl="fused")
    with pytest.raises(ValueError, match="nonlinearity"):
        LayerNormRNN(3, 4, nonlinearity="gelu")
    with pytest.warns(UserWarning, match="dropout=0.5 has no effect with num_layers=1"):
        LayerNormGRU(3, 4, dropout=0.5)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\], got 1.5"):
        LayerNormLSTM(3, 4, norm="batch", momentum=1.5)
    # half inputs on the CPU run the fused path (in float32), so impl="fused" accepts them
    half = LayerNormGRU(3, 4, impl="fused", dtype=torch.bfloat16)
    xh = torch.randn(5, 2, 3, dtype=torch.bfloat16)
    fused = half(xh)[0]
    half.impl = "auto"
    assert fused.dtype == torch.bfloat16 and torch.equal(half(xh)[0], fused)


@pytest.mark.parametrize(
    "cls",
    [
        LayerNormRNN,
        LayerNormLSTM,
        LayerNormGRU,
        LayerNormRNNCell,
        LayerNormLSTMCell,
        LayerNormGRUCell,
    ],
)
def test_sizes_of_the_wrong_kind_are_type_errors(cls) -> None:
    # torch.nn.LSTM(3.0, 4) is a TypeError too; a wrong value (0) stays a ValueError
    with pytest.raises(TypeError, match=r"input_size must be a positive int, got float 3.0"):
        cls(3.0, 4)
    with pytest.raises(TypeError, match=r"hidden_size must be a positive int, got bool True"):
        cls(3, True)
    with pytest.raises(TypeError, match=r"gain_init must be a finite float, got str '1'"):
        cls(3, 4, gain_init="1")
    with pytest.raises(ValueError, match=r"gain_init must be a finite float, got inf"):
        cls(3, 4, gain_init=float("inf"))
    # NumPy integers (from a config array, say) are ints
    np = pytest.importorskip("numpy")
    m = cls(np.int64(3), np.int32(4))
    assert (type(m.input_size), type(m.hidden_size)) == (int, int)
    assert m.weight_ih_l0.shape[1] == 3 if hasattr(m, "weight_ih_l0") else m.weight_ih.shape[1] == 3


def test_num_layers_and_max_steps_kinds() -> None:
    with pytest.raises(TypeError, match=r"num_layers must be a positive int, got float 2.0"):
        LayerNormLSTM(3, 4, num_layers=2.0)
    with pytest.raises(TypeError, match=r"max_steps must be a positive int, got NoneType None"):
        LayerNormLSTM(3, 4, norm="batch", max_steps=None)
    with pytest.raises(TypeError, match=r"momentum must be a finite float, got str"):
        LayerNormLSTM(3, 4, norm="batch", momentum="0.1")


@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_empty_batch_gives_empty_outputs_like_torch(kind, batch_first) -> None:
    # torch.nn.LSTM returns empty outputs for a batch of 0 sequences; no time steps is an error
    ours = getattr(layernorm, f"LayerNorm{kind}")(
        3, 4, 2, batch_first=batch_first, bidirectional=True
    )
    ref = getattr(torch.nn, kind)(3, 4, 2, batch_first=batch_first, bidirectional=True)
    x = torch.randn((0, 5, 3) if batch_first else (5, 0, 3), requires_grad=True)
    out, h = ours(x)
    ref_out, ref_h = ref(x)
    assert out.shape == ref_out.shape
    if kind == "LSTM":
        assert [t.shape for t in h] == [t.shape for t in ref_h]
    else:
        assert h.shape == ref_h.shape
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    hx = torch.zeros(4, 0, 4)
    out2, _ = ours(x, (hx, hx) if kind == "LSTM" else hx)
    assert out2.shape == out.shape
    with pytest.raises(ValueError, match=r"empty input of shape .* \(no time steps\)"):
        ours(torch.randn((2, 0, 3) if batch_first else (0, 2, 3)))


def test_lstm_takes_torch_proj_size_keyword() -> None:
    # code that builds torch.nn.LSTM(**cfg) with proj_size=0 passes the same cfg here
    cfg = {"input_size": 3, "hidden_size": 4, "num_layers": 2, "proj_size": 0}
    model = LayerNormLSTM(**cfg)
    assert model.proj_size == 0
    assert (
        model(torch.randn(5, 2, 3))[0].shape == torch.nn.LSTM(**cfg)(torch.randn(5, 2, 3))[0].shape
    )
    # torch's rule: 0 <= proj_size < hidden_size
    for bad in (4, 5, -1):
        with pytest.raises(
            ValueError, match=rf"proj_size must be in \[0, hidden_size=4\), got {bad}"
        ):
            LayerNormLSTM(3, 4, proj_size=bad)
    with pytest.raises(TypeError, match=r"proj_size must be an int, got float 2.0"):
        LayerNormLSTM(3, 4, proj_size=2.0)


def test_lstm_hx_of_the_wrong_length_says_how_many() -> None:
    x = torch.randn(5, 2, 3)
    h = torch.zeros(1, 2, 4)
    with pytest.raises(TypeError, match=r"hx must be a tuple \(h_0, c_0\), got a tuple of 3 items"):
        LayerNormLSTM(3, 4)(x, (h, h, h))
    with pytest.raises(TypeError, match=r"hx must be a tuple \(h, c\), got a list of 1 items"):
        LayerNormLSTMCell(3, 4)(x[0], [h[0]])
    with pytest.raises(TypeError, match=r"hx must be a tuple \(h_0, c_0\), got Tensor"):
        LayerNormLSTM(3, 4)(x, h)


def test_dropout_kind_and_value() -> None:
    with pytest.raises(TypeError, match=r"dropout must be a number in \[0, 1\], got str 'a'"):
        LayerNormLSTM(3, 4, 2, dropout="a")
    with pytest.raises(TypeError, match=r"dropout must be a number in \[0, 1\], got NoneType"):
        LayerNormGRU(3, 4, 2, dropout=None)
    with pytest.raises(ValueError, match=r"dropout must be a number in \[0, 1\], got nan"):
        LayerNormRNN(3, 4, 2, dropout=float("nan"))
    np = pytest.importorskip("numpy")
    assert LayerNormLSTM(3, 4, 2, dropout=np.float32(0.5)).dropout == 0.5


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("w_ih with layer norms, none on gx", "w_ih without input_norm needs normalize=False"),
        ("biases without w_ih", "b_ih and b_hh need input_norm or w_ih"),
        ("a gain of LN(gx) without input_norm", r"w0 \(a gain of LN\(gx\)\) needs input_norm"),
        ("one of torch's biases", "b_ih and b_hh come together or not at all"),
    ],
)
def test_lstm_sequence_refuses_input_arguments_that_do_not_fit(case: str, message: str) -> None:
    """:class:`LSTMSequence` takes the raw inputs and W_ih (``w_ih``) with LN(gx) in the kernels
    (``input_norm``) or with no layer norm at all; torch's biases with either; anything else is
    refused by name before a kernel runs."""
    from layernorm.recurrent import _fused

    n_steps, batch, inputs, hidden = 3, 2, 4, 5
    x = torch.randn(n_steps * batch, inputs)
    w_ih, bias = torch.randn(4 * hidden, inputs), torch.randn(4 * hidden)
    h0, c0 = torch.zeros(batch, hidden), torch.zeros(batch, hidden)
    w_hh = torch.randn(4 * hidden, hidden)
    sched = _fused.make_schedule([batch] * n_steps, False)
    normalize = case == "w_ih with layer norms, none on gx"
    extra = {
        "w_ih with layer norms, none on gx": (False, None, None, w_ih, None, None),
        "biases without w_ih": (False, None, None, None, bias, bias),
        "a gain of LN(gx) without input_norm": (False, bias, None, w_ih, None, None),
        "one of torch's biases": (False, None, None, w_ih, bias, None),
    }[case]
    gx = x if extra[3] is not None else torch.randn(n_steps * batch, 4 * hidden)
    with pytest.raises(ValueError, match=message):
        _fused.LSTMSequence.apply(
            gx, h0, c0, w_hh, None, None, None, None, sched, 1e-5, normalize, False,
            None, None, None, None, *extra,
        )  # fmt: skip
