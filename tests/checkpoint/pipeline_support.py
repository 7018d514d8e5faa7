"""A model to checkpoint across pipeline layouts, split into stages torchtitan's way, and its
plain-torch reference (tests/checkpoint/test_pipeline_*.py).

`Net` has an input layer, L blocks in a ModuleDict, a norm and a head, and a buffer on the
root. `stage_model(s, P)` is the whole model with the other stages' layers deleted (torchtitan's
split: every param keeps its fully qualified name, `layers.3.fc1.weight` on the last stage as
in the whole model). Stages differ in size: the input layer is on the first, the norm and head
on the last.

The loss is a sum of one term per module, each of the module's own output on its own random
rows (no activations pass between stages), so any split of the modules over pipeline stages
computes the same gradients for each param: a stage needs no pipeline schedule to train, and a
checkpoint can be resumed at any layout (tests/comm/test_world_mesh.py's approach). The global
batch is ROWS rows per module per step; dp rank r of D takes rows [r*ROWS/D, (r+1)*ROWS/D), so
the dp average is the global mean at every dp size. `chain=True` makes the forward the real
chain (inp, blocks, norm, head) for a pipeline schedule.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

import zerokern as zk

IN, D, H, OUT, L = 8, 16, 24, 4, 4
ROWS = 8  # global rows per module per step: divisible by every dp size used (1, 2, 4, 8)
LR, BETAS, EPS, WD = 1e-2, (0.8, 0.9), 1e-3, 0.1
MAX_NORM = 0.5  # the global clip (over every stage) acts at every step
BUCKET_MB = 0.0002  # ~50 fp32 elements: many buckets, params straddle them
SEED = 4242
MODULES = ["inp", *[f"layers.{i}" for i in range(L)], "norm", "head"]
IN_DIM = {"inp": IN, "norm": D, "head": D, **{f"layers.{i}": D for i in range(L)}}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, seed: int = SEED, chain: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(IN, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(L)})
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, OUT)
        with torch.no_grad():  # not LayerNorm's ones and zeros: a wrong load shows
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
        self.register_buffer("scale", torch.rand(D) + 0.5)  # on every stage (the root's)
        self.chain = chain

    def module(self, name: str) -> Optional[nn.Module]:
        if name.startswith("layers."):
            return self.layers[name[7:]] if name[7:] in self.layers else None
        return getattr(self, name)

    def forward(self, xs):
        if self.chain:  # the pipeline's stage: the modules it holds, in order
            x = xs
            for name in MODULES:
                m = self.module(name)
                if m is not None:
                    x = m(x) if name != "norm" else m(x) * self.scale
            return x
        total = None
        for k, name in enumerate(MODULES):  # one term per module held here
            m = self.module(name)
            if m is None:
                continue
            y = m(xs[name])
            if name == "norm":
                y = y * self.scale
            term = (y ** 2).mean() * (1 + 0.25 * k)
            total = term if total is None else total + term
        return total


def stage_model(s: int, P: int, seed: int = SEED, chain: bool = False) -> Net:
    """Pipeline stage s of P: the whole model with the other stages' layers deleted."""
    m = Net(seed, chain)
    per = L // P
    for i in range(L):
        if not s * per <= i < (s + 1) * per:
            del m.layers[str(i)]
    if s != 0:
        m.inp = None
    if s != P - 1:
        m.norm = None
        m.head = None
    return m


def renumbered_stage(s: int, P: int) -> Net:
    """The mistake a checkpoint must refuse: stage layers renumbered from 0 (a Sequential cut
    into pieces), so two stages hold `layers.0.fc1.weight`."""
    m = stage_model(s, P)
    m.layers = nn.ModuleDict({str(k): b for k, b in enumerate(m.layers.values())})
    return m


def batch(step: int, dp_rank: int, dp: int) -> Dict[str, torch.Tensor]:
    out = {}
    for k, name in enumerate(MODULES):
        g = torch.Generator().manual_seed(10_000 * step + k)
        x = torch.randn(ROWS, IN_DIM[name], generator=g)
        n = ROWS // dp
        out[name] = x[dp_rank * n:(dp_rank + 1) * n]
    return out


def groups(model: nn.Module) -> List[dict]:
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [dict(params=decay, weight_decay=WD), dict(params=rest, weight_decay=0.0, lr=2 * LR)]


def zero_opt(model: nn.Module, stage: int, **kw):
    return zk.ZeroAdamW(model, lr=LR, betas=BETAS, eps=EPS, stage=stage, precision="fp32",
                        backend="cpu", max_grad_norm=MAX_NORM, bucket_mb=BUCKET_MB,
                        param_groups=groups(model), **kw)


def train(model: nn.Module, opt, dp_rank: int, dp: int, start: int, n: int) -> None:
    for step in range(start, start + n):
        model(batch(step, dp_rank, dp)).backward()
        opt.step()
        opt.zero_grad()


def params_of(model: nn.Module, opt=None) -> Dict[str, torch.Tensor]:
    """{name: full fp32 value} (stage 3: gathered; DTensors: their full tensors)."""
    ctx = opt.gathered_params() if opt is not None and opt.stage == 3 else _null()
    with ctx:
        out = {}
        for n, p in model.named_parameters():
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[n] = t.detach().clone()
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def reference(steps: int) -> List[Dict[str, torch.Tensor]]:
    """The whole model on one process: torch.optim.AdamW, global clip; params after each
    step."""
    model = Net()
    opt = torch.optim.AdamW([{**g, "params": g["params"]} for g in groups(model)], lr=LR,
                            betas=BETAS, eps=EPS)
    out = []
    for step in range(steps):
        opt.zero_grad()
        model(batch(step, 0, 1)).backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), MAX_NORM)
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def rel_err(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """max over b's params of max|a - b| / max|b|, in float64; a must hold every name of b."""
    worst = 0.0
    for n in b:
        x, y = a[n].double(), b[n].double()
        worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item())
    return worst


def merge(dicts) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for d in dicts:
        out.update(d)
    return out
