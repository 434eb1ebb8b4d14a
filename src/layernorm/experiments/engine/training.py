"""The training loop every experiment shares: mini-batch training with per-epoch evaluation,
atomic per-epoch checkpoints, exact resumption and optional data parallelism.

Determinism: the model is built right after ``torch.manual_seed(seed)``, the data order comes
from a dedicated ``torch.Generator`` seeded with ``seed``, and each checkpoint stores the model,
the optimizer, that generator's state, torch's global RNG state and the history so far (the
files are :class:`~layernorm.experiments.engine.checkpoints.RunFiles`). A run resumed from the
checkpoint of epoch ``k`` therefore performs exactly the same floating-point operations as an
uninterrupted run, and ends with bitwise the same numbers on the same machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from . import distributed
from .checkpoints import RunFiles, checkpoint_written, claimed_run
from .registry import Record, RunContext

__all__ = [
    "TrainSpec",
    "evaluate",
    "make_adam",
    "torch_threads",
    "train_classifier",
]


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads (``n <= 0``: torch's setting), then restore it.

    The quick models are small (the recurrent ones a long chain of tiny matrix products): on a
    2-core CPU that is also busy with other work, splitting each small product over two threads
    costs more in waiting than it saves, so the quick settings use one thread. A resumed run
    must use the same count to repeat the same sums.
    """
    if n <= 0:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def make_adam(model: nn.Module, lr: float) -> torch.optim.Adam:
    """Adam with torch's defaults, fused (one kernel over all parameters per update) where the
    parameters allow it: at batch 4 the optimizer's pass over the 1.8M parameters of the
    784-1000-1000-10 network costs more than the network itself, and fusing halves the epoch
    (160–235 s → 95 s on one AMD EPYC thread). The same update rule, only rounded differently."""
    params = list(model.parameters())
    fusable = all(p.dtype.is_floating_point and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.Adam(params, lr=lr, fused=fusable or None)


@dataclass(frozen=True)
class TrainSpec:
    """How to train one model.

    Attributes:
        epochs: passes over the training set.
        batch_size: the global mini-batch (split over processes under torchrun).
        lr: Adam learning rate.
        seed: seeds model initialisation and data order.
        eval_batch_size: batch size for evaluation passes (no gradients).
    """

    epochs: int
    batch_size: int
    lr: float = 1e-3
    seed: int = 0
    eval_batch_size: int = 1000


@torch.no_grad()
def evaluate(
    model: nn.Module, x: Tensor, y: Tensor, device: torch.device, batch: int
) -> tuple[float, float]:
    """Mean negative log-likelihood (nats) and error rate of a classifier in eval mode."""
    was_training = model.training
    model.eval()
    nll, wrong = 0.0, 0
    for i in range(0, x.shape[0], batch):
        xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
        logits = model(xb)
        nll += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
        wrong += int((logits.argmax(1) != yb).sum())
    model.train(was_training)
    return nll / x.shape[0], wrong / x.shape[0]


@claimed_run
def train_classifier(
    run_id: str,
    build: Callable[[], nn.Module],
    train: tuple[Tensor, Tensor],
    evals: Mapping[str, tuple[Tensor, Tensor]],
    spec: TrainSpec,
    ctx: RunContext,
    tags: Mapping[str, Any],
) -> list[Record]:
    """Train ``build()`` with Adam on ``train`` and return one record per epoch.

    Each record holds ``tags``, ``epoch``, ``train_loss`` (mean mini-batch loss over the epoch, in
    training mode), ``seconds`` and, for every ``name`` in ``evals``, ``{name}_nll`` and
    ``{name}_err`` measured in eval mode after the epoch.

    Checkpoints go to ``ctx.out_dir/ckpt/{run_id}.pt`` after every epoch; the finished records to
    ``ctx.out_dir/runs/{run_id}.json``. With ``ctx.resume`` a finished run is read back and an
    unfinished one continues from its last checkpoint. The last incomplete mini-batch of each
    epoch is dropped, so every process of a data-parallel run gets an equal share.
    """
    files = RunFiles.of(ctx, run_id)
    finished = files.finished()
    if finished is not None:
        return finished

    device = ctx.device
    rank, world = distributed.rank_world()
    torch.manual_seed(spec.seed)
    model = build().to(device)
    net = distributed.wrap(model, device)
    opt = make_adam(model, spec.lr)
    order = torch.Generator().manual_seed(spec.seed)
    state, history = files.restore(model, opt, order, "order_rng")
    start = int(state.get("epoch", 0))
    history = history[:start]

    x, y = train
    n = x.shape[0]
    steps = n // spec.batch_size
    if steps == 0:
        raise ValueError(
            f"{run_id}: batch size {spec.batch_size} is larger than the training set ({n})"
        )
    bar = tqdm(
        total=spec.epochs * steps,
        initial=start * steps,
        desc=run_id,
        unit="step",
        disable=not (ctx.progress and rank == 0),
        leave=False,
        dynamic_ncols=True,
    )
    net.train()
    for epoch in range(start, spec.epochs):
        t0 = time.perf_counter()
        perm = torch.randperm(n, generator=order)
        total = 0.0
        for s in range(steps):
            idx = distributed.shard(
                perm[s * spec.batch_size : (s + 1) * spec.batch_size], rank, world
            )
            xb, yb = x[idx].to(device), y[idx].to(device)
            loss = nn.functional.cross_entropy(net(xb), yb)
            value = float(loss.detach())
            if not math.isfinite(value):
                bar.close()
                raise FloatingPointError(f"{run_id}: loss became {value} at epoch {epoch + 1}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += value
            bar.update(1)
            if s % 20 == 0:
                bar.set_postfix(epoch=epoch + 1, loss=f"{value:.3f}")
        rec: Record = {**tags, "epoch": epoch + 1, "train_loss": total / steps}
        for name, (ex, ey) in evals.items():
            rec[f"{name}_nll"], rec[f"{name}_err"] = evaluate(
                model, ex, ey, device, spec.eval_batch_size
            )
        rec["seconds"] = time.perf_counter() - t0
        history.append(rec)
        bar.set_postfix(epoch=epoch + 1, loss=f"{rec['train_loss']:.3f}")
        if rank == 0:
            files.save(history, {"epoch": epoch + 1}, model, opt, order, "order_rng")
        distributed.barrier()
        if rank == 0:
            checkpoint_written()
    bar.close()
    if rank == 0:
        files.finish(history)
    distributed.barrier()
    return history
