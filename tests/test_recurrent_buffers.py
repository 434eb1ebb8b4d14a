"""The CPU buffer cache (layernorm.kernels.cpu.buffers) of the recurrent layers and the norm
kernels' large outputs: a buffer is handed out
again only once nothing holds its memory, and training through it gives the gradients that fresh
buffers give, with graphs alive side by side and graphs run backward twice."""

from __future__ import annotations

import pytest
import torch

import layernorm
from kernel_paths import needs_sequence_kernels
from layernorm import LayerNormGRU, LayerNormLSTM
from layernorm.kernels.cpu import buffers as _buffers
from layernorm.kernels.cpu import torch_ops
from layernorm.recurrent import buffer_cache_limit, clear_buffer_cache, set_buffer_cache_limit
from layernorm.recurrent import layers as recurrent_layers

pytestmark = pytest.mark.skipif(
    _buffers._FREE is None, reason="this torch has no storage reference count"
)

_ROWS = _buffers.MIN_BYTES // (4 * 64)  # a (rows, 64) float32 buffer is cached


@pytest.fixture(autouse=True)
def fresh_cache():
    limit = buffer_cache_limit()
    clear_buffer_cache()
    yield
    set_buffer_cache_limit(limit)
    clear_buffer_cache()


def _like() -> torch.Tensor:
    return torch.empty(0)


def test_released_buffer_is_handed_out_again() -> None:
    a = _buffers.empty(_like(), (_ROWS, 64))
    ptr = a.data_ptr()
    del a
    b = _buffers.empty(_like(), (_ROWS, 64))
    assert b.data_ptr() == ptr
    assert b._base is None  # not a view: an autograd output on it may be modified in place


@pytest.mark.parametrize("hold", ["view", "storage", "tensor"])
def test_buffer_held_anywhere_is_not_handed_out(hold) -> None:
    a = _buffers.empty(_like(), (_ROWS, 64))
    ptr = a.data_ptr()
    kept = {"view": a[1:], "storage": a.untyped_storage(), "tensor": a}[hold]
    del a
    b = _buffers.empty(_like(), (_ROWS, 64))
    assert b.data_ptr() != ptr
    del kept, b
    cached = _buffers.cached_bytes()
    c = _buffers.empty(_like(), (_ROWS, 64))  # both free now: one is handed out, none made
    assert c.data_ptr() != 0 and _buffers.cached_bytes() == cached


def test_small_and_cuda_like_buffers_are_not_cached() -> None:
    small = _buffers.empty(_like(), (4, 64))
    assert small.shape == (4, 64)
    assert _buffers.cached_bytes() == 0


def test_a_free_buffer_serves_requests_up_to_an_eighth_smaller() -> None:
    """New buffers have the size asked for; a free one serves a request it exceeds by at most an
    eighth (the smallest that fits), not a smaller one."""
    rows = 8 * _ROWS
    a = _buffers.empty(_like(), (rows, 64))
    ptr, cached = a.data_ptr(), _buffers.cached_bytes()
    assert cached == rows * 64 * 4
    del a
    b = _buffers.empty(_like(), (rows - rows // 9, 64))  # fits: the same memory
    assert b.data_ptr() == ptr and _buffers.cached_bytes() == cached
    del b
    c = _buffers.empty(_like(), (rows // 2, 64))  # too small for it: a new buffer
    assert c.data_ptr() != ptr and _buffers.cached_bytes() == cached + rows // 2 * 64 * 4
    del c
    d = _buffers.empty(_like(), (rows // 2 - 1, 64))  # the smaller free one fits best
    assert d.data_ptr() != ptr


def test_limit_bounds_what_is_kept() -> None:
    set_buffer_cache_limit(0)
    a = _buffers.empty(_like(), (_ROWS, 64))
    assert _buffers.cached_bytes() == 0
    del a
    one = _buffers.MIN_BYTES
    set_buffer_cache_limit(2 * one)
    held = [_buffers.empty(_like(), (_ROWS, 64)) for _ in range(3)]  # the third is not kept
    assert _buffers.cached_bytes() == 2 * one
    del held
    set_buffer_cache_limit(one)  # free buffers beyond the new limit go
    assert _buffers.cached_bytes() == one
    with pytest.raises(ValueError, match="byte count >= 0"):
        set_buffer_cache_limit(-1)


@pytest.mark.parametrize("full", [False, True], ids=["room", "at-limit"])
def test_many_held_buffers_are_not_all_asked(full, monkeypatch) -> None:
    """A caller holding many buffers of one size (graphs kept alive): an allocation asks at most
    ``_MAX_PROBES`` of them whether they are free, in lookup and in eviction (at the limit too),
    and a buffer released among the first it asks is handed out again."""
    held = [_buffers.empty(_like(), (_ROWS, 64)) for _ in range(40)]
    assert len(held) > 2 * _buffers._MAX_PROBES  # else the test shows nothing
    if full:
        set_buffer_cache_limit(_buffers.cached_bytes())
    asked = []
    real = _buffers._holders
    monkeypatch.setattr(_buffers, "_holders", lambda flat: asked.append(1) or real(flat))
    extra = _buffers.empty(_like(), (_ROWS, 64))
    assert extra.data_ptr() not in {t.data_ptr() for t in held}
    assert 0 < len(asked) <= 2 * _buffers._MAX_PROBES
    ptr = held[1].data_ptr()
    del held[1]
    asked.clear()
    again = _buffers.empty(_like(), (_ROWS, 64))
    assert again.data_ptr() == ptr and len(asked) == 2


def test_without_reference_counts_every_buffer_is_fresh(monkeypatch) -> None:
    monkeypatch.setattr(_buffers, "_FREE", None)
    a = _buffers.empty(_like(), (_ROWS, 64))
    assert a.shape == (_ROWS, 64) and _buffers.cached_bytes() == 0


def test_threads_never_share_a_buffer() -> None:
    """Threads taking and releasing buffers at once: no two buffers held at the same time share
    memory (a buffer is found free and handed out under one lock)."""
    import threading

    held: list[list[torch.Tensor]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def work(k: int) -> None:
        start.wait()
        for i in range(200):
            t = _buffers.empty(_like(), (_ROWS, 64))
            if i % 3 == 0:
                held[k].append(t)  # kept to the end: must stay this thread's alone

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ptrs = [t.data_ptr() for ts in held for t in ts]
    assert len(ptrs) == len(set(ptrs))


def _grads(model: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
    grads = torch.autograd.grad(out.square().sum(), [x, *model.parameters()], retain_graph=True)
    return [g.clone() for g in grads]


@pytest.mark.usefixtures("python_training_node")  # the C++ node's buffers are its own
@pytest.mark.parametrize("cls", [LayerNormLSTM, LayerNormGRU], ids=["lstm", "gru"])
def test_training_through_the_cache_matches_fresh_buffers(cls) -> None:
    """Two graphs alive at once, each run backward twice (retain_graph), against the gradients
    with the cache off: a buffer still held by the first graph must not serve the second."""
    torch.manual_seed(0)
    model = cls(16, 64)
    xs = [torch.randn(40, 16, 16, requires_grad=True) for _ in range(2)]  # (640, 256) buffers
    set_buffer_cache_limit(0)
    reference = []
    for x in xs:
        out = model(x)[0]
        reference.append((out.detach().clone(), _grads(model, x, out)))
    set_buffer_cache_limit(64 << 20)
    outs = [model(x)[0] for x in xs]
    assert _buffers.cached_bytes() > 0
    for _ in range(2):
        for x, out, (ref_out, ref_grads) in zip(xs, outs, reference, strict=True):
            torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
            for g, r in zip(_grads(model, x, out), ref_grads, strict=True):
                torch.testing.assert_close(g, r, rtol=0, atol=0)
        # a third forward in between, on the buffers the first two left free
        model(torch.randn(40, 16, 16))[0].sum().backward()


_NORM_OPS = {
    "layer_norm": lambda x, w: layernorm.layer_norm(x, x.shape[-1], w, None),
    "detach_norm": lambda x, w: layernorm.layer_norm(x, x.shape[-1], w, None, detach_std=True),
    "rms_norm": lambda x, w: layernorm.rms_norm(x, x.shape[-1], w),
    "ada_norm": lambda x, w: layernorm.ada_norm(x, x.shape[-1]),
}


def _norm_case(op: str, seed: int):
    """``(op, x, w)``: norm op ``op`` of _NORM_OPS and a ``(_ROWS, 64)`` float32 input with its
    gain (skips where the fused kernels are not built: only they take buffers of the cache)."""
    from layernorm.kernels.cpu import _native

    if not _native.enabled():
        pytest.skip("the fused kernels are not built here")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(_ROWS, 64, generator=gen) + 3.0
    return _NORM_OPS[op], x, 0.5 + torch.rand(64, generator=gen)


@pytest.mark.parametrize("op", list(_NORM_OPS))
def test_large_norm_outputs_come_from_the_cache_and_stay_the_callers(op, monkeypatch) -> None:
    """From OUTPUT_MIN_BYTES up a norm kernel's y and dx are buffers of the cache: reused once
    nothing holds them, never while an output or a gradient the caller kept does, and equal to
    what fresh memory gives."""
    monkeypatch.setattr(_buffers, "OUTPUT_MIN_BYTES", _buffers.MIN_BYTES)
    fn, x, w = _norm_case(op, seed=7)
    with torch.no_grad():
        y1 = fn(x, w)
        kept = y1.clone()
        y2 = fn(2 * x, w)  # y1 held: other memory
        assert y2.data_ptr() != y1.data_ptr() and torch.equal(y1, kept)
        ptr = y1.data_ptr()
        del y1
        y3 = fn(x, w)  # y1's memory is free again
        assert y3.data_ptr() == ptr and torch.equal(y3, kept)
    assert _buffers.cached_bytes() > 0
    xg = x.clone().requires_grad_()
    fn(xg, w).sum().backward()
    g1 = xg.grad
    kept_grad = g1.clone()
    xg.grad = None
    fn(xg, w).sum().backward()  # the first gradient is held: the second gets other memory
    assert xg.grad.data_ptr() != g1.data_ptr() and torch.equal(g1, kept_grad)
    torch.testing.assert_close(xg.grad, kept_grad, rtol=0, atol=0)
    set_buffer_cache_limit(0)  # off: fresh memory, nothing more kept (held buffers stay counted)
    held = _buffers.cached_bytes()
    with torch.no_grad():
        assert torch.equal(fn(x, w), kept) and _buffers.cached_bytes() == held


@pytest.mark.parametrize("op", list(_NORM_OPS))
def test_outputs_a_backward_follows_come_from_the_cache_from_the_training_size(
    op, monkeypatch
) -> None:
    """On the ops' Python path (where the C++ operators are off: they take these sizes with
    outputs from malloc), below OUTPUT_MIN_BYTES and from TRAINING_OUTPUT_MIN_BYTES up, a forward
    that autograd records takes its output from the cache and its backward the input gradient;
    the next step reuses both once the caller let go of them; under no_grad the same call takes
    fresh memory."""
    monkeypatch.setitem(torch_ops._switch, "on", False)
    fn, x, w = _norm_case(op, seed=3)
    nbytes = _ROWS * 64 * 4
    assert _buffers.TRAINING_OUTPUT_MIN_BYTES <= nbytes < _buffers.OUTPUT_MIN_BYTES
    with torch.no_grad():
        expected = fn(x, w)
    assert _buffers.cached_bytes() == 0
    xg = x.clone().requires_grad_()
    y = fn(xg, w)
    assert _buffers.cached_bytes() == nbytes
    torch.testing.assert_close(y.detach(), expected, rtol=0, atol=0)
    y.sum().backward()
    assert _buffers.cached_bytes() == 2 * nbytes
    kept_grad = xg.grad.clone()
    del y
    xg.grad = None
    y = fn(xg, w)
    y.sum().backward()
    assert _buffers.cached_bytes() == 2 * nbytes  # both buffers handed out again
    torch.testing.assert_close(xg.grad, kept_grad, rtol=0, atol=0)


def test_small_norm_outputs_are_plain_allocations() -> None:
    x = torch.randn(_ROWS, 64)  # above MIN_BYTES, below OUTPUT_MIN_BYTES
    with torch.no_grad():
        layernorm.layer_norm(x, 64)
    assert _buffers.cached_bytes() == 0


@needs_sequence_kernels
@pytest.mark.usefixtures("python_training_node")  # the C++ node's buffers are its own
@pytest.mark.parametrize("cls", [LayerNormLSTM, LayerNormGRU], ids=["lstm", "gru"])
@pytest.mark.parametrize("steps", [1, 40], ids=["one step", "sequence"])
def test_weight_gradients_come_from_the_cache_and_kept_ones_stay(cls, steps, monkeypatch) -> None:
    """The recurrent weight's gradient is a buffer of the cache: after ``zero_grad()`` the next
    step's gradient takes the same memory (no fresh pages), and a gradient the caller kept is
    never written by a later step."""
    # the fused node at one step, which a training call of one step otherwise leaves to the
    # step ops (layers._LEAN_TRAINING_STEPS)
    monkeypatch.setattr(recurrent_layers, "_LEAN_TRAINING_STEPS", {})
    torch.manual_seed(0)
    model = cls(16, 160)  # W_hh (G, 160): above the cache's smallest buffer
    x = torch.randn(steps, 16, 16)

    def step(inputs: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        model(inputs)[0].square().sum().backward()
        return model.weight_hh_l0.grad

    assert model.weight_hh_l0.numel() * 4 >= _buffers.MIN_BYTES
    first = step(x)
    cached = {t.untyped_storage().data_ptr() for t in _buffers._CACHE.entries.values()}
    assert first.untyped_storage().data_ptr() in cached
    ptr = first.data_ptr()
    del first
    assert step(x).data_ptr() == ptr  # released by zero_grad, handed out again
    kept = model.weight_hh_l0.grad
    kept_values = kept.clone()
    again = step(2 * x)  # `kept` is still held: the new gradient takes other memory
    assert again.data_ptr() != kept.data_ptr()
    assert torch.equal(kept, kept_values)
