"""Shared by the activation-checkpointing tests: a small transformer-like model with dropout on
both RNG streams, its data, and a training loop whose checkpoint function is a parameter.

The model: N_LAYERS pre-norm blocks (attention with dropout on the attention probabilities drawn
inside `tracker.fork()`, Megatron's model-parallel stream, and an MLP whose output dropout draws
from the default generator), then a linear head and an MSE loss. `Model.ckpt` is the function
each block runs through: None (no checkpointing), zerokern.checkpointing.checkpoint,
deepspeed.checkpointing.checkpoint, or a broken one (negative controls). `tracker` is the RNG
tracker the attention dropout forks (zerokern's or DeepSpeed's).

The tensor-parallel variant (`TPBlock`) splits the heads and the MLP's hidden units over a tp
group with Megatron's f / g operators: the attention dropout (tracker stream) differs per tp
rank, the MLP output dropout (default stream, after the all-reduce) is the same on every tp
rank.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..support.tp_ops import CopyToTP as _CopyToTP
from ..support.tp_ops import ReduceFromTP as _ReduceFromTP

D, HEADS, MLP, N_LAYERS, SEQ, BATCH = 16, 2, 24, 3, 6, 4
P_ATTN, P_OUT = 0.2, 0.1
MODEL_SEED, DATA_SEED, RNG_SEED = 4321, 77, 1234


class Block(nn.Module):
    def __init__(self, heads: int = HEADS, mlp: int = MLP) -> None:
        super().__init__()
        self.heads, self.hd = heads, D // HEADS
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * heads * self.hd)
        self.proj = nn.Linear(heads * self.hd, D, bias=False)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, mlp)
        self.fc2 = nn.Linear(mlp, D, bias=False)
        self.b_proj = nn.Parameter(torch.zeros(D))
        self.b_fc2 = nn.Parameter(torch.zeros(D))
        self.tracker = None   # set by the model
        self.group = None     # tp group (TPBlock)

    def _into(self, x):       # Megatron's f (identity here, no tp)
        return x

    def _out(self, x):        # Megatron's g
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self._into(self.ln1(x))).split(self.heads * self.hd, dim=-1)
        q, k, v = (z.view(b, t, self.heads, self.hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) * self.hd ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        with self.tracker.fork():  # split over tp ranks: the model-parallel stream
            att = F.dropout(att, P_ATTN, self.training)
        y = (att @ v).transpose(1, 2).reshape(b, t, self.heads * self.hd)
        x = x + self._out(self.proj(y)) + self.b_proj
        h = F.gelu(self.fc1(self._into(self.ln2(x))))
        out = self._out(self.fc2(h)) + self.b_fc2
        return x + F.dropout(out, P_OUT, self.training)  # replicated: the default stream


class TPBlock(Block):
    """Block with its heads and MLP units split over a tp group of size tp (rank r keeps
    heads / MLP units r-th of tp), built from a full Block's weights."""

    def __init__(self, full: Block, group, tp: int, rank: int) -> None:
        super().__init__(HEADS // tp, MLP // tp)
        self.group = group
        hd, hh, m = self.hd, HEADS // tp, MLP // tp
        cols = torch.arange(rank * hh * hd, (rank + 1) * hh * hd)
        qkv_rows = torch.cat([cols + j * HEADS * hd for j in range(3)])
        units = torch.arange(rank * m, (rank + 1) * m)
        with torch.no_grad():
            self.ln1.load_state_dict(full.ln1.state_dict())
            self.ln2.load_state_dict(full.ln2.state_dict())
            self.qkv.weight.copy_(full.qkv.weight[qkv_rows])
            self.qkv.bias.copy_(full.qkv.bias[qkv_rows])
            self.proj.weight.copy_(full.proj.weight[:, cols])
            self.fc1.weight.copy_(full.fc1.weight[units])
            self.fc1.bias.copy_(full.fc1.bias[units])
            self.fc2.weight.copy_(full.fc2.weight[:, units])
            self.b_proj.copy_(full.b_proj)
            self.b_fc2.copy_(full.b_fc2)
        for p in (self.qkv.weight, self.qkv.bias, self.proj.weight, self.fc1.weight,
                  self.fc1.bias, self.fc2.weight):
            p.tensor_model_parallel = True

    def _into(self, x):
        return _CopyToTP.apply(x, self.group)

    def _out(self, x):
        return _ReduceFromTP.apply(x, self.group)


class Model(nn.Module):
    def __init__(self, tracker, ckpt: Optional[Callable] = None, tp_group=None, tp: int = 1,
                 tp_rank: int = 0) -> None:
        super().__init__()
        torch.manual_seed(MODEL_SEED)
        full = [Block() for _ in range(N_LAYERS)]
        with torch.no_grad():  # generic biases, so every grad is non-trivial
            for b in full:
                b.b_proj.normal_(0, 0.1)
                b.b_fc2.normal_(0, 0.1)
        self.head = nn.Linear(D, D)
        self.inp = nn.Linear(D, D)  # so the first block's input requires grad (DeepSpeed's
        # reentrant checkpoint needs one that does, as Megatron's embedding output does)
        blocks = full if tp == 1 else [TPBlock(b, tp_group, tp, tp_rank) for b in full]
        self.blocks = nn.ModuleList(blocks)
        for b in self.blocks:
            b.tracker = tracker
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x) if self.ckpt is None else self.ckpt(b, x)
        return self.head(x)


def data(step: int, rank: int = 0):
    g = torch.Generator().manual_seed(DATA_SEED + 101 * step + rank)
    return torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, D, generator=g)


def train(model: nn.Module, step_fn, steps: int, rank: int = 0, seed_fn=None,
          engine=None) -> List[float]:
    """Per-step losses; `seed_fn()` seeds both RNG streams first; `step_fn(loss)` runs
    backward and the optimizer step (or the engine's)."""
    if seed_fn is not None:
        seed_fn()
    losses = []
    for s in range(steps):
        x, y = data(s, rank)
        loss = F.mse_loss((engine or model)(x), y)
        step_fn(loss)
        losses.append(loss.item())
    return losses
