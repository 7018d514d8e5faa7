"""The Muon rule (issue 23): one fp32 state, `momentum_buffer` (torch.optim.Muon's name), and a
group step over a whole buffer (phased: zerokern.rules [Note: a rule per param group]).
K = 8 bytes per param with the fp32 master (4 + 4). ZeroMuon is the engine with this rule for
the matrices' param groups and the AdamW rule for the others (optimizer_muon.py).

[Note: the Muon group step]
Per buffer (one param group's, at stage 3 one unit's), with this rank's state pieces:
1. `momentum_` on every bucket's piece (element-wise: the grad times grad_scale, i.e. unscaled
   and clipped exactly as AdamW's kernel takes it), the Nesterov update into a scratch buffer
   of the state's size;
2. `ShardedOrthogonalizer.orthogonalize_` on the scratch: every matrix on one owner rank
   (FLOP-balanced), pieces exchanged by two all_to_all_single over the shard group. At stage 0
   every rank holds every grad, yet each still orthogonalizes only the matrices it owns and
   receives the others' results (the plan with `replicated=True`): N times less Newton-Schulz
   per rank for one all-to-all of the results, the same bits everywhere;
3. `apply_` per bucket: decoupled weight decay and the shape-scaled lr per param segment, then
   the step counter (+1 unless found_inf) and the cast-back `out.copy_(master)` (round to
   nearest even, bitwise `.to(dtype)`), then the caller's `after_piece(k)` (frozen params'
   state restored, the piece published: stages 1-2 all-gather it).
A skipped step (found_inf) changes nothing: every write is `torch.where(found_inf, old, new)`
on the device (muon_pieces.py), no host read. The orthogonalization runs on the params' device;
with offload="cpu"/"nvme" the momentum and the update run on the host where the state is, the
update goes to the device for step 2 and comes back (one copy each way per buffer and step).

[Note: Muon's host copies]
With the state on the host and the params on a GPU, every copy between the two goes through
one pinned fp32 staging buffer (`HostStaging`, reserved at construction for the largest Muon
buffer of the process: the group steps run one at a time and each has drained its copies
when it returns), queued non_blocking on the current stream:
    grads --D2H--> staging (as fp32: exact), one event, waited: the momentum pass reads them
    momentum pass on the host: staging <- the update
    staging --H2D--> a device buffer; orthogonalized there; --D2H--> staging, one event, waited:
    the update pass reads it
and this step's [grad_scale, found_inf] are the ones the placement shipped to pinned host memory
(`place.scalars`, waited for through `place._wait`, offload.py [Note: the one blocking wait]).
The two waits are the host's own reads of device results; nothing pageable crosses (a pageable
copy is a blocking cudaMemcpy that also syncs the stream: 5 of them per buffer and step before).
The staging costs 4 bytes per element of the largest Muon buffer, page-locked through torch's
pinned allocator (zerokern.state.pinned sits above the rules).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, List

import torch

from zerokern.platform.device import handle
from zerokern.rules import Rule, StateSpec, map_in_memory_
from zerokern.rules.muon_orthogonalize import (
    ADJUST_LR_FNS,
    EPS,
    NS_COEFFICIENTS,
    NS_METHODS,
    NS_STEPS,
    ShardedOrthogonalizer,
)
from zerokern.rules.muon_pieces import apply_, momentum_

# The group keys of each rule (ZeroMuon refuses a key of the other rule in a group).
MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps",
             "ns_steps", "adjust_lr_fn", "ns_method")


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


class MuonRule(Rule):
    name = "muon"
    states = (StateSpec("momentum_buffer"),)
    defaults = dict(lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                    ns_coefficients=NS_COEFFICIENTS, eps=EPS, ns_steps=NS_STEPS,
                    adjust_lr_fn=None, ns_method="standard")
    phased = True
    counts_steps = False
    # zerokern.rules [Note: what a rule supports]: pass 1 the momentum, pass 2 the master
    nvme_passes = (("momentum_buffer",), ("master",))
    compact_master_ok = True

    def check_group(self, group: Dict[str, Any], where: str = "") -> None:
        sfx = f" (in {where})" if where else ""
        for key in MUON_KEYS:
            if key not in group:
                raise ValueError(f"a Muon param group needs {key!r}{sfx}")
        lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
        if not (_real(lr) and lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0{sfx}, got {lr!r}")
        if not (_real(wd) and wd >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0{sfx}, got {wd!r}")
        if not (_real(mom) and mom >= 0):
            raise ValueError(f"momentum must be a finite number >= 0{sfx}, got {mom!r}")
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov must be a bool{sfx}, got "
                            f"{type(group['nesterov']).__name__}")
        c = group["ns_coefficients"]
        if not (isinstance(c, (tuple, list)) and len(c) == 3 and all(_real(x) for x in c)):
            raise ValueError(f"ns_coefficients must be three finite numbers (a, b, c){sfx}, "
                             f"got {c!r}")
        eps, steps = group["eps"], group["ns_steps"]
        if not (_real(eps) and eps > 0):
            raise ValueError(f"eps must be a finite number > 0{sfx}, got {eps!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"ns_steps must be an int in [0, 100){sfx}, got {steps!r}")
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}{sfx}, got "
                             f"{group['adjust_lr_fn']!r}")
        if group["ns_method"] not in NS_METHODS:  # [Note: Newton-Schulz methods]
            raise ValueError(f"ns_method must be one of {NS_METHODS}{sfx}, got "
                             f"{group['ns_method']!r}")

    def hyper(self, group: Dict[str, Any]) -> Dict[str, Any]:
        return {k: group[k] for k in MUON_KEYS}

    def step_(self, *args, **kwargs) -> None:
        raise NotImplementedError("the Muon rule is phased: the engine runs group_step_ "
                                  "(zerokern.rules [Note: a rule per param group])")

    def plan(self, g, comm_shard) -> ShardedOrthogonalizer:
        """The phased protocol's plan (zerokern.rules [Note: state kinds and the owner
        protocol]): Muon's is its orthogonalizer; it has no matrix states."""
        return self.orthogonalizer(g, comm_shard)

    @staticmethod
    def orthogonalizer(g, comm_shard) -> ShardedOrthogonalizer:
        """The plan of buffer g (every slot a matrix) over the shard group, made at
        construction; with g's state on the host and its params on a GPU it also reserves the
        pinned staging of [Note: Muon's host copies] (`plan.host_staging`)."""
        plan = ShardedOrthogonalizer(g.layout, comm_shard.rank, comm_shard.world_size,
                                     g.pattern.replicated_state, range(len(g.layout.slots)),
                                     comm_shard.group)
        buf = g.rule_states.get("momentum_buffer")
        plan.host_staging = None
        if handle(g.device).pins_host_memory and buf is not None and buf.device.type == "cpu":
            STAGING.reserve(g.state_numel)
            plan.host_staging = STAGING
        return plan

    def group_step_(self, g, grads: List[torch.Tensor], orth: ShardedOrthogonalizer, *,
                    grad_scale: torch.Tensor, found_inf: torch.Tensor,
                    after_piece: Callable[[int], None], place=None, gi: int = 0,
                    unused=None, **hyper) -> None:
        """[Note: the Muon group step] over buffer g, its state read and written through the
        placement's passes (`place.map_piece_`, placement.py: in memory on the device or the
        host, chunked through a compact master, or streamed from the NVMe files).

        Args:
            g: the buffer (shard_buffer.ShardBuffer) of a Muon param group.
            grads: bucket k's reduced grad piece, per k (the engine's `grad_piece`).
            orth: g's ShardedOrthogonalizer (`orthogonalizer(g, comm.shard)`).
            grad_scale, found_inf: this step's 0-d device tensors (engine Note steps 2-3).
            after_piece: called with k once bucket k's params are written.
            place: the optimizer's placement (None: g's state in memory).
            gi: g's index among the placement's buffers.
            unused: not read: the engine restores a param no rank used (momentum and master,
                frozen_slots.py); Muon has no matrix states.
            **hyper: `hyper(group)`.
        """
        L = g.layout
        buf = g.rule_states["momentum_buffer"]
        sdev = buf.device
        run = (lambda k, names, fn, params=False: map_in_memory_(g, k, names, fn, params)) \
            if place is None else \
            (lambda k, names, fn, params=False: place.map_piece_(gi, k, names, fn, params))
        staging = getattr(orth, "host_staging", None) if sdev != g.device else None
        if staging is None:  # the state on the params' device (or a CPU-only machine)
            found = found_inf.to(sdev) != 0  # the engine's found_inf is a 0/1 float
            scale = grad_scale.to(sdev)
            upd = torch.zeros(g.state_numel, dtype=torch.float32, device=sdev)
            grad_of = lambda k, a, b: grads[k][a:b].to(sdev)  # noqa: E731
        else:  # [Note: Muon's host copies]
            place._wait(place.scalars_ev)  # (shipped by place.begin)
            scale, found = place.scalars[0], place.scalars[1] != 0
            upd = staging.take(g.state_numel)
            self._grads_to_host_(g, grads, upd, place)
            grad_of = lambda k, a, b: upd[a + g.state_slice(k).start:  # noqa: E731
                                          b + g.state_slice(k).start]
        for k in range(L.n_buckets):
            s0 = g.state_slice(k).start

            def mom(a, b, views, k=k, s0=s0):
                upd[a:b] = momentum_(views[0], grad_of(k, a - s0, b - s0),
                                     momentum=hyper["momentum"], nesterov=hyper["nesterov"],
                                     grad_scale=scale, found_inf=found)
            run(k, ("momentum_buffer",), mom)
        orth.coefficients = tuple(hyper["ns_coefficients"])
        orth.steps, orth.eps = hyper["ns_steps"], hyper["eps"]
        orth.method = hyper["ns_method"]
        if staging is None:
            work = upd.to(g.device)
            orth.orthogonalize_(work)
            upd = work.to(sdev)
        else:
            work = torch.empty(upd.shape, dtype=upd.dtype, device=g.device)
            work.copy_(upd, non_blocking=True)
            orth.orthogonalize_(work)
            upd.copy_(work, non_blocking=True)
            place._wait(_recorded(g.device))  # the update pass reads it on the host
        not_found = (~found).to(torch.int64)
        for k in range(L.n_buckets):
            lo, hi = g.state_range(k)
            s0 = g.state_slice(k).start
            segs = [(a - lo, b - lo, orth.matrix_shape(i)) for i, a, b in L.overlaps(lo, hi)]

            def upd_(a, b, views, s0=s0, segs=segs):  # the segments cut to [a, b)
                part = [(max(x, a - s0) - (a - s0), min(y, b - s0) - (a - s0), shape)
                        for x, y, shape in segs if x < b - s0 and y > a - s0]
                apply_(views[0], upd[a:b], part, lr=hyper["lr"],
                       weight_decay=hyper["weight_decay"], adjust_lr_fn=hyper["adjust_lr_fn"],
                       found_inf=found.to(views[0].device))
            run(k, ("master",), upd_, True)
            g.steps[k].add_(not_found.to(g.steps.device))
            after_piece(k)

    @staticmethod
    def _grads_to_host_(g, grads: List[torch.Tensor], upd: torch.Tensor, place) -> None:
        """Every bucket's grad piece into its state range of `upd` (pinned, fp32: exact), queued
        at once; the rest of `upd` zeroed; the host waits once, for the momentum pass."""
        end = 0
        for k in range(g.layout.n_buckets):
            sl = g.state_slice(k)
            upd[end:sl.start].zero_()
            upd[sl].copy_(grads[k][:sl.stop - sl.start], non_blocking=True)
            end = sl.stop
        upd[end:].zero_()
        place._wait(_recorded(g.device))


def _recorded(device: torch.device):
    """An event after the copies queued on `device`'s current stream (a GPU), else None."""
    h = handle(device)
    if not h.has_streams:
        return None
    return h.recorded_event(h.current_stream(device))


class HostStaging:
    """[Note: Muon's host copies]: one pinned fp32 buffer, grown at construction (`reserve`)
    to the largest Muon buffer whose state is on the host and params on a GPU."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32)

    def reserve(self, n: int) -> None:
        if self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=torch.float32, pin_memory=True)

    def take(self, n: int) -> torch.Tensor:
        """(n,) fp32, pinned: the first n elements (n <= the reserved size)."""
        return self.buf[:n]


STAGING = HostStaging()
MUON = MuonRule()


def embedding_weight_ids(model) -> set:
    """ids of the matrices the default split leaves to AdamW (optimizer_muon.py [Note: which
    params Muon takes]): `model`'s nn.Embedding / nn.EmbeddingBag weights (a tied head is the
    same Parameter) and its output head - a Hugging Face model's `get_output_embeddings()`,
    or the weight of a submodule named `lm_head` (DeepSpeed's keyword for the same split).
    None: no model, an empty set."""
    if model is None:
        return set()
    emb = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    out = {id(m.weight) for m in model.modules() if isinstance(m, emb)}
    heads = [m for name, m in model.named_modules() if name.split(".")[-1] == "lm_head"]
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            heads.append(get())
        except (NotImplementedError, AttributeError):  # a model without a head
            pass
    out |= {id(h.weight) for h in heads
            if isinstance(getattr(h, "weight", None), torch.nn.Parameter)}
    return out


def takes_muon(shape, is_embedding: bool) -> bool:
    """ZeroMuon's default (optimizer_muon.py [Note: which params Muon takes]): a param of this
    (original, unflattened) shape takes Muon."""
    return len(shape) >= 2 and not is_embedding
