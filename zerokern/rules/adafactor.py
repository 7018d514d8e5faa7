"""The Adafactor rule (issue 35): torch.optim.Adafactor over ZeRO's flat shards, a phased rule
whose every state is per matrix, held by the param's owner (zerokern.rules [Note: state kinds
and the owner protocol]). ZeroAdafactor is the engine with this rule (optimizer_adafactor.py).

[Note: Adafactor over flat pieces: the owner protocol]
torch's update of a param needs the whole param three times: the row and column means of its
squared grad (the factored second moment of a >= 2-D param, over its last two dims), RMS(param)
(the step size alpha) and RMS(update) (the clipping by d). ZeRO cuts params at bucket and rank
boundaries, so two designs were open:
- reduction: each rank computes partial row/col sums and sums of squares of its pieces, which
  are all-reduced (or reduce-scattered to the owner of the statistics);
- owner (chosen): each param is owned by one rank of the shard group (rules/owners.py,
  balanced by elements), which holds its row/col state and step, receives the param's grad and
  fp32 master whole, computes the update exactly as torch does and sends the new master's
  pieces back.
The owner protocol is the same one Muon runs (one declared protocol, no engine special case),
its result is the same bits at every world size and stage (a reduction's summation order
follows the pieces, so a checkpoint resharded to another world size would continue with other
bits), and the per-matrix state sits on one rank instead of being reduced every step. Its
cost: per step, two all_to_all_single over the shard group - out: the grad and the master of
what a rank holds of other ranks' params (8 bytes per element, about 2·4Ψ(N-1)/N² per rank),
back: the new master (4 bytes per element); a reduction would send O(rows + cols) per matrix
instead, but twice (statistics, then norms) and with world-size-dependent bits. Extra memory:
an (S, 2) fp32 scratch of the buffer's state size (grad, master) plus an (S,) one for the
result, and the owned params whole while they are computed.

[Note: the Adafactor group step]
Per buffer, with this rank's state pieces (`group_step_`):
1. pass 1 per bucket (`map_piece_(("master",))`): the grad piece times grad_scale (unscaled,
   clipped: what AdamW's kernel takes) and the master piece into the scratch (the master is
   read, not changed; a compact master's pass writes back, bitwise the same, since its
   expand/compact round trip is exact);
2. `plan.gather_`: the owned params whole (grad, master); on the state's device each runs
   torch's update (`adafactor_matrix_`: the ops of torch.optim.Adafactor's foreach path in its
   order, step counter, rho_t, alpha and the clipping denominator on the device in float64 as
   torch's Python floats, so no host read); `plan.scatter_` sends the new master's pieces
   back;
3. pass 2 per bucket (`map_piece_(("master",), params=True)`): the new master written and cast
   into the params, the bucket's step counter + 1 unless found_inf, then `after_piece(k)`.
A skipped step (found_inf) and a param no rank used (`unused`) change nothing: every write is
`torch.where(skip, old, new)` on the device. The per-param step is a matrix state ("step",
torch's name), so a param no rank used keeps its own count, as torch's does.
Differences from torch: eps1=None is the fp32 epsilon (the master's dtype: the update runs on
the fp32 master at every precision; torch takes the param's dtype); lr is a float (torch also
takes a Tensor); `foreach` is an implementation switch and not taken: the update is the
foreach path's (`param += update * (-alpha/denom)`, two roundings), torch's single-tensor
path adds with alpha (one fused rounding): the two differ by an ulp.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, List, Optional

import torch

from zerokern.rules import Rule, StateSpec, map_in_memory_
from zerokern.rules.matrix_states import MatrixStates
from zerokern.rules.owners import OwnerPlan

ADAFACTOR_KEYS = ("lr", "beta2_decay", "eps", "d", "weight_decay", "maximize")


def _row_shape(shape):
    return (*shape[:-1], 1) if len(shape) >= 2 else None


def _col_shape(shape):
    return (*shape[:-2], 1, shape[-1]) if len(shape) >= 2 else None


def _variance_shape(shape):
    return tuple(shape) if len(shape) < 2 else None


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


class AdafactorPlan(OwnerPlan):
    """Buffer g's owners (by elements) and the per-matrix states of the params this rank owns
    (`states`, on the state's device)."""

    def __init__(self, g, comm_shard, specs) -> None:
        super().__init__(g.layout, comm_shard.rank, comm_shard.world_size,
                         g.pattern.replicated_state, range(len(g.layout.slots)),
                         comm_shard.group)
        self.states = MatrixStates(specs, {i: tuple(g.layout.slots[i].shape)
                                           for i in self.owned}, g.steps.device)

    def snapshot(self) -> torch.Tensor:
        """A copy of the per-matrix states, taken before a step that may roll back
        (offload="nvme": the files roll back as a whole, these are not in them)."""
        return self.states.flat.clone()

    def restore_(self, saved: torch.Tensor) -> None:
        """Put back the states `snapshot` took (a failed step, rolled back)."""
        self.states.flat.copy_(saved)


class AdafactorRule(Rule):
    name = "adafactor"
    states = ()
    matrix_states = (StateSpec("row_var", sharded=False, shape_of=_row_shape),
                     StateSpec("col_var", sharded=False, shape_of=_col_shape),
                     StateSpec("variance", sharded=False, shape_of=_variance_shape),
                     StateSpec("step", sharded=False, shape_of=lambda shape: ()))
    defaults = dict(lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0,
                    maximize=False)
    phased = True
    counts_steps = False  # the step is per param, a matrix state (see the Note)
    # zerokern.rules [Note: what a rule supports]: the master is read and written only
    # through map_piece_, so a compact master works, and so do the NVMe files: two passes over
    # the master (1. read it into the exchange, 2. write the new one), whose second writes
    # every element, so the journal holds (offload_nvme.py [Note: a phased rule over NVMe]);
    # pass 1 changes nothing and is declared a read pass: its chunks are not written back
    # (offload_nvme.py [Note: a read pass writes nothing]).
    # The per-matrix states are not in the files: they stay on the host (rows + cols per
    # matrix, [Note: per-matrix states on the owner]) and roll back with a failed step through
    # the plan's snapshot (AdafactorPlan.snapshot / restore_).
    compact_master_ok = True
    nvme_passes = (("master",), ("master",))
    nvme_read_passes = (0,)

    def check_group(self, group: Dict[str, Any], where: str = "") -> None:
        sfx = f" (in {where})" if where else ""
        for key in ADAFACTOR_KEYS:
            if key not in group:
                raise ValueError(f"an Adafactor param group needs {key!r}{sfx}")
        lr, b2, eps, d, wd = (group[k] for k in ("lr", "beta2_decay", "eps", "d",
                                                 "weight_decay"))
        if not (_real(lr) and lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0{sfx}, got {lr!r}")
        if not (_real(b2) and b2 <= 0):
            raise ValueError(f"beta2_decay must be a finite number <= 0{sfx}, got {b2!r}")
        if not (isinstance(eps, (tuple, list)) and len(eps) == 2
                and (eps[0] is None or (_real(eps[0]) and eps[0] >= 0))
                and _real(eps[1]) and eps[1] >= 0):
            raise ValueError(f"eps must be a pair (eps1 >= 0 or None, eps2 >= 0){sfx}, got "
                             f"{eps!r}")
        if not (_real(d) and d >= 1):
            raise ValueError(f"d (the clipping threshold) must be a finite number >= 1{sfx}, "
                             f"got {d!r}")
        if not (_real(wd) and wd >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0{sfx}, got {wd!r}")
        if not isinstance(group["maximize"], bool):
            raise TypeError(f"maximize must be a bool{sfx}, got "
                            f"{type(group['maximize']).__name__}")

    def hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        return {k: group[k] for k in ADAFACTOR_KEYS}

    def step_(self, *args, **kwargs) -> None:
        raise NotImplementedError("the Adafactor rule is phased: the engine runs group_step_ "
                                  "(zerokern.rules [Note: state kinds and the owner protocol])")

    def plan(self, g, comm_shard) -> AdafactorPlan:
        return AdafactorPlan(g, comm_shard, self.matrix_states)

    def group_step_(self, g, grads: List[torch.Tensor], plan: AdafactorPlan, *,
                    grad_scale: torch.Tensor, found_inf: torch.Tensor,
                    after_piece: Callable[[int], None], place=None, gi: int = 0,
                    unused: Optional[torch.Tensor] = None, **hyper) -> None:
        """[Note: the Adafactor group step] over buffer g.

        Args:
            g: the buffer (shard_buffer.ShardBuffer) of an Adafactor param group.
            grads: bucket k's reduced grad piece, per k (the engine's `grad_piece`).
            plan: g's AdafactorPlan (`plan(g, comm.shard)`).
            grad_scale, found_inf: this step's 0-d device tensors.
            after_piece: called with k once bucket k's params are written.
            place: the optimizer's placement (None: g's state in memory).
            gi: g's index among the placement's buffers.
            unused: (n_slots,) device bool, True for a param no rank used (None: all used).
            **hyper: `hyper(group)`.
        """
        L = g.layout
        sdev = g.steps.device
        run = (lambda k, names, fn, params=False: map_in_memory_(g, k, names, fn, params)) \
            if place is None else \
            (lambda k, names, fn, params=False: place.map_piece_(gi, k, names, fn, params))
        found = found_inf.to(sdev) != 0  # the engine's found_inf is a 0/1 float
        scale = grad_scale.to(sdev)
        skip = found if unused is None else unused.to(sdev) | found
        work = torch.zeros((g.state_numel, 2), dtype=torch.float32, device=sdev)
        # a compact master's pass always writes back (placement.py): for this read pass
        # bitwise the same master and params (its expand/compact round trip is exact)
        rewrite = getattr(place, "master", "fp32") == "compact"
        for k in range(L.n_buckets):  # 1. grad (unscaled, clipped) and master
            s0 = g.state_slice(k).start

            def take(a, b, views, k=k, s0=s0):
                work[a:b, 0] = grads[k][a - s0:b - s0].to(sdev).float() * scale
                work[a:b, 1] = views[0]
            run(k, ("master",), take, rewrite)
        xchg = work.to(g.device)
        results = {}
        for i, full in plan.gather_(xchg).items():  # 2. whole params on their owners
            full = full.to(sdev)
            shape = tuple(L.slots[i].shape)
            new = adafactor_matrix_(full[:, 1].contiguous().view(shape),
                                    full[:, 0].contiguous().view(shape),
                                    plan.states.views(i), skip=skip[i] if skip.ndim else skip,
                                    **hyper)
            results[i] = new.reshape(-1).to(g.device)
        out = xchg[:, 1].contiguous()  # the old master (padding kept as it is)
        plan.scatter_(out, results)
        out = out.to(sdev)
        not_found = (~found).to(torch.int64)
        for k in range(L.n_buckets):  # 3. the new master into the state and the params
            def put(a, b, views):
                views[0].copy_(out[a:b])
            run(k, ("master",), put, True)
            g.steps[k].add_(not_found.to(g.steps.device))
            after_piece(k)


def adafactor_matrix_(param: torch.Tensor, grad: torch.Tensor, states: Dict[str, torch.Tensor],
                      *, skip: torch.Tensor, lr: float, beta2_decay: float, eps, d: float,
                      weight_decay: float, maximize: bool) -> torch.Tensor:
    """torch.optim.Adafactor's update of one whole param, on its owner (the foreach path's ops,
    in its order), with the scalars on the device; returns the new param, its states updated
    in place ([Note: the Adafactor group step]).

    Args:
        param: the param's fp32 master, its shape.
        grad: its fp32 grad (averaged over ranks, unscaled and clipped), its shape.
        states: its per-matrix states by name: "step" (0-d), and "row_var" (..., R, 1) and
            "col_var" (..., 1, C) for >= 2 dims, else "variance" (param's shape).
        skip: 0-d bool on param's device: True leaves the states and returns param unchanged.
        lr, beta2_decay, eps, d, weight_decay, maximize: torch.optim.Adafactor's.
    """
    eps1, eps2 = eps
    if eps1 is None:
        eps1 = torch.finfo(torch.float32).eps  # the master's dtype (see the Note)
    if maximize:
        grad = -grad
    step = states["step"]
    t = step + 1
    t64 = t.double()  # torch: step_t.item(), a Python float
    one_minus_beta2 = t64.pow(beta2_decay).float()
    rho = t64.pow(0.5).reciprocal().clamp(max=lr)
    n = param.numel()
    alpha = (param.norm(2).double() / (n ** 0.5)).clamp(min=eps2) * rho
    new = param.mul(1 - lr * weight_decay) if weight_decay != 0 else param.clone()
    if grad.dim() > 1:
        row_var, col_var = states["row_var"], states["col_var"]
        row_mean = torch.norm(grad, dim=-1, keepdim=True)
        row_mean.mul_(row_mean).div_(grad.size(-1))
        row_new = row_var.lerp(row_mean, one_minus_beta2)
        col_mean = torch.norm(grad, dim=-2, keepdim=True)
        col_mean.mul_(col_mean).div_(grad.size(-2))
        col_new = col_var.lerp(col_mean, one_minus_beta2)
        var_estimate = row_new @ col_new
        var_estimate.div_(row_new.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        torch.where(skip, row_var, row_new, out=row_var)
        torch.where(skip, col_var, col_new, out=col_var)
    else:
        variance = states["variance"]
        var_new = variance.lerp(grad * grad, one_minus_beta2)
        var_estimate = var_new.clone()
        torch.where(skip, variance, var_new, out=variance)
    update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
    update.mul_(grad)
    denom = (update.norm(2).double() / ((n ** 0.5) * d)).clamp(min=1.0)
    update.mul_((-alpha / denom).float())
    new.add_(update)
    torch.where(skip, step, t, out=step)
    return torch.where(skip, param, new)


ADAFACTOR = AdafactorRule()
