"""Drafter training over several worker processes (gloo on the CPU): data-parallel workers train one
drafter, and the group averages gradients and notices replicas that drifted apart."""

import json

import pytest
import torch
from helpers import train_dataset

from deepflash.drafter.checkpoint import load_drafter
from deepflash.engine.config import EngineConfig
from deepflash.engine.engine import Engine
from deepflash.engine.sampling import SamplingParams
from deepflash.train.trainer import TrainConfig


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return train_dataset(tmp_path_factory)


def test_data_parallel_workers_train_one_drafter(dataset, tmp_path):
    """--workers 2 on the CPU (gloo): the workers end on the same step with identical replicas (the run
    raises otherwise), and the lead's export keeps the greedy contract; with --ema the workers share the
    weight average's start (its CPU step count too, which NCCL carries from the GPU) and the lead exports it."""
    from helpers import tiny_target_and_tokenizer

    from deepflash.train.parallel import train

    target, tok, data, _ = dataset
    tc = TrainConfig(data=str(data), out=str(tmp_path / "run"), layers=1, taps=2, block_size=4, anchors=16, steps=6,
                     lr=3e-3, batch_tokens=200, eval_every=1000, ckpt_every=1000, log_every=1, attention="sdpa",
                     mask_token_id=95, ema=0.5)
    folder = train(2, tc, tiny_target_and_tokenizer, torch.device("cpu"))
    log = [json.loads(line) for line in (tmp_path / "run" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert load_drafter(tmp_path / "run" / "drafter-ema").cfg == load_drafter(folder).cfg
    prompt, params = [5, 9, 22, 31], SamplingParams(max_new_tokens=12)
    spec = Engine(target, tok, load_drafter(folder), config=EngineConfig(spec="on")).complete(prompt, params)
    assert spec.token_ids == Engine(target, tok).complete(prompt, params).token_ids


def _group_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from deepflash.train.parallel import Group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = Group(rank, 2)
    weight = torch.nn.Parameter(torch.full((3,), 1.0 + rank))
    weight.grad = torch.full((3,), 2.0 * rank)
    idle = torch.nn.Parameter(torch.zeros(2))  # no gradient on rank 0: it contributes zeros
    idle.grad = None if rank == 0 else torch.ones(2)
    values = group.average_step([weight, idle], [10.0 * rank, 0.5])
    try:
        group.check_replicas([weight])
        drift = None
    except RuntimeError as err:
        drift = str(err)
    torch.save({"grad": weight.grad, "idle": idle.grad, "values": values, "drift": drift}, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_workers_average_gradients_and_notice_drifted_replicas(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_group_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got["grad"], torch.ones(3)) and torch.equal(got["idle"], torch.full((2,), 0.5))
        assert got["values"] == [5.0, 0.5]
        assert "differ" in got["drift"]  # the replicas started at 1.0 and 2.0
