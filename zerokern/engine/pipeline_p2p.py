"""Activations forward and their gradients backward between neighbouring pipeline stages.

[Note: what crosses a stage boundary]
A stage's output is a tensor or a tuple of tensors (DeepSpeed's PipelineModule contract). Each
activation message is a fixed-size int64 header (the structure, dtypes and shapes) followed by
each tensor as raw bytes, so every dtype (bool masks, bf16) crosses any backend, and the shapes
may change from one micro-batch to the next (DeepSpeed needs `dynamic_shape=True` for that; here
the header goes with every message, 2 KiB). The receiver makes its floating tensors leaves that
require grad; the gradient message back holds, in order, the gradient of each floating input
(zeros where the stage did not use one), whose shapes the sender of the activations knows.

Sends are posted asynchronously and waited for at the end of the step (`drain`), receives are
waited for at once: with the 1F1B order (pipeline_schedule.py) every receive is then matched
eventually, and no send blocks its stage while the peer waits on it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

HEADER = 256  # int64 slots: [kind, n, (dtype id, ndim, *shape) per tensor]
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
TENSOR, TUPLE = 0, 1

Activations = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


def _as_tuple(x: Activations, what: str) -> Tuple[Tuple[torch.Tensor, ...], int]:
    if isinstance(x, torch.Tensor):
        return (x,), TENSOR
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x), TUPLE
    raise TypeError(f"{what} must be a tensor or a tuple of tensors (DeepSpeed's PipelineModule "
                    f"contract), got {type(x).__name__}"
                    + ("" if not isinstance(x, (tuple, list)) else
                       f" holding {[type(t).__name__ for t in x]}"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class StageLink:
    """The messages of one pipeline stage with its neighbours (global ranks).

    Args:
        prev_rank: the global rank of the previous stage (same data-parallel index), or None
            on the first stage.
        next_rank: that of the next stage, or None on the last.
        device: where received tensors are allocated (the stage's device).
    """

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int],
                 device: torch.device) -> None:
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self._pending: List[Tuple[object, torch.Tensor]] = []  # (work, buffer kept alive)

    def _isend(self, t: torch.Tensor, dst: int) -> None:
        self._pending.append((dist.isend(t, dst), t))

    def _recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        dist.irecv(t, src).wait()
        return t

    def send_activations(self, out: Activations) -> None:
        """Post the stage's output to the next stage ([Note: what crosses a stage boundary])."""
        ts, kind = _as_tuple(out, "a pipeline stage's output")
        meta = [kind, len(ts)]
        for t in ts:
            meta += [DTYPES.index(t.dtype), t.dim(), *t.shape]
        if len(meta) > HEADER:
            raise ValueError(f"a pipeline stage's output has too many tensors or dimensions "
                             f"for its header ({len(meta)} > {HEADER} slots)")
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[:len(meta)] = torch.tensor(meta, dtype=torch.int64)
        self._isend(header.to(self.device), self.next_rank)
        for t in ts:
            if t.numel():
                self._isend(_bytes(t), self.next_rank)

    def recv_activations(self) -> Activations:
        """The previous stage's output: floating tensors are leaves that require grad."""
        h = self._recv(torch.empty(HEADER, dtype=torch.int64, device=self.device),
                       self.prev_rank).tolist()
        kind, n, pos, out = h[0], h[1], 2, []
        for _ in range(n):
            dtype, ndim = DTYPES[h[pos]], h[pos + 1]
            shape = h[pos + 2:pos + 2 + ndim]
            pos += 2 + ndim
            t = torch.empty(shape, dtype=dtype, device=self.device)
            if t.numel():
                self._recv(_bytes(t), self.prev_rank)  # a view of t's storage: fills t
            t.requires_grad_(t.is_floating_point())
            out.append(t)
        return out[0] if kind == TENSOR else tuple(out)

    def send_grads(self, inputs: Activations) -> None:
        """Post the gradients of the received floating inputs to the previous stage."""
        ts, _ = _as_tuple(inputs, "a pipeline stage's input")
        for t in ts:
            if t.is_floating_point():
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                if g.numel():
                    self._isend(_bytes(g), self.prev_rank)

    def recv_grads(self, outputs: Activations) -> List[torch.Tensor]:
        """The next stage's gradients of this stage's floating outputs, in order."""
        ts, _ = _as_tuple(outputs, "a pipeline stage's output")
        grads = []
        for t in ts:
            if t.is_floating_point():
                g = torch.empty_like(t, memory_format=torch.contiguous_format)
                if g.numel():
                    self._recv(_bytes(g), self.next_rank)
                grads.append(g)
        return grads

    def drain(self) -> None:
        """Wait for every posted send (end of a step)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def floating(ts: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The floating tensors of `ts`, in order (those that carry a gradient message)."""
    return [t for t in ts if t.is_floating_point()]
