"""A tiny transformer-like LM with odd sizes, its data, and the plain-torch reference trainers.

Everything a bug could hide behind is present on purpose:
- odd sizes (vocab 61, d_model 24, MLP 37) so nothing divides the world size or the bucket;
- the embedding weight tied to the output projection (one Parameter reached twice);
- a frozen param (`pos`, requires_grad=False) that must stay fp32, untouched, out of the buffers;
- a 0-d param (`temp`, one element, shape ());
- two param groups: weights (weight decay) and biases/norms (no decay, their own lr);
- exaggerated hyperparameters (betas 0.5/0.6, eps 0.25, weight decay 0.1): with eps that large
  the update is nearly linear in the gradient, so a wrong gradient scale shows directly;
- tiny buckets (BUCKET_MB: a few hundred elements) so there are many buckets and params
  straddle bucket and shard boundaries.

The global batch (GLOBAL_BATCH sequences) is the same at every world size; rank r trains on its
contiguous slice, so the mean-reduced loss averaged over ranks is the global mean.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import zerokern as zk

VOCAB, D_MODEL, HEADS, D_MLP, N_BLOCKS, SEQ = 61, 24, 2, 37, 2, 7
GLOBAL_BATCH = 12  # sequences; divisible by world sizes 1, 2, 3 and 4
LR, BETAS, EPS, WD = 1e-2, (0.5, 0.6), 0.25, 0.1
NO_DECAY_LR = 2e-2  # the bias/norm group has its own lr: per-group lr must be honoured
BUCKET_MB = 0.002  # 2097 B: 512 fp32 / 1024 16-bit elements (384 / 768 at 3 ranks)
BACKEND = "cpu"  # the C++ kernel (JIT-built once); "reference" where a test says so
MODEL_SEED = 20240607
DATA_SEED = 977


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc1 = nn.Linear(D_MODEL, D_MLP)
        self.fc2 = nn.Linear(D_MLP, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // HEADS
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, HEADS, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) * (hd**-0.5)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.zeros(SEQ, D_MODEL), requires_grad=False)  # frozen
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)
        self.head.weight = self.emb.weight  # tied: the same Parameter, reached twice
        self.temp = nn.Parameter(torch.ones(()))  # a 0-d param: numel 1, shape ()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = x + self.pos[: tokens.shape[1]].to(x.dtype)  # pos stays fp32 in a 16-bit model
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x)) * self.temp


def make_model(seed: int = MODEL_SEED) -> TinyLM:
    """Deterministic init from `seed`; no zeros anywhere (norm weights ~1, biases ~0.1)."""
    model = TinyLM()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("bias"):
                p.copy_(0.1 * r)
            elif p.dim() <= 1:  # LayerNorm weight, temp
                p.copy_(1 + 0.1 * r)
            elif name == "pos":
                p.copy_(0.3 * r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))
    return model


def is_decayed(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 2 and name != "pos"


def param_groups(model: nn.Module, tied_twice: bool = True, **decay_over) -> List[dict]:
    """[weights (weight decay WD), biases/norms (weight decay 0, lr NO_DECAY_LR)].

    tied_twice=True lists the tied weight twice (emb.weight and head.weight) and the frozen
    param too, as `model.named_parameters(remove_duplicate=False)` yields them: ZeroAdamW must
    store the tie once and skip the frozen param. Torch references use tied_twice=False.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters(remove_duplicate=not tied_twice):
        (decay if is_decayed(name, p) or name == "pos" else no_decay).append(p)
    return [
        dict(params=decay, weight_decay=decay_over.get("weight_decay", WD)),
        dict(params=no_decay, weight_decay=0.0, lr=NO_DECAY_LR),
    ]


def zero_opt(model: nn.Module, stage: int, precision: str = "fp32", **kw) -> zk.ZeroAdamW:
    """ZeroAdamW over `param_groups(model)` with the exaggerated hyperparameters (stage 3: the
    model itself, with the same groups as `param_groups=`)."""
    kw = {
        "lr": LR,
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": WD,
        "bucket_mb": BUCKET_MB,
        "backend": BACKEND,
        **kw,
    }
    if stage == 3:
        return zk.ZeroAdamW(model, stage=3, precision=precision,
                            param_groups=param_groups(model, tied_twice=False), **kw)
    with warnings.catch_warnings():  # torch warns about the tied param listed twice
        warnings.simplefilter("ignore", UserWarning)
        return zk.ZeroAdamW(param_groups(model), stage=stage, precision=precision, **kw)


def torch_adamw(model: nn.Module, **over) -> torch.optim.AdamW:
    """torch.optim.AdamW, same groups and hyperparameters (`over`: wrong ones, for controls)."""
    groups = param_groups(model, tied_twice=False, **over)
    return torch.optim.AdamW(
        groups, lr=LR, betas=over.get("betas", BETAS), eps=EPS, weight_decay=WD, foreach=False
    )


# ---- data ------------------------------------------------------------------------------------
def global_tokens(step: int, micro: int = 0, n: int = GLOBAL_BATCH) -> torch.Tensor:
    """Fresh random tokens (n, SEQ + 1) for (step, micro), identical on every rank."""
    g = torch.Generator().manual_seed(DATA_SEED + 7919 * step + 104729 * micro)
    return torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)


def rank_tokens(step: int, rank: int, world_size: int, micro: int = 0) -> torch.Tensor:
    t = global_tokens(step, micro)
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (computed in fp32 also for 16-bit models)."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


# ---- inspection ------------------------------------------------------------------------------
def snapshot(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Clones of every unique param (frozen included), by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_snapshot(model: nn.Module, opt: zk.ZeroAdamW) -> Dict[str, torch.Tensor]:
    """`snapshot` with stage 3's params gathered (a no-op context at stages 0-2)."""
    with opt.gathered_params():
        return snapshot(model)


def full_replica_diff(model: nn.Module, opt: zk.ZeroAdamW) -> float:
    with opt.gathered_params():
        return replica_diff(model)


def trainable_names(model: nn.Module) -> List[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def rel_err(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    """max over params of max|a - b| / max|b| (b is the reference), computed in float64."""
    worst = 0.0
    for n in b:
        x, y = a[n].double().cpu(), b[n].double().cpu()  # (offload: host vs device)
        worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item())
    return worst


def abs_err(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max((a[n].double() - b[n].double()).abs().max().item() for n in b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return t if t.dtype == torch.bool else t.view(torch.uint8)


def bitwise_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes, shapes and bits (so nan == nan and -0.0 != 0.0)."""
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype
        and a[n].shape == b[n].shape
        and torch.equal(_bits(a[n]), _bits(b[n]))
        for n in b
    )


def gather_state(opt: zk.ZeroAdamW, model: nn.Module, key: str) -> Dict[str, torch.Tensor]:
    """Full fp32 `key` ("master", "exp_avg", "exp_avg_sq") per param name, from every shard.

    Follows partition.py's [Note: bucket-major layout]: rank r's piece of bucket k sits at
    `shard_offset(k)` in its shard buffers and at `piece_range(k, r)` in the flat buffer.
    Uses plain dist.all_gather, not zerokern's own collectives. fp32 has no master: the flat
    param buffer is the master.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    ws = opt.comm.shard.world_size
    out = {}
    for g in opt.flat_groups:
        L = g.layout
        buf = getattr(g, key)
        replicated = opt.stage == 0 or ws == 1
        if buf is None:  # fp32: the param buffer is the master (full at stages 0-2)
            buf = g.param_shard if opt.stage == 3 else g.flat
            replicated = replicated or opt.stage != 3
        if replicated:
            full = buf
        else:
            full = torch.empty(L.padded_numel, dtype=buf.dtype)
            for k in range(L.n_buckets):
                n, off = L.piece_numel(k), L.shard_offset(k)
                parts = [torch.empty(n, dtype=buf.dtype) for _ in range(ws)]
                dist.all_gather(parts, buf[off : off + n].contiguous())
                lo, hi = L.bucket_range(k)
                full[lo:hi] = torch.cat(parts)
        for p, s in zip(g.params, L.slots):
            out[names[id(p)]] = full[s.offset : s.offset + s.numel].view(s.shape).clone()
    return out


def replica_diff(model: nn.Module) -> float:
    """max |param difference| between this rank and rank 0 (params are replicated at 0-2)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    flat = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    return (flat - ref).abs().max().item()


# ---- training loops ----------------------------------------------------------------------------
def train_zero(
    model: nn.Module,
    opt: zk.ZeroAdamW,
    rank: int,
    ws: int,
    steps: int,
    start: int = 0,
    micro: int = 1,
    scheduler=None,
    before_backward: Optional[Callable[[int], None]] = None,
) -> dict:
    """`steps` ZeroAdamW steps; each backward is the micro-batch's loss / micro via opt.backward.

    Returns {"params": [snapshot after each step], "grad_norm": [...], "skipped": [...],
    "loss_scale": [...], "lr": [[group lrs] per step]} (host reads happen after each step).
    """
    rec = {"params": [], "grad_norm": [], "skipped": [], "loss_scale": [], "lr": []}
    for s in range(start, start + steps):
        opt.zero_grad()
        for m in range(micro):
            if before_backward is not None:
                before_backward(s)
            # As with DDP: the loss divided by the micro-batches (grads sum over backward
            # passes), every micro-batch but the last under no_sync().
            ctx = opt.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                opt.backward(loss_fn(model, rank_tokens(s, rank, ws, micro=m)) / micro)
        rec["lr"].append([g["lr"] for g in opt.param_groups])
        opt.step()
        if scheduler is not None:
            scheduler.step()
        rec["params"].append(full_snapshot(model, opt))
        rec["grad_norm"].append(float(opt.grad_norm))
        rec["skipped"].append(bool(opt.step_skipped))
        rec["loss_scale"].append(float(opt.loss_scale))
    return rec


def train_torch(
    model: nn.Module,
    rank: int,
    ws: int,
    steps: int,
    micro: int = 1,
    clip: Optional[float] = None,
    scheduler_fn=None,
    **wrong,
) -> dict:
    """DDP (gloo; no wrap at world size 1) + torch.optim.AdamW, the fp32 reference.

    micro > 1 trains on the concatenation of the `micro` micro-batches (the big batch).
    `wrong` perturbs the reference (betas / weight_decay) for negative controls.
    """
    net = model if ws == 1 else nn.parallel.DistributedDataParallel(model)
    opt = torch_adamw(model, **wrong)
    sched = scheduler_fn(opt) if scheduler_fn else None
    rec = {"params": [], "grad_norm": [], "lr": [], "opt": opt}
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        tokens = torch.cat([rank_tokens(s, rank, ws, micro=m) for m in range(micro)])
        loss_fn(net, tokens).backward()
        if clip is not None:
            rec["grad_norm"].append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        rec["lr"].append([g["lr"] for g in opt.param_groups])
        opt.step()
        if sched is not None:
            sched.step()
        rec["params"].append(snapshot(model))
    return rec


def torch_state(opt: torch.optim.AdamW, model: nn.Module, key: str) -> Dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: st[key].clone() for p, st in opt.state.items()}


def train_mixed_reference(
    model32: nn.Module,
    rank: int,
    ws: int,
    steps: int,
    precision: str,
    loss_scale=None,
    betas=BETAS,
    reduce_fp32: bool = False,
) -> dict:
    """The plain-torch mixed-precision reference (DESIGN §3 semantics, no zerokern code).

    - 16-bit model = model32 cast (round to nearest even); fp32 masters = model32's values;
    - loss * scale backward in the 16-bit model (scale 1 for bf16);
    - grads all-reduced per param with SUM **in the 16-bit dtype** (zerokern's default
      reduce_dtype), or in fp32 with reduce_fp32=True (zerokern's reduce_dtype=torch.float32),
      then unscaled in fp32 by 1/(scale * ws), the same fp32 reciprocal;
    - any non-finite grad on any rank: skip the step; dynamic scale: x0.5 on overflow,
      x2 after 2000 clean steps (GradScaler rules);
    - else torch.optim.AdamW on the masters, then cast the masters back into the 16-bit params.
    `betas` other than BETAS make a deliberately wrong reference (negative controls).
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model = copy.deepcopy(model32).to(dtype)
    masters = {n: p.detach().clone() for n, p in model32.named_parameters() if p.requires_grad}
    mparams = {n: nn.Parameter(t) for n, t in masters.items()}
    named = dict(model.named_parameters())
    groups = []
    for g in param_groups(model32, tied_twice=False):
        ids = {id(p) for p in g["params"]}
        groups.append(
            {
                **g,
                "params": [
                    mparams[n]
                    for n, p in model32.named_parameters()
                    if id(p) in ids and p.requires_grad
                ],
            }
        )
    opt = torch.optim.AdamW(groups, lr=LR, betas=betas, eps=EPS, weight_decay=WD, foreach=False)
    dynamic = precision == "fp16" and loss_scale in (None, "dynamic")
    scale = 2.0**16 if dynamic else float(loss_scale or 1.0)
    tracker = 0
    rec = {"params": [], "masters": [], "skipped": [], "loss_scale": []}
    for s in range(steps):
        model.zero_grad(set_to_none=True)
        (loss_fn(model, rank_tokens(s, rank, ws)) * scale).backward()
        inv = (torch.tensor(scale, dtype=torch.float32) * float(ws)).reciprocal()
        found = False
        for n, mp in mparams.items():
            g = named[n].grad.float() if reduce_fp32 else named[n].grad
            if ws > 1:
                dist.all_reduce(g)  # SUM
            mp.grad = g.float() * inv
            found |= not bool(torch.isfinite(mp.grad).all())
        if not found:
            opt.step()
            with torch.no_grad():
                for n, mp in mparams.items():
                    named[n].copy_(mp)
        if dynamic:
            tracker = 0 if found else tracker + 1
            scale = scale * 0.5 if found else (scale * 2 if tracker == 2000 else scale)
        rec["params"].append(snapshot(model))
        rec["masters"].append({n: mp.detach().clone() for n, mp in mparams.items()})
        rec["skipped"].append(found)
        rec["loss_scale"].append(scale)
    return rec
