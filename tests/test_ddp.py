"""Data parallelism on 2 CPU processes (gloo): a layer-norm network's gradients equal those of one
process on the same global batch; a batch-norm network's do not, because each process normalizes
with its own half of the batch (the paper's point about small per-device batches)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from layernorm.experiments.engine import distributed
from layernorm.experiments.models.mlp import build_mlp

GLOBAL_BATCH = 8


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = 0.3 + torch.rand(GLOBAL_BATCH, 784, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)


def _model(norm: str) -> nn.Module:
    torch.manual_seed(1)
    return build_mlp(norm, 12, batch_size=GLOBAL_BATCH).double()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _ddp_grads(norm: str, rank: int, world: int) -> list[torch.Tensor]:
    """One backward of ``norm``'s network under DDP on this process's share of the batch; the
    wrapper (which holds the process group) is freed on return."""
    x, y = _data()
    model = _model(norm)
    net = distributed.wrap(model, torch.device("cpu"))
    assert isinstance(net, nn.parallel.DistributedDataParallel)
    idx = distributed.shard(torch.arange(GLOBAL_BATCH), rank, world)
    nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
    return _grads(model)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    assert distributed.init_from_env(torch.device("cpu"))
    result = {norm: _ddp_grads(norm, rank, world) for norm in ("layer", "batch")}
    if rank == 0:
        torch.save(result, out)
    # the group left with no DDP wrapper holding it: one freed at the interpreter's exit aborted
    # a worker now and then (gloo, "terminate called without an active exception")
    distributed.close()
    assert not dist.is_initialized()
    # and no interpreter teardown at all: gloo's threads were still seen to abort a worker there
    # once the work was done (the full suite under load; the result file is closed by now)
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_ddp_layer_norm_matches_single_process_batch_norm_does_not(tmp_path):
    out = str(tmp_path / "grads.pt")
    for attempt in range(3):
        # the free port is found before the workers bind it: another process may take it first
        try:
            mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
            break
        except mp.ProcessRaisedException as e:
            if "address already in use" not in str(e).lower() or attempt == 2:
                raise
    ddp = torch.load(out, weights_only=True)

    x, y = _data()
    for norm in ("layer", "batch"):
        model = _model(norm)
        nn.functional.cross_entropy(model(x), y).backward()
        single = _grads(model)
        diffs = [float((a - b).abs().max()) for a, b in zip(ddp[norm], single, strict=True)]
        scale = max(float(g.abs().max()) for g in single)
        if norm == "layer":
            assert max(diffs) <= 1e-12 * scale, diffs  # float64: only the summation order differs
        else:
            assert max(diffs) > 1e-3 * scale, diffs  # per-process batch statistics


def test_shard_needs_an_even_split():
    assert distributed.shard(torch.arange(8), 1, 2).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="divisible"):
        distributed.shard(torch.arange(7), 0, 2)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_close_leaves_a_callers_own_group_alone(tmp_path):
    """``close`` leaves only the group ``init_from_env`` started: one the caller made stays up."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        distributed.close()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
    distributed.close()  # nothing up: nothing to do
    assert not dist.is_initialized()
