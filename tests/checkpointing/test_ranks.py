"""zerokern.checkpointing on gloo ranks: parity under ZeroAdamW at stages 0-3 (N = 1, 2), and
Pa at tp = 2 (a Megatron-style mpu through zerokern.initialize's activation_checkpointing
section, and a DTensor DeviceMesh through configure).

Parity is bitwise on CPU: the model of common.py (dropout on both RNG streams) trains to the
same losses with checkpointing as without. At tp = 2 the checkpointed inputs are split over the
two ranks: the bytes kept per rank after the forward are half those of tp = 1 (counted by
stats()), and with cpu_checkpointing they are in the host pool (device bytes 0), the pool
allocating in the first step only. The attention dropout (tracker stream) differs between the tp
ranks, the output dropout (default stream) does not.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from tests.checkpointing.common import BATCH, N_LAYERS, RNG_SEED, SEQ, D, Model, train
from tests.support.harness import cached, case, run_cases

STEPS = 3
IN_BYTES = BATCH * SEQ * D * 4


def _zero_run(rank, stage, ckpt):
    import zerokern
    import zerokern.checkpointing as ck

    model = Model(ck.get_cuda_rng_tracker(), ck.checkpoint if ckpt else None)
    opt = zerokern.ZeroAdamW(model, lr=1e-2, stage=stage, precision="fp32")

    def step(loss):
        opt.backward(loss) if hasattr(opt, "backward") else loss.backward()
        opt.step()
        opt.zero_grad()

    return train(model, step, STEPS, rank,
                 seed_fn=lambda: ck.model_parallel_cuda_manual_seed(RNG_SEED))


def _stages_worker(rank, ws):
    import zerokern.checkpointing as ck

    ck.configure(None)
    cases = {}
    for s in (0, 1, 2, 3):
        cases[f"ref{s}"] = lambda s=s: _zero_run(rank, s, False)
        cases[f"ck{s}"] = lambda s=s: _zero_run(rank, s, True)
    return run_cases(cases)


@pytest.mark.parametrize("ws", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_parity(ws, stage):
    res = cached(_stages_worker, ws)
    ref, got = case(res, f"ref{stage}"), case(res, f"ck{stage}")
    assert got == ref, (got, ref)


# ---- tp = 2 -------------------------------------------------------------------------------------
class MPU:
    """Megatron's mpu over 2 ranks: one tp group [0, 1], dp groups [0] and [1]."""

    def __init__(self, rank):
        self.tp = dist.new_group([0, 1])
        self.dps = [dist.new_group([0]), dist.new_group([1])]
        self.rank = rank

    def get_data_parallel_group(self):
        return self.dps[self.rank]

    def get_model_parallel_group(self):
        return self.tp

    def get_model_parallel_rank(self):
        return self.rank

    def get_tensor_model_parallel_rank(self):
        return self.rank

    def get_model_parallel_world_size(self):
        return 2

    def get_data_parallel_rank(self):
        return 0

    def get_data_parallel_world_size(self):
        return 1


def _engine_run(rank, mpu, section):
    """zerokern.initialize with mpu at stage 1; `section`: the activation_checkpointing
    section (None: no checkpointing). Per-step (loss, stats after the forward)."""
    import zerokern
    import zerokern.checkpointing as ck

    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 1}}
    if section is not None:
        cfg["activation_checkpointing"] = section
    model = Model(ck.get_cuda_rng_tracker(), None if section is None else ck.checkpoint,
                  tp_group=mpu.get_model_parallel_group(), tp=2, tp_rank=rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        engine, *_ = zerokern.initialize(model=model, config=cfg, mpu=mpu)
    seen = []

    def step(loss):
        seen.append(ck.stats())
        engine.backward(loss)
        engine.step()

    losses = train(model, step, STEPS, 0, engine=engine,
                   seed_fn=lambda: ck.model_parallel_cuda_manual_seed(RNG_SEED))
    return {"losses": losses, "stats": seen}


def _rng_streams(rank):
    import zerokern.checkpointing as ck

    ck.model_parallel_cuda_manual_seed(RNG_SEED)
    default = torch.rand(4)
    with ck.get_cuda_rng_tracker().fork():
        tracked = torch.rand(4)
    out = [torch.zeros(8) for _ in range(2)]
    dist.all_gather(out, torch.cat([default, tracked]))
    return [o.tolist() for o in out]


def _mesh_run(rank, cpu):
    """configure(DeviceMesh) with Pa (and cpu): bytes per rank after one forward."""
    from torch.distributed.device_mesh import init_device_mesh

    import zerokern.checkpointing as ck

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ck.configure(mesh, partition_activations=True, checkpoint_in_cpu=cpu)
    model = Model(ck.get_cuda_rng_tracker(), ck.checkpoint, tp_group=mesh.get_group(), tp=2,
                  tp_rank=rank)
    ck.model_parallel_cuda_manual_seed(RNG_SEED)
    x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(3))
    out = model(x).square().mean()
    s = ck.stats()
    out.backward()
    return {"stats": s, "after": ck.stats(), "loss": out.item()}


def _tp_worker(rank, ws):
    import zerokern.checkpointing as ck

    mpu = MPU(rank)
    ck.configure(mpu)  # as Megatron: the model-parallel seed reads the tp rank from it
    cases = {
        "ref": lambda: _engine_run(rank, mpu, None),
        "whole": lambda: _engine_run(rank, mpu, {}),  # checkpointing, nothing split
        "pa": lambda: _engine_run(rank, mpu, {"partition_activations": True}),
        "pa_cpu": lambda: _engine_run(rank, mpu, {"partition_activations": True,
                                                  "cpu_checkpointing": True}),
        "pa_contiguous": lambda: _engine_run(rank, mpu, {
            "partition_activations": True, "contiguous_memory_optimization": True,
            "number_checkpoints": N_LAYERS}),
        "streams": lambda: _rng_streams(rank),
        "mesh": lambda: _mesh_run(rank, False),
        "mesh_cpu": lambda: _mesh_run(rank, True),
    }
    out = run_cases(cases)
    ck.configure(None)
    return out


def _tp():
    return cached(_tp_worker, 2)


@pytest.mark.parametrize("name", ["whole", "pa", "pa_cpu", "pa_contiguous"])
def test_tp2_parity_through_initialize(name):
    ref = case(_tp(), "ref")
    got = case(_tp(), name)
    assert [g["losses"] for g in got] == [r["losses"] for r in ref]
    assert ref[0]["losses"] == ref[1]["losses"]  # tp ranks compute the same loss


def test_tp2_pa_halves_the_bytes_per_rank():
    whole, pa = case(_tp(), "whole"), case(_tp(), "pa")
    for w, p in zip(whole, pa):
        for sw, sp in zip(w["stats"], p["stats"]):
            assert sw["checkpoints"] == sp["checkpoints"] == N_LAYERS
            assert sw["device_bytes"] == N_LAYERS * IN_BYTES
            assert sp["device_bytes"] * 2 == sw["device_bytes"]  # 1/tp per rank
    for r in case(_tp(), "pa_contiguous"):
        assert all(s["contiguous_bytes"] == N_LAYERS * IN_BYTES // 2 for s in r["stats"])


def test_tp2_pa_cpu_moves_the_pieces_to_the_bounded_host_pool():
    for r in case(_tp(), "pa_cpu"):
        for s in r["stats"]:
            assert s["device_bytes"] == 0 and s["host_bytes"] == N_LAYERS * IN_BYTES // 2
        assert [s["pool_allocations"] for s in r["stats"]] == [N_LAYERS] * STEPS
        assert r["stats"][-1]["gathers"] == N_LAYERS * (STEPS - 1)


def test_tp2_rng_streams():
    a, b = case(_tp(), "streams")
    assert a == b  # both ranks see the same gathered values
    r0, r1 = a
    assert r0[:4] == r1[:4]   # the default stream: the same on every tp rank
    assert r0[4:] != r1[4:]   # the tracker stream: different per tp rank


def test_tp2_device_mesh():
    mesh, mesh_cpu = case(_tp(), "mesh"), case(_tp(), "mesh_cpu")
    for m, c in zip(mesh, mesh_cpu):
        assert m["stats"]["device_bytes"] == N_LAYERS * IN_BYTES // 2
        assert c["stats"]["host_bytes"] == N_LAYERS * IN_BYTES // 2
        assert c["stats"]["device_bytes"] == 0
        assert m["loss"] == c["loss"]
        assert m["after"]["gathers"] == N_LAYERS and m["after"]["checkpoints"] == 0
