"""Data-parallel training under ``torchrun``: process-group set-up and batch sharding.

``torchrun --nproc_per_node N -m layernorm reproduce mnist-ff`` starts N processes with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; :func:`init_from_env` joins them (gloo on
CPU, nccl on CUDA). Each process takes its contiguous share of every global mini-batch
(:func:`shard`) and :class:`torch.nn.parallel.DistributedDataParallel` averages the gradients, so a
model whose per-example computation does not look at other examples (layer norm) gets exactly the
gradient of the global batch; batch norm instead normalizes with each process's smaller batch —
the paper's point about small per-device batches.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["barrier", "close", "init_from_env", "is_main", "rank_world", "shard", "wrap"]


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return rank_world()[0] == 0


# id() of the process group init_from_env started (close() leaves only that one, not a caller's
# own; an id, not the group: a reference kept here would hold the group to the interpreter's exit)
_joined: list[int] = []


def init_from_env(device: torch.device) -> bool:
    """Join the process group described by torchrun's environment; ``False`` when not launched
    by torchrun (``WORLD_SIZE`` unset or 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or not dist.is_available():
        return False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        _joined.append(id(dist.group.WORLD))
    return True


def shard(batch: Tensor, rank: int, world: int) -> Tensor:
    """This process's contiguous slice of a global batch (its size must divide evenly)."""
    if batch.shape[0] % world:
        raise ValueError(
            f"a global batch of {batch.shape[0]} cannot be split evenly over {world} processes; "
            "choose a batch size divisible by the number of processes"
        )
    return batch.chunk(world)[rank]


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    """Wrap in DDP when a process group is up; the model itself otherwise."""
    if rank_world()[1] == 1:
        return model
    ids = [device.index] if device.type == "cuda" and device.index is not None else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()


def close() -> None:
    """Leave the process group :func:`init_from_env` started (after a barrier, so that no process
    leaves while another still talks to it); nothing otherwise. Call it once the DDP wrappers are
    freed: a group left to the interpreter's exit is torn down in no set order, and gloo aborted
    processes there now and then ("terminate called without an active exception")."""
    if _joined and dist.is_initialized() and id(dist.group.WORLD) == _joined[-1]:
        dist.barrier()
        dist.destroy_process_group()
    _joined.clear()
