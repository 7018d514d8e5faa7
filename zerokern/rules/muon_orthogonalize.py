"""Muon's orthogonalization over ZeRO's flat shards: every matrix on exactly one rank.

Muon (torch.optim.Muon) replaces each 2-D update by an approximately orthogonal matrix with a
quintic Newton-Schulz iteration. That needs the whole matrix, while ZeRO holds flat pieces of
every param, cut at bucket and rank boundaries with no regard for shapes. This module is the
distributed half of the rule; the element-wise half (momentum, Nesterov, weight decay, the
scaled update) runs on the pieces as any other rule does.

[Note: one owner per matrix]
The protocol is the phased rules' (rules/owners.py, shared with Adafactor); for Muon:
each matrix gets one owner rank, chosen by balancing Newton-Schulz FLOPs (`assign_owners`: the
largest first to the least-loaded rank, ties by index, so every rank computes the same plan).
A step then
1. sends every piece of matrix i to its owner (one all-to-all; a piece the owner holds itself
   is not sent),
2. the owner runs Newton-Schulz on the whole matrix (exactly torch's ops: bf16, transposed when
   tall, so the result is bitwise torch's),
3. sends each piece of the result back to every rank that holds it (a second all-to-all).
No matrix is orthogonalized twice and no rank holds more than its own matrices whole: the peak
extra memory on a rank is its owned matrices plus its pieces in flight, not the model. Bytes per
rank per step: what it holds of other ranks' matrices, out and back (about 2Ψ(N-1)/N² fp32
elements when sharded; at stage 0, where every rank holds everything, only step 3 sends, about
Ψ(N-1)/N: the results to every holder).
DeepSpeed's Muon gathers whole params in its ZeRO-3 path too; its stage-0 path never ran
Newton-Schulz (issue 23): here stage 0 is the same code with `replicated=True`.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from zerokern.geometry.partition import FlatLayout
from zerokern.rules.owners import OwnerPlan, balance, held_pieces  # noqa: F401 (re-exported)

# torch.optim.Muon's defaults (Keller Jordan's coefficients), kept identical so results match.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
# [Note: Newton-Schulz methods] "standard": torch.optim.Muon's quintic iteration in bf16
# (`newton_schulz`, bitwise torch's). "gram": DeepSpeed 0.19's default (its
# `zeropower_via_gram_newtonschulz`, runtime/zero/muon/original_muon.py; `newton_schulz_gram`):
# the same quintic, mathematically equal, iterated on the small Gram matrix R = X X^T with a
# restart at iteration 2, and in fp16 where DeepSpeed's accelerator has fp16, else fp32.
NS_METHODS = ("standard", "gram")


def newton_schulz(update: torch.Tensor, coefficients: Sequence[float] = NS_COEFFICIENTS,
                  steps: int = NS_STEPS, eps: float = EPS) -> torch.Tensor:
    """Quintic Newton-Schulz orthogonalization of a 2-D matrix, as torch.optim.Muon runs it.

    Args:
        update: (A, B) matrix, any float dtype.
        coefficients: (a, b, c) of the quintic.
        steps: iterations (torch refuses >= 100).
        eps: floor of the Frobenius norm the input is divided by.

    Returns:
        (A, B) bf16 matrix. bf16 throughout, as torch does: the result is bitwise torch's.

    Raises:
        ValueError: update not 2-D, steps out of range, or not three coefficients.
    """
    _check_ns_args(update, coefficients, steps)
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def _check_ns_args(update: torch.Tensor, coefficients, steps: int) -> None:
    """The arguments both Newton-Schulz methods take, checked alike."""
    if update.ndim != 2:
        raise ValueError(f"update must be a 2-D matrix, got shape {tuple(update.shape)}")
    if not 0 <= steps < 100:
        raise ValueError(f"ns_steps must be in [0, 100), got {steps}")
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must be three numbers (a, b, c), got {coefficients}")


def gram_dtype(device: torch.device) -> torch.dtype:
    """The dtype the "gram" iteration runs in on `device` ([Note: Newton-Schulz methods]).

    DeepSpeed's `ns_compute_dtype("gram")` is fp16 when its accelerator supports fp16, fp32
    otherwise. zerokern: fp16 on CUDA (what DeepSpeed runs on a GPU), fp32 on any other device
    (what DeepSpeed runs on an accelerator without fp16; its CPU accelerator reports fp16 when
    oneDNN has it, zerokern keeps fp32 on the CPU, the more accurate of the two)."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def newton_schulz_gram(update: torch.Tensor, coefficients: Sequence[float] = NS_COEFFICIENTS,
                       steps: int = NS_STEPS, eps: float = EPS,
                       dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """DeepSpeed 0.19's Gram Newton-Schulz (`zeropower_via_gram_newtonschulz`), op for op.

    The input is normalized in its own dtype (fp32 for an fp16 input), X / (||X||_F + eps) --
    DeepSpeed's form, not torch's clamp --, then cast to the compute dtype. A square matrix
    runs the standard quintic in that dtype; a rectangular one (wide after the transpose of a
    tall one) iterates on R = X X^T: Q accumulates the polynomial, R is advanced except at the
    last step and before the restart at iteration 2 (X <- Q X, R <- X X^T), and the result is
    Q X (tall: X^T Q^T). With steps == 0 the normalized matrix is returned (DeepSpeed fails).

    Args:
        update: (A, B) matrix, any float dtype.
        coefficients: (a, b, c) of the quintic (DeepSpeed fixes torch's defaults).
        steps: iterations (< 100).
        eps: added to the Frobenius norm the input is divided by.
        dtype: the compute dtype; default `gram_dtype(update.device)`.

    Returns:
        (A, B) matrix in the compute dtype.

    Raises:
        ValueError: update not 2-D, steps out of range, or not three coefficients.
    """
    _check_ns_args(update, coefficients, steps)
    a, b, c = coefficients
    compute = dtype if dtype is not None else gram_dtype(update.device)
    norm_dtype = torch.float32 if update.dtype == torch.float16 else update.dtype
    x = update.to(norm_dtype)
    tall = update.size(-2) > update.size(-1)
    if tall:
        x = x.mT
    n, m = x.size(-2), x.size(-1)
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + eps)).to(compute)
    if m <= n or steps == 0:  # square: no gain from the Gram form, DeepSpeed's standard loop
        for _ in range(steps):
            A = x @ x.mT
            B = b * A + c * A @ A
            x = a * x + B @ x
        return x.mT if tall else x
    R = x @ x.mT
    Q = None
    restart_at = 2
    for i in range(steps):
        if i == restart_at:
            x = Q @ x
            R = x @ x.mT
            Q = None
        Z = b * R + c * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal().add_(a)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and (i + 1) != restart_at:
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    return x.mT @ Q.mT if tall else Q @ x


def orthogonalize(update: torch.Tensor, method: str = "standard",
                  coefficients: Sequence[float] = NS_COEFFICIENTS, steps: int = NS_STEPS,
                  eps: float = EPS) -> torch.Tensor:
    """`update` orthogonalized by the Newton-Schulz `method` ([Note: Newton-Schulz methods]).

    Raises:
        ValueError: an unknown method (and as `newton_schulz` / `newton_schulz_gram`).
    """
    if method == "standard":
        return newton_schulz(update, coefficients, steps, eps)
    if method == "gram":
        return newton_schulz_gram(update, coefficients, steps, eps)
    raise ValueError(f"ns_method must be one of {NS_METHODS}, got {method!r}")


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: Sequence[int]) -> float:
    """torch.optim.Muon's shape-dependent learning rate.

    "original" (None): lr·sqrt(max(1, A/B)) (Keller Jordan);
    "match_rms_adamw": lr·0.2·sqrt(max(A, B))
    (Moonlight: the update's RMS matches AdamW's, so AdamW's lr and weight decay carry over).
    """
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def ns_flops(shape: Sequence[int], steps: int = NS_STEPS) -> int:
    """Multiply-adds of Newton-Schulz on an (A, B) matrix: per step m²n (gram) + m³ (its square)
    + m²n (the update), m = min(A, B), n = max(A, B)."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    return steps * (2 * m * m * n + m ** 3)


def assign_owners(shapes: Sequence[Sequence[int]], world_size: int,
                  steps: int = NS_STEPS) -> List[int]:
    """Owner rank of each matrix: largest FLOPs first onto the least-loaded rank (ties: the
    lower index, then the lower rank), so every rank derives the same plan without talking
    (owners.balance over `ns_flops`)."""
    return balance([ns_flops(s, steps) for s in shapes], world_size)


class ShardedOrthogonalizer(OwnerPlan):
    """Orthogonalize the matrices of one flat buffer in place in each rank's state pieces
    (the owner protocol of rules/owners.py, owners balanced by Newton-Schulz FLOPs).

    Args:
        layout: the buffer's FlatLayout.
        rank, world_size: this rank in `group` (world_size == layout.world_size).
        replicated: True at stage 0 (every rank holds every element's state).
        matrix_slots: indices of the layout's slots that are Muon matrices; each slot's shape
            must be 2-D, or N-D reshaped to (shape[0], prod(rest)) as torch users do for convs.
        group: the process group the buffer is sharded over (None: world size 1).
    """

    def __init__(self, layout: FlatLayout, rank: int, world_size: int, replicated: bool,
                 matrix_slots: Sequence[int], group=None,
                 coefficients: Sequence[float] = NS_COEFFICIENTS, steps: int = NS_STEPS,
                 eps: float = EPS, method: str = "standard") -> None:
        if world_size != layout.world_size:
            raise ValueError(f"world_size {world_size} != layout.world_size {layout.world_size}")
        self.layout = layout
        self.coefficients, self.steps, self.eps = tuple(coefficients), steps, eps
        self.method = method  # [Note: Newton-Schulz methods]
        for i in matrix_slots:
            if len(layout.slots[i].shape) < 2:
                raise ValueError(f"slot {i} of shape {layout.slots[i].shape} is not a matrix: "
                                 "Muon needs >= 2-D params (1-D ones go to AdamW)")
        self.shapes = {i: self.matrix_shape(i) for i in matrix_slots}
        super().__init__(layout, rank, world_size, replicated, matrix_slots, group,
                         cost=lambda i: ns_flops(self.shapes[i], steps))

    def matrix_shape(self, i: int) -> Tuple[int, int]:
        shape = self.layout.slots[i].shape
        return shape[0], int(math.prod(shape[1:]))

    def orthogonalize_(self, state: torch.Tensor) -> None:
        """Replace each matrix's update held in `state` (this rank's fp32 state buffer, laid out
        as the layout's state_range pieces) by its orthogonalization, in place, on every rank:
        gathered whole on its owner, orthogonalized there, scattered back (owners.py)."""
        results = {i: orthogonalize(full.view(self.shapes[i]), self.method, self.coefficients,
                                    self.steps, self.eps).reshape(-1).to(state.dtype)
                   for i, full in self.gather_(state).items()}
        self.scatter_(state, results)
