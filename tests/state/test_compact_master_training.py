"""master="compact" trains bitwise like master="fp32" (bf16), at 1, 2 and 3 gloo ranks.

One spawned group per world size runs, for stages 0, 1 and 2, the same schedule with both
masters on the odd test model (tests/support/models.py: tied weight, frozen param, 0-d param, two
param groups, tiny buckets that params straddle), with clipping on every step (max_grad_norm):
  step 0 plain; step 1 two micro-batches, the first under no_sync(); step 2 an inf injected into
  one grad on rank 0 by a hook (every rank skips); after step 3 `model.load_state_dict` of an
  fp32 state dict (the masters take its exact values); after step 4 `zerokern.checkpoint.save`;
  after step 5 `zerokern.checkpoint.load` of it (back to step 4's state); steps 6-8 plain.
Compared bit for bit per step: the params, grad_norm, step_skipped; at the end: exp_avg,
exp_avg_sq, the master read through `opt.state_dict()` and through a second checkpoint. The
compact run must have taken its chunked path (pieces counted) and end compacted (the expanded
master dropped), so the comparison covers the compact step, not only the expanded fallback.
"""

from __future__ import annotations

import os

import pytest
import torch

import zerokern as zk

from ..support import models as M
from ..support.harness import cached, case, run_cases, ws_params

STEPS = 9
STAGES = [0, 1, 2]
MAX_NORM = 0.05  # below the model's grad norms (~0.1-1): the clip is active


def _bits(t: torch.Tensor) -> torch.Tensor:
    dt = torch.int16 if t.element_size() == 2 else torch.int32
    return t.detach().reshape(-1).view(dt).clone()


def _perturbed_state(model) -> dict:
    g = torch.Generator().manual_seed(99)
    return {k: v.float() + 0.01 * torch.randn(v.shape, generator=g)
            for k, v in model.state_dict().items()}


def _run(rank, ws, stage, master, ckpt_dir):
    model = M.make_model()
    opt = M.zero_opt(model, stage, "bf16", master=master, max_grad_norm=MAX_NORM)
    inf_param = dict(model.named_parameters())["blocks.0.fc1.weight"]
    rec = {"params": [], "grad_norm": [], "skipped": []}
    ckpt = os.path.join(ckpt_dir, f"{stage}-{master}")
    for s in range(STEPS):
        opt.zero_grad()
        micro = 2 if s == 1 else 1
        hook = None
        if s == 2 and rank == 0:
            hook = inf_param.register_hook(lambda g: g * float("inf"))
        for mi in range(micro):
            ctx = opt.no_sync() if mi < micro - 1 else torch.enable_grad()
            with ctx:
                opt.backward(M.loss_fn(model, M.rank_tokens(s, rank, ws, micro=mi)) / micro)
        if hook is not None:
            hook.remove()
        opt.step()
        rec["params"].append({n: _bits(p) for n, p in model.named_parameters()})
        rec["grad_norm"].append(_bits(opt.grad_norm.reshape(1)))
        rec["skipped"].append(bool(opt.step_skipped))
        if s == 3:
            model.load_state_dict(_perturbed_state(model))
        elif s == 4:
            zk.checkpoint.save(ckpt, model, opt)
        elif s == 5:
            zk.checkpoint.load(ckpt, model, opt)
    compact = [getattr(g.state, "compact_pieces", None) for g in opt.flat_groups]
    expanded = [getattr(g.state, "expanded", None) for g in opt.flat_groups]
    rec["moments"] = [(_bits(g.exp_avg), _bits(g.exp_avg_sq), g.steps.clone())
                      for g in opt.flat_groups]
    zk.checkpoint.save(ckpt + "-end", model, opt)
    rec["state_dict"] = [{k: _bits(t) if t.is_floating_point() else t for k, t in st.items()}
                         for st in opt.state_dict()["state"]]
    rec["consolidated"] = {k: _bits(v) for k, v in
                           zk.checkpoint.consolidate(ckpt + "-end").items()} if rank == 0 else {}
    rec["compact_pieces"], rec["expanded_before_reads"] = compact, expanded
    return rec


def _worker(rank, ws, ckpt_dir):
    cases = {}
    for stage in STAGES:
        def thunk(stage=stage):
            a = _run(rank, ws, stage, "fp32", ckpt_dir)
            b = _run(rank, ws, stage, "compact", ckpt_dir)
            return _compare(a, b)
        cases[f"stage{stage}"] = thunk
    return run_cases(cases)


def _compare(a, b) -> dict:
    def eq(x, y):
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(u, v) for u, v in zip(x, y))
        if isinstance(x, torch.Tensor):
            return torch.equal(x, y)
        return x == y
    keys = ("params", "grad_norm", "skipped", "moments", "state_dict", "consolidated")
    return {"equal": {k: eq(a[k], b[k]) for k in keys}, "skipped": a["skipped"],
            "compact_pieces": b["compact_pieces"], "expanded": b["expanded_before_reads"],
            "params_moved": not eq(a["params"][0], a["params"][-1])}


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("compact"))


@pytest.mark.parametrize("world_size", ws_params(1, 2, 3))
@pytest.mark.parametrize("stage", STAGES)
def test_compact_master_trains_bitwise_like_fp32_master(world_size, stage, ckpt_dir):
    results = cached(_worker, world_size, os.path.join(ckpt_dir, str(world_size)))
    for rank, r in enumerate(case(results, f"stage{stage}")):
        where = f"world size {world_size}, stage {stage}, rank {rank}"
        assert all(r["equal"].values()), f"{where}: differs in {r['equal']}"
        assert r["skipped"] == [s == 2 for s in range(STEPS)], where  # the inf step only
        assert r["params_moved"], where
        assert all(n and n > 0 for n in r["compact_pieces"]), where  # the chunked path ran
        assert r["expanded"] == [False] * len(r["expanded"]), where  # and ends compacted
