"""DeepSpeed is the reference for its API: the model of common.py run with
`deepspeed.checkpointing` (DeepSpeed 0.19, CPU accelerator, configured the same way, its own
RNG tracker seeded by its own model_parallel_cuda_manual_seed) and with `zerokern.checkpointing`
trains to the same losses (torch AdamW, fp32): at tp = 1 on one rank, and at tp = 2 with
partition_activations on two ranks (slow). Negative control: DeepSpeed's run seeded with
another seed is caught by the same comparison.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.checkpointing.common import RNG_SEED, Model, train
from tests.support.harness import cached, case, run_cases

STEPS = 3


class MPU:
    """Megatron's mpu with one tp group over all ranks and one data-parallel rank."""

    def __init__(self, rank, ws):
        self.tp = dist.new_group(list(range(ws)))
        self.dps = [dist.new_group([r]) for r in range(ws)]
        self.rank, self.ws = rank, ws

    def get_data_parallel_group(self):
        return self.dps[self.rank]

    def get_model_parallel_group(self):
        return self.tp

    def get_model_parallel_rank(self):
        return self.rank

    def get_model_parallel_world_size(self):
        return self.ws

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1


def _run(lib, mpu, ws, rank, seed=RNG_SEED, **kw):
    lib.configure(mpu, **kw)
    tp_group = mpu.get_model_parallel_group() if ws > 1 else None
    model = Model(lib.get_cuda_rng_tracker(), lib.checkpoint, tp_group=tp_group, tp=ws,
                  tp_rank=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(loss):
        opt.zero_grad()
        loss.backward()
        opt.step()

    return train(model, step, STEPS, 0, seed_fn=lambda: lib.model_parallel_cuda_manual_seed(seed))


def _worker(rank, ws):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws),
                      LOCAL_WORLD_SIZE=str(ws))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    ds_ck = deepspeed.checkpointing

    import zerokern.checkpointing as zk_ck

    deepspeed.init_distributed(dist_backend="gloo")
    mpu = MPU(rank, ws)
    kw = {"partition_activations": ws > 1}
    cases = {"ds": lambda: _run(ds_ck, mpu, ws, rank, **kw),
             "zk": lambda: _run(zk_ck, mpu, ws, rank, **kw),
             "ds_other_seed": lambda: _run(ds_ck, mpu, ws, rank, seed=RNG_SEED + 1, **kw)}
    out = run_cases(cases)
    zk_ck.configure(None)
    return out


@pytest.mark.slow  # 60 s on 2 loaded cores (DeepSpeed's engine per step); CI runs it
@pytest.mark.parametrize("ws", [1, 2])
def test_same_losses_as_deepspeed_checkpointing(ws):
    res = cached(_worker, ws)
    ds, zk, other = case(res, "ds"), case(res, "zk"), case(res, "ds_other_seed")
    for d, z, o in zip(ds, zk, other):
        assert max(abs(a - b) for a, b in zip(d, z)) <= 1e-6 * max(map(abs, d)), (d, z)
        assert max(abs(a - b) for a, b in zip(o, z)) > 1e-4, (o, z)  # negative control
