"""The ZeRO engine (`ZeroOptimizer`): stages 0-3 over flat shard buffers with the fused kernels
(DESIGN §1-§5), for any optimizer rule (zerokern.rules [Note: a rule and the engine]). The
public optimizers are the engine with their rules: ZeroAdamW (optimizer_adamw.py), ZeroLion,
ZeroMuon; the arguments' text they share is optimizer_doc.ENGINE_ARGS.

The class does bookkeeping; the math lives in the rule's kernels (`zerokern.kernels`), the
layout in `partition`, the buffers in `flat_group`, the gradient paths in `grad_sync`, the
collectives in `comm`, the user-facing extras (clipping, no_sync, reports) and this rank's
state dict in the class's last sections.

[Note: one optimizer step, without a host sync]
1. `grad_sync.reduced_buckets()` yields each bucket as its reduction lands (normally already
   reduced during backward; what ran under no_sync() only is reduced here).
2. `grad_stats_` over this rank's grads -> found_inf, sumsq, in one small fp32 tensor; one
   all-reduce (SUM) combines it across ranks (stages 1-3; at stage 0 every rank has all grads).
3. On the device: unscale = 1/(loss_scale * N) for summed shards (stages 1-3), 1/loss_scale at
   stage 0 (its grads are already DDP's average); the global norm, the clip coefficient,
   grad_scale = unscale * clip. Grads sum over backward passes, as torch's: no division by the
   number of micro-batches (divide the loss, as with DDP). Steps 1-3 run once per set of grads
   (`_prepare`), so `clip_grad_norm_()` before `step()` costs nothing extra.
4. Per buffer, its param group's rule (zerokern.rules [Note: a rule per param group]): the
   fused step per bucket (`adam_step_` for AdamW): master, the rule's states and the 16-bit
   cast-back in one pass; skipped bitwise when found_inf. A phased rule (Muon) runs its group
   step over the buffer instead (rules/muon.py [Note: the Muon group step]).
5. All-gather each updated piece in place as soon as it is written (stages 1-2), then
   update the loss scale.
Nothing reads a device value on the host: every branch is on host state (stage, micro-steps).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch

from zerokern import kernels
from zerokern.core.decision import decide
from zerokern.core.frozen_slots import FrozenSkip, GroupParamsWatch, HostUnused, UnfreezeWatch
from zerokern.core.hyper_agreement import SLOTS as HYPER_SLOTS
from zerokern.core.hyper_agreement import HyperAgreement
from zerokern.core.model_sync import (
    ModelWatch,
    model_tensors,
    sync_from_first_rank,
)
from zerokern.grads.full_grads import FullGrads
from zerokern.grads.sharded_grads import BucketedGrads
from zerokern.grads.tp_norm import TpStats
from zerokern.layout.flat_group import FlatGroup
from zerokern.memory.report import memory_report
from zerokern.options.args import (
    check_clip,
)
from zerokern.options.doc import ENGINE_ARGS, PARAM_FORMAT_ARG
from zerokern.rules import Rule
from zerokern.state.placement import make_placement


class ZeroOptimizer(torch.optim.Optimizer):
    _group_keys = ()  # param-group keys the optimizer reads besides its rules' (ZeroMuon's)
    __doc__ = """The ZeRO engine with an optimizer rule (zerokern.rules): `ZeroAdamW`, `ZeroLion`,
    or a rule of your own (`ZeroOptimizer(model, rule=MyRule(), defaults={...}, stage=2, ...)`).

    Args:
        params_or_model: params or param-group dicts (stages 0-2), or an nn.Module.
        rule: a `zerokern.rules.Rule` (its states and its fused update), or a list of one
            rule per param group, in the groups' order (zerokern.rules [Note: a rule per param
            group]; each group is then checked by its own rule, and `defaults` only fills
            missing keys).
        defaults: the rule's hyperparameters (checked by `rule.check_group`), per group where
            given in a group.""" + ENGINE_ARGS + PARAM_FORMAT_ARG + """
    Gradients have torch's and DDP's semantics: they SUM over the backward passes since
    `zero_grad()` (also across a `step()` without `zero_grad()`) and are AVERAGED over ranks.
    With accumulation divide the loss by the number of micro-batches, as with DDP, and run all
    but the last micro-batch under `opt.no_sync()`. `p.grad` after backward is DDP's gradient
    at stage 0; at stages 1-3 it is released (a placeholder whose use raises: the gradient is
    sharded) - clip with `opt.clip_grad_norm_()`.
    """

    def __init__(
        self,
        params_or_model: Union[torch.nn.Module, Iterable],
        rule: Union[Rule, Sequence[Rule]],
        defaults: Dict[str, Any],
        stage: int = 2,
        precision: str = "bf16",
        loss_scale: Any = "dynamic",
        max_grad_norm: Optional[float] = None,
        offload: Optional[str] = None,
        bucket_mb: float = 25.0,
        reduce_dtype: Optional[torch.dtype] = None,
        process_group=None,
        backend: str = "auto",
        *,
        param_groups: Optional[List[Dict[str, Any]]] = None,
        units=None,
        offload_path=None,
        free_grads: bool = False,
        offload_params: Optional[str] = None,
        master: str = "fp32",
        mesh=None,
        hpz: bool = False,
        quantized_weights: bool = False,
        quantized_gradients: Union[bool, str] = False,
        keep_for_backward_mb: float = 0.0,
        broadcast_params: bool = True,
        activation_checkpointing: Optional[str] = None,
        param_format: Optional[str] = None,
    ) -> None:
        # ---- decide: every check, the plan, nothing changed yet ([Note: construction is a
        # decision] in decision.py) ------------------------------------------------------------
        self._given_keys = []  # each group's own keys, before the defaults fill it
        d = decide(
            self, params_or_model, rule, defaults, stage=stage, precision=precision,
            loss_scale=loss_scale, max_grad_norm=max_grad_norm, offload=offload,
            bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, process_group=process_group,
            backend=backend, param_groups=param_groups, units=units, offload_path=offload_path,
            free_grads=free_grads, offload_params=offload_params, master=master, mesh=mesh,
            hpz=hpz, quantized_weights=quantized_weights,
            quantized_gradients=quantized_gradients, keep_for_backward_mb=keep_for_backward_mb,
            broadcast_params=broadcast_params, activation_checkpointing=activation_checkpointing,
            param_format=param_format)
        self.decision = d
        self.rule, self.rules = d.rule, d.rules
        self.plan = d.plan  # the roles ([Note: one parallel plan] in comm/plan.py)
        self.tp = d.plan.tp
        comm = self.comm = d.comm
        comm.enable_debug_log()  # ZEROKERN_DEBUG_COLLECTIVES=1: checked at every step()

        # ---- now change the model, as decided ------------------------------------------------
        self.state = FlatState(type(self).__name__)  # [Note: no per-param opt.state]
        self.param_homes = None  # offload_params (stage3/param_offload.py)
        self.stage, self.precision, self.dtype = d.stage, d.precision, d.dtype
        self.max_grad_norm = d.max_grad_norm
        self.backend = d.backend
        self.scaler = d.scaler
        self.reduce_dtype = d.reduce_dtype
        model = d.model
        self._unfrozen = UnfreezeWatch(self, model, self.param_groups)  # before frozen ones leave
        self._frozen_skip = FrozenSkip()  # frozen after construction (frozen_slots.py)
        for group, ps in zip(self.param_groups, d.trainable):
            group["params"] = ps  # frozen params leave the group; duplicates (ties) are gone
        self._group_watch = GroupParamsWatch(self)  # [Note: a group's params edited]
        self._group_keys_checked: dict = {}  # group -> its keys at the last check
        for ps in d.trainable:  # re-creating an optimizer on a model takes its params over
            for p in ps:
                ref = getattr(p, "_zerokern_sync", None)
                old = ref() if ref is not None else None
                if old is not None and not old.detached:
                    old.detach()  # (stage 3: gathers them whole again first)
        if d.broadcast_params:  # every dp rank starts from the first one's params and
            # buffers, before the buffers copy them or stage 3 shards them (model_sync.py
            # [Note: ranks start from the first rank's weights])
            sync_from_first_rank(model_tensors(d.listed, model), comm.world)
        # Where the master and the rule's state live and the update that runs there
        # (placement.py [Note: offload is a placement of the state]): made first, so the
        # buffers allocate through it.
        self.pattern = P = d.pattern
        self.offload = d.offload
        self.master = d.master
        self.placement = make_placement(d.offload, d.reduce_dtype, d.offload_path, d.plan,
                                        d.master, d.rule, d.per_group, d.param_codec)
        if P.shards_params:
            from zerokern.stage3.build import build_stage3

            self.units = d.units
            self.flat_groups, self.grad_sync, self.param_homes = build_stage3(d, self.placement)
        else:
            self.flat_groups: List[FlatGroup] = [
                FlatGroup(ps, d.dtype, comm.shard.world_size, comm.shard.rank, P,
                          d.bucket_bytes, placement=self.placement, group_index=gi,
                          slot_align=align)  # partition.py [Note: block-aligned slots]
                for gi, (ps, align) in enumerate(zip(d.trainable, d.slot_aligns))]
            self.grad_sync = (
                BucketedGrads(self.flat_groups, comm, d.reduce_dtype) if P.shards_grads
                else FullGrads(self.flat_groups, comm, d.reduce_dtype, d.stage))
        self.grad_sync.free_on_zero = d.free_grads
        for p in d.to_cast:  # frozen params are part of the model the forward runs (issue 11)
            p.data = p.data.to(d.dtype)
        self.offload_params = d.offload_params
        self.placement.attach(self.flat_groups)
        # phased rules (Muon, Adafactor): one plan per buffer of whole matrices over the shard
        # group (zerokern.rules [Note: state kinds and the owner protocol])
        self._plans = {gi: self.rules[g.group_index].plan(g, comm.shard)
                       for gi, g in enumerate(self.flat_groups)
                       if self.rules[g.group_index].phased}
        if self.param_homes is not None:  # "nvme": journaled with the state files
            self.param_homes.attach(self.offloader)
        self._built = True
        dev = self.flat_groups[0].device
        # [found_inf, sumsq] (+ the tp-replicated part's sumsq with tensor parallelism)
        # + one "used on this rank" flag per param, summed by the same all-reduce ([Note: a
        # param no rank used] in frozen_slots.py): the flags start at _flag_base
        self._flag_base = 2 if self.tp is None else 3
        self._flag_index = {(gi, i): j for j, (gi, i) in enumerate(
            (gi, i) for gi, g in enumerate(self.flat_groups) for i in range(len(g.params)))}
        # + the groups' hyperparameter fingerprints ([Note: the same hyperparameters on every
        # rank] in hyper_agreement.py) after the flags, in the same all-reduce
        self._flag_end = self._flag_base + len(self._flag_index)
        self._stats = torch.zeros(self._flag_end + HYPER_SLOTS, dtype=torch.float32,
                                  device=dev)
        self._hyper = HyperAgreement(dev)
        if self.placement.offload is not None:  # the host skips params no rank used
            self._frozen_skip.host = self.placement.unused = HostUnused(self)
        self._tp_stats = None if self.tp is None else TpStats(self.flat_groups)
        self.grad_norm = torch.zeros((), dtype=torch.float32, device=dev)
        self.step_skipped = torch.zeros((), dtype=torch.bool, device=dev)
        self._prepared = None         # grad_sync.generation whose stats are in _stats
        self._clip_next = None        # (max_norm, norm) from clip_grad_norm_ for the next step
        gs = self.grad_sync
        gs.require_scaled = d.precision == "fp16" or bool(d.scaler.dynamic) or \
            float(d.scaler.scale) != 1.0
        self.model_watch = None
        if not P.shards_params:  # stages 0-2 follow model.to() and load_state_dict
            self.model_watch = ModelWatch(self, model)
            gs.watchers = (self._unfrozen, self.model_watch)
        gs.watchers = (self._group_watch,) + tuple(gs.watchers)
        self.activations = None  # activation_checkpointing (stage3/activation_policy.py)
        if d.act_mode is not None:
            from zerokern.stage3.activation_policy import apply_policy

            self.activations = apply_policy(model, d.act_mode, modules=[
                u.module for u in self.units if not u.is_root] if P.shards_params else None)

    @property
    def model_parallel(self):
        """An mpu's side of the agreement (grads/model_parallel.py), attached to the plan by
        zerokern.initialize(mpu=...); else None."""
        return self.plan.model_parallel

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Only during construction (torch.optim.Optimizer calls it for each group).

        Args:
            param_group: a param-group dict, as torch's.

        Raises:
            NotImplementedError: after construction; the flat buffers are laid out once, so
                pass every group to the constructor.
        """
        if getattr(self, "_built", False):
            raise NotImplementedError(f"{type(self).__name__} cannot add param groups after "
                                      "construction: "
                                      "the flat buffers are laid out once; pass all groups "
                                      "to the constructor")
        if isinstance(param_group, dict):  # checked against the group's rule (check_groups)
            self._given_keys.append([k for k in param_group if k != "params"])
        super().add_param_group(param_group)

    # ---- the step --------------------------------------------------------------------------
    def _follow_model(self, where: str = "backward") -> None:
        self._unfrozen.check(where)
        if self.model_watch is not None:
            self.model_watch.check(where)

    def _move_to(self, device) -> None:
        """The model moved (model_sync.py): buffers, state and scalars follow it."""
        for g in self.flat_groups:
            g.to_(device)
        self.grad_sync.to_(device)
        for name in ("_stats", "grad_norm", "step_skipped"):
            setattr(self, name, getattr(self, name).to(device))
        self.scaler.to_(device)

    def _check_ready(self) -> None:
        gs = self.grad_sync
        if gs.detached:
            raise RuntimeError(f"this {type(self).__name__} no longer owns its params: a newer "
                               "zerokern optimizer (ZeroAdamW) was created on the same model "
                               "and took them over")
        self._follow_model("step()")
        gs.finish_aborted_backward("step()")  # [Note: a backward that raised]
        try:  # what this rank's user did to p.grad: maybe on this rank only (comm/abort.py)
            self._group_watch.check("step()")
            self._check_grads_ready(gs)
            self._check_groups_now()
        except (RuntimeError, ValueError, TypeError) as e:
            self.comm.signal_failure(e)
            raise

    def _check_groups_now(self) -> None:
        """[Note: hyperparameters changed between steps] torch reads a param group's values at
        every step, so users change them between steps (a beta2 or weight-decay schedule, an
        lr set by hand). Each value was checked at construction, and the kernels check theirs
        again, but only when their bucket's turn comes: a bad value in group 1 (an lr of -1 or
        NaN) raised after group 0 had been updated, so the step was half done and its retry
        updated group 0 twice (shown on the old code: 9 params changed by the failed step). A
        key of another optimizer added since (`group["amsgrad"] = True`, `"maximize"`, a
        misspelt "weight_decy") was not checked at all, and the update went on without it.
        So every group is checked here, before anything changes: its rule's values (a few
        comparisons per group, no device read: a tensor lr is left to the kernel), and its
        keys again when they changed since the last check (zerokern.rules [Note: a rule's
        keys]; a scheduler's "initial_lr" passes)."""
        seen = self._group_keys_checked
        for gi, group in enumerate(self.param_groups):
            rule, where = self.rules[gi], f"param group {gi}"
            missing = [k for k in rule.defaults if k not in group]
            if missing:
                raise ValueError(f"{type(self).__name__}.step(): {where} has no {missing[0]!r} "
                                 f"any more (the {rule.name!r} rule reads it at every step)")
            keys = frozenset(k for k in group if k != "params")
            if seen.get(gi) != keys:
                rule.check_group_keys(keys, where=where, allowed=self._group_keys)
                seen[gi] = keys
            rule.check_group(group, where=where)

    def _check_grads_ready(self, gs) -> None:
        if gs.micro_steps == 0 or not gs.has_grads():
            raise RuntimeError(f"{type(self).__name__}.step() called with no backward since "
                               "zero_grad(): "
                               "run loss.backward() (or opt.backward(loss)) first")
        gs.check_unchanged_since_backward()
        self._check_scaled_grads_untouched(gs)
        if gs.unscaled_backward:
            raise RuntimeError(
                f"{type(self).__name__}(precision={self.precision!r}): a backward since "
                "zero_grad() did "
                "not go through the loss scale, so its gradients would be divided by a scale "
                "that was never applied. Use opt.backward(loss) or "
                "opt.scale_loss(loss).backward() for every backward (then opt.zero_grad())")

    def _check_scaled_grads_untouched(self, gs) -> None:
        """[Note: an edit of a loss-scaled p.grad] With a loss scale (fp16, or an explicit
        loss_scale=), stage 0's p.grad views the reduced gradient as the backward left it:
        multiplied by the scale (torch's GradScaler leaves p.grad scaled too, until
        scaler.unscale_(opt)). torch.nn.utils.clip_grad_norm_(model.parameters(), c) on it
        measured the scaled norm and shrank the gradient by about the scale more than
        asked, and clip_grad_value_ clipped scaled values: a wrong step without a word (fp16
        at stage 0, N = 2, scale 2^12, clip 0.05: the params moved 0.0025 in 3 steps, 0.0057
        with opt.clip_grad_norm_). So
        an in-place change to a p.grad since the backward is refused under a loss scale
        (version counters: each p.grad views its bucket, whose counter every view shares);
        opt.clip_grad_norm_ clips the unscaled gradient. Without a loss scale an edit is
        the user's to make, and stage 0 steps with it as DDP would."""
        if not gs.require_scaled:
            return
        edited = gs.edited_grad()
        if edited is None:
            return
        gi, i = edited
        raise RuntimeError(
            f"{type(self).__name__}(precision={self.precision!r}): p.grad of param {i} in param "
            f"group {gi} was changed in place after the backward (e.g. torch.nn.utils."
            "clip_grad_norm_ or clip_grad_value_), but under a loss scale p.grad holds the "
            f"scaled gradient (x {float(self.scaler.scale):g} now), so the change acts on "
            "scaled values (torch's GradScaler asks for scaler.unscale_(opt) first). Clip with "
            "opt.clip_grad_norm_(max_norm), which clips the unscaled gradient, or "
            "max_grad_norm=; opt.zero_grad() starts over")

    def _prepare(self) -> None:
        """Reduce, then found_inf/sumsq/grad_norm: once per set of grads (Note steps 1-3)."""
        gs = self.grad_sync
        if self._prepared == gs.generation:
            return
        gs.check_collectives()  # ZEROKERN_DEBUG_COLLECTIVES=1 only
        stats = self._stats
        base = self._flag_base
        stats.zero_()
        self._set_used_flags(stats[base:self._flag_end])
        self._hyper.fill_(stats[self._flag_end:], self.param_groups, self.rules)
        found, sumsq = stats[0], stats[1]
        mp = self.model_parallel
        averaged = self.pattern.grads_averaged
        # [Note: stage 0 reads 1/N for its stats] (grads/full_grads.py)
        split = averaged and self._tp_stats is None and mp is None
        for gi, k in gs.reduced_buckets():  # stats of bucket k while later ones still reduce
            if self._tp_stats is not None:  # tp-sharded and replicated elements apart
                self._tp_stats.stats_(gi, k, gs.grad_piece(gi, k), stats, self.backend)
            elif mp is not None:  # [Note: model-parallel grad stats] (grads/model_parallel.py)
                mp.stats_(gs.grad_piece(gi, k), gi, k, found, sumsq, self._grad_stats)
            else:
                piece = gs.stats_piece(gi, k) if split else gs.grad_piece(gi, k)
                kernels.grad_stats_(piece, found, sumsq, backend=self.backend)
        # The agreement ([Note: one parallel plan]): every rank skips and clips alike, and
        # knows which params no rank used. Over dp: the stats when each rank read a shard or
        # a piece, else (stage 0 with tp / mpu) only the used flags.
        if not averaged or split:
            self.comm.count_once_(stats[1:base])  # HSDP: replicas hold the same shard
            self.plan.agree_(stats, model=False)
        else:
            self.plan.agree_(stats[base:], model=False)
        if self.tp is not None:  # [Note: the global norm over tp and dp] (comm/tp.py)
            self.tp.fold_replicated_(stats)
        # over the other slices of the model (tensor / pipeline ranks): [found_inf, sumsq],
        # not the flags (their params are others)
        self.plan.agree_(stats[:2], dp=False, label="tp grad stats")
        self._hyper.read(stats[self._flag_end:])
        # Each shard holds the sum over the whole world (comm.reduce_grads_): divide by it.
        divisor = 1 if averaged else self.comm.world.world_size
        self._unscale = (self.scaler.scale * float(divisor)).reciprocal()
        torch.mul(sumsq.sqrt(), self._unscale, out=self.grad_norm)
        self._prepared = gs.generation
        gs.see_grad_edits()  # what the preparation itself did to the buffers is ours

    def _set_used_flags(self, flags: torch.Tensor) -> None:
        """flags (zeroed, on the device) := 1 for every param that got a gradient on this rank
        since zero_grad() (`p.grad` not None, host state), 0 for the others; filled on the
        device run by run (one fill, plus one per run of unused params: no host->device copy).
        The step's all-reduce then sums them over the ranks ([Note: a param no rank used] in
        frozen_slots.py)."""
        flags.fill_(1.0)
        start = None
        for (gi, i), j in self._flag_index.items():
            unused = self.flat_groups[gi].params[i].grad is None
            if unused and start is None:
                start = j
            elif not unused and start is not None:
                flags[start:j].zero_()
                start = None
        if start is not None:
            flags[start:].zero_()

    def _grad_stats(self, grad, found, sumsq) -> None:
        kernels.grad_stats_(grad, found, sumsq, backend=self.backend)

    @torch.no_grad()
    def step(self, closure=None):
        """One optimizer step on this rank's shard, with no host-device synchronisation.

        Reduces what is left to reduce, computes found_inf and the global norm, clips
        (`max_grad_norm`, or a preceding `clip_grad_norm_`), runs the fused AdamW update and
        all-gathers the new params (stages 1-2). With fp16 a step whose gradients hold inf or
        NaN on any rank is skipped on every rank, bit for bit, and the loss scale halves
        (`step_skipped`, `loss_scale`).

        Args:
            closure: optional, as torch's: re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: fp16 after a plain `loss.backward()` (the gradients were never
                scaled), or `p.grad` changed between backward and step (names the param).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_ready()
        self._prepare()
        self._hyper.check(self.param_groups, "step()")  # before anything is updated
        gs = self.grad_sync
        found = self._stats[0]
        clip = None
        if self._clip_next is not None:
            max_norm, norm = self._clip_next
            clip = (max_norm / (norm + 1e-6)).clamp_(max=1.0)
        elif self.max_grad_norm is not None:
            clip = (self.max_grad_norm / (self.grad_norm + 1e-6)).clamp_(max=1.0)
        grad_scale = self._unscale if clip is None else self._unscale * clip
        self._clip_next = None
        gathers = []
        place = self.placement  # one update path, wherever the state lives (placement.py)
        # A phased plan's state outside the placement (Adafactor's per-matrix states) is
        # copied where a step can roll back (offload="nvme": [Note: all or nothing])
        held = {gi: plan.snapshot() for gi, plan in self._plans.items()
                if self.offload == "nvme" and hasattr(plan, "snapshot")}
        place.begin(grad_scale, found, self._stats[self._flag_base:self._flag_end])  # (offload)
        # params frozen since, and params no rank used: left as they are (frozen_slots.py;
        # after place.begin, which settles whether a compact master is expanded)
        self._frozen_skip.begin(self, found, self._stats[self._flag_base:self._flag_end] == 0)
        for gi, g in enumerate(self.flat_groups):
            rule = self.rules[g.group_index]
            hyper = rule.hyper(self.param_groups[g.group_index])
            if rule.phased:  # a group step over the whole buffer (zerokern.rules [Note:
                # state kinds and the owner protocol])
                rule.group_step_(
                    g, [gs.grad_piece(gi, k) for k in range(g.layout.n_buckets)],
                    self._plans[gi], grad_scale=grad_scale, found_inf=found,
                    place=place, gi=gi,
                    unused=self._unused_slots(gi, g) if rule.matrix_states else None,
                    after_piece=lambda k, gi=gi, g=g, hyper=hyper: gathers.append(
                        self._after_piece(gi, g, k, hyper, grad_scale, found)),
                    **hyper)
                continue
            for k in range(g.layout.n_buckets):
                grad = gs.grad_piece(gi, k)
                place.update_piece(gi, k, grad, hyper, self.backend)
                self._frozen_skip.after_update_(self, gi, k, grad, hyper, grad_scale, found)
                gathers.append(g.publish_piece(self.comm.shard, k))  # stages 1-2: gather
        for h in gathers:
            if h is not None:
                h.wait()
        try:
            place.finish()  # nvme: commit, or roll back and raise (offload_nvme.py)
        except BaseException:
            for gi, saved in held.items():  # a phased plan's own state rolls back with it
                self._plans[gi].restore_(saved)
            raise
        gs.after_step()
        torch.gt(found, 0, out=self.step_skipped)
        self.scaler.update_(self.step_skipped)
        self._prepared = None  # the stats of a second step() are taken again
        return loss

    def _unused_slots(self, gi: int, g) -> torch.Tensor:
        """(n_slots,) device bool: buffer gi's params no rank used this step (the step's
        summed used flags, [Note: a param no rank used] in frozen_slots.py)."""
        j = self._flag_index[(gi, 0)] if g.params else 0
        return self._stats[self._flag_base + j:self._flag_base + j + len(g.params)] == 0

    def _after_piece(self, gi: int, g, k: int, hyper: dict, grad_scale, found):
        """Bucket k of buffer gi is written (a phased rule's group step): params frozen since
        construction get their state back, then the piece is published (stages 1-2)."""
        self._frozen_skip.after_update_(self, gi, k, self.grad_sync.grad_piece(gi, k), hyper,
                                        grad_scale, found)
        return g.publish_piece(self.comm.shard, k)

    def close(self) -> None:
        """Release what outlives a step: offload="nvme" removes its state files now (they are
        removed at garbage collection and at exit too). The optimizer cannot step afterwards."""
        self.placement.close()
        if self.param_homes is not None:
            self.param_homes.close()

    # ---- the user-facing extras: loss scaling, no_sync, zero_grad, clipping, reports ------

    @property
    def loss_scale(self) -> torch.Tensor:
        """0-d device tensor: the loss scale used by the last/next backward."""
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the loss scale, for `opt.scale_loss(loss).backward()`.

        Args:
            loss: the 0-d loss tensor.

        Returns:
            loss * loss_scale (the same graph), marked as scaled for `step()`.
        """
        return self.grad_sync.mark_scaled_loss(loss * self.scaler.scale)

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """Loss-scaled backward. With fp16 (or an explicit loss_scale) every backward must go
        through the scale (this, or scale_loss); plain loss.backward() is fine otherwise.

        Args:
            loss: the 0-d loss tensor (divide it by the number of micro-batches when
                accumulating, as with DDP).
            **kwargs: passed to `torch.Tensor.backward` (e.g. retain_graph).
        """
        self.scale_loss(loss).backward(**kwargs)

    @contextmanager
    def no_sync(self):
        """As DDP's no_sync(): backward passes inside accumulate locally, with no
        communication; the first backward outside reduces everything (or step() does). Stage 2
        holds a full local grad accumulator meanwhile (Ψ elements of reduce_dtype)."""
        gs = self.grad_sync
        old, gs.sync = gs.sync, False
        try:
            yield
        finally:
            gs.sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: p.grad becomes None (set_to_none=True) or zeros; the accumulated
        gradient (and every shard of it) is cleared.

        Args:
            set_to_none: True (torch's default): `p.grad` becomes None; with
                free_grads=True the gradient memory is freed too. False: zeros.
        """
        self._group_watch.check("zero_grad()")
        self.grad_sync.zero_grad(set_to_none)
        self._clip_next = None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every rank's shard (a 0-d device tensor, no host sync);
        the coming step() clips to max_norm, as torch.nn.utils.clip_grad_norm_ would with
        DDP's gradients (coefficient max_norm / (norm + 1e-6), at most 1). Call after the last
        backward and before step(), as FSDP's clip_grad_norm_.

        Args:
            max_norm: the largest norm the step's gradient may have (> 0).
            norm_type: 2.0 (default), any p > 0, or math.inf.

        Returns:
            The global norm of the (unclipped, unscaled) gradient: a 0-d fp32 tensor on the
            param device, the same on every rank.

        Raises:
            ValueError: max_norm or norm_type out of range.
            RuntimeError: no backward since the last step (nothing to clip).
        """
        check_clip(max_norm, norm_type)
        self._check_ready()
        self._prepare()
        norm = self.grad_norm if norm_type == 2 else self._other_norm(float(norm_type))
        self._clip_next = (float(max_norm), norm)
        return norm.clone()

    def _other_norm(self, p: float) -> torch.Tensor:
        tp = getattr(self, "tp", None)
        if tp is not None and p != math.inf:  # (tp-replicated elements would count tp times)
            raise ValueError(f"norm_type={p} is not supported with tensor parallelism (DTensor "
                             "params); use norm_type=2 or inf")
        gs, mp = self.grad_sync, self.model_parallel
        parts = [t.float() for gi, g in enumerate(self.flat_groups)
                 for k in range(g.layout.n_buckets)
                 for t in ([gs.grad_piece(gi, k)] if mp is None
                           else mp.counted(gs.grad_piece(gi, k), gi, k))]
        if p == math.inf:
            zero = torch.zeros((), dtype=torch.float32, device=self._stats.device)
            acc = torch.stack([t.abs().max() for t in parts if t.numel()] or [zero]).max()
            op = torch.distributed.ReduceOp.MAX
        else:
            acc = torch.stack([t.abs().pow(p).sum() for t in parts]).sum()
            op = torch.distributed.ReduceOp.SUM
        averaged = self.pattern.grads_averaged
        if not averaged and p != math.inf:
            self.comm.count_once_(acc)  # HSDP: replicas hold the same shard
        # over dp where each rank read a shard, and over the model-parallel ranks (the tp
        # shards, an mpu's slices): [Note: one parallel plan] (comm/plan.py)
        self.plan.agree_(acc, op=op, dp=not averaged)
        return (acc if p == math.inf else acc.pow(1.0 / p)) * self._unscale

    @property
    def offloader(self):
        """The offload placement (offload.Offloader / offload_nvme.NvmeOffloader), None
        without offload: for benchmarks and tests that tune its chunking."""
        return None if self.offload is None else self.placement

    # ---- introspection ---------------------------------------------------------------------

    def memory_report(self) -> Dict[str, Any]:
        """Bytes held per category on this rank, with the DESIGN §4 formula beside them.

        Returns:
            A dict: `measured` (bytes per device category: params, grads, buckets, master,
            one per state of the rule (by its name), padding, and at stage 3 frozen and live_units),
            `measured_total`, `formula`, `formula_total`, `allowed_slack`; with offload
            `host_measured` / `disk_measured` and their totals, `host_pinned_total`,
            `host_pageable_total`; at stage 3 `peak_live_units` and `live_units_bound`;
            `comm_buffers` (this rank's shared-memory segments for CPU collectives between
            ranks on one host: a transport buffer, not a model state); and num_params,
            world_size, stage, precision. Equal to `zerokern estimate`.
        """
        return memory_report(self)

    def comm_stats(self, reset: bool = False) -> Dict[str, Any]:
        """Bytes sent per collective type by this rank since the last reset.

        Args:
            reset: also reset the counters after reading them.

        Returns:
            A dict per collective type (all_reduce, reduce_scatter, all_gather) with the bytes
            sent and the number of calls; `dims`: the same per group ("shard", "replicate",
            "world", "hpz"); on a 2-D mesh `nodes`: {"intra_node", "inter_node"} bytes, dim 1
            of the mesh being a node (zerokern.memory.mesh.node_split).
        """
        from zerokern.memory.mesh import node_split

        out = self.comm.stats.as_dict()
        split = node_split(out["dims"], self.comm.dims)
        if split is not None:
            out["nodes"] = split
        if reset:
            self.comm.stats.reset()
        return out

    def reset_comm_stats(self) -> None:
        """Zero the counters `comm_stats()` reads."""
        self.comm.stats.reset()

    @contextmanager
    def gathered_params(self, modify: bool = False):
        """Full params inside the block (stage 3 gathers every unit, then re-shards; at
        stages 0-2 they are always resident and this does nothing). Collective at stage 3.

        Args:
            modify: True: changes made to the params inside are kept (each rank takes its
                piece back into its shard and fp32 master); False: discarded at stage 3.
        """
        if not self.pattern.shards_params:
            yield
            return
        self.grad_sync.gather_all()
        try:
            yield
        except BaseException:
            self.grad_sync.release_all(write_back=modify)  # (its error stands: no check)
            raise
        self.grad_sync.release_all(write_back=modify, check=True)

    # ---- this rank's own state dict (zerokern.checkpoint reshards) -----------------------

    def _meta(self) -> Dict[str, Any]:
        return {"rule": self.rule.name, "rules": [r.name for r in self.rules],
                "stage": self.stage, "precision": self.precision,
                "world_size": self.comm.shard.world_size, "rank": self.comm.shard.rank,
                # block-aligned slots (8-bit: partition.py) add their alignment, so a state
                # dict of packed slots is refused, not loaded at other offsets
                "layouts": [(g.layout.numel, g.layout.padded_numel, g.layout.bucket_numel,
                             [s.shape for s in g.layout.slots])
                            + ((g.layout.slot_align,) if g.layout.slot_align != 1 else ())
                            for g in self.flat_groups]}

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shard: moments, masters, step counters, scaler, hyperparameters (and at
        stage 3 the param shard, which the model's own state_dict cannot give)."""
        self._frozen_skip.check_savable("state_dict()")
        groups = [{k: v for k, v in group.items() if k != "params"}
                  for group in self.param_groups]
        return {"zero": self._meta(),
                "state": [{k: t.detach().clone() for k, t in g.state_tensors().items()}
                          for g in self.flat_groups],
                "param_groups": groups,
                "loss_scaler": self.scaler.state_dict(),
                # per buffer, the per-matrix states this rank owns (a phased rule's: zerokern.
                # rules [Note: state kinds and the owner protocol]), "slot.name" -> tensor
                "matrix": [{f"{i}.{name}": t.detach().clone() for i, name, t in st.items()}
                           for st in self._matrix_states()]}

    def _matrix_states(self):
        """Per buffer, its plan's MatrixStates, or an empty one."""
        plans = getattr(self, "_plans", {})
        return [getattr(plans.get(gi), "states", None) or _NO_STATES
                for gi in range(len(self.flat_groups))]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a `state_dict()` of the same model, stage, precision, world size and rank.

        Args:
            state_dict: what `state_dict()` returned on this rank (use zerokern.checkpoint to
                change world size, stage or precision).

        Raises:
            ValueError: not a ZeroAdamW state dict, or one of another stage, precision, world
                size, rank or layout (naming which).
        """
        if not isinstance(state_dict, dict) or "zero" not in state_dict:
            raise ValueError("state_dict is not a ZeroAdamW state dict (no 'zero' entry); "
                             "use zerokern.checkpoint to reshard across layouts")
        meta, mine = state_dict["zero"], self._meta()
        for key in ("rule", "rules", "stage", "precision", "world_size", "rank", "layouts"):
            # a state dict saved before rules existed is ZeroAdamW's; before a rule per
            # group, "rule" is every group's
            default = {"rule": "adamw", "rules": [meta.get("rule", "adamw")] *
                       len(mine["rules"])}.get(key)
            if meta.get(key, default) != mine[key]:
                raise ValueError(f"state_dict {key} {meta.get(key)!r} does not match this "
                                 f"optimizer's {mine[key]!r}")
        states, groups = state_dict["state"], state_dict["param_groups"]
        for g, st in zip(self.flat_groups, states):
            for k, t in g.state_tensors().items():
                if k not in st or st[k].shape != t.shape or st[k].dtype != t.dtype:
                    raise ValueError(f"state_dict entry {k!r} is missing or mis-shaped")
        matrix = state_dict.get("matrix", [{}] * len(self.flat_groups))
        for st, saved in zip(self._matrix_states(), matrix):
            for i, name, t in st.items():
                v = saved.get(f"{i}.{name}")
                if v is None or v.shape != t.shape or v.dtype != t.dtype:
                    raise ValueError(f"state_dict per-matrix entry {i}.{name} is missing or "
                                     "mis-shaped")
        # The scaler checks its entry before writing anything; ours are checked above.
        self.scaler.load_state_dict(state_dict["loss_scaler"])
        for g, st in zip(self.flat_groups, states):
            for k, t in g.state_tensors().items():
                t.copy_(st[k])
        for st, saved in zip(self._matrix_states(), matrix):
            for i, name, t in st.items():
                t.copy_(saved[f"{i}.{name}"])
        for group, saved in zip(self.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self.state_loaded()

    def state_loaded(self) -> None:
        """The masters were just loaded (state_dict, zerokern.checkpoint): they define the
        state, so param writes made before the load are not taken into them again."""
        if self.model_watch is not None:
            self.model_watch.record_versions()
        self.grad_sync.see_param_writes()  # stage 3's ([Note: a write to a sharded param])
        self.grad_sync.generation += 1
        for g in self.flat_groups:  # FP8 params: re-encoded from the loaded masters
            g.params_loaded_()      # (collective; kernels/param_codec.py)


class FlatState(dict):
    """`opt.state` of a zerokern optimizer: empty, and `opt.state[p]` raises.

    [Note: no per-param opt.state] torch's optimizers keep each param's state in `opt.state[p]`
    (AdamW's "step", "exp_avg", "exp_avg_sq"), and user code reads or changes it there: resets
    the moments of some params, logs them, checks `"exp_avg" in opt.state[p]`. A zerokern
    optimizer keeps the moments, the fp32 masters and the step counts in flat buffers sharded
    across the ranks, so torch's defaultdict here answered `opt.state[p]` with a new empty dict:
    such code read nothing and changed nothing, silently. Now indexing (and get, setdefault,
    assignment) raises, naming what to use; iterating finds nothing (library code that walks
    `opt.state.values()` to move tensors has nothing to move: the optimizer places its own
    buffers), `len()` is 0. torch.distributed.checkpoint's get_state_dict, seeing no state,
    calls step() with zero grads to create it: that step() raises (no backward) before
    anything changes; save a zerokern optimizer with zerokern.checkpoint."""

    def __init__(self, owner: str = "the zerokern optimizer") -> None:
        super().__init__()
        self.owner = owner

    def __reduce__(self):
        return (type(self), (self.owner,))

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(
            f"{self.owner}.state[p]: a zerokern optimizer keeps its state (the moments, the "
            "fp32 masters, the step counts) in flat buffers sharded across the ranks, not in "
            "torch's per-param opt.state dicts, so opt.state[p] holds nothing to read or "
            "change. Save and load it with zerokern.checkpoint, which reshards it on load "
            "(opt.state_dict() is this rank's shard)")

    __getitem__ = __setitem__ = get = setdefault = _refuse


class _NoStates:
    """No per-matrix states (a buffer whose rule has none)."""

    @staticmethod
    def items():
        return iter(())


_NO_STATES = _NoStates()
