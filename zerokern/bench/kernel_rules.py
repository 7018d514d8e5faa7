"""Kernel rows per optimizer rule (issue 23): Lion, 8-bit AdamW and Muon, beside the AdamW rows
of kernels.py, each against what a user runs today, as a fraction of the rule's byte floor.

[Note: the byte floor of a rule]
A fused step over a flat piece of n elements reads and writes the fp32 master (8n) and every
state of the rule (`StateSpec.bytes_per_elem`, read and written: 2 x k_bytes), reads the grad
and writes the 16-bit param out where the case has one. Derived from the rule's StateSpec list
(`rule_floor`), so it follows the rule:
- AdamW: 8 + 2 x 8 + grad + out = 28 B/elem (bf16 case), DESIGN §6's 28n;
- Lion: 8 + 2 x 4 + grad + out = 20 (bf16), 20 (fp32: 16 + 4-byte grad);
- 8-bit AdamW: 8 + 2 x (1 + 1 + 4/128 + 4/128) + grad + out = 16.125 (bf16);
- Muon's element-wise part ("muon_pieces": momentum, Nesterov, decay and the update per piece)
  has Muon's floor, 8 + 2 x 4 + grad + out = 20 (bf16). Its pieces also write the update and
  read it back around Newton-Schulz (+8n), which the floor does not credit (the orthogonalized
  update must exist somewhere), so 100% of the floor is out of reach for that row by design.
GB/s = floor / median time for every provider of a rule (effective bandwidth), and
% RMW = that over the fp32 in-place read-modify-write ceiling measured at the same size in
the same run (kernels.py [Note: what is compared]), so "% RMW" is the fraction of the floor's
time a provider achieves.

[Note: the peers per rule]
- Lion: `lion-pytorch`'s Lion (the package ZeroLion matches; plain torch ops per param on the
  CPU) and "torch-foreach", the same update written with torch._foreach_* ops (what a user
  would write for speed; torch has no Lion). vs torch = time of lion-pytorch / time.
- 8-bit AdamW: bitsandbytes' AdamW8bit (it runs on the CPU here, block 256 there against our
  128), torchao's `torchao.optim.AdamW8bit` ("torchao-8bit": a torch.compile'd step over its
  8-bit tensor subclass, block 256; compiled by the untimed first step), fp32
  `AdamW(fused=True)` (what 8-bit replaces: 12 bytes of state against 2.06) and "zk-adamw32",
  zerokern's own fp32-state `adam_step_` on the same backend (issue 40 asks the 8-bit step to
  take <= 0.7x its time: it moves 28 B/elem against 16.1). vs torch = time of bnb-8bit / time.
- Muon pieces: "torch-eager", the same element-wise update written as plain in-place torch ops
  (lerp_, lerp, mul_, add_): zerokern's pieces add a torch.where per write (skipped steps without
  a host sync) and an update buffer; this row shows their cost.
- Newton-Schulz per matrix and the whole single-matrix Muon step against torch.optim.Muon:
  kernel_rules_ns.py.
In the 16-bit cases the torch-side providers run the mixed path of the AdamW rows: upcast the
grad into the fp32 param's grad, step, cast the param back (not credited by the floor).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch

from ..rules import Rule
from .kernel_cases import Case, Timed, _zk_adam

RULES = ("lion", "adamw8bit", "muon")
OPS = {"lion": "lion_step_", "adamw8bit": "adamw8bit_step_", "muon": "muon_pieces"}
PEERS = {"lion": ("lion-pytorch", "torch-foreach"),
         "adamw8bit": ("bnb-8bit", "torchao-8bit", "zk-adamw32", "torch-fused"),
         "muon": ("torch-eager",)}
BASELINE = {"lion": "lion-pytorch", "adamw8bit": "bnb-8bit", "muon": "torch-eager"}
# The zk kernels per rule: Muon's pieces are torch ops on any device (no backend).
ZK_PROVIDER = {"muon": ("zk-pieces",)}
LION_HYPER = dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.01)
MUON_HYPER = dict(lr=0.02, momentum=0.95, weight_decay=0.01)
ADAM_HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# Peak bytes per element of one size's rule round (for skipping sizes that cannot fit): the
# master, grads (16-bit, fp32) and param_out, Lion's m, 8-bit codes, Muon's buffer and update,
# the fp32 AdamW peers' m and v, the ceilings' 3 buffers, temporaries.
BYTES_NEEDED = 72


def rule_of(name: str) -> Rule:
    from ..rules.registry import rule_by_name

    return rule_by_name(name)


def rule_floor(rule: Rule, case: Case) -> float:
    """Bytes per element of one fused step of `rule` ([Note: the byte floor of a rule])."""
    out = case.param_out_dtype.itemsize if case.param_out_dtype is not None else 0
    return 8 + 2 * rule.k_bytes + case.grad_dtype.itemsize + out


def describe(name: str, case: Case) -> str:
    rule = rule_of(name)
    states = " + ".join(f"{s.name} {s.bytes_per_elem:g}" for s in rule.states)
    io = f"{case.name} grad" + (f" + {case.name} param_out" if case.mixed else "")
    return (f"{OPS[name]} {case.name}: master 4 + {states} read and written, {io}: floor "
            f"{rule_floor(rule, case):g} B/elem; vs torch = time of {BASELINE[name]} / time")


def _scalars(device):
    return (torch.ones((), dtype=torch.int64, device=device),       # one step already taken
            torch.ones((), dtype=torch.float32, device=device),     # grad_scale
            torch.zeros((), dtype=torch.bool, device=device))       # found_inf


def _zk_lion(backend, master, m, grad, out, device) -> Callable[[], None]:
    from ..kernels.lion import lion_step_

    step, scale, found = _scalars(device)
    b1, b2 = LION_HYPER["betas"]
    kw = dict(lr=LION_HYPER["lr"], beta1=b1, beta2=b2, weight_decay=LION_HYPER["weight_decay"],
              step=step, grad_scale=scale, found_inf=found, backend=backend)

    def fn():
        lion_step_(master, m, grad, out, **kw)
    fn()  # builds the backend outside the timed reps
    return fn


def _zk_8bit(backend, master, q, grad, out, device) -> Callable[[], None]:
    from ..kernels.adamw8bit import adamw8bit_step_

    step, scale, found = _scalars(device)
    b1, b2 = ADAM_HYPER["betas"]
    kw = dict(lr=ADAM_HYPER["lr"], beta1=b1, beta2=b2, eps=ADAM_HYPER["eps"],
              weight_decay=ADAM_HYPER["weight_decay"], step=step, grad_scale=scale,
              found_inf=found, backend=backend)

    def fn():
        adamw8bit_step_(master, *q, grad, out, **kw)
    fn()
    return fn


def _zk_muon_pieces(master, buf, grad, out, device) -> Callable[[], None]:
    from ..rules.muon_pieces import apply_, momentum_

    _, scale, found = _scalars(device)
    n = master.numel()
    segments = [(0, n, (n // 1024, 1024))]
    h = MUON_HYPER

    def fn():
        upd = momentum_(buf, grad, momentum=h["momentum"], nesterov=True, grad_scale=scale,
                        found_inf=found)
        apply_(master, upd, segments, lr=h["lr"], weight_decay=h["weight_decay"],
               adjust_lr_fn=None, found_inf=found)
        if out is not None:
            out.copy_(master)
    fn()
    return fn


def _torch_eager_muon(master, buf, grad, out) -> Callable[[], None]:
    h = MUON_HYPER

    def fn():
        g = grad.float()
        buf.lerp_(g, 1 - h["momentum"])
        upd = g.lerp(buf, h["momentum"])  # a new tensor, as torch.optim.Muon's Nesterov
        master.mul_(1 - h["lr"] * h["weight_decay"]).add_(upd, alpha=-h["lr"])
        if out is not None:
            out.copy_(master)
    return fn


class _ForeachLion(torch.optim.Optimizer):
    """Lion (lion-pytorch's update) in torch._foreach_* ops ([Note: the peers per rule])."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            grads = [p.grad for p in ps]
            ms = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in ps]
            b1, b2 = g["betas"]
            torch._foreach_mul_(ps, 1 - g["lr"] * g["weight_decay"])
            c = torch._foreach_lerp(ms, grads, 1 - b1)
            torch._foreach_sign_(c)
            torch._foreach_add_(ps, c, alpha=-g["lr"])
            torch._foreach_lerp_(ms, grads, 1 - b2)


def _torch_opt(provider: str, param, grad32, states: Dict[str, torch.Tensor]):
    """The peer's optimizer over `param`, one step taken, then the shared state swapped in."""
    param.grad = grad32
    if provider == "lion-pytorch":
        from lion_pytorch import Lion

        opt = Lion([param], **LION_HYPER)
    elif provider == "torch-foreach":
        opt = _ForeachLion([param], **LION_HYPER)
    elif provider == "bnb-8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit([param], min_8bit_size=0, **ADAM_HYPER)
    elif provider == "torchao-8bit":
        from torchao.optim import AdamW8bit

        opt = AdamW8bit([param], **ADAM_HYPER)
    elif provider == "torch-fused":
        opt = torch.optim.AdamW([param], fused=True, **ADAM_HYPER)
    else:
        raise ValueError(f"unknown provider {provider!r}")
    opt.step()
    opt.state[param].update({k: v for k, v in states.items() if k in opt.state[param]})
    return opt


def _mixed(opt, param, grad, out) -> Callable[[], None]:
    if out is None:
        return opt.step

    def fn():
        param.grad.copy_(grad)      # upcast the 16-bit grad
        opt.step()
        out.copy_(param)            # cast back
    return fn


def build_rule_timed(n: int, log2n: int, cases: Sequence[Case], rules: Sequence[str],
                     zk_backends: Sequence[str], device: torch.device,
                     skipped: List[dict], peers: bool = True) -> List[Timed]:
    """The timed callables of every rule's rows at n elements (fresh random data); peers=False:
    zerokern's kernels only (`--providers` naming no torch provider)."""
    gen = torch.Generator(device=device).manual_seed(4321 + log2n)

    def rand(scale: float, positive: bool = False) -> torch.Tensor:
        t = torch.rand(n, generator=gen, device=device) if positive else \
            torch.randn(n, generator=gen, device=device)
        return t.mul_(scale).add_(1e-8) if positive else t.mul_(scale)

    timed: List[Timed] = []
    master = rand(1.0)
    for case in cases:
        grad = rand(1e-3).to(case.grad_dtype)
        out = master.to(case.param_out_dtype) if case.mixed else None
        grad32 = grad.float()
        for name in rules:
            rule, op = rule_of(name), OPS[name]
            floor = rule_floor(rule, case)
            base = BASELINE[name]
            if name == "muon":
                buf = rand(1e-3)
                timed.append(Timed(op, case.name, "zk-pieces", floor,
                                   _zk_muon_pieces(master, buf, grad, out, device), base))
                if peers:
                    timed.append(Timed(op, case.name, "torch-eager", floor,
                                       _torch_eager_muon(master, buf, grad, out), base))
                continue
            if name == "lion":
                m = rand(1e-3)
                state = {"exp_avg": m}
                make = lambda b, m=m, g=grad, o=out: _zk_lion(b, master, m, g, o, device)  # noqa: E731
            else:
                from ..kernels.quant8 import BLOCK

                q = (torch.randint(0, 256, (n,), generator=gen, device=device,
                                   dtype=torch.int64).to(torch.uint8),
                     rand(1e-3, positive=True)[: n // BLOCK].clone(),
                     torch.randint(128, 256, (n,), generator=gen, device=device,
                                   dtype=torch.int64).to(torch.uint8),
                     rand(1e-6, positive=True)[: n // BLOCK].clone())
                state = {}
                make = lambda b, q=q, g=grad, o=out: _zk_8bit(b, master, q, g, o, device)  # noqa: E731
            for b in zk_backends:
                try:
                    timed.append(Timed(op, case.name, b, floor, make(b), base))
                except Exception as e:  # noqa: BLE001 - a backend that cannot run is a row less
                    skipped.append({"provider": b, "op": op, "case": case.name, "log2n": log2n,
                                    "reason": str(e).splitlines()[0][:300]})
            for p in PEERS[name] if peers else ():
                if p == "zk-adamw32":  # zerokern's fp32-state step on the first zk backend
                    if not zk_backends:
                        continue

                    m32, v32 = rand(1e-3), rand(1e-6, positive=True)
                    timed.append(Timed(op, case.name, p, floor,
                                       _zk_adam(zk_backends[0], master, m32, v32, grad, out,
                                                device), base))
                    continue
                try:
                    param = master.view(-1)
                    opt = _torch_opt(p, param, grad32 if out is not None else grad, state)
                except Exception as e:  # noqa: BLE001 - e.g. bitsandbytes without a CPU build
                    skipped.append({"provider": p, "op": op, "case": case.name, "log2n": log2n,
                                    "reason": f"{type(e).__name__}: {str(e)[:300]}"})
                    continue
                timed.append(Timed(op, case.name, p, floor, _mixed(opt, param, grad, out), base))
    return timed
