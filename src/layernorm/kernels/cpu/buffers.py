"""Reused CPU memory: the fused recurrent functions' per-row buffers and the norm kernels' large
outputs.

A training call of an LN-LSTM allocates about a dozen ``(N, ·)`` buffers (the gates, the
pre-activations, the statistics kept for backward; the gradients backward writes), megabytes each,
and frees them when the step is done. Memory that size comes fresh from the operating system on
every call, and the first write to each of its pages is a page fault: LN-LSTM training at
``(T, B, I, H) = (1000, 4, 32, 128)`` spent 14% of its time in the kernel's page-fault handling
(AMD EPYC, one thread; ``torch.nn.LSTM``, whose oneDNN kernels keep their scratch memory, 3%), and
handing backward's three buffers back from one call to the next cut its time from 15.0 to 10.7 ms.

So buffers of at least :data:`MIN_BYTES` come from a cache: each is a tensor on the memory of a
flat tensor the cache keeps, and that memory is handed out again once nothing else holds it: no
tensor or view on it alive, not in the saved tensors of an autograd graph, not a gradient, not an
output a caller kept (torch counts a storage's references from C++, and Python those to its
storage object; a caller holding either keeps that buffer out of the cache's reach, and the next
call gets another). A buffer serves requests up to an eighth smaller than itself (the smallest
free one that fits, among the first few asked: :data:`_MAX_PROBES`), so that sequences of
somewhat different lengths share buffers, and new buffers have the size asked for. The cache
keeps at most :func:`buffer_cache_limit` bytes (the least recently used free buffers go first);
:func:`clear_buffer_cache` hands them all back. CUDA tensors come from torch's own caching
allocator and never pass through here.

The norm kernels take their outputs (y, dx) from here (:func:`output`) from
:data:`OUTPUT_MIN_BYTES` up, and from :data:`TRAINING_OUTPUT_MIN_BYTES` up when a backward
follows (the forward of an autograd node, and its backward). glibc's malloc maps a block of 32 MiB
or more from the operating system on every call and unmaps it when freed, so each call's first
write to each of its pages faults: a float32 layer norm's forward and backward at (8192, 1024)
took 55 ms on a processor that ran it in 16 ms on reused memory (AMD EPYC, one thread; torch's own
58 ms). Smaller blocks come from malloc's heap, but a training step frees the forward's output
and the backward's gradient together, and freeing that much at the top of the heap hands it back
to the operating system (glibc's trim threshold, twice the largest block it has mapped), so the
next step faults again: forward and backward of float32 layer norm, one thread, fresh against
reused memory, (512, 1024) 1.66 against 0.95 ms, (2048, 768) 4.8 against 3.2 ms, (8192, 256)
6.3 against 3.8 ms. A forward alone frees its output by itself, which the heap keeps: there the
cache's lookup (about 8 µs) only costs, 7-20% of a call of up to a few MiB, hence the two sizes.
"""

from __future__ import annotations

import bisect
import math
import sys
import threading
from collections import OrderedDict

import torch
from torch import Tensor

#: Buffers smaller than this are plain allocations (small ones come from the heap without page
#: faults, and the cache's bookkeeping would cost more than it saves on a decoder step).
MIN_BYTES = 256 << 10
#: The norm kernels' outputs from this size up come from the cache (:func:`output`): glibc's
#: largest mmap threshold, from which on every allocation is a fresh mapping.
OUTPUT_MIN_BYTES = 32 << 20
#: The same for the outputs of a call that a backward follows: the forward's output and the
#: backward's input gradient (see the module's notes).
TRAINING_OUTPUT_MIN_BYTES = MIN_BYTES
_DEFAULT_LIMIT = 512 << 20

# torch's count of a storage's references from C++ (its tensors and views, a Python storage
# object while Python holds one). Private to torch: without it nothing is cached.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _holders(flat: Tensor) -> tuple[int, int]:
    """References to ``flat``'s storage: from C++, and to its Python storage object (torch keeps
    one object per storage, so a caller holding it shows only in the second count)."""
    storage = flat.untyped_storage()
    return _use_count(storage._cdata), sys.getrefcount(storage)  # type: ignore[misc]


# What a flat tensor that nothing else holds shows (its own reference, and this module's).
_FREE = None if _use_count is None else _holders(torch.empty(1))


def _fits(size: int, numel: int) -> bool:
    """Whether a buffer of ``size`` elements serves ``numel``: at most an eighth larger."""
    return numel <= size <= numel + numel // 8


# Most buffers a lookup asks whether they are free (about 2 µs each): a caller holding many
# graphs (outputs kept with grad enabled, a loss summed over many forward calls) holds many
# buffers of each size, and asking each of them on every allocation cost more than the call
# (LN-LSTM forward at (50, 16, 32, 64) with 400 graphs held: 8.9 ms a call against 4.8 ms with
# the cache off). Past this many, a lookup takes a fresh allocation, an eviction stops.
_MAX_PROBES = 8


class _Cache:
    """The buffers, and the lock under which a buffer is found free and handed out in one step
    (two threads checking the same free buffer before either holds it would share it).

    ``entries`` orders them by last hand-out (least recent first: eviction's order);
    ``by_size`` finds those of a dtype and element count (``sizes``: the counts, sorted), each
    list least recently handed out first, where a free one is likeliest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        # id -> flat tensor, least recently handed out first
        self.entries: OrderedDict[int, Tensor] = OrderedDict()
        self.by_size: dict[tuple[torch.dtype, int], list[Tensor]] = {}
        self.sizes: dict[torch.dtype, list[int]] = {}
        self.lock = threading.Lock()

    @staticmethod
    def _free(flat: Tensor) -> bool:
        return _FREE is not None and _holders(flat) == _FREE

    def _take(self, dtype: torch.dtype, numel: int) -> Tensor | None:
        """The smallest free buffer of ``dtype`` that fits ``numel`` elements among the first
        :data:`_MAX_PROBES` that fit, or ``None`` (under the lock)."""
        sizes = self.sizes.get(dtype, [])
        probes = 0
        for i in range(bisect.bisect_left(sizes, numel), len(sizes)):
            if not _fits(sizes[i], numel):
                break
            bucket = self.by_size[dtype, sizes[i]]
            for j, flat in enumerate(bucket):
                if probes == _MAX_PROBES:
                    return None
                probes += 1
                if self._free(flat):
                    bucket.append(bucket.pop(j))
                    self.entries.move_to_end(id(flat))
                    return flat
        return None

    def _drop(self, ident: int) -> None:
        """Forget entry ``ident`` (under the lock)."""
        old = self.entries.pop(ident)
        key = (old.dtype, old.numel())
        bucket = self.by_size[key]
        del bucket[next(j for j, t in enumerate(bucket) if t is old)]  # by identity, not ==
        if not bucket:
            del self.by_size[key]
            self.sizes[old.dtype].remove(key[1])
        self.bytes -= old.numel() * old.element_size()

    def _evict(self, room: int, max_busy: int | None = _MAX_PROBES) -> None:
        """Drop free buffers, least recently used first, until ``room`` more bytes fit, asking
        at most ``max_busy`` buffers in use (``None``: all of them) (under the lock)."""
        if self.bytes + room <= self.limit:
            return
        busy = 0
        for ident, flat in list(self.entries.items()):  # a copy: dropping changes entries
            if self.bytes + room <= self.limit or busy == max_busy:
                return
            if self._free(flat):
                self._drop(ident)
            else:
                busy += 1

    def _add(self, flat: Tensor) -> None:
        """Keep ``flat`` if it fits under the limit (under the lock)."""
        size = flat.numel() * flat.element_size()
        self._evict(size)
        if self.bytes + size <= self.limit:
            self.entries[id(flat)] = flat
            key = (flat.dtype, flat.numel())
            if key not in self.by_size:
                self.by_size[key] = []
                bisect.insort(self.sizes.setdefault(flat.dtype, []), key[1])
            self.by_size[key].append(flat)
            self.bytes += size

    def empty(self, like: Tensor, shape: tuple[int, ...], dtype: torch.dtype, numel: int) -> Tensor:
        with self.lock:
            flat = self._take(dtype, numel)
            if flat is None:
                flat = like.new_empty((numel,), dtype=dtype)
                self._add(flat)
            # a tensor on the flat tensor's memory, not a view of it: an output of an autograd
            # Function that is a view may not be modified in place (Dropout(inplace=True) on it)
            return like.new_empty((0,), dtype=dtype).set_(flat.untyped_storage(), 0, shape)

    def set_limit(self, limit: int) -> None:
        with self.lock:
            self.limit = limit
            self._evict(0, max_busy=None)  # every free buffer beyond it

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.by_size.clear()
            self.sizes.clear()
            self.bytes = 0


_CACHE = _Cache(_DEFAULT_LIMIT)


def empty(like: Tensor, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialized contiguous tensor of ``shape`` on ``like``'s device, in ``dtype``
    (default ``like``'s): on the CPU and from :data:`MIN_BYTES` up, a buffer of the cache."""
    dtype = like.dtype if dtype is None else dtype
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if not like.is_cpu or _FREE is None or nbytes < MIN_BYTES or nbytes > _CACHE.limit:
        return like.new_empty(shape, dtype=dtype)
    return _CACHE.empty(like, shape, dtype, numel)


def output(like: Tensor, for_backward: bool = False) -> Tensor:
    """An uninitialized tensor of ``like``'s shape, dtype and device for a kernel's output: from
    the cache from :data:`OUTPUT_MIN_BYTES` up (CPU), from :data:`TRAINING_OUTPUT_MIN_BYTES` up
    ``for_backward`` (a forward whose backward follows, or that backward), else
    ``torch.empty_like``. Contiguous."""
    limit = TRAINING_OUTPUT_MIN_BYTES if for_backward else OUTPUT_MIN_BYTES
    if like.numel() * like.element_size() < limit:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    return empty(like, tuple(like.shape))


def buffer_cache_limit() -> int:
    """The most bytes the buffer cache keeps (default 512 MiB)."""
    return _CACHE.limit


def set_buffer_cache_limit(nbytes: int) -> None:
    """Keep at most ``nbytes`` bytes of buffers for reuse (0: none, every buffer a fresh
    allocation); free buffers beyond the new limit are handed back now."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"set_buffer_cache_limit: expected a byte count >= 0, got {nbytes!r}")
    _CACHE.set_limit(nbytes)


def clear_buffer_cache() -> None:
    """Hand back every cached buffer (those in use stay with their holders until released)."""
    _CACHE.clear()


def cached_bytes() -> int:
    """Bytes the buffer cache holds now, in use or free."""
    return _CACHE.bytes
