"""Keeping the optimizer and the model in agreement after construction (stages 0-2).

At stages 0-2 every trainable param is a view into its group's flat buffer and 16-bit params
have an fp32 master. Users change the model behind the optimizer's back in ordinary ways; each
is followed or refused here, at the next backward or step, before anything is corrupted:

- `model.to(device)` / `.cuda()` (Accelerate and Trainer do it): `Module._apply` gives every
  param new storage on the new device, so the params stop viewing the flat buffer and a step
  would change nothing. The buffers, state and grads move along and the params are re-viewed,
  as a torch optimizer keeps working after `model.to()`; the fp32 master of a param whose
  16-bit values did not change stays bit for bit ([Note: a move keeps the master]), and a
  p.grad cleared before the move stays cleared (grad_sync's readopt).
- New storage on the same device (`p.data = t`, `module._apply(fn)`): the values are taken in.
- A dtype other than `precision`, or a new shape: a clear error (torch would silently keep
  training the old Parameter; we cannot).
- In-place writes (`model.load_state_dict`, `nn.init.*`, `p.copy_()` under no_grad) bump
  `p._version`, a host-side counter our own kernels never touch (they write the flat buffer,
  whose views have their own counters): the fp32 master of a changed param takes its new
  16-bit value (what building the optimizer after the write would give). With the model given,
  `model.load_state_dict` of an fp32 state dict is caught by a hook and the masters take the
  exact fp32 values. (`p.data.copy_()` bypasses the counter, as it bypasses autograd.)

All checks read host metadata only (data_ptr, shape, dtype, device, _version): no host sync.

[Note: ranks start from the first rank's weights]
Ranks that build a model from different seeds (or load different files) would otherwise train
different models silently: at stage 0 each rank keeps its own, at stages 1-2 the first step
publishes a mix of each rank's pieces, at stage 3 the shards are that mix from the start. So,
as DDP's constructor and DeepSpeed's initialize do, the optimizer copies the params (trainable
and frozen) and the model's buffers of the data-parallel group's first rank (group rank 0) to
the other ranks at construction (`sync_from_first_rank`), before anything copies them into
flat buffers or shards them. Over the data-parallel ranks only (the `world` group of
comm/groups.py: a 2-D mesh's shard and replicate groups together, an mpu's data-parallel
group): a DTensor param contributes its local tensor, so tensor-parallel shards stay as they
are. Coalesced per (device, dtype) in buckets of at most BROADCAST_BUCKET_MB, like DDP: one
model's worth of bytes once per construction. `broadcast_params=False` skips the copy and
checks instead (`check_same_on_ranks`): one int64 fingerprint per tensor (the bits of every
element, position-weighted, summed with int64 wrap-around), one all-reduce of those, and a
ValueError on every rank naming the first tensor that differs and `broadcast_params`.
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from zerokern.comm.fingerprint import differ_across_ranks, fingerprint
from zerokern.geometry.dtensor_params import local


class ModelWatch:
    def __init__(self, opt, model: Optional[torch.nn.Module]) -> None:
        self._opt = weakref.ref(opt)
        self._loaded: Dict[int, torch.Tensor] = {}
        self._hooks = []
        self._model = None if model is None else weakref.ref(model)
        self._owned = {id(p) for g in opt.flat_groups for p in g.params}
        self._n_params = None if model is None else len(list(model.parameters()))
        self.record_versions()
        if model is not None:
            ref = weakref.ref(self)
            names = {id(p) for g in opt.flat_groups for p in g.params}

            def pre(module, state_dict, prefix, *args, ref=ref, names=names):
                me = ref()
                if me is None or prefix:
                    return
                for name, p in module.named_parameters(remove_duplicate=False):
                    v = state_dict.get(name)
                    if id(p) in names and isinstance(v, torch.Tensor) and \
                            v.dtype == torch.float32 and v.shape == p.shape:
                        me._loaded[id(p)] = v

            def post(module, incompatible, ref=ref):
                me = ref()
                if me is not None:
                    me.check()

            self._hooks.append(model.register_load_state_dict_pre_hook(pre))
            self._hooks.append(model.register_load_state_dict_post_hook(post))
            opt_ref = weakref.ref(opt)
            self._hooks.append(model.register_forward_pre_hook(
                lambda m, a, ref=opt_ref: _refuse_ddp(ref, m)))

    def record_versions(self) -> None:
        opt = self._opt()
        self._versions: List[List[int]] = [[local(p)._version for p in g.params]
                                           for g in opt.flat_groups]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---- the check -----------------------------------------------------------------------------
    def check(self, where: str = "") -> None:
        """Follow what the user did to the params since the last check (see module doc);
        `where` (backward, step()) is the caller's, for the watchers' common signature."""
        opt = self._opt()
        if opt is None:  # the optimizer is gone: nothing to follow
            return
        self._check_structure()
        moved, changed = [], []
        for gi, g in enumerate(opt.flat_groups):
            es = g.flat.element_size()
            base = g.flat.data_ptr()
            for i, (p, s) in enumerate(zip(g.params, g.layout.slots)):
                lp = local(p)  # a DTensor param: its local shard (dtensor_params.py)
                if p.dtype != g.dtype:
                    raise TypeError(
                        f"zerokern: param {i} of param group {gi} was cast to {p.dtype} after "
                        f"ZeroAdamW(precision={opt.precision!r}) was built; cast the model "
                        "before building the optimizer, or build it with the precision you "
                        "want (ZeroAdamW casts the params itself)")
                if tuple(lp.shape) != s.shape:
                    raise RuntimeError(
                        f"zerokern: param {i} of param group {gi} changed shape from {s.shape} "
                        f"to {tuple(lp.shape)} after ZeroAdamW was built; build the optimizer "
                        "after the model is complete")
                if p.device != g.device or lp.data_ptr() != base + s.offset * es:
                    moved.append((gi, i))
                elif lp._version != self._versions[gi][i]:
                    changed.append((gi, i))
        same = self._readopt(opt, moved) if moved else {}
        if changed or moved or self._loaded:
            for gi, i in changed + moved:
                self._sync_master(opt.flat_groups[gi], i, keep=same.get((gi, i)))
            for gi, g in enumerate(opt.flat_groups):  # loaded via a hook, unchanged versions
                for i, p in enumerate(g.params):
                    if id(p) in self._loaded and (gi, i) not in changed + moved:
                        self._sync_master(g, i)
            self._loaded.clear()
            self.record_versions()
            opt.grad_sync.generation += 1  # cached stats may be stale

    def _check_structure(self) -> None:
        """A Parameter replaced or added after construction (`model.fc.weight =
        nn.Parameter(...)`): torch's optimizer would keep training the old object silently."""
        model = None if self._model is None else self._model()
        if model is None:
            return
        ps = list(model.parameters())
        if len(ps) == self._n_params and all(id(p) in self._owned for p in ps
                                             if p.requires_grad):
            return
        new = [n for n, p in model.named_parameters()
               if p.requires_grad and id(p) not in self._owned]
        raise RuntimeError(
            "zerokern: the model's parameters changed after ZeroAdamW was built (a Parameter "
            f"replaced or added: {new[:5] or 'params removed'}); the optimizer would keep "
            "updating the old ones. Build the model completely (and load or replace weights "
            "with load_state_dict / p.copy_()), then build the optimizer")

    def _readopt(self, opt, moved) -> None:
        devices = {opt.flat_groups[gi].params[i].device for gi, i in moved}
        if len(devices) > 1 or any(p.device != next(iter(devices))
                                   for g in opt.flat_groups for p in g.params):
            raise RuntimeError(
                "zerokern: the model's params are now on several devices "
                f"({sorted(str(d) for d in devices)}); ZeroAdamW needs them on one device")
        device = next(iter(devices))
        if device != opt.flat_groups[0].device:
            if not opt.placement.movable:
                raise RuntimeError(
                    f"zerokern: the model moved to {device} after "
                    f"ZeroAdamW(offload={opt.offload!r}) was built; move the model first, "
                    "then build the optimizer")
            opt._move_to(device)
        same = {}
        for gi, i in moved:  # [Note: a move keeps the master]
            g = opt.flat_groups[gi]
            s = g.layout.slots[i]
            same[(gi, i)] = _bitwise_equal(local(g.params[i]).detach().reshape(-1),
                                           g.flat[s.offset:s.offset + s.numel])
        for g in opt.flat_groups:
            g.adopt_params_()  # copy the params' current values in, view them again
        opt.grad_sync.readopt()
        return same

    @staticmethod
    def _state_regions(g, i):
        """(master view, flat lo, flat hi) for param i's part of this rank's state."""
        s = g.layout.slots[i]
        for k in range(g.layout.n_buckets):
            lo, hi = g.state_range(k)
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                yield g.master_piece(k)[a - lo:b - lo], a, b

    def _sync_master(self, g, i: int, keep: Optional[torch.Tensor] = None) -> None:
        """Param i's master takes its 16-bit value; keep (a 0-d device bool: the values are
        unchanged bit for bit) keeps the master as it is instead, with no host read."""
        if g.master is None:
            return  # fp32 without offload: the flat buffer is the master
        p, s = g.params[i], g.layout.slots[i]
        exact = self._loaded.get(id(p))
        for m, a, b in self._state_regions(g, i):
            new = g.flat[a:b].to(m.device)
            if keep is not None and exact is None:
                m.copy_(torch.where(keep.to(m.device), m, new.to(m.dtype)))
                continue
            if exact is not None:
                src = local(exact).detach().reshape(-1)[a - s.offset:b - s.offset].to(m.device)
                if torch.equal(src.to(new.dtype), new):  # this rank's params hold it
                    m.copy_(src)
                    continue
            m.copy_(new)  # the param was written as a whole: its 16-bit value is the value


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """0-d device bool: a and b (same dtype and numel) hold the same bits (NaN payloads and
    the sign of zero included, which `==` would not tell apart), with no host read.

    [Note: a move keeps the master]
    `model.to(device)` (or `.to(device, dtype)` with the dtype it has, `ZeroAccelerator.prepare`)
    gives every param new storage holding the same 16-bit values; the fp32 master of such a
    param must stay as it is, bit for bit (issue 21, item 4: re-seeding it from the bf16 values
    moved the params rel 2.8e-3 from the unmoved run in 3 steps). A param whose new storage
    holds other values (`p.data = t`) was written as a whole and its master takes the value.
    The comparison runs on the device (one pass over the moved params, once per move)."""
    if a.dtype.itemsize == 2:
        a, b = a.view(torch.int16), b.view(torch.int16)
    elif a.dtype.itemsize == 4:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return (a == b.to(a.device)).all()


def _refuse_ddp(opt_ref, module) -> None:
    """DDP around a ZeroAdamW model: two reducers issuing collectives on one process group.

    Refused at the first forward, before any gradient exists. A warning would not do: besides
    reducing every gradient twice, DDP's all-reduces and ours interleave in a per-rank order
    (ours run on the gloo ring thread), which was seen to hang 3 gloo ranks at stage 0, and at
    stages 1-2 DDP writes its result into p.grad, which holds no values there."""
    opt = opt_ref()
    if opt is None:
        return
    ddp = torch.nn.parallel.DistributedDataParallel._active_ddp_module
    if ddp is not None and ddp.module is module:
        raise RuntimeError(
            f"zerokern: the model is wrapped in DistributedDataParallel, but ZeroAdamW("
            f"stage={opt.stage}) reduces the gradients itself. Pass the bare model to your "
            "training loop (no DDP wrapper); use opt.no_sync() where you used DDP's no_sync() "
            "and opt.clip_grad_norm_() for clipping")


# ---- [Note: ranks start from the first rank's weights] -----------------------------------------
BROADCAST_BUCKET_MB = 32.0  # per coalesced broadcast (DDP's default is 250 MiB; memory, not speed)


def model_tensors(params_or_groups: Iterable, model: Optional[torch.nn.Module]
                  ) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) of what the ranks must agree on: with a model, its params (frozen ones
    included; a tied param once) and its buffers, by name; with bare params, the params of
    `params_or_groups` (param-group dicts: "param i of param group g"). A DTensor gives its
    local tensor (the tensor-parallel shard stays as it is); meta and empty tensors are left
    out (nothing to copy).

    Args:
        params_or_groups: the optimizer's param groups (dicts with "params") or params; used
            only without a model.
        model: the nn.Module, or None.
    """
    out, seen = [], set()

    def add(name, t):
        if t is None or id(t) in seen:
            return
        seen.add(id(t))
        lt = local(t)
        if lt.device.type != "meta" and lt.numel():
            out.append((name, lt))

    if model is not None:
        for name, p in model.named_parameters():
            add(name, p)
        for name, b in model.named_buffers():
            add(f"buffer {name}", b)
        return out
    for gi, g in enumerate(params_or_groups):
        ps = g["params"] if isinstance(g, dict) else [g]
        ps = [ps] if isinstance(ps, torch.Tensor) else ps
        for i, p in enumerate(ps):
            add(f"param {i} of param group {gi}", p)
    return out


def _first_rank(group) -> int:
    """The global rank of `group`'s rank 0 (the broadcast source)."""
    return dist.get_global_rank(group, 0) if group is not None and \
        group is not dist.group.WORLD else 0


def _collective(gc, fn, t: torch.Tensor, *args, label: str) -> None:
    """Run `fn(t, *args, group)` (dist.broadcast / dist.all_reduce, blocking) on gc's group in
    gc's order of collectives: on its gloo ring thread for a CPU tensor (where its other
    collectives run), else on this thread, counted for the abort channel (comm/abort.py). gc is
    a GroupComm, or a bare ProcessGroup (the forward-only engine), used directly."""
    if isinstance(gc, dist.ProcessGroup):
        fn(t, *args, gc)
        return
    gc._record(fn.__name__, t, label)  # ZEROKERN_DEBUG_COLLECTIVES=1 (not in comm_stats)
    if gc._ring_for(t) is not None:
        gc._on_ring(False, fn, t, *args, gc.group)
    else:
        gc._issue(False, fn, t, *args, group=gc.group)


def _size_rank(gc) -> Tuple[int, int, object]:
    if isinstance(gc, dist.ProcessGroup):
        return dist.get_world_size(gc), dist.get_rank(gc), gc
    return gc.world_size, gc.rank, gc.group


def sync_from_first_rank(tensors: Sequence[Tuple[str, torch.Tensor]], gc,
                         bucket_mb: float = BROADCAST_BUCKET_MB) -> int:
    """Copy every tensor of the group's rank 0 into the same tensor on the other ranks, in
    place ([Note: ranks start from the first rank's weights]); every rank passes the same
    names, shapes and dtypes in the same order. Returns the number of broadcasts issued.

    Args:
        tensors: `model_tensors(...)`.
        gc: the data-parallel GroupComm (the optimizer's `comm.world`), or a ProcessGroup.
        bucket_mb: the most MiB one coalesced broadcast carries (a larger tensor goes alone).
    """
    n, rank, group = _size_rank(gc)
    if n <= 1 or not tensors:
        return 0
    src = _first_rank(group)
    limit = int(bucket_mb * 2**20)
    buckets: Dict[tuple, List[List[torch.Tensor]]] = {}
    for _, t in tensors:  # (device, dtype) -> buckets, in the given order (same on every rank)
        bs = buckets.setdefault((str(t.device), t.dtype), [[]])
        used = sum(x.numel() * x.element_size() for x in bs[-1])
        if bs[-1] and used + t.numel() * t.element_size() > limit:
            bs.append([])
        bs[-1].append(t)
    issued = 0
    with torch.no_grad():
        for (_, _), bs in buckets.items():
            for ts in bs:
                numel = sum(t.numel() for t in ts)
                flat = torch.cat([t.detach().reshape(-1) for t in ts]) if rank == 0 else \
                    torch.empty(numel, dtype=ts[0].dtype, device=ts[0].device)
                _collective(gc, dist.broadcast, flat, src, label="initial params")
                issued += 1
                if rank == 0:
                    continue  # the source's tensors are the values
                off = 0
                for t in ts:
                    t.detach().copy_(flat[off:off + t.numel()].view(t.shape))
                    off += t.numel()
    return issued


def check_same_on_ranks(tensors: Sequence[Tuple[str, torch.Tensor]], gc,
                        flag: str = "broadcast_params=False") -> None:
    """ValueError on every rank if some tensor differs across the group's ranks
    ([Note: ranks start from the first rank's weights]): one all-reduce of fingerprints.

    Args:
        tensors: `model_tensors(...)`, the same names, shapes and dtypes on every rank.
        gc: the data-parallel GroupComm (the optimizer's `comm.world`), or a ProcessGroup.
        flag: the argument named in the error.

    Raises:
        ValueError: naming the first tensor that differs (in `tensors`' order) and `flag`.
    """
    n, rank, group = _size_rank(gc)
    if n <= 1 or not tensors:
        return
    k = len(tensors)
    differ = differ_across_ranks(
        [fingerprint(t) for _, t in tensors],
        lambda both: _collective(gc, dist.all_reduce, both, dist.ReduceOp.MAX,
                                 label="param fingerprints"), tensors[0][1].device)
    if differ:
        names = [tensors[i][0] for i in differ]
        raise ValueError(
            f"{flag}: the params and buffers differ across the {n} data-parallel ranks "
            f"({len(names)} of {k} tensors, first {names[0]!r}"
            f"{', then ' + ', '.join(map(repr, names[1:4])) if len(names) > 1 else ''}"
            f"{' ...' if len(names) > 4 else ''}), so the ranks would train different models. "
            "Leave broadcast_params=True (the default: every rank starts from the first "
            "rank's values, as DDP and DeepSpeed do), or make them equal before building the "
            "optimizer (the same seed, or load the same weights); nothing was changed")
