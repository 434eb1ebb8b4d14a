r"""DRAW (Gregor et al. 2015, *DRAW: A Recurrent Neural Network For Image Generation*) with read
and write attention, and the layer-normalized DRAW of Ba et al. (2016, §6.4).

For ``t = 1 … T`` glimpses, with canvas ``c_0 = 0`` and zero initial LSTM states:

.. math::
    \hat x_t = x − σ(c_{t−1}) \\
    r_t = \mathrm{read}(x, \hat x_t, h^{dec}_{t−1}) \\
    h^{enc}_t = \mathrm{LSTM}^{enc}([r_t, h^{dec}_{t−1}]) \\
    z_t \sim Q(z_t | h^{enc}_t) = N(μ_t, σ_t),\ (μ_t, \log σ_t) = W h^{enc}_t + b \\
    h^{dec}_t = \mathrm{LSTM}^{dec}(z_t) \\
    c_t = c_{t−1} + \mathrm{write}(h^{dec}_t)

The loss of an image is the negative variational bound in nats (Gregor et al.'s loss function):
``L = L^x + L^z`` with ``L^x = −log D(x | c_T)`` (Bernoulli with logits ``c_T``, summed over the
784 pixels) and ``L^z = Σ_t ½ Σ_j (μ_{t,j}² + σ_{t,j}² − 2 log σ_{t,j} − 1)`` (the KL of each
glimpse's posterior from ``N(0, I)``).

Attention (Gregor et al.'s selective attention model): a linear map of ``h^{dec}`` gives
``(g̃_X, g̃_Y, log σ², log δ̃, log γ)``; the grid centre is ``g_X = (A+1)/2 (g̃_X + 1)``, the stride
``δ = (max(A,B)−1)/(N−1) δ̃``, and the ``N × N`` Gaussian filters have centres
``μ_X^i = g_X + (i − N/2 − 0.5) δ`` with rows of ``F_X`` normalized to sum to one. ``read``
returns ``γ [F_Y x F_Xᵀ, F_Y x̂ F_Xᵀ]`` (2N² values); ``write`` returns
``(1/γ̂) F̂_Yᵀ w_t F̂_X`` with the ``N × N`` patch ``w_t = W(h^{dec}_t)``.

The LSTM cells, with ``norm``:

* ``"none"``: ``(i, f, g, o) = W [x, h] + b``, ``c_t = σ(f) c_{t−1} + σ(i) tanh(g)``,
  ``h_t = σ(o) tanh(c_t)``;
* ``"cell"``: the same with ``h_t = σ(o) tanh(LN(c_t))`` (gain 1, bias 0 at init), layer norm on
  the cell state only, where the LN paper's supplementary material puts it for DRAW;
* ``"full"``: the full LN-LSTM, :class:`layernorm.LayerNormLSTMCell` (LN on both gate
  projections and on the cell state).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import LayerNorm, LayerNormLSTMCell

__all__ = ["DRAW", "NORMS", "DrawLSTMCell"]

NORMS = ("none", "cell", "full")


class DrawLSTMCell(nn.Module):
    r"""LSTM cell with optional layer norm on the cell state inside the output tanh.

    .. math::
        (i, f, g, o) = W [x_t, h_{t−1}] + b \\
        c_t = σ(f) ⊙ c_{t−1} + σ(i) ⊙ \tanh(g) \\
        h_t = σ(o) ⊙ \tanh(LN(c_t))  \quad (\text{or } \tanh(c_t) \text{ without norm})

    The carried state is the un-normalized ``c_t``. Both variants run the same operations apart
    from the norm, so their times per update compare the norm's cost only.

    Args:
        input_size, hidden_size: as :class:`torch.nn.LSTMCell`.
        cell_norm: layer-normalize ``c_t`` inside the tanh.
    """

    def __init__(self, input_size: int, hidden_size: int, cell_norm: bool) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.gates = nn.Linear(input_size + hidden_size, 4 * hidden_size)
        self.norm = LayerNorm(hidden_size) if cell_norm else None
        bound = 1.0 / math.sqrt(hidden_size)  # torch.nn.LSTMCell's initialization
        nn.init.uniform_(self.gates.weight, -bound, bound)
        nn.init.uniform_(self.gates.bias, -bound, bound)

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h, c = state  # (B, H) each
        i, f, g, o = self.gates(torch.cat([x, h], 1)).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        cn = self.norm(c) if self.norm is not None else c
        return torch.sigmoid(o) * torch.tanh(cn), c


def _cell(norm: str, input_size: int, hidden: int) -> nn.Module:
    if norm == "full":
        return LayerNormLSTMCell(input_size, hidden)
    return DrawLSTMCell(input_size, hidden, cell_norm=norm == "cell")


def filterbank(params: Tensor, n: int, size: int = 28) -> tuple[Tensor, Tensor, Tensor]:
    """``(F_X, F_Y, γ)`` from the attention parameters ``params (B, 5)`` of a square ``size²``
    image: ``F_X, F_Y`` of shape ``(B, n, size)`` (rows normalized), ``γ`` of shape ``(B, 1)``."""
    gx_, gy_, log_var, log_delta, log_gamma = params.unbind(1)  # (B,) each
    gx = (size + 1) / 2 * (gx_ + 1)
    gy = (size + 1) / 2 * (gy_ + 1)
    delta = (size - 1) / max(n - 1, 1) * torch.exp(log_delta)
    var = torch.exp(log_var)
    # Gregor et al.'s coordinates are 1-based: filters i = 1..n, pixels a = 1..size, so the
    # grid at g̃ = 0 is centred on the image, (size + 1) / 2
    grid = torch.arange(1, n + 1, dtype=params.dtype, device=params.device) - n / 2 - 0.5
    pix = torch.arange(1, size + 1, dtype=params.dtype, device=params.device)  # (size,)

    def bank(g: Tensor) -> Tensor:
        mu = g[:, None] + grid[None, :] * delta[:, None]  # (B, n) filter centres
        f = torch.exp(-((pix[None, None, :] - mu[:, :, None]) ** 2) / (2 * var[:, None, None]))
        # the small constant keeps a filter that falls entirely off the image finite
        return f / (f.sum(2, keepdim=True) + 1e-8)  # (B, n, size)

    return bank(gx), bank(gy), torch.exp(log_gamma)[:, None]


def _init_attention(layer: nn.Linear, n: int, size: int, span: float, write: bool) -> None:
    """Start the grid centred, with stride ``δ = span·(size−1)/(n−1)``, filter width ``σ = δ/2``
    and unit gain: ``γ = 1`` for a read (a constant image reads as that constant), ``γ = 1/δ²``
    for a write (a constant patch adds about that constant to every pixel under the grid, since
    the filters, each summing to one, overlap ``1/δ`` per pixel and axis).

    Gregor et al. do not state an initialization. Torch's default bias would start a 2 × 2 read
    grid at stride 27 with σ = 1 pixel: its four filters then sit on MNIST's blank corners, the
    read carries nothing about the image, and training stays for hundreds of updates at the bound
    of the mean image (≈ 203 nats); and with γ = 1 a write changes a pixel's logit by only about
    w/δ², so the canvas grows slowly. The rule above gives both a useful start."""
    delta = span * (size - 1) / max(n - 1, 1)
    with torch.no_grad():
        layer.bias.zero_()  # g̃ = 0: centred
        layer.bias[2] = 2 * math.log(delta / 2)  # log σ²
        layer.bias[3] = math.log(span)  # log δ̃
        layer.bias[4] = -2 * math.log(delta) if write else 0.0  # log γ


class DRAW(nn.Module):
    """DRAW with read and write attention on ``size × size`` binary images.

    Args:
        glimpses: ``T``, the number of read/write steps.
        hidden: units of the encoder and of the decoder LSTM.
        z_size: latent units per glimpse.
        read_n, write_n: attention grid sizes (Gregor et al.'s MNIST model: 2 and 5).
        norm: ``"none"``, ``"cell"`` (LN on the cell state, the LN paper's DRAW) or ``"full"``
            (the full LN-LSTM); see the module docstring.
        size: image side (28 for MNIST).

    ``forward(x (B, size²), generator=None) -> (B,)`` the negative variational bound (nats) of
    each image, with ``z`` sampled from ``generator`` (torch's global RNG when ``None``).
    """

    def __init__(self, glimpses: int, hidden: int, z_size: int, read_n: int = 2,
                 write_n: int = 5, norm: str = "none", size: int = 28) -> None:  # fmt: skip
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"DRAW: norm must be one of {NORMS}, got {norm!r}")
        if min(glimpses, hidden, z_size, read_n, write_n, size) < 1:
            raise ValueError("DRAW: glimpses, hidden, z_size, read_n, write_n, size must be >= 1")
        self.glimpses, self.hidden, self.z_size = glimpses, hidden, z_size
        self.read_n, self.write_n, self.size, self.norm = read_n, write_n, size, norm
        self.encoder = _cell(norm, 2 * read_n * read_n + hidden, hidden)
        self.decoder = _cell(norm, z_size, hidden)
        self.q = nn.Linear(hidden, 2 * z_size)  # (μ, log σ)
        self.read_attn = nn.Linear(hidden, 5)
        self.write_attn = nn.Linear(hidden, 5)
        self.write_patch = nn.Linear(hidden, write_n * write_n)
        _init_attention(self.read_attn, read_n, size, span=0.5, write=False)
        _init_attention(self.write_attn, write_n, size, span=1.0, write=True)

    def read(self, x: Tensor, x_hat: Tensor, h_dec: Tensor) -> Tensor:
        """``γ [F_Y x F_Xᵀ, F_Y x̂ F_Xᵀ]``, flattened to ``(B, 2 N²)``."""
        fx, fy, gamma = filterbank(self.read_attn(h_dec), self.read_n, self.size)
        s = self.size
        both = torch.stack([x.view(-1, s, s), x_hat.view(-1, s, s)], 1)  # (B, 2, s, s)
        glimpse = fy[:, None] @ both @ fx[:, None].transpose(2, 3)  # (B, 2, N, N)
        return gamma * glimpse.flatten(1)

    def write(self, h_dec: Tensor) -> Tensor:
        """``(1/γ̂) F̂_Yᵀ w F̂_X`` flattened to ``(B, size²)``."""
        fx, fy, gamma = filterbank(self.write_attn(h_dec), self.write_n, self.size)
        w = self.write_patch(h_dec).view(-1, self.write_n, self.write_n)
        return (fy.transpose(1, 2) @ w @ fx).flatten(1) / gamma

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        b = x.shape[0]
        zeros = x.new_zeros(b, self.hidden)
        enc, dec = (zeros, zeros), (zeros, zeros)
        canvas = torch.zeros_like(x)
        kl = x.new_zeros(b)
        for _ in range(self.glimpses):
            x_hat = x - torch.sigmoid(canvas)
            r = self.read(x, x_hat, dec[0])
            enc = self.encoder(torch.cat([r, dec[0]], 1), enc)
            mu, log_sigma = self.q(enc[0]).chunk(2, 1)
            eps = torch.randn(mu.shape, generator=generator, dtype=mu.dtype, device=mu.device)
            z = mu + torch.exp(log_sigma) * eps
            kl = kl + 0.5 * (mu**2 + torch.exp(2 * log_sigma) - 2 * log_sigma - 1).sum(1)
            dec = self.decoder(z, dec)
            canvas = canvas + self.write(dec[0])
        recon = F.binary_cross_entropy_with_logits(canvas, x, reduction="none").sum(1)
        return recon + kl
