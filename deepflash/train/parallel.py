"""Data-parallel drafter training: `train-drafter train --workers N`.

N worker processes each hold the frozen target and a replica of the drafter, train on their own share
of the sequences, and average their gradients every step, so every replica takes the same optimizer
step. They take the GPUs round-robin, several sharing one if there are more workers than GPUs: a
profile of a training step on an H200 found it mostly host work, which several processes can overlap; how much that gains on one GPU is not measured yet. NCCL carries the averages when each
worker has a GPU of its own; gloo otherwise (NCCL refuses two workers on one GPU, and the CPU has only
gloo).

One all-reduce per step carries the gradients, the step's tokens and each worker's share of the
budget before and after the step; the mean shares are the common clock that sets the learning rate and
ends the run on the same step everywhere.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


class Group:
    """This worker's place among the workers and the one collective a step needs."""

    def __init__(self, rank: int = 0, world: int = 1):
        self.rank, self.world = rank, world

    @property
    def lead(self) -> bool:
        """The worker that evaluates, logs, checkpoints and exports."""
        return self.rank == 0

    def share(self, tensors: list[torch.Tensor]) -> None:
        """Give every worker the lead worker's values (the drafter's start, the feature scale)."""
        if self.world > 1:
            for t in tensors:
                shared = self._carried(t.detach())
                dist.broadcast(shared, 0)
                t.data.copy_(shared)

    def average_step(self, params: list[torch.nn.Parameter], values: list[float]) -> list[float]:
        """Average the gradients in place, and the values (the step's tokens, budget shares) with them.
        A worker whose batch had nothing to learn from contributes zero gradients."""
        if self.world == 1:
            return values
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.flatten().float() for g in grads] +
                         [torch.tensor(values, dtype=torch.float32, device=grads[0].device)])
        flat = self._reduced(flat, dist.ReduceOp.SUM).to(grads[0].device) / self.world
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset: offset + g.numel()].view_as(p).to(p.dtype)
            offset += g.numel()
        return flat[offset:].tolist()

    def check_replicas(self, params: list[torch.nn.Parameter]) -> None:
        """Raise if the drafter replicas drifted apart (they must take identical steps)."""
        if self.world == 1:
            return
        mine = torch.stack([p.detach().double().sum() for p in params])
        low, high = self._reduced(mine, dist.ReduceOp.MIN), self._reduced(mine, dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise RuntimeError("data-parallel training: the drafter replicas differ between workers")

    @classmethod
    def _reduced(cls, tensor: torch.Tensor, op) -> torch.Tensor:
        """An all-reduced copy."""
        tensor = cls._carried(tensor, copy=True)
        dist.all_reduce(tensor, op=op)
        return tensor

    @staticmethod
    def _carried(tensor: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """The tensor where the backend carries it: on the CPU under gloo (its GPU support does not cover
        every operation), on this worker's GPU under NCCL, which carries no CPU tensors (AveragedModel keeps
        the weight average's step count on the CPU)."""
        on_cpu = dist.get_backend() == "gloo"
        return tensor.to("cpu" if on_cpu else torch.device("cuda", torch.cuda.current_device()), copy=copy)


def worker_device(rank: int, device: torch.device) -> torch.device:
    """Workers take the GPUs round-robin; on the CPU they all use it."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % torch.cuda.device_count())


def backend(workers: int, device: torch.device) -> str:
    return "nccl" if device.type == "cuda" and workers <= torch.cuda.device_count() else "gloo"


def train(workers: int, tc, load: Callable, device: torch.device) -> Path:
    """Run the training in `workers` processes; `load(device)` -> (target, tokenizer) runs in each (it
    must be picklable: a module-level function or a partial of one). Returns the exported drafter."""
    with socket.socket() as s:  # a free port for the workers' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(workers, port, tc, load, device), nprocs=workers, join=True)
    return Path(tc.out) / "drafter"


def _worker(rank: int, workers: int, port: int, tc, load: Callable, device: torch.device) -> None:
    # dynamo first imported after the group exists keeps a reference to the group (torch 2.13), so that
    # destroy_process_group cannot join gloo's threads; one of them then finished a collective during the
    # interpreter's shutdown and aborted the process (about 1 CPU test run in 10). Imported first, it does not.
    import torch._dynamo  # noqa: F401

    from .trainer import Trainer

    mine = worker_device(rank, device)
    if mine.type == "cuda":
        torch.cuda.set_device(mine)
    dist.init_process_group(backend(workers, device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=workers)
    try:
        target, tokenizer = load(mine)
        Trainer(tc, target, tokenizer, mine, Group(rank, workers)).run()
        # every worker reaches the teardown before any destroys the group: rank 0 hosts the rendezvous
        # store, which its peers' teardown still uses.
        # Not in `finally`: a worker that failed must not wait here for peers stuck in a collective.
        dist.barrier()
    finally:
        dist.destroy_process_group()
