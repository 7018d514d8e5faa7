"""What `p.grad` shows where ZeRO has no full, reduced gradient to give (stages 1-3).

At stages 1-3 a rank holds only its shard of the reduced gradient, so `p.grad` cannot be DDP's
value. Leaving `None` there would make `torch.nn.utils.clip_grad_norm_(model.parameters())`
return 0.0 and clip nothing, and leaving the local, unreduced values would give a plausible wrong
norm; both are silent. Instead `p.grad` holds a `ReleasedGrad`: a tensor of the param's shape,
dtype and device with no storage, which raises a clear error naming the sharded alternative on
any use. It also marks "this param has a gradient since zero_grad()": a user who clears it
(`model.zero_grad()`, `p.grad = None`) is seen at the next backward and the shard accumulator is
cleared with it, as torch would.
"""

from __future__ import annotations

import torch

_MESSAGE = (
    "zerokern: p.grad of a param managed by ZeroAdamW(stage={stage}) holds no values: the "
    "gradient is reduced across ranks into this rank's shard only, so there is no full gradient "
    "to read here (reading the local, unreduced one would be silently wrong). For clipping use "
    "opt.clip_grad_norm_(max_norm) (or ZeroAdamW(max_grad_norm=...)); the global norm of the "
    "last step is opt.grad_norm. To clear gradients use opt.zero_grad() or model.zero_grad(). "
    "(Tried: {op})"
)


_MOVES = (torch.ops.aten._to_copy.default, torch.ops.aten.detach.default,
          torch.ops.aten.alias.default)


class ReleasedGrad(torch.Tensor):
    """A storage-less stand-in for a sharded gradient; any op on it raises."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, stage: int, dtype=None, device=None):
        # like's current shape: torch requires it (a freed stage-3 param has 0 elements)
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=dtype or like.dtype,
                                                device=device or like.device,
                                                requires_grad=False)
        t._zk_stage = stage
        return t

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"ReleasedGrad(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"stage={self._zk_stage}: reduced into the rank's shard; see opt.grad_norm)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MOVES:  # model.to(device) moves p.grad along: still released, elsewhere
            src = args[0]
            return ReleasedGrad(src, src._zk_stage, kwargs.get("dtype"), kwargs.get("device"))
        stage = next((a._zk_stage for a in args if isinstance(a, ReleasedGrad)), "1-3")
        raise RuntimeError(_MESSAGE.format(stage=stage, op=func))
