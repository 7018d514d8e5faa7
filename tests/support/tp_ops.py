"""Megatron's tensor-parallel f / g operators, for the tests' hand-written TP models."""

from __future__ import annotations

import torch
import torch.distributed as dist


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input grad over tp backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward over tp, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None
