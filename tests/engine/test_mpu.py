"""zerokern.initialize(mpu=...): a Megatron-style tensor-parallel MLP on 4 gloo ranks as
tp 2 x dp 2 (tp groups [0,1] [2,3], dp groups [0,2] [1,3], Megatron's rank order).

Reference: the same MLP unsplit in one process with torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_ on the global batch (the two dp ranks' batches), fresh random
data. At stages 0-3 each rank's local slices equal the reference's slices after STEPS steps
(rel <= 1e-6, fp32), and engine.get_global_grad_norm() equals clip_grad_norm_'s return at every
step (the norm counts the split params on every tp rank and the replicated ones once).

DeepSpeed 0.19.8 with the same mpu (stages 1-2, CPU) gives the same norms and params.
Negative controls: the reference with lr x 1.01 is caught; the old agreement (no
model-parallel all-reduce: model_parallel=None) and a wrong count (replicated params counted on
every tp rank) both miss the reference norm; an inf in one rank's grad skips the step on every
rank (without the model-parallel all-reduce the other dp group steps). Bad mpu objects raise
TypeError/ValueError naming mpu, and checkpoints with an mpu raise NotImplementedError.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.support.harness import cached, case, run_cases

from ..support.tp_ops import CopyToTP as _CopyToTP
from ..support.tp_ops import ReduceFromTP as _ReduceFromTP

# A DeepSpeed-reference matrix: the whole module runs in CI's -m slow pass (the default run's
# budget, pyproject.toml [Note: the slow mark]).
pytestmark = pytest.mark.slow

WS, TP, DP = 4, 2, 2
D, H, B = 8, 16, 6     # model width, hidden width (split over tp), rows per dp rank
STEPS = 4
LR, CLIP = 2e-2, 0.05  # the grad norm here is ~0.5: every step is clipped
TOL = {"param": 1e-6, "norm": 1e-5, "negative": 1e-4}


# ---- the tensor-parallel model (Megatron's f / g operators: tests/support/tp_ops.py) -----------
class FullMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.ln = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        with torch.no_grad():  # LayerNorm's init is 1 / 0: random, so its grads are generic
            self.ln.weight.normal_(1.0, 0.2)
            self.ln.bias.normal_(0.0, 0.2)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class TPMLP(nn.Module):
    """FullMLP split over the tp group: fc1 column-parallel, fc2 row-parallel (weights and
    fc1's bias carry `tensor_model_parallel`), ln and fc2's bias replicated."""

    def __init__(self, full: FullMLP, tp_rank: int, group) -> None:
        super().__init__()
        self.group = group
        h = H // TP
        rows = slice(tp_rank * h, (tp_rank + 1) * h)
        self.ln = nn.LayerNorm(D)
        self.ln.load_state_dict(full.ln.state_dict())
        self.w1 = nn.Parameter(full.fc1.weight.detach()[rows].clone())
        self.b1 = nn.Parameter(full.fc1.bias.detach()[rows].clone())
        self.w2 = nn.Parameter(full.fc2.weight.detach()[:, rows].clone())
        self.b2 = nn.Parameter(full.fc2.bias.detach().clone())
        for p in (self.w1, self.b1, self.w2):
            p.tensor_model_parallel = True

    def forward(self, x):
        x = _CopyToTP.apply(self.ln(x), self.group)
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, self.w1, self.b1))
        y = _ReduceFromTP.apply(torch.nn.functional.linear(h, self.w2), self.group)
        return y + self.b2


def data(step: int, dp_rank: int):
    g = torch.Generator().manual_seed(1000 + 17 * step + dp_rank)
    return torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)


def reference(lr: float = LR):
    """(the reference's named params after STEPS steps, its grad norm per step)."""
    model = FullMLP()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.9), eps=1e-6,
                            weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        xs, ys = zip(*(data(step, r) for r in range(DP)))
        loss = torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, norms


def local_slices(full: dict, tp_rank: int) -> dict:
    h = H // TP
    rows = slice(tp_rank * h, (tp_rank + 1) * h)
    return {"ln.weight": full["ln.weight"], "ln.bias": full["ln.bias"],
            "w1": full["fc1.weight"][rows], "b1": full["fc1.bias"][rows],
            "w2": full["fc2.weight"][:, rows], "b2": full["fc2.bias"]}


class MPU:
    """Megatron's mpu interface over tp groups [0,1] [2,3] and dp groups [0,2] [1,3]."""

    def __init__(self, rank: int) -> None:
        self.tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        self.dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        self.rank = rank

    def get_data_parallel_group(self):
        return self.dp_groups[self.rank % TP]

    def get_model_parallel_group(self):
        return self.tp_groups[self.rank // TP]

    def get_tensor_model_parallel_rank(self):
        return self.rank % TP

    def get_model_parallel_rank(self):
        return self.rank % TP

    def get_data_parallel_rank(self):
        return self.rank // TP

    def get_data_parallel_world_size(self):
        return DP

    def get_model_parallel_world_size(self):
        return TP


def config(stage: int, lr: float = LR, precision: str = "fp32") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
           "gradient_clipping": CLIP, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.8, 0.9],
                                                     "eps": 1e-6, "weight_decay": 0.1,
                                                     "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    return cfg


# ---- rank side ----------------------------------------------------------------------------------
def _train(rank, mpu, stage, tamper=None, inf_on=None):
    import zerokern

    tp_rank = rank % TP
    model = TPMLP(FullMLP(), tp_rank, mpu.get_model_parallel_group())
    engine, opt, _, _ = zerokern.initialize(model=model, config=config(stage), mpu=mpu)
    if tamper is not None:
        tamper(opt)
    if inf_on == rank:
        model.w2.register_hook(lambda g: torch.full_like(g, float("inf")))
    norms, skipped = [], []
    for step in range(STEPS):
        x, y = data(step, rank // TP)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
        skipped.append(bool(opt.step_skipped))
        if inf_on is not None:
            break
    with opt.gathered_params():
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"params": params, "norms": norms, "skipped": skipped}


def _count_all(opt):
    from zerokern.grads.model_parallel import ModelParallelStats

    opt.plan.model_parallel = ModelParallelStats(opt.model_parallel.group, True, opt.flat_groups)


def _no_mp(opt):
    opt.plan.model_parallel = None


def _raises(fn):
    try:
        fn()
    except (TypeError, ValueError, NotImplementedError) as e:
        return type(e).__name__, str(e)
    return None


def _bad(rank, mpu):
    import zerokern

    class NoDP:
        def get_model_parallel_group(self):
            return mpu.get_model_parallel_group()

    class WrongSize(MPU):
        def __init__(self, base):
            self.__dict__.update(base.__dict__)

        def get_data_parallel_world_size(self):
            return 3

    def init(m, **cfg):
        model = TPMLP(FullMLP(), rank % TP, mpu.get_model_parallel_group())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        out = _raises(lambda: zerokern.initialize(model=model, config=config(**cfg) if cfg
                                                  else config(2), mpu=m))
        same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return out, same

    hpz_cfg = config(3)
    hpz_cfg["zero_optimization"]["zero_hpz_partition_size"] = 2
    model = TPMLP(FullMLP(), rank % TP, mpu.get_model_parallel_group())
    engine, *_ = zerokern.initialize(model=model, config=config(1), mpu=mpu)
    return {"no_dp": init(NoDP()), "wrong_size": init(WrongSize(mpu)),
            "hpz": _raises(lambda: zerokern.initialize(
                model=TPMLP(FullMLP(), rank % TP, mpu.get_model_parallel_group()),
                config=hpz_cfg, mpu=mpu)),
            "save": _raises(lambda: engine.save_checkpoint("/nonexistent/ckpt"))}


def _deepspeed(rank, ws, stage, mpu):
    """The same run through DeepSpeed 0.19.8 with the same mpu (CPU accelerator)."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ws),
                      LOCAL_WORLD_SIZE=str(ws))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from tests.engine.common import restore_linear

    model = TPMLP(FullMLP(), rank % TP, mpu.get_model_parallel_group())
    norms = []
    with restore_linear():
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(stage), mpu=mpu)
        for step in range(STEPS):
            x, y = data(step, rank // TP)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            norms.append(float(engine.get_global_grad_norm()))
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "norms": norms}


def _worker(rank, ws):
    torch.manual_seed(0)
    mpu = MPU(rank)
    cases = {f"stage{s}": (lambda s=s: _train(rank, mpu, s)) for s in (0, 1, 2, 3)}
    cases["count_all"] = lambda: _train(rank, mpu, 2, tamper=_count_all)
    cases["no_mp"] = lambda: _train(rank, mpu, 2, tamper=_no_mp)
    for s in (1, 3):
        cases[f"inf{s}"] = lambda s=s: _train(rank, mpu, s, inf_on=3)
    cases["inf_no_mp"] = lambda: _train(rank, mpu, 2, tamper=_no_mp, inf_on=3)
    cases["bad"] = lambda: _bad(rank, mpu)
    for s in (1, 2):
        cases[f"ds{s}"] = lambda s=s: _deepspeed(rank, ws, s, mpu)
    return run_cases(cases)


def _results():
    return cached(_worker, WS)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module")
def ref():
    return reference(), reference(lr=LR * 1.01)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mpu_matches_unsplit_reference(stage, ref):
    (want, want_norms), (neg, _) = ref
    for rank, r in enumerate(case(_results(), f"stage{stage}")):
        for k, w in local_slices(want, rank % TP).items():
            got = r["params"][k]
            assert _rel(got, w) <= TOL["param"], (rank, k, _rel(got, w))
            if k == "w1":  # negative control: lr x 1.01 is caught
                nw = local_slices(neg, rank % TP)[k]
                assert _rel(got, nw) > 100 * TOL["param"]
        for got, w in zip(r["norms"], want_norms):
            assert abs(got - w) <= TOL["norm"] * w, (rank, got, w)


@pytest.mark.parametrize("name", ["count_all", "no_mp"])
def test_wrong_norm_counts_are_caught(name, ref):
    (_, want_norms), _ = ref
    for r in case(_results(), name):
        assert abs(r["norms"][0] - want_norms[0]) > TOL["negative"] * want_norms[0]


@pytest.mark.parametrize("stage", [1, 3])
def test_inf_on_one_rank_skips_everywhere(stage):
    res = case(_results(), f"inf{stage}")
    assert [r["skipped"][0] for r in res] == [True] * WS
    full = FullMLP()
    init = local_slices(dict(full.named_parameters()), 0)
    for r in res:  # nothing moved
        for k in ("ln.weight", "b2"):
            assert torch.equal(r["params"][k], init[k].detach())
    # negative control: without the model-parallel all-reduce the other dp group steps
    assert [r["skipped"][0] for r in case(_results(), "inf_no_mp")] == [False, True, False, True]


def test_bad_mpu_and_checkpoint_raise():
    for r in case(_results(), "bad"):
        (kind, msg), untouched = r["no_dp"]
        assert kind == "TypeError" and "mpu" in msg and "get_data_parallel_group" in msg
        assert untouched
        (kind, msg), untouched = r["wrong_size"]
        assert kind == "ValueError" and "get_data_parallel_world_size" in msg and untouched
        kind, msg = r["hpz"]
        assert kind == "ValueError" and "zero_hpz_partition_size" in msg
        kind, msg = r["save"]
        assert kind == "NotImplementedError" and "mpu" in msg


@pytest.mark.parametrize("stage", [1, 2])
def test_mpu_matches_deepspeed(stage):
    """DeepSpeed 0.19.8 with the same mpu on CPU: the same per-step global norms (it counts
    the model-parallel ranks as zerokern does) and the same params."""
    zk_res, ds_res = case(_results(), f"stage{stage}"), case(_results(), f"ds{stage}")
    for rank, (z, d) in enumerate(zip(zk_res, ds_res)):
        for a, b in zip(z["norms"], d["norms"]):
            assert abs(a - b) <= TOL["norm"] * b, (rank, z["norms"], d["norms"])
        for k, w in d["params"].items():
            assert _rel(z["params"][k], w) <= TOL["param"], (rank, k)
