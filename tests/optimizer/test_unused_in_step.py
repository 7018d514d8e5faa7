"""A trainable param that no rank used in a step is skipped as torch's AdamW skips a param whose
grad is None (issue 36, item 1; frozen_slots.py [Note: a param no rank used]).

A small MoE-like model on N = 1, 2, 3 gloo ranks, routed by step number (deterministic):
expert 0 every step; expert 1 on no rank at steps 1 and 4; expert 2 on no rank at steps 1, 2
and 4 (back at step 3 with its own bias-correction count, t = 2 where the bucket's is 4);
expert 3 on rank 0 only (the negative control: used on one rank, it moves on all, as DDP's
zero-gradient contribution makes it). weight_decay 0.1, fp32, the cpu backend.

Reference: DistributedDataParallel(find_unused_parameters=True) + torch.optim.AdamW
(foreach=False), which leaves an expert no rank used with grad None, so AdamW skips it (no
decay, no moment update, no step count). Checks per case:
- "skip": at every step where an expert was used by no rank, its params (and master and moments
  where kept) are bit for bit what they were before the step, on every rank;
- "rel": params after 5 steps against the reference (TOL, the parity tests' fp32 bound);
- "control": the expert used on rank 0 only moved at every step (N >= 2).
ZeroMuon (Muon over the expert matrices, AdamW over the biases; torch.optim.Muon skips a grad
None param too) and ZeroLion (no lion-pytorch here; Lion counts no steps) get the "skip" and
"control" checks; ZeroMuon's AdamW half is the biases'.
On the code before this change the "skip" check failed at every stage (the unused experts moved
by weight decay and stale momentum) and so did "rel" (1e-3).
"""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zerokern as zk

from ..support import models as M
from ..support.harness import cached, case, run_cases, ws_params

STEPS = 5
LR, WD = 1e-2, 0.1
TOL = 1e-5
UNUSED = {1: {1, 4}, 2: {1, 2, 4}}  # expert -> steps where no rank uses it


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x, route):
        h = torch.relu(self.inp(x.to(self.inp.weight.dtype)))
        out = sum(self.experts[e](h) for e in route)
        return self.head(torch.relu(out))


def route(step: int, rank: int):
    r = [0] + [e for e in (1, 2) if step not in UNUSED[e]]
    return r + [3] if rank == 0 else r


def batch(step: int, rank: int):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _expert(name: str):
    return int(name.split(".")[1]) if name.startswith("experts.") else None


def _state(opt, model):
    """master / moments by name where the rule keeps them (gathered; 8-bit: the codes)."""
    out = {}
    if getattr(opt, "master", None) == "compact":  # its low halves and tie bits, this rank's
        from zerokern.state.compact_master import unpack_ties  # (reading `master` expands it)

        names = {id(p): n for n, p in model.named_parameters()}
        for key in ("low", "ties"):
            out[key] = {}
            for g in opt.flat_groups:
                t = g.state.low if key == "low" else unpack_ties(g.state.ties)
                for i, p in enumerate(g.params):
                    out[key][names[id(p)]] = torch.cat(
                        [t[a:b] for a, b in g.state_spans(i)] + [t[:0]]).clone()
    for key in ("master", "exp_avg", "exp_avg_sq", "momentum_buffer"):
        if key == "master" and out:
            continue
        shim = type("S", (), dict(comm=opt.comm, stage=opt.stage, flat_groups=[
            g for g in opt.flat_groups if key in g.rule_states or
            (key == "master" and g.master is not None)]))()
        if shim.flat_groups:
            out[key] = M.gather_state(shim, model, key)
    return out


def _opt(model, stage, kind, precision="fp32", **kw):
    if kind == "adamw":
        return zk.ZeroAdamW(model, stage=stage, precision=precision, backend="cpu", lr=LR,
                            weight_decay=WD, bucket_mb=0.002, **kw)
    if kind == "lion":
        return zk.ZeroLion(model, stage=stage, precision=precision, backend="cpu", lr=1e-3,
                           weight_decay=WD, bucket_mb=0.002, **kw)
    return zk.ZeroMuon(model, stage=stage, precision=precision, backend="cpu", lr=0.02,
                       weight_decay=WD, adamw_lr=LR, adamw_weight_decay=WD,
                       bucket_mb=0.002, **kw)


def _run(rank, ws, stage, kind="adamw", twin=None, **kw):
    """twin: the kwargs of a zerokern run to compare with bit for bit (master="compact"
    against master="fp32"), instead of DDP + torch's AdamW."""
    model = MoE()
    opt = _opt(model, stage, kind, **kw)
    ref = ropt = None
    if twin is not None:
        ref_model = MoE()
        ropt = _opt(ref_model, stage, kind, **twin)
        ref = lambda x, r: ref_model(x, r)  # noqa: E731
        ref.module = ref_model
    elif kind == "adamw":
        ref_model = MoE()
        ref = nn.parallel.DistributedDataParallel(ref_model, find_unused_parameters=True)
        ropt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD,
                                 foreach=False)
    skip_bad, control_still = [], []
    for step in range(STEPS):
        before = M.full_snapshot(model, opt)
        st_before = _state(opt, model)
        model(batch(step, rank), route(step, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        after = M.full_snapshot(model, opt)
        st_after = _state(opt, model)
        for n, p in after.items():
            e = _expert(n)
            if e in UNUSED and step in UNUSED[e]:
                if not torch.equal(p, before[n]):
                    skip_bad.append((step, n, float((p - before[n]).abs().max())))
                for key, d in st_after.items():
                    if n in d and not torch.equal(d[n], st_before[key][n]):
                        skip_bad.append((step, f"{key}:{n}",
                                         float((d[n] - st_before[key][n]).abs().max())))
            if e == 3 and torch.equal(p, before[n]):
                control_still.append((step, n))
        if ref is not None:
            ref(batch(step, rank), route(step, rank)).pow(2).mean().backward()
            ropt.step()
            ropt.zero_grad()
    out = dict(skip=skip_bad, control=control_still)
    if kw.get("master") == "compact":  # the skips kept the master compact (never expanded)
        out["expanded"] = [gi for gi, g in enumerate(opt.flat_groups)
                           if g.state.expanded or not g.state.compact_pieces]
    if ref is not None:
        got = M.full_snapshot(model, opt)
        want = M.full_snapshot(ref.module, ropt) if twin is not None else \
            M.snapshot(ref.module)
        out["rel"] = M.rel_err(got, want)
        out["rel_unused"] = max(
            float((got[n] - want[n]).abs().max() / want[n].abs().max())
            for n in got if _expert(n) in UNUSED)
    return out


CASES = [(kind, stage) for stage in range(4) for kind in ("adamw", "lion", "muon")]

# Where the state is not updated in place on the device (issue 36, item 1, the rest):
# config -> (kwargs, stages, kinds). "nvme" gets a temporary offload_path in the worker.
BF16 = dict(precision="bf16")
CONFIGS = {
    "cpu": (dict(offload="cpu"), range(1, 4), ("adamw", "lion", "muon")),
    "nvme": (dict(offload="nvme"), range(1, 4), ("adamw", "lion", "muon")),
    "compact": (dict(BF16, master="compact"), range(3), ("adamw", "lion", "muon")),
    "params-cpu": (dict(offload_params="cpu"), (3,), ("adamw", "muon")),
    "params-cpu-cpu": (dict(offload_params="cpu", offload="cpu"), (3,), ("adamw", "muon")),
    "params-nvme": (dict(offload_params="nvme", offload="nvme"), (3,), ("adamw",)),
}
CFG_CASES = [(cfg, kind, stage) for cfg, (_, stages, kinds) in CONFIGS.items()
             for stage in stages for kind in kinds]


def _cfg_run(rank, ws, cfg, kind, stage):
    kw = dict(CONFIGS[cfg][0])
    twin = None
    if kw.get("master") == "compact":  # bitwise master="fp32" (state/compact_master.py)
        twin = dict(kw, master="fp32")
    elif kind != "adamw":  # no torch Lion here; Muon's twin: the same run on the device
        twin = dict(kw)
        twin.pop("offload", None)
        twin.pop("offload_params", None)
    if "nvme" in (kw.get("offload"), kw.get("offload_params")):
        with tempfile.TemporaryDirectory(prefix="zk_unused_") as d:
            kw["offload_path"] = d
            if twin is not None and "nvme" in (twin.get("offload"),
                                               twin.get("offload_params")):
                twin["offload_path"] = d
            return _run(rank, ws, stage, kind, twin=twin, **kw)
    return _run(rank, ws, stage, kind, twin=twin, **kw)


def _worker(rank, ws):
    cases = {f"{kind}-s{stage}": (lambda kind=kind, stage=stage: _run(rank, ws, stage, kind))
             for kind, stage in CASES}
    cases.update({f"{cfg}-{kind}-s{stage}": (lambda c=cfg, kind=kind, stage=stage:
                                              _cfg_run(rank, ws, c, kind, stage))
                  for cfg, kind, stage in CFG_CASES})
    return run_cases(cases)


# N = 3 in the slow pass ([Note: the slow mark]: its spawn runs every case, 18 s); the 8-bit
# file's N = 3 is slow too
@pytest.fixture(scope="module", params=ws_params(1, 2, 3))
def results(request):
    return request.param, cached(_worker, request.param)


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("kind,stage", CASES)
def test_param_no_rank_used_is_skipped(results, kind, stage):
    ws, res = results
    for r, got in enumerate(case(res, f"{kind}-s{stage}")):
        assert not got["skip"], f"rank {r}: moved while no rank used it: {got['skip'][:4]}"
        if ws >= 2:  # negative control: used on rank 0 only, it moves on every rank
            assert not got["control"], f"rank {r}: expert 3 did not move: {got['control']}"
        if "rel" in got:
            assert got["rel"] <= TOL, f"rank {r}: params vs DDP+AdamW rel {got['rel']:.3g}"
            assert got["rel_unused"] <= TOL, \
                f"rank {r}: the unused experts vs DDP+AdamW {got['rel_unused']:.3g}"


@pytest.mark.slow  # the default run's budget (pyproject.toml [Note: the slow mark])
@pytest.mark.parametrize("cfg,kind,stage", CFG_CASES)
def test_param_no_rank_used_is_skipped_offload_compact(results, cfg, kind, stage):
    """offload="cpu"/"nvme", master="compact" (bf16, bitwise its master="fp32" twin),
    offload_params (stage 3): skipped bit for bit, the rest as the reference (DDP + AdamW, or
    for Lion / Muon the same run with the state on the device, bitwise)."""
    ws, res = results
    for r, got in enumerate(case(res, f"{cfg}-{kind}-s{stage}")):
        assert not got["skip"], f"rank {r}: moved while no rank used it: {got['skip'][:4]}"
        if ws >= 2:
            assert not got["control"], f"rank {r}: expert 3 did not move: {got['control']}"
        assert not got.get("expanded"), f"rank {r}: compact master expanded {got['expanded']}"
        tol = TOL if kind == "adamw" and "compact" not in cfg else 0.0
        assert got["rel"] <= tol, f"rank {r}: params vs the reference rel {got['rel']:.3g}"
        assert got["rel_unused"] <= tol, \
            f"rank {r}: the unused experts vs the reference {got['rel_unused']:.3g}"
