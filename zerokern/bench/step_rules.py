"""`zerokern bench --step --optimizer muon|lion|adamw8bit`: the step benchmark's providers for
the rules beyond AdamW (issue 23), beside step.py's AdamW ones.

[Note: the peers per optimizer]
Each zerokern stage runs the rule's optimizer (ZeroMuon, ZeroLion, ZeroAdamW(state_bits=8));
the peer is DDP (gradient_as_bucket_view, the same bucket size) + the single-process optimizer
a user would run, on its own copy of the same model and data:
- muon: torch.optim.Muon over the matrices + torch.optim.AdamW(fused=True) over the rest, the
  split ZeroMuon makes by default (rules.muon.embedding_weight_ids / takes_muon), stepped one
  after the other (`_Pair`); both with ZeroMuon's hyperparameters;
- lion: lion-pytorch's Lion (plain torch ops per param; torch has no Lion);
- adamw8bit: bitsandbytes' AdamW8bit (its CPU path), min_8bit_size=0 so every param is 8-bit
  as in ZeroAdamW(state_bits=8).
ZeroRedundancyOptimizer and FSDP2 wrap torch's AdamW in step.py; their Muon/Lion/8-bit forms
are not standard (Muon needs whole matrices), so only DDP is the peer here. The ratio
"× DDP" is measured in the same run, round-robin (step.py).
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

OPTIMIZERS = ("adamw", "muon", "lion", "adamw8bit")
DDP_NAME = {"adamw": "DDP + AdamW(fused)", "muon": "DDP + torch Muon + AdamW",
            "lion": "DDP + lion-pytorch Lion", "adamw8bit": "DDP + bnb AdamW8bit"}
MUON_HP = dict(lr=0.02, weight_decay=0.01, momentum=0.95, nesterov=True)
ADAMW_HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
LION_HP = dict(lr=1e-5, betas=(0.9, 0.99), weight_decay=0.01)


class _Pair:
    """torch.optim.Muon + torch.optim.AdamW stepped as one optimizer (the peer's split)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.opts = (muon, adamw)
        self.state = {**muon.state, **adamw.state}

    def step(self) -> None:
        for o in self.opts:
            o.step()
        self.state = {**self.opts[0].state, **self.opts[1].state}

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad()


def muon_split(model: torch.nn.Module):
    """(matrices, rest): ZeroMuon's default split of `model`'s trainable params."""
    from ..rules.muon import embedding_weight_ids, takes_muon

    emb = embedding_weight_ids(model)
    ps = [p for p in model.parameters() if p.requires_grad]
    mats = [p for p in ps if takes_muon(p.shape, id(p) in emb)]
    ids = {id(p) for p in mats}
    return mats, [p for p in ps if id(p) not in ids]


def zerokern_optimizer(kind: str, model, stage: int, args):
    """The zerokern optimizer of `kind` over `model` (step.py's arguments)."""
    import zerokern as zk

    kw = dict(stage=stage, precision=args.precision, backend=args.backend,
              bucket_mb=args.bucket_mb)
    if kind == "muon":
        return zk.ZeroMuon(model, **MUON_HP, adamw_lr=ADAMW_HP["lr"],
                           adamw_betas=ADAMW_HP["betas"], adamw_eps=ADAMW_HP["eps"],
                           adamw_weight_decay=ADAMW_HP["weight_decay"], **kw)
    if kind == "lion":
        return zk.ZeroLion(model, **LION_HP, **kw)
    if kind == "adamw8bit":
        return zk.ZeroAdamW(model, state_bits=8, **ADAMW_HP, **kw)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS[1:]}, got {kind!r}")


def peer_optimizer(kind: str, model):
    """The single-process optimizer DDP runs with ([Note: the peers per optimizer])."""
    if kind == "muon":
        mats, rest = muon_split(model)
        return _Pair(torch.optim.Muon(mats, **MUON_HP),
                     torch.optim.AdamW(rest, fused=True, **ADAMW_HP))
    if kind == "lion":
        from lion_pytorch import Lion

        return Lion(model.parameters(), **LION_HP)
    if kind == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(model.parameters(), min_8bit_size=0, **ADAMW_HP)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS[1:]}, got {kind!r}")


def make_providers(args, gpt: Callable, iteration: Callable, torch_probe: Callable,
                   ddp_kw: Dict) -> Dict[str, tuple]:
    """name -> (iteration fn, optimizer, memory fn, model), as step._make_providers."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    provs: Dict[str, tuple] = {}
    for stage in args.stages:
        m = gpt()
        opt = zerokern_optimizer(args.optimizer, m, stage, args)
        provs[f"zerokern s{stage}"] = (iteration(m, opt, no_sync=opt.no_sync), opt,
                                       lambda opt=opt: opt.memory_report(), m)
    if args.peers:
        m = gpt()
        ddp = DDP(m, gradient_as_bucket_view=True, bucket_cap_mb=args.bucket_mb, **ddp_kw)
        opt = peer_optimizer(args.optimizer, m)
        probe, box = torch_probe(m, opt)
        provs[DDP_NAME[args.optimizer]] = (iteration(m, opt, ddp, probe, ddp.no_sync), opt,
                                           lambda box=box: box["bytes"], m)
    return provs
